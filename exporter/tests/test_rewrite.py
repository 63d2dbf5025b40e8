"""The tract rewrites: each reproducer fails (or is slow) in tract as reported, the rewritten
graph equals the original in onnxruntime, and policyd (tract) serves the rewritten one."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import check_config, run_cli

from policyd_export import rewrite, tract_bugs

CONFIGS = {
    "cumsum_int64": ("x", [8], "positions"),
    "concat_expand_matmul": ("a", [50, 96], "y"),
}


def _config(tmp: Path, model: Path, name: str) -> Path:
    key, shape, out = CONFIGS[name]
    extra = (
        '[[inputs]]\nkey = "b"\ntensor = "b"\ndtypes = ["float32"]\nshape = [1, 96]\n'
        if (name == "concat_expand_matmul")
        else ""
    )
    path = tmp / f"{model.stem}.toml"
    path.write_text(
        f'[engine]\nmodel = "{model}"\nwarmup_runs = 1\n'
        f'[[inputs]]\nkey = "{key}"\ntensor = "{key}"\ndtypes = ["float32"]\nshape = {shape}\n'
        f'{extra}[[outputs]]\ntensor = "{out}"\n'
    )
    return path


def _serves(policyd: str, config: Path) -> tuple[bool, str]:
    """Whether policyd loads and warms up `config` (a warm-up run evaluates the graph)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [policyd, "--config", str(config), "--port", str(port)], stderr=subprocess.PIPE, text=True
    )
    try:
        for _ in range(200):
            if proc.poll() is not None:
                return False, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return True, ""
            except OSError:
                pass
            time.sleep(0.05)
        return False, "timed out"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("name", ["cumsum_int64", "concat_expand_matmul", "pow3"])
def test_rewrite_equals_the_original(name: str, tmp_path: Path) -> None:
    model, feeds = tract_bugs.ALL[name]()
    src = tmp_path / f"{name}.onnx"
    onnx.save_model(model, str(src))
    out = tmp_path / f"{name}.rw.onnx"
    r = run_cli("rewrite", str(src), str(out))
    assert r.returncode == 0, r.stderr
    counts = [
        line.rsplit(": ", 1)[1] for line in r.stdout.splitlines() if line[:2] in ("R1", "R2", "R3")
    ]
    assert sorted(counts) == ["0", "0", "1"], r.stdout  # exactly one pattern rewritten
    assert rewrite.check_same(src, out, feeds) <= 1e-5
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    gone = {"cumsum_int64": "Expand", "concat_expand_matmul": "Concat", "pow3": "Pow"}[name]
    if name != "cumsum_int64":
        assert gone not in ops, ops


@pytest.mark.parametrize("name", ["cumsum_int64", "concat_expand_matmul"])
def test_tract_fails_on_the_reproducer_and_serves_the_rewrite(
    name: str, tmp_path: Path, policyd: str
) -> None:
    model, _ = tract_bugs.ALL[name]()
    src = tmp_path / f"{name}.onnx"
    onnx.save_model(model, str(src))
    ok, err = _serves(policyd, _config(tmp_path, src, name))
    # If tract fixes the bug, this fails: then the rewrite can go (docs/export.md says which).
    assert not ok, f"tract now runs {name}: the rewrite may be unnecessary"
    tract_says = {
        "cumsum_int64": "TDim is not a number",
        "concat_expand_matmul": "Trying to substitute",
    }[name]
    assert tract_says in err, err
    # policyd names the pattern and the rewrite beside tract's own words.
    rule = {"cumsum_int64": "R1", "concat_expand_matmul": "R2"}[name]
    assert f"({rule}:" in err and "policyd-export rewrite" in err, err
    # check-config says so too (R1 fails only when run: it gets a trial run there).
    checked = check_config(policyd, _config(tmp_path, src, name))
    assert checked.returncode != 0 and f"({rule}:" in checked.stderr, checked.stderr
    fixed, report = rewrite.rewrite(model)
    assert report.total() == 1
    dst = tmp_path / f"{name}.rw.onnx"
    onnx.save_model(fixed, str(dst))
    ok, err = _serves(policyd, _config(tmp_path, dst, name))
    assert ok, err
    checked = check_config(policyd, _config(tmp_path, dst, name))
    assert checked.returncode == 0, checked.stderr


def test_a_graph_without_the_patterns_is_unchanged() -> None:
    model, _ = tract_bugs.pow3()
    for node in model.graph.node:
        if node.op_type == "Pow":
            node.op_type = "Mul"  # x·3 is no cube
    out, report = rewrite.rewrite(model)
    assert report.total() == 0
    assert out.SerializeToString() == model.SerializeToString()


def test_rewrite_cli_refuses_a_file_that_is_not_onnx(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(np.arange(10, dtype=np.uint8).tobytes())
    r = run_cli("rewrite", str(bad), str(tmp_path / "out.onnx"))
    assert r.returncode == 2 and "not an ONNX model" in r.stderr


def test_policyd_serves_a_graph_with_external_data(tmp_path: Path, policyd: str) -> None:
    """Graphs past 256 MB are saved with their weights in `<graph>.onnx.data` (ONNX's 2 GB
    protobuf limit, and a lower load peak): policyd must find them beside the graph. Forced
    here on a small one."""
    model, _ = tract_bugs.concat_expand_matmul()
    fixed, _ = rewrite.rewrite(model)
    graph = tmp_path / "external.onnx"
    rewrite.save(fixed, graph, external_over=0)
    assert (tmp_path / "external.onnx.data").is_file()
    # As readable as the graph (a service user reads both).
    mode = (tmp_path / "external.onnx.data").stat().st_mode & 0o777
    assert mode == graph.stat().st_mode & 0o777 == 0o644, oct(mode)
    ok, err = _serves(policyd, _config(tmp_path, graph, "concat_expand_matmul"))
    assert ok, err
    (tmp_path / "external.onnx.data").unlink()
    ok, err = _serves(policyd, _config(tmp_path, graph, "concat_expand_matmul"))
    assert not ok and "external.onnx" in err, err


def test_a_large_graph_is_rewritten_without_loading_its_weights(
    tmp_path: Path, policyd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exporter's path for graphs past 2 GB (a real pi0's prefix): the traced graph's
    weights stay in their file, R2 reads the one weight it splits from there, the file becomes
    the rewritten graph's `<graph>.onnx.data` with the split weights appended, and the result
    equals the original in onnxruntime and serves in policyd. Forced here on a small graph."""
    model, _ = tract_bugs.concat_expand_matmul()
    raw = tmp_path / "g.raw.onnx"
    onnx.save_model(model, str(raw), save_as_external_data=True, location="g.raw.onnx.data")
    feeds = rewrite.random_feeds(raw)
    want = rewrite.run_once(raw, feeds)
    structure = onnx.load(str(raw), load_external_data=False)
    weights = [t for t in structure.graph.initializer if t.dims and np.prod(t.dims) > 256]
    assert weights and all(not t.HasField("raw_data") for t in weights)
    fixed, report = rewrite.rewrite(structure, base_dir=tmp_path)
    assert report.concat_expand_matmul
    monkeypatch.setattr(rewrite, "EXTERNAL_OVER", 0)
    graph = tmp_path / "g.onnx"
    rewrite.place(fixed, tmp_path / "g.raw.onnx.data", graph)
    assert not (tmp_path / "g.raw.onnx.data").exists()
    onnx.checker.check_model(str(graph), full_check=False)
    assert rewrite.max_diff(want, rewrite.run_once(graph, feeds)) <= 1e-5
    ok, err = _serves(policyd, _config(tmp_path, graph, "concat_expand_matmul"))
    assert ok, err

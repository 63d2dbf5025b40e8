"""What a bundle's config says about time: `engine.timeout_ms` sized from a chunk measured at
export, so that a real-size policy serves and verifies with no edits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import checkpoints
import onnx
import pytest
from conftest import check_config

from policyd_export.bundle import sized_engine
from policyd_export.families import Exported
from policyd_export.graphs import Graph


def graph(file: str, run_seconds: float) -> Graph:
    return Graph(file, [], [], 0.0, [], 1.0, run_seconds)


def exported(graphs: list[Graph], steps: int | None = None) -> Exported:
    config: dict = {"engine": {"backend": "cpu", "model": graphs[0].file}}
    if steps is not None:
        config["denoise"] = {"model": graphs[1].file}
        config["sampler"] = {"kind": "flow", "steps": steps}
    return Exported(config, graphs, {}, {})


def test_a_fast_policy_keeps_the_default_timeout() -> None:
    engine, note = sized_engine(exported([graph("model.onnx", 0.03)]))
    assert engine["timeout_ms"] == 10_000 and "warmup_runs" not in engine
    assert "30 ms" in note


def test_a_slow_pipeline_gets_ten_chunks_and_one_warm_up() -> None:
    # SmolVLA at its real size: a 2.5 s prefix and ten 1.8 s expert steps = 20.5 s a chunk.
    engine, note = sized_engine(
        exported([graph("prefix.onnx", 2.5), graph("step.onnx", 1.8)], steps=10)
    )
    assert engine["timeout_ms"] == 205_000
    assert engine["warmup_runs"] == 1
    assert engine["model"] == "prefix.onnx" and engine["backend"] == "cpu"
    assert "20500 ms" in note and "WatchdogSec" in note


def test_build_plans_finds_external_data_beside_each_graph(
    tmp_path: Path, policyd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every graph written with external data (as a real pi0's prefix is, past ONNX's 2 GB):
    the weights lie beside the graph under a relative name, policyd serves the bundle, and
    build-plans.sh hands trtexec each graph from the bundle's directory, where the parser finds
    `<graph>.onnx.data` (a stand-in trtexec here loads each graph as the ONNX parser does)."""
    from policyd_export import rewrite
    from policyd_export.cli import main

    monkeypatch.setattr(rewrite, "EXTERNAL_OVER", 0)
    ckpt = checkpoints.act(tmp_path / "checkpoint")
    bundle = tmp_path / "bundle"
    assert main(["lerobot", str(ckpt), "--out", str(bundle)]) == 0
    graph = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    locations = {
        e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"model.onnx.data"}
    assert (bundle / "model.onnx.data").stat().st_size > 1_000_000
    r = check_config(policyd, bundle / "policyd.toml")
    assert r.returncode == 0, r.stderr
    script = (bundle / "build-plans.sh").read_text()
    assert '"$TRTEXEC" --onnx=model.onnx --saveEngine=model.plan' in script
    fake = tmp_path / "trtexec"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, onnx\n"
        "args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)\n"
        "m = onnx.load(args['onnx'])  # resolves external data against the graph's directory\n"
        "assert m.graph.initializer and all(not t.external_data for t in m.graph.initializer)\n"
        "open(args['saveEngine'], 'wb').write(b'plan')\n"
    )
    fake.chmod(0o755)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [str(bundle / "build-plans.sh")],
        cwd=elsewhere,
        env={**os.environ, "TRTEXEC": str(fake)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (bundle / "model.plan").read_bytes() == b"plan"
    # A truncated or missing weights file: refused at load naming the graph, never a crash.
    data = bundle / "model.onnx.data"
    size = data.stat().st_size
    with data.open("r+b") as f:
        f.truncate(size // 2)
    r = check_config(policyd, bundle / "policyd.toml")
    assert r.returncode == 2 and "out of bounds" in r.stderr, r
    assert f"model.onnx.data holds {size // 2} bytes" in r.stderr, r.stderr
    data.unlink()
    r = check_config(policyd, bundle / "policyd.toml")
    assert r.returncode == 2 and "model.onnx.data" in r.stderr, r

"""Bad input gets a clear error and exit status 2, and nothing is written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_cli, run_console_script


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def _edit_config(ckpt: Path, **changes: object) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.unlink()  # a hard link: do not write through to the fixture's file
    path.write_text(json.dumps(config))


def _fails(args: list[str], *needles: str) -> str:
    r = run_cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr
    return r.stderr


def test_not_a_directory(tmp_path: Path) -> None:
    _fails(["lerobot", str(tmp_path / "nope"), "--out", str(tmp_path / "b")], "not a directory")


def test_the_console_script_runs_as_a_user_runs_it(tmp_path: Path) -> None:
    """The installed `policyd-export` (the other tests call its main in-process)."""
    r = run_console_script("lerobot", str(tmp_path / "nope"), "--out", str(tmp_path / "b"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not a directory" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


def test_not_a_checkpoint(tmp_path: Path) -> None:
    _fails(
        ["lerobot", str(tmp_path), "--out", str(tmp_path / "b")],
        "not a LeRobot checkpoint",
        "config.json",
    )


def test_unsupported_policy_types_list_the_supported(act_bundle: object, tmp_path: Path) -> None:
    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    _edit_config(ckpt, type="vqbet")
    _fails(
        ["lerobot", str(ckpt), "--out", str(tmp_path / "b")],
        "'vqbet' is not supported",
        "supported: act, diffusion, groot, pi0, pi05, smolvla",
    )
    _edit_config(ckpt, type="pi0_fast")
    _fails(["lerobot", str(ckpt), "--out", str(tmp_path / "b")], "not exported yet")


def test_groot_n15_gets_lerobots_advice(act_bundle: object, tmp_path: Path) -> None:
    """GR00T: LeRobot 0.6.1's is N1.7 (exported, test_groot.py); an N1.5 checkpoint, however
    it is told apart, gets LeRobot's own advice. In-process: each CLI run would import LeRobot
    anew."""
    from policyd_export.checkpoint import load
    from policyd_export.errors import ExportError

    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    for n15 in (
        {"model_version": "n1.5"},
        {"model_version": "n1.7", "base_model_path": "nvidia/GR00T-N1.5-3B"},
        {
            "model_version": "n1.7",
            "base_model_path": None,
            "tokenizer_assets_repo": "lerobot/eagle2hg-processor-groot-n1p5",
        },
    ):
        _edit_config(ckpt, type="groot", **n15)
        with pytest.raises(ExportError, match=r"GR00T N1\.5.*pip install 'lerobot==0\.5\.1'"):
            load(ckpt)


@pytest.mark.parametrize(
    "missing",
    [
        "policy_preprocessor.json",
        "policy_postprocessor.json",
        "policy_preprocessor_step_3_normalizer_processor.safetensors",
        "model.safetensors",
    ],
)
def test_missing_files_are_named(missing: str, act_bundle: object, tmp_path: Path) -> None:
    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    (ckpt / missing).unlink()
    _fails(["lerobot", str(ckpt), "--out", str(tmp_path / "b")], missing, "missing")
    assert not (tmp_path / "b").exists()


def test_a_feature_policyd_cannot_bind(act_bundle: object, tmp_path: Path) -> None:
    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["input_features"]["observation.language"] = {"type": "LANGUAGE", "shape": [1]}
    _edit_config(ckpt, input_features=config["input_features"])
    _fails(
        ["lerobot", str(ckpt), "--out", str(tmp_path / "b")],
        "observation.language",
        "LANGUAGE",
        "policyd binds",
    )


def test_missing_statistics_are_named(act_bundle: object, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    name = "policy_preprocessor_step_3_normalizer_processor.safetensors"
    stats = load_file(str(ckpt / name))
    del stats["observation.state.std"]
    (ckpt / name).unlink()
    save_file(stats, str(ckpt / name))
    _fails(
        ["lerobot", str(ckpt), "--out", str(tmp_path / "b")], "observation.state", "MEAN_STD", "std"
    )


def test_an_existing_output_needs_force(act_bundle: object, tmp_path: Path) -> None:
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep").write_text("x")
    _fails(["lerobot", str(act_bundle.checkpoint), "--out", str(out)], "already exists", "--force")
    assert (out / "keep").read_text() == "x"


def test_verify_refuses_a_checkpoint_of_another_type(
    act_bundle: object, ddim_bundle: object, policyd: str
) -> None:
    _fails(
        ["verify", str(act_bundle.bundle), str(ddim_bundle.checkpoint), "--policyd", policyd],
        "diffusion checkpoint",
        "act one",
    )


def test_verify_needs_a_bundle(tmp_path: Path, act_bundle: object) -> None:
    _fails(["verify", str(tmp_path), str(act_bundle.checkpoint)], "not a policyd-export bundle")


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The CLI in this process (its refusals come before any model is built): exit 2's message."""
    from policyd_export.cli import main

    assert main(args) == 2
    return capsys.readouterr().err


STATS = "policy_preprocessor_step_3_normalizer_processor.safetensors"


def _state_file(ckpt: Path, name: str) -> None:
    path = ckpt / "policy_preprocessor.json"
    pipeline = json.loads(path.read_text())
    for step in pipeline["steps"]:
        if step.get("registry_name") == "normalizer_processor":
            step["state_file"] = name
    path.unlink()
    path.write_text(json.dumps(pipeline))


def test_a_statistics_file_must_be_safetensors_inside_the_checkpoint(
    act_bundle: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 49, item 6: a normaliser `state_file` that is a pickle or not safetensors was an
    uncaught exception, and one naming `/etc/passwd` or `../` was read."""
    import pickle

    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    args = ["lerobot", str(ckpt), "--out", str(tmp_path / "b")]
    (ckpt / STATS).unlink()
    (ckpt / STATS).write_bytes(pickle.dumps({"observation.state.mean": [1.0]}))
    err = _run(args, capsys)
    assert STATS in err and "not a safetensors file" in err, err
    (ckpt / STATS).unlink()
    (ckpt / STATS).write_text("not safetensors at all")
    assert "not a safetensors file" in _run(args, capsys)
    for outside in ["/etc/passwd", "../c/" + STATS]:
        _state_file(ckpt, outside)
        err = _run(args, capsys)
        assert "policy_preprocessor.json" in err and "outside the checkpoint" in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("stat", "value", "says"),
    [("mean", float("nan"), "NaN or infinity"), ("std", -0.5, "negative"), ("min", 1e9, "above")],
)
def test_statistics_policyd_would_refuse_are_refused_at_export(
    stat: str,
    value: float,
    says: str,
    act_bundle: object,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    stats = load_file(str(ckpt / STATS))
    key = f"observation.state.{stat}"
    if key not in stats:  # min/max: written beside mean/std by LeRobot's stats
        stats["observation.state.min"] = np.zeros_like(stats["observation.state.mean"])
        stats["observation.state.max"] = np.ones_like(stats["observation.state.mean"])
    stats[key] = stats[key].copy()
    stats[key][0] = value
    (ckpt / STATS).unlink()
    save_file(stats, str(ckpt / STATS))
    err = _run(["lerobot", str(ckpt), "--out", str(tmp_path / "b")], capsys)
    assert STATS in err and f"observation.state.{stat}" in err and says in err, err


@pytest.mark.parametrize(
    ("field", "value"),
    [("chunk_size", 1e9), ("chunk_size", 0), ("n_action_steps", "many"), ("chunk_size", True)],
)
def test_sizes_are_checked_before_anything_is_allocated(
    field: str,
    value: object,
    act_bundle: object,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`chunk_size = 1e9` ran 313 s to a 9 GB peak before failing."""
    import time

    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    _edit_config(ckpt, **{field: value})
    start = time.monotonic()
    err = _run(["lerobot", str(ckpt), "--out", str(tmp_path / "b")], capsys)
    assert "config.json" in err and field in err and "from 1 to 4096" in err, err
    assert time.monotonic() - start < 5


def test_a_config_nested_past_the_recursion_limit_is_named(
    act_bundle: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _copy(act_bundle.checkpoint, tmp_path / "c")
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    err = _run(["lerobot", str(ckpt), "--out", str(tmp_path / "b")], capsys)
    assert "config.json" in err and "nested too deeply" in err, err

"""Bad input gets a clear error and exit status 2, and nothing is written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_cli


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

"""Exported bundles served by the real policyd, driven by the official openpi-client, against
LeRobot's own inference (its preprocessor → predict_action_chunk → postprocessor) on the same
observations, noise injected for Diffusion: `policyd-export verify`, end to end."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import check_config, run_cli

from policyd_export.checkpoint import load
from policyd_export.reference import Reference
from policyd_export.verify import observations

BUNDLES = ["act_bundle", "ddim_bundle", "ddpm_bundle"]


@pytest.mark.parametrize("name", BUNDLES)
def test_check_config_passes_and_prints_the_budget(
    name: str, request: pytest.FixtureRequest, policyd: str
) -> None:
    b = request.getfixturevalue(name)
    r = check_config(policyd, b.bundle / "policyd.toml")
    assert r.returncode == 0, r.stderr
    assert "OK (cpu backend" in r.stdout and "memory budget" in r.stdout
    if name != "act_bundle":
        assert "pipeline: DD" in r.stdout and "history" in r.stdout


@pytest.mark.parametrize("name", BUNDLES)
def test_served_actions_equal_lerobot(
    name: str, request: pytest.FixtureRequest, policyd: str
) -> None:
    b = request.getfixturevalue(name)
    r = run_cli("verify", str(b.bundle), str(b.checkpoint), "--policyd", policyd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("observation ")]
    assert len(rows) == 4 and all(line.endswith("pass") for line in rows), r.stdout


def test_the_bundle_names_lerobot_keys_and_stats(act_bundle: object) -> None:
    config = tomllib.loads((act_bundle.bundle / "policyd.toml").read_text())
    keys = [i["key"] for i in config["inputs"]]
    assert keys == ["observation.state", "observation.images.cam0", "observation.images.cam1"]
    image = config["inputs"][1]
    assert image["dtypes"] == ["uint8"] and image["shape"] == [48, 64, 3]
    assert image["layout"] == "hwc_to_chw" and image["eps"] == 1e-8
    assert config["outputs"][0]["eps"] == 0.0  # LeRobot un-normalises with x·std + mean
    manifest = json.loads((act_bundle.bundle / "export.json").read_text())
    assert manifest["policy_type"] == "act" and manifest["graphs"][0]["max_abs_diff"] < 1e-4


def _without_state_norm(bundle: Path, tmp: Path) -> Path:
    """A copy of `bundle` whose state input skips normalisation."""
    copy = tmp / "bundle"
    copy.mkdir()
    for f in bundle.iterdir():
        (copy / f.name).symlink_to(f)
    (copy / "policyd.toml").unlink()
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    state = config["inputs"][0]
    for k in ("mean", "std", "min", "max", "eps"):
        state.pop(k, None)
    (copy / "policyd.toml").write_text(tomli_w.dumps(config))
    return copy


@pytest.mark.parametrize("name", ["act_bundle", "ddim_bundle"])
def test_verify_fails_when_a_normalisation_is_skipped(
    name: str, request: pytest.FixtureRequest, policyd: str, tmp_path: Path
) -> None:
    b = request.getfixturevalue(name)
    broken = _without_state_norm(b.bundle, tmp_path)
    r = run_cli("verify", str(broken), str(b.checkpoint), "--policyd", policyd)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in r.stdout


def test_diffusion_history_changes_lerobots_actions(ddim_bundle: object) -> None:
    """The second observation's actions depend on the first (n_obs_steps = 2): so the parity
    of observations 2-4 checks policyd's per-session history, not only the current frame."""
    ckpt = load(ddim_bundle.checkpoint)
    ref = Reference(ckpt)
    obs = observations(ckpt, 2, seed=3)
    noise = np.random.default_rng(0).standard_normal((16, 6)).astype(np.float32)
    ref.actions(obs[0], noise)
    after_first = ref.actions(obs[1], noise)
    ref.reset()
    fresh = ref.actions(obs[1], noise)
    scale = float(np.abs(fresh).max())
    assert float(np.abs(after_first - fresh).max()) > 1e-2 * scale


@pytest.mark.parametrize("name", BUNDLES)
def test_the_tensorrt_config_is_the_cpu_config_on_plans(
    name: str, request: pytest.FixtureRequest
) -> None:
    """No TensorRT here to check policyd.tensorrt.toml against real plans: it must be the CPU
    config (which check-config passes above) with only the backend and the graphs swapped for
    the plans build-plans.sh writes, whose I/O trtexec keeps as the ONNX graphs'."""
    b = request.getfixturevalue(name)
    cpu = tomllib.loads((b.bundle / "policyd.toml").read_text())
    trt = tomllib.loads((b.bundle / "policyd.tensorrt.toml").read_text())
    script = (b.bundle / "build-plans.sh").read_text()
    for section in ("engine", "denoise"):
        if section not in cpu:
            continue
        onnx_file = cpu[section]["model"]
        plan = trt[section]["model"]
        assert plan == onnx_file.removesuffix(".onnx") + ".plan"
        assert f"--onnx={onnx_file} --saveEngine={plan}" in script
        cpu[section].pop("model")
        trt[section].pop("model")
    assert trt["engine"].pop("backend") == "tensorrt" and cpu["engine"].pop("backend") == "cpu"
    assert trt == cpu


@pytest.mark.parametrize("name", ["act_bundle", "ddim_bundle"])
def test_served_on_onnxruntime_actions_equal_lerobot(
    name: str, request: pytest.FixtureRequest, policyd: str, tmp_path: Path
) -> None:
    """The same bundle on `engine.backend = "ort"` (this venv's onnxruntime wheel): LeRobot's
    actions, as on `cpu`."""
    import shutil

    import onnxruntime

    b = request.getfixturevalue(name)
    bundle = tmp_path / "bundle"
    shutil.copytree(b.bundle, bundle)
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    config["engine"]["backend"] = "ort"
    config["engine"]["ort_library"] = str(Path(onnxruntime.__file__).parent / "capi")
    (bundle / "policyd.toml").write_text(tomli_w.dumps(config))
    checked = check_config(policyd, bundle / "policyd.toml")
    assert checked.returncode == 0 and "OK (ort backend" in checked.stdout, checked.stderr
    r = run_cli("verify", str(bundle), str(b.checkpoint), "--policyd", policyd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("observation ")]
    assert len(rows) == 4 and all(line.endswith("pass") for line in rows), r.stdout


def test_diffusion_resize_shape_is_served_with_its_antialiased_resize(
    tmp_path: Path, policyd: str
) -> None:
    """`resize_shape` (torchvision's Resize, antialiased) on 120×160 cameras: the encoder
    graph resizes as LeRobot does, and the same bundle with the antialiasing switched off
    is far off, so the check can fail."""
    import checkpoints
    import onnx

    ckpt = checkpoints.diffusion(tmp_path / "checkpoint", image=(120, 160), resize=(96, 128))
    bundle = tmp_path / "bundle"
    r = run_cli("lerobot", str(ckpt), "--out", str(bundle))
    assert r.returncode == 0, r.stderr
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    assert config["inputs"][-1]["shape"] == [120, 160, 3]
    r = run_cli("verify", str(bundle), str(ckpt), "--policyd", policyd)
    assert r.returncode == 0, r.stdout + r.stderr
    model = onnx.load(str(bundle / "encoder.onnx"))
    resizes = [n for n in model.graph.node if n.op_type == "Resize"]
    assert resizes
    for n in resizes:
        for a in n.attribute:
            if a.name == "antialias":
                a.i = 0
    onnx.save(model, str(bundle / "encoder.onnx"))
    r = run_cli("verify", str(bundle), str(ckpt), "--policyd", policyd)
    assert r.returncode == 1, r.stdout + r.stderr

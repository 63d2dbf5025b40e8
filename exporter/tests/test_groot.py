"""GR00T N1.7 over a tiny Qwen3-VL and a tiny base written to local directories: exported as a
flow pipeline with GR00T's time buckets, the cameras brought through GR00T's resize, crop and
resize inside the prefix graph, the prompt laid out in policyd between the chat template's ids,
and served with LeRobot's own `predict_action_chunk` actions (fp32, noise injected)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpoints import GROOT_CAMERAS, groot, tiny_qwen3vl
from conftest import Exported, check_config, run_cli
from numpy.typing import NDArray

from policyd_export.checkpoint import load
from policyd_export.reference import Reference
from policyd_export.verify import RTC_CASES, injected_config, read_manifest, serve

#: Prompts of several lengths (padding must not move the actions), an empty one (GR00T's
#: default task) and one that cleans to something else.
PROMPTS = [
    "pick up the red cube",
    "Fold the towel!",
    "open the top drawer and put the bowl inside, then put the red cube on the stove",
    "",
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("groot")
    vlm = tiny_qwen3vl(root / "vlm")
    ckpt = groot(root, vlm)
    r = run_cli("lerobot", str(ckpt), "--out", str(root / "bundle"))
    assert r.returncode == 0, r.stderr
    return Exported(ckpt, root / "bundle", r.stdout)


@pytest.fixture(scope="module")
def reference(bundle: Exported) -> Reference:
    return Reference(load(bundle.checkpoint))


def _observation(rng: np.random.Generator, prompt: str) -> dict[str, Any]:
    """Cameras at their own sizes, and a state half outside the statistics' range (GR00T clips
    the normalised state to [−1, 1])."""
    obs: dict[str, Any] = {"task": prompt}
    for key, (c, h, w) in GROOT_CAMERAS.items():
        obs[key] = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
    obs["observation.state"] = (10.0 * rng.standard_normal(6)).astype(np.float32)
    return obs


def test_the_bundle_is_a_groot_flow_pipeline(bundle: Exported, policyd: str) -> None:
    config = tomllib.loads((bundle.bundle / "policyd.toml").read_text())
    assert config["sampler"]["flow_time"] == "groot" and config["sampler"]["steps"] == 4
    cams = [b for b in config["inputs"] if b["key"].startswith("observation.images.")]
    assert [b["shape"] for b in cams] == [[48, 64, 3]] * 2  # their own size: resized in the graph
    prompt = config["inputs"][-1]["tokenizer"]
    assert prompt["format"] == "groot" and prompt["overflow"] == "refuse"
    assert prompt["prefix_ids"][-1] != prompt["prefix_ids"][0]
    output = config["outputs"][0]
    assert output["clip"] == [-1.0, 1.0] and output["columns"] == 6
    r = check_config(policyd, bundle.bundle / "policyd.toml")
    assert r.returncode == 0, r.stderr
    assert "GR00T: upward time, integer buckets" in r.stdout


def _served(
    bundle: Exported,
    reference: Reference,
    policyd: str,
    tmp: Path,
    steps: list[int],
    rows: int = 8,
) -> list[tuple[str, int, float, float]]:
    """(prompt, steps, max |policyd − LeRobot|, action scale) for each prompt and step count."""
    from openpi_client import websocket_client_policy

    manifest = read_manifest(bundle.bundle)
    config, _ = injected_config(bundle.bundle, manifest, tmp)
    rng = np.random.default_rng(3)
    out = []
    with serve(policyd, config) as port:
        client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
        for n in steps:
            reference.set_steps(n)
            for prompt in PROMPTS:
                obs = _observation(rng, prompt)
                noise = rng.standard_normal(manifest["noise"]["shape"]).astype(np.float32)
                request = {**obs, "noise": noise}
                request["sampling_params"] = {"num_inference_steps": n}
                got = np.asarray(client.infer(request)["actions"], dtype=np.float64)
                want = reference.actions(obs, noise).astype(np.float64)
                assert got.shape == want.shape == (rows, 6)
                out.append((prompt, n, float(np.abs(got - want).max()), float(np.abs(want).max())))
    reference.set_steps(4)
    return out


def test_served_actions_equal_lerobot(
    bundle: Exported, reference: Reference, policyd: str, tmp_path: Path
) -> None:
    """4, 5 and 10 steps (5 and 10: where a bucket from a float32 time would be off by one),
    prompts of several lengths (the padding masked), states outside the statistics."""
    for prompt, n, diff, scale in _served(bundle, reference, policyd, tmp_path, [4, 5, 10]):
        assert diff <= 1e-4 * scale, (prompt, n, diff, scale)


def test_a_checkpoints_own_statistics_decode_as_lerobot_decodes_them(
    tmp_path_factory: pytest.TempPathFactory, policyd: str, tmp_path: Path
) -> None:
    """An Isaac-GR00T base with its own `statistics.json` and modality config: LeRobot packs
    the state and decodes the actions per group with those (q01/q99 under `use_percentiles`,
    six valid steps of eight) instead of the dataset's, and so does the bundle."""
    import json

    root = tmp_path_factory.mktemp("groot-own-stats")
    ckpt = groot(root, tiny_qwen3vl(root / "vlm"), seed=1, checkpoint_stats=True)
    post = json.loads((ckpt / "policy_postprocessor.json").read_text())
    assert "groot_n1_7_action_decode_v1" in [s.get("registry_name") for s in post["steps"]]
    r = run_cli("lerobot", str(ckpt), "--out", str(root / "bundle"))
    assert r.returncode == 0, r.stderr
    own = Exported(ckpt, root / "bundle", r.stdout)
    output = tomllib.loads((own.bundle / "policyd.toml").read_text())["outputs"][0]
    assert output["rows"] == [0, 6]
    stats = json.loads((root / "base" / "statistics.json").read_text())["new_embodiment"]
    q = stats["action"]
    assert output["min"] == pytest.approx(q["arm"]["q01"] + q["gripper"]["q01"])
    reference = Reference(load(ckpt))
    for prompt, n, diff, scale in _served(own, reference, policyd, tmp_path, [4, 10], rows=6):
        assert diff <= 1e-4 * scale, (prompt, n, diff, scale)


def test_the_inputs_move_the_actions(bundle: Exported, reference: Reference) -> None:
    """The comparison above can fail: the prompt, each camera and the state each change
    LeRobot's actions by more than five times its tolerance."""
    rng = np.random.default_rng(5)
    noise = rng.standard_normal((8, 8)).astype(np.float32)
    obs = _observation(rng, PROMPTS[0])
    base = reference.actions(obs, noise)
    scale = float(np.abs(base).max())
    changed = {
        "prompt": {**obs, "task": "fold the towel"},
        "front": {**obs, "observation.images.front": 255 - obs["observation.images.front"]},
        "wrist": {**obs, "observation.images.wrist": 255 - obs["observation.images.wrist"]},
        "state": {**obs, "observation.state": -obs["observation.state"]},
    }
    for what, other in changed.items():
        diff = float(np.abs(reference.actions(other, noise) - base).max())
        assert diff > 5e-4 * scale, (what, diff, scale)


def _edited(bundle: Exported, tmp_path: Path, **fields: object) -> Path:
    import json
    import shutil

    ckpt = tmp_path / "checkpoint"
    shutil.copytree(bundle.checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(fields)
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.mark.parametrize(
    ("field", "value"),
    [("use_relative_actions", True), ("action_decode_transform", "libero")],
)
def test_what_is_not_reproduced_exits_2_naming_it(
    field: str, value: object, bundle: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(In this process: the CLI's own start-up, importing torch and LeRobot, is most of a
    subprocess's time, and the refusal comes before any model is built.)"""
    from policyd_export.cli import main

    ckpt = _edited(bundle, tmp_path, **{field: value})
    assert main(["lerobot", str(ckpt), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert field in err, err


def test_a_base_model_not_on_this_machine_is_named_with_the_command(
    bundle: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The base's config.json sizes the network: a Hub name that is not cached stops the export
    with the download command (config files only) and the option; no weights are fetched."""
    from policyd_export.cli import main

    ckpt = _edited(bundle, tmp_path, base_model_path="nvidia/GR00T-N1.7-3B")
    assert main(["lerobot", str(ckpt), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "huggingface-cli download nvidia/GR00T-N1.7-3B" in err and "--base" in err, err
    assert not (tmp_path / "b").exists()


#: A VLM's own Python: writes the marker when imported, then fails (the test needs no more).
EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
raise RuntimeError("the checkpoint's own code ran")
"""


def _evil_vlm(vlm: Path, at: Path, marker: Path) -> Path:
    """A copy of the tiny VLM whose config.json's `auto_map` names a marker-writing `evil.py`."""
    import json
    import shutil

    shutil.copytree(vlm, at)
    (at / "evil.py").write_text(EVIL.format(marker=str(marker)))
    config = json.loads((at / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    (at / "config.json").write_text(json.dumps(config))
    return at


def _naming(ckpt: Path, base: Path, base_name: str, vlm_name: str) -> None:
    """Points the checkpoint at `base_name` and both of GR00T's VLM reads at `vlm_name`."""
    import json

    for file, key, value in [
        (ckpt / "config.json", "base_model_path", base_name),
        (base / "config.json", "model_name", vlm_name),
    ]:
        config = json.loads(file.read_text())
        config[key] = value
        file.write_text(json.dumps(config))
    pre = ckpt / "policy_preprocessor.json"
    text = json.loads(pre.read_text())
    for step in text["steps"]:
        if "model_name" in step.get("config", {}):
            step["config"]["model_name"] = vlm_name
    pre.write_text(json.dumps(text))


def _hostile(bundle: Exported, tmp_path: Path, layout: str, monkeypatch: Any) -> Path:
    """The checkpoint naming a VLM with code, as a Hub id in the HF cache, as an absolute path,
    or as relative names inside one downloaded directory (which is then the current one)."""
    import shutil

    marker = tmp_path / "marker"
    root = bundle.checkpoint.parent
    if layout == "relative":
        ckpt = tmp_path / "download"
        shutil.copytree(bundle.checkpoint, ckpt)
        shutil.copytree(root / "base", ckpt / "base")
        _evil_vlm(root / "vlm", ckpt / "vlm", marker)
        _naming(ckpt, ckpt / "base", "base", "vlm")
        monkeypatch.chdir(ckpt)
        return ckpt
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(bundle.checkpoint, ckpt)
    base = shutil.copytree(root / "base", tmp_path / "base")
    if layout == "absolute":
        vlm = _evil_vlm(root / "vlm", tmp_path / "vlm", marker)
        _naming(ckpt, base, str(base), str(vlm))
    else:  # a Hub id whose snapshot is in the cache
        import huggingface_hub.constants

        hub = tmp_path / "hub"
        repo = hub / "models--someone--vlm"
        _evil_vlm(root / "vlm", repo / "snapshots" / "0123abcd", marker)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
        _naming(ckpt, base, str(base), "someone/vlm")
    return ckpt


@pytest.mark.parametrize("layout", ["hub-cache", "absolute", "relative"])
def test_a_vlm_with_its_own_code_is_refused_not_run(
    layout: str,
    bundle: Exported,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """LeRobot loads GR00T's VLM with `trust_remote_code=True`: an `auto_map` in the VLM's
    config would run its `.py`. The export and verify refuse it, naming the file, the key and
    the flag, and nothing runs (no marker)."""
    from policyd_export.cli import main

    ckpt = _hostile(bundle, tmp_path, layout, monkeypatch)
    for argv in (
        ["lerobot", str(ckpt), "--out", str(tmp_path / "b")],
        ["verify", str(bundle.bundle), str(ckpt)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "config.json" in err and "auto_map" in err and "--trust-remote-code" in err, err
        assert "evil.py" in err, err
        assert not (tmp_path / "marker").exists()
    if layout == "relative":
        # Resolved against the checkpoint's directory, not the current one: the same refusal
        # from anywhere, naming the checkpoint's own vlm/.
        monkeypatch.chdir(tmp_path)
        assert main(["lerobot", str(ckpt), "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err
        assert str(ckpt / "vlm" / "config.json") in err, err
    assert not (tmp_path / "marker").exists()


def test_the_flag_lets_the_vlms_code_run(
    bundle: Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `--trust-remote-code` the same checkpoint's code runs (the marker appears): the
    refusals above are what keeps it from running, and the test sees execution."""
    from policyd_export.cli import main

    ckpt = _hostile(bundle, tmp_path, "absolute", monkeypatch)
    main(["lerobot", str(ckpt), "--out", str(tmp_path / "b"), "--trust-remote-code"])
    assert (tmp_path / "marker").read_text() == "ran"


def test_transformers_own_loader_is_refused_for_the_whole_command(
    bundle: Exported, tmp_path: Path
) -> None:
    """The backstop for a path the directory checks did not foresee: under the command's
    guard, transformers' dynamic-module loader refuses even when its caller passes
    `trust_remote_code=True`, and nothing runs."""
    from transformers import AutoConfig

    from policyd_export.remote_code import RemoteCodeRefused, guard

    vlm = _evil_vlm(bundle.checkpoint.parent / "vlm", tmp_path / "vlm", tmp_path / "marker")
    with guard(False), pytest.raises(RemoteCodeRefused, match="--trust-remote-code"):
        AutoConfig.from_pretrained(str(vlm), trust_remote_code=True)
    assert not (tmp_path / "marker").exists()


def test_the_position_ids_patch_fails_loudly_when_transformers_changes(
    bundle: Exported, reference: Reference
) -> None:
    """The M-RoPE ids are computed by LeRobot's backbone code through transformers'
    `compute_3d_position_ids`; if that stops producing GR00T's 4-row ids, the export stops
    naming it rather than baking wrong positions. (The image chain is checked against
    LeRobot's at every export, and the token layout against the processor.)"""
    from policyd_export.errors import ExportError
    from policyd_export.families import groot as family

    t = tomllib.loads((bundle.bundle / "policyd.toml").read_text())["inputs"][-1]["tokenizer"]
    layout = family.Layout(t["prefix_ids"], t["suffix_ids"], [], t["max_tokens"])
    grids = [(4, 4), (4, 4)]
    pos = family._position_ids(reference.policy, layout, 0, grids)
    assert tuple(pos.shape) == (4, 1, t["max_tokens"])
    backbone = reference.policy._groot_model.backbone
    qwen = getattr(backbone.model, "model", backbone.model)
    saved = qwen.compute_3d_position_ids
    qwen.compute_3d_position_ids = lambda **kw: saved(**kw)[:2]  # not Qwen3-VL's 3 rows
    try:
        with pytest.raises(ExportError, match="compute_3d_position_ids"):
            family._position_ids(reference.policy, layout, 0, grids)
    finally:
        qwen.compute_3d_position_ids = saved


def test_verify_passes(bundle: Exported, policyd: str) -> None:
    """The served chunks equal LeRobot's, and so do RTC chunks (GR00T's inpainting, as
    LeRobot maps a leftover onto it) for each of verify's cases."""
    r = run_cli("verify", str(bundle.bundle), str(bundle.checkpoint), "--policyd", policyd)
    assert r.returncode == 0, r.stdout + r.stderr
    rtc = [line for line in r.stdout.splitlines() if line.startswith("rtc ")]
    assert len(rtc) == len(RTC_CASES) and all(line.endswith("pass") for line in rtc), r.stdout


def test_lerobots_robot_client_drives_it_over_grpc(
    bundle: Exported,
    reference: Reference,
    policyd: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`robot_client --policy_type=groot`: the unmodified `RobotClient` runs its control loop
    against the bundle's `[lerobot]` service; and a chunk LeRobot's own stub asks for (robot
    keys mapped by LeRobot, the task from the observation) equals LeRobot's
    `predict_action_chunk` on that observation. policyd's initial noise is a binding no robot
    sends, filled with zeros, as the reference's."""

    import policyd_test_robot as test_robot
    from lerobot.async_inference.configs import RobotClientConfig
    from lerobot.async_inference.helpers import (
        RemotePolicyConfig,
        map_robot_keys_to_lerobot_features,
    )
    from test_lerobot_client import Stub, drive, observation, served

    monkeypatch.chdir(tmp_path)  # robot_client's logger writes logs/ here when imported
    from lerobot.async_inference.robot_client import RobotClient

    noise_shape = read_manifest(bundle.bundle)["noise"]["shape"]
    exported = _zero_noise_bundle(bundle, tmp_path, "bundle")
    frames = {
        k.removeprefix("observation.images."): (h, w) for k, (_, h, w) in GROOT_CAMERAS.items()
    }
    ckpt = str(bundle.checkpoint.resolve())
    with served(policyd, exported, tmp_path) as s:
        robot = test_robot.PolicydTestRobot(
            test_robot.PolicydTestRobotConfig(frames=frames, seed=11)
        )
        features = map_robot_keys_to_lerobot_features(robot)
        stub = Stub(s.address)
        stub.setup(RemotePolicyConfig("groot", ckpt, features, 8, "cpu"))
        obs = observation(robot, 3)
        stub.observe(obs)
        actions = stub.actions()
        stub.close()
        assert [a.get_timestep() for a in actions] == list(range(3, 11))
        got = np.stack([a.get_action().numpy() for a in actions]).astype(np.float64)
        raw = obs.get_observation()
        mine = {f"observation.images.{cam}": raw[cam] for cam in frames}
        mine["observation.state"] = np.array(
            [raw[f"{m}.pos"] for m in test_robot.MOTORS], dtype=np.float32
        )
        mine["task"] = raw["task"]
        want = reference.actions(mine, np.zeros(noise_shape, np.float32)).astype(np.float64)
        scale = float(np.abs(want).max())
        assert got.shape == want.shape == (8, 6)
        assert float(np.abs(got - want).max()) <= 1e-4 * scale, (got, want)

        cfg = RobotClientConfig(
            policy_type="groot",
            pretrained_name_or_path=ckpt,
            robot=test_robot.PolicydTestRobotConfig(frames=frames, seed=12),
            actions_per_chunk=8,
            server_address=s.address,
            task="pick up the red cube",
            fps=30,
        )
        _, driven = drive(RobotClient(cfg), cfg.task, 3.0)
        # 3 s at 30 Hz: actions flow from the first chunk on, one per tick.
        assert len(driven.actions) >= 45, len(driven.actions)
        assert len(driven.observations) >= 2
        for a in driven.actions:
            assert list(a) == [f"{m}.pos" for m in test_robot.MOTORS]
            assert all(np.isfinite(v) for v in a.values())
        assert s.healthy()
        assert 'policyd_requests_total{route="lerobot",endpoint="observe"}' in s.metrics()


def _zero_noise_bundle(bundle: Exported, tmp_path: Path, name: str, **tables: Any) -> Exported:
    """A copy of the bundle whose noise is a binding no robot sends, filled with zeros (as the
    reference's), with the top-level `tables` given (`rtc`, `pacing`)."""
    import shutil

    import tomli_w

    copy = tmp_path / name
    shutil.copytree(bundle.bundle, copy)
    config = tomllib.loads((copy / "policyd.toml").read_text())
    config["sampler"]["inject_noise"] = True
    config["inputs"].append(
        {
            "key": "noise",
            "tensor": "x_t",
            "dtypes": ["float32"],
            "shape": read_manifest(bundle.bundle)["noise"]["shape"],
            "optional": True,
            "fill": 0.0,
        }
    )
    config.update(tables)
    (copy / "policyd.toml").write_text(tomli_w.dumps(config))
    return Exported(bundle.checkpoint, copy, "")


def _rtc_bundle(bundle: Exported, tmp_path: Path, name: str, rtc: dict[str, Any]) -> Exported:
    """A zero-noise copy with `[rtc]` as given and a 100 ms latency budget (three control
    periods at 30 Hz)."""
    return _zero_noise_bundle(bundle, tmp_path, name, rtc=rtc, pacing={"latency_budget_ms": 100})


def test_rtc_over_grpc_continues_the_chunk_the_robot_was_sent(
    bundle: Exported,
    reference: Reference,
    policyd: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real-time chunking on LeRobot's gRPC service. With LeRobot's own stub and a fixed delay:
    the second chunk equals LeRobot's `predict_action_chunk(inference_delay=2,
    prev_chunk_left_over=…)`, the leftover being the first chunk from the second
    observation's timestep on (5 rows, zero-padded to the horizon of 6). Then the unmodified
    `RobotClient` with the delay measured (a 100 ms budget at 30 Hz): every chunk it receives
    that overlaps the previous one starts with the previous one's action for that timestep
    (GR00T's frozen rows), which a chunk sampled afresh does not."""
    import policyd_test_robot as test_robot
    import torch
    from lerobot.async_inference.configs import RobotClientConfig
    from lerobot.async_inference.helpers import (
        RemotePolicyConfig,
        map_robot_keys_to_lerobot_features,
    )
    from test_lerobot_client import Stub, drive, observation, served

    monkeypatch.chdir(tmp_path)  # robot_client's logger writes logs/ here when imported
    from lerobot.async_inference.robot_client import RobotClient

    noise = np.zeros(read_manifest(bundle.bundle)["noise"]["shape"], np.float32)
    frames = {
        k.removeprefix("observation.images."): (h, w) for k, (_, h, w) in GROOT_CAMERAS.items()
    }
    ckpt = str(bundle.checkpoint.resolve())

    def mine(obs: Any) -> dict[str, Any]:
        raw = obs.get_observation()
        out = {f"observation.images.{cam}": raw[cam] for cam in frames}
        out["observation.state"] = np.array(
            [raw[f"{m}.pos"] for m in test_robot.MOTORS], dtype=np.float32
        )
        out["task"] = raw["task"]
        return out

    fixed = _rtc_bundle(bundle, tmp_path, "fixed", {"execution_horizon": 6, "inference_delay": 2})
    with served(policyd, fixed, tmp_path) as s:
        robot = test_robot.PolicydTestRobot(
            test_robot.PolicydTestRobotConfig(frames=frames, seed=11)
        )
        stub = Stub(s.address)
        stub.setup(RemotePolicyConfig("groot", ckpt, map_robot_keys_to_lerobot_features(robot), 8))
        first_obs, second_obs = observation(robot, 3), observation(robot, 6)
        stub.observe(first_obs)
        chunk1 = stub.actions()
        stub.observe(second_obs)
        chunk2 = stub.actions()
        stub.close()
    assert [a.get_timestep() for a in chunk2] == list(range(6, 14))
    got = np.stack([a.get_action().numpy() for a in chunk2]).astype(np.float64)
    first = reference.chunk(mine(first_obs), noise)
    prev = torch.cat([first[0, 3:], torch.zeros((1, first.shape[2]))])
    reference.use_rtc(6, "linear", 10.0)
    try:
        want = reference.chunk(
            mine(second_obs), noise, inference_delay=2, prev_chunk_left_over=prev
        )
    finally:
        reference.policy.config.rtc_config = None
    want_actions = reference.postprocess(want).astype(np.float64)
    plain = reference.actions(mine(second_obs), noise).astype(np.float64)
    scale = float(np.abs(want_actions).max())
    assert float(np.abs(got - want_actions).max()) <= 1e-4 * scale, (got, want_actions)
    sent = np.stack([a.get_action().numpy() for a in chunk1]).astype(np.float64)
    assert np.abs(got[:2] - sent[3:5]).max() <= 1e-5 * scale, "the delayed rows are frozen"
    assert np.abs(plain[:2] - sent[3:5]).max() > 1e-3 * scale, "afresh, they would not be"

    measured = _rtc_bundle(bundle, tmp_path, "measured", {"execution_horizon": 6})
    with served(policyd, measured, tmp_path) as s:
        cfg = RobotClientConfig(
            policy_type="groot",
            pretrained_name_or_path=ckpt,
            robot=test_robot.PolicydTestRobotConfig(frames=frames, seed=12),
            actions_per_chunk=8,
            server_address=s.address,
            task="pick up the red cube",
            fps=30,
        )
        client = RobotClient(cfg)
        received: list[dict[int, NDArray[Any]]] = []
        aggregate = client._aggregate_action_queues

        def record(actions: list[Any], *args: Any, **kwargs: Any) -> Any:
            received.append({a.get_timestep(): a.get_action().numpy() for a in actions})
            return aggregate(actions, *args, **kwargs)

        client._aggregate_action_queues = record  # type: ignore[method-assign]
        _, driven = drive(client, cfg.task, 3.0)
        assert len(driven.actions) >= 45, len(driven.actions)
        assert s.healthy()
    # A chunk continues one sent before it (the last released when its observation started,
    # which need not be the one received just before it).
    continued = 0
    for i, b in enumerate(received[1:], 1):
        t0 = min(b)
        earlier = [a[t0] for a in received[:i] if t0 in a]
        assert earlier, [sorted(r) for r in received]
        assert min(np.abs(b[t0] - a).max() for a in earlier) <= 1e-5 * scale, (t0, earlier, b[t0])
        continued += 1
    assert continued >= 3, [sorted(r) for r in received]


def test_build_plans_follows_nvidias_precisions(bundle: Exported, tmp_path: Path) -> None:
    """NVIDIA's GR00T deployment builds the action head in BF16 and keeps the vision tower in
    FP32: the step plan gets `--bf16`, the prefix (vision tower, backbone) none; a stand-in
    trtexec records each call, and policyd.tensorrt.toml is the cpu config on those plans."""
    import os
    import shutil
    import sys

    copy = tmp_path / "bundle"
    shutil.copytree(bundle.bundle, copy)
    calls = tmp_path / "calls"
    fake = tmp_path / "trtexec"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if '=' in a)\n"
        "open(args['saveEngine'], 'wb').write(b'plan')\n"
    )
    fake.chmod(0o755)
    r = subprocess.run(
        [str(copy / "build-plans.sh"), "--memPoolSize=workspace:2048M"],
        cwd=tmp_path,
        env={**os.environ, "TRTEXEC": str(fake)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls.read_text().splitlines() == [
        "--onnx=prefix.onnx --saveEngine=prefix.plan --memPoolSize=workspace:2048M",
        "--onnx=step.onnx --saveEngine=step.plan --bf16 --memPoolSize=workspace:2048M",
    ]
    cpu = tomllib.loads((copy / "policyd.toml").read_text())
    trt = tomllib.loads((copy / "policyd.tensorrt.toml").read_text())
    assert (trt["engine"].pop("model"), trt["denoise"].pop("model")) == ("prefix.plan", "step.plan")
    assert (cpu["engine"].pop("model"), cpu["denoise"].pop("model")) == ("prefix.onnx", "step.onnx")
    assert trt["engine"].pop("backend") == "tensorrt" and cpu["engine"].pop("backend") == "cpu"
    assert trt == cpu

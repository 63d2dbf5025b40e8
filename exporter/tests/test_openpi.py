"""openpi's own checkpoints: `policyd-export openpi` on tiny pi0 / pi0.5 checkpoints laid out as
openpi's converter writes them, served by policyd to openpi-client, equal to openpi's pipeline.

openpi is not installable here, so the reference is its inference re-implemented in numpy from
openpi's source (`policyd_export.openpi_reference`, which `policyd-export verify` runs too),
around LeRobot's `PI0Pytorch` loaded from the same file by LeRobot's own `from_pretrained`, on
this file's facts about each config."""

from __future__ import annotations

import json
import shutil
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w
import torch
from checkpoints import OPENPI, gemma_tokenizer, openpi_checkpoint, tiny_pi0
from conftest import check_config

from policyd_export import openpi
from policyd_export.cli import main
from policyd_export.openpi import FLIP, Robot, TrainConfig
from policyd_export.openpi_reference import OpenpiReference, resize_with_pad
from policyd_export.verify import RTC_CASES, injected_config, serve

#: The openpi config whose verify checks real-time chunking too.
RTC_CONFIG = "pi05_libero"

#: openpi's per-config facts the reference needs besides `OPENPI`: quantile normalisation
#: (every model but pi0), the state in the prompt (`discrete_state_input`: pi0.5's default,
#: off for pi05_libero), the delta-action mask, the prompt length.
ALOHA_DELTA = ([True] * 6 + [False]) * 2
DELTA = {
    "pi0_libero": [True] * 6 + [False],
    "pi0_aloha": ALOHA_DELTA,
    "pi05_aloha": ALOHA_DELTA,
    # Eight entries over DROID's 7 joints and its gripper: the gripper stays absolute.
    "pi05_full_droid_finetune": [True] * 7 + [False],
}
STATE_IN_PROMPT = {"pi05_droid", "pi05_aloha", "pi05_full_droid_finetune"}
DEFAULT_PROMPT = {"pi0_aloha_sim": "Transfer cube"}
RESET_POSE = {"reset_pose": [0, -1.5, 1.5, 0, 0, 0]}
METADATA = {"pi0_aloha": RESET_POSE, "pi05_aloha": RESET_POSE}
LIBERO_KEYS = (["observation/image", "observation/wrist_image"], ["observation/state"])
DROID_KEYS = (
    ["observation/exterior_image_1_left", "observation/wrist_image_left"],
    ["observation/joint_position", "observation/gripper_position"],
)

ALOHA_KEYS = (["images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist"], ["state"])
ALOHA_SIM_KEYS = (["images/cam_high"], ["state"])
SIZES = {
    "observation/state": 8,
    "observation/joint_position": 7,
    "observation/gripper_position": 1,
    "state": 14,
}


def keys(name: str) -> tuple[list[str], list[str]]:
    if "aloha" in name:
        return ALOHA_SIM_KEYS if name.endswith("sim") else ALOHA_KEYS
    return DROID_KEYS if "droid" in name else LIBERO_KEYS


def get(obs: dict[str, Any], key: str) -> Any:
    """A request value by policyd's key (nested maps joined with `/`)."""
    if key.startswith("images/"):
        return obs["images"][key.split("/", 1)[1]]
    return obs[key]


def has(obs: dict[str, Any], key: str) -> bool:
    if key.startswith("images/"):
        return key.split("/", 1)[1] in obs.get("images", {})
    return key in obs


def put(obs: dict[str, Any], key: str, value: Any) -> None:
    if key.startswith("images/"):
        obs.setdefault("images", {})[key.split("/", 1)[1]] = value
    else:
        obs[key] = value


def reference(
    checkpoint: Path, name: str, tokenizer: Path, frames: tuple[int, int] = (224, 224)
) -> OpenpiReference:
    """openpi's pipeline (the package's numpy re-implementation, which verify runs too) on
    this file's own facts about the config, not the exporter's table: a fact the exporter
    got wrong shows as a difference."""
    pi05, horizon, asset, _, columns = OPENPI[name]
    cams, state_keys = keys(name)
    aloha = "aloha" in name
    robot = Robot(
        name,
        tuple(cams),
        tuple((k, SIZES[k]) for k in state_keys),
        columns,
        chw=aloha,
        adapt_to_pi=aloha,
        optional=tuple(cams[1:]) if aloha else (),
    )
    delta = DELTA.get(name)
    cfg = TrainConfig(
        name,
        pi05,
        robot,
        horizon,
        asset,
        delta=None if delta is None else tuple(delta),
        discrete_state=name in STATE_IN_PROMPT,
        default_prompt=DEFAULT_PROMPT.get(name),
    )
    ckpt = openpi.load(checkpoint, name, frames=frames)
    return OpenpiReference(replace(ckpt, config=cfg), tokenizer)


def norm_stats(checkpoint: Path, name: str) -> dict[str, Any]:
    asset = OPENPI[name][2]
    raw = json.loads((checkpoint / "assets" / asset / "norm_stats.json").read_text())
    return {
        k: {s: np.asarray(v, np.float64) for s, v in d.items()}
        for k, d in raw["norm_stats"].items()
    }


def observations(name: str, n: int, seed: int, stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests as openpi's LIBERO / DROID clients send them: uint8 224×224 frames, the state
    spread across the statistics (and past q01/q99), a task."""
    rng = np.random.default_rng(seed)
    cams, state_keys = keys(name)
    s = stats["state"]
    prompts = ["pick up the red cube", "put_the bowl on the stove ", "fold the towel"]
    out = []
    aloha = "aloha" in name
    for i in range(n):
        obs: dict[str, Any] = {}
        for k in [*cams, *(["images/cam_low"] if aloha else [])]:  # cam_low: sent, not read
            shape = (3, 224, 224) if aloha else (224, 224, 3)
            put(obs, k, rng.integers(0, 256, shape, np.uint8))
        d = sum(SIZES[k] for k in state_keys)
        state = s["mean"][:d] + s["std"][:d] * 2.0 * rng.standard_normal(d)
        if aloha:
            # Raw ALOHA: joints around the (pi-space) statistics, grippers in [0, 1].
            state = np.asarray(FLIP) * state
            state[[6, 13]] = rng.random(2)
        at = 0
        for k in state_keys:
            obs[k] = state[at : at + SIZES[k]]
            at += SIZES[k]
        if "observation/gripper_position" in obs and i % 2:
            # openpi's DroidInputs also takes the gripper as a bare number.
            obs["observation/gripper_position"] = float(obs["observation/gripper_position"][0])
        if not (name in DEFAULT_PROMPT and i % 2 == 0):  # ALOHA sim's client sends none
            obs["prompt"] = prompts[i % len(prompts)]
        out.append(obs)
    return out


class Case:
    def __init__(self, root: Path, name: str, tokenizer: Path):
        self.name = name
        self.checkpoint = openpi_checkpoint(root / "checkpoint", name)
        self.bundle = root / "bundle"
        self.tokenizer = tokenizer / "tokenizer.model"
        self.stats = norm_stats(self.checkpoint, name)
        args = ["openpi", str(self.checkpoint), "--config", name, "--out", str(self.bundle)]
        assert main([*args, "--tokenizer", str(self.tokenizer)]) == 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def patched() -> Iterator[None]:
    with tiny_pi0():
        yield


@pytest.fixture(scope="module", params=sorted(OPENPI))
def case(
    request: pytest.FixtureRequest,
    patched: None,
    tokenizer: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Case:
    return Case(tmp_path_factory.mktemp(request.param), request.param, tokenizer)


def test_served_actions_equal_openpis_pipeline(case: Case, policyd: str) -> None:
    from openpi_client import websocket_client_policy

    from policyd_export.bundle import read_manifest

    ref = reference(case.checkpoint, case.name, case.tokenizer)
    manifest = read_manifest(case.bundle)
    rng = np.random.default_rng(7)
    diffs = []
    with tempfile.TemporaryDirectory() as tmp:
        config, _ = injected_config(case.bundle, manifest, Path(tmp))
        with serve(policyd, config) as port:
            client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
            # openpi's server sends its config's policy_metadata ({} for most).
            assert client.get_server_metadata() == METADATA.get(case.name, {})
            for obs in observations(case.name, 4, seed=3, stats=case.stats):
                noise = rng.standard_normal(manifest["noise"]["shape"]).astype(np.float32)
                served = np.asarray(client.infer({**obs, "noise": noise})["actions"])
                want = ref.infer(obs, noise)
                assert served.shape == want.shape == (OPENPI[case.name][1], OPENPI[case.name][4])
                scale = float(np.abs(want).max())
                diffs.append(float(np.abs(served - want).max()) / scale)
    assert max(diffs) <= 1e-4, diffs


def test_the_reference_depends_on_what_it_models(case: Case) -> None:
    """So the parity above checks the prompt, the state (pi0's expert, pi0.5's prompt, or
    nothing for pi05_libero) and the delta actions."""
    ref = reference(case.checkpoint, case.name, case.tokenizer)
    obs = observations(case.name, 2, seed=5, stats=case.stats)
    noise = np.random.default_rng(0).standard_normal((OPENPI[case.name][1], 32)).astype("f4")
    a = ref.infer(obs[0], noise)
    scale = float(np.abs(a).max())
    b = ref.infer({**obs[0], "prompt": "open the top drawer twice"}, noise)
    # Past three times the parity tolerance, so a mistake there would show.
    assert float(np.abs(a - b).max()) > 3e-4 * scale
    _, state_keys = keys(case.name)
    c = ref.infer({**obs[0], **{k: obs[1][k] for k in state_keys}}, noise)
    moved = float(np.abs(a - c).max()) > 3e-4 * scale
    assert moved == (case.name != "pi05_libero"), case.name


def test_the_bundle_speaks_openpis_keys(case: Case, policyd: str) -> None:
    config = tomllib.loads((case.bundle / "policyd.toml").read_text())
    cams, state_keys = keys(case.name)
    bound = [b["key"] for b in config["inputs"]]
    state_bound = [] if case.name == "pi05_libero" else state_keys
    assert bound == [*cams, *state_bound, "prompt"]
    assert "lerobot" not in config  # no LeRobot client describes an openpi policy
    assert config["sampler"]["flow_time"] == "openpi" and config["sampler"]["steps"] == 10
    prompt = config["inputs"][-1]["tokenizer"]
    assert prompt["format"] == ("pi05" if case.name in STATE_IN_PROMPT else "pi0")
    assert config["outputs"][0]["columns"] == OPENPI[case.name][4]
    assert ("relative_to" in config["outputs"][0]) == (case.name in DELTA)
    r = check_config(policyd, case.bundle / "policyd.toml")
    assert r.returncode == 0, r.stderr
    assert "pipeline: flow (openpi Euler)" in r.stdout, r.stdout


def test_aloha_requests_may_leave_out_a_wrist_camera(
    patched: None, tokenizer: Path, tmp_path_factory: pytest.TempPathFactory, policyd: str
) -> None:
    """`AlohaInputs` needs only `cam_high`: a wrist camera the robot does not send is a zero
    image with its mask off. The bundle's wrist bindings are optional with a presence flag
    (`present_tensor`) as the mask; served actions equal openpi's pipeline on requests without
    the right wrist and without both, and the mask matters (the same zero images sent, their
    masks on, move the actions)."""
    from openpi_client import websocket_client_policy

    from policyd_export.bundle import read_manifest

    case = Case(tmp_path_factory.mktemp("pi0_aloha-wrists"), "pi0_aloha", tokenizer)
    config = tomllib.loads((case.bundle / "policyd.toml").read_text())
    wrists = [b for b in config["inputs"] if "wrist" in b["key"]]
    assert [b.get("present_tensor") for b in wrists] == [
        "left_wrist_0_rgb_present",
        "right_wrist_0_rgb_present",
    ]
    ref = reference(case.checkpoint, case.name, case.tokenizer)
    manifest = read_manifest(case.bundle)
    rng = np.random.default_rng(13)
    diffs, moved = [], []
    with tempfile.TemporaryDirectory() as tmp:
        served_config, _ = injected_config(case.bundle, manifest, Path(tmp))
        with serve(policyd, served_config) as port:
            client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
            obs_list = observations(case.name, 4, seed=9, stats=case.stats)
            for i, obs in enumerate(obs_list):
                left_out = ["cam_right_wrist"] + (["cam_left_wrist"] if i % 2 else [])
                for cam in left_out:
                    del obs["images"][cam]
                noise = rng.standard_normal(manifest["noise"]["shape"]).astype(np.float32)
                served = np.asarray(client.infer({**obs, "noise": noise})["actions"])
                want = ref.infer(obs, noise)
                scale = float(np.abs(want).max())
                diffs.append(float(np.abs(served - want).max()) / scale)
                zeros = {**obs, "images": dict(obs["images"])}
                for cam in left_out:
                    zeros["images"][cam] = np.zeros((3, 224, 224), np.uint8)
                sent = np.asarray(client.infer({**zeros, "noise": noise})["actions"])
                moved.append(float(np.abs(sent - served).max()) / scale)
    assert max(diffs) <= 1e-4, diffs
    assert min(moved) > 1e-3, moved


@pytest.mark.parametrize("frames", [(480, 640), (120, 100), (1080, 1920), (223, 301), (224, 300)])
def test_the_graphs_resize_is_pillows_bit_for_bit(frames: tuple[int, int]) -> None:
    """openpi's `ResizeImages` is `openpi_client.image_tools`: Pillow's BILINEAR, two passes
    each rounded to uint8. The prefix graph's resize equals Pillow's on every pixel (and the
    reference calls Pillow itself); a one-pass resize rounded once (jax's, which the graph did
    before) differs on about a tenth of them, which the parity tests' 1e-4 could not see."""
    from PIL import Image

    from policyd_export.openpi import ResizeWithPad

    rng = np.random.default_rng(sum(frames))
    frame = rng.integers(0, 256, (*frames, 3), np.uint8)
    pil = resize_with_pad(frame)
    chw = torch.from_numpy(frame).permute(2, 0, 1).float()
    graph = (ResizeWithPad(*frames)(chw) + 1.0) * (255.0 / 2.0)
    ours = torch.round(graph).byte().permute(1, 2, 0).numpy()
    assert (ours != pil).sum() == 0, f"{(ours != pil).mean():.3%} of the pixels differ"
    # The reference is Pillow's own resize, pasted on black.
    h, w = frames
    ratio = max(w / 224, h / 224)
    rh, rw = int(h / ratio), int(w / ratio)
    top, left = (224 - rh) // 2, (224 - rw) // 2
    direct = np.asarray(Image.fromarray(frame).resize((rw, rh), Image.BILINEAR))
    assert (pil[top : top + rh, left : left + rw] == direct).all()
    # One rounding instead of two: visibly different (so the check above can fail).
    one = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
    once = torch.nn.functional.interpolate(one, (rh, rw), mode="bilinear", antialias=True)
    once = torch.round(once[0]).clamp(0, 255).byte().permute(1, 2, 0).numpy()
    assert (once != direct).mean() > 0.01


@pytest.mark.parametrize("frames", [(480, 640), (120, 100)])
def test_frames_of_another_size_are_resized_as_openpi_does(
    frames: tuple[int, int], patched: None, tokenizer: Path, tmp_path: Path, policyd: str
) -> None:
    """`--frame-size`: the robot sends its cameras' own frames (480×640: a 2.86× antialiased
    downscale, padded above and below; 120×100: a bilinear upscale, padded at the sides) and
    the bundle does openpi's `ResizeImages` (Pillow's, bit for bit); the actions equal openpi's
    pipeline on the frames openpi's resize makes of them, to float rounding."""
    from openpi_client import websocket_client_policy

    from policyd_export.bundle import read_manifest

    name = "pi0_libero"
    ckpt = openpi_checkpoint(tmp_path / "checkpoint", name)
    bundle = tmp_path / "bundle"
    size = f"{frames[0]}x{frames[1]}"
    args = ["openpi", str(ckpt), "--config", name, "--out", str(bundle), "--frame-size", size]
    assert main([*args, "--tokenizer", str(tokenizer / "tokenizer.model")]) == 0
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    cams = [b for b in config["inputs"] if b["key"] in keys(name)[0]]
    assert [b["shape"] for b in cams] == [[*frames, 3]] * 2
    assert all("scale" not in b for b in cams)  # 0..255 into the graph's resize
    ref = reference(ckpt, name, tokenizer / "tokenizer.model")
    manifest = read_manifest(bundle)
    rng = np.random.default_rng(11)
    diffs = []
    with tempfile.TemporaryDirectory() as tmp:
        served_config, _ = injected_config(bundle, manifest, Path(tmp))
        with serve(policyd, served_config) as port:
            client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
            for obs in observations(name, 3, seed=5, stats=norm_stats(ckpt, name)):
                for k in keys(name)[0]:
                    put(obs, k, rng.integers(0, 256, (*frames, 3), np.uint8))
                noise = rng.standard_normal(manifest["noise"]["shape"]).astype(np.float32)
                served = np.asarray(client.infer({**obs, "noise": noise})["actions"])
                resized = dict(obs)
                for k in keys(name)[0]:
                    put(resized, k, resize_with_pad(get(obs, k)))
                want = ref.infer(resized, noise)
                scale = float(np.abs(want).max())
                diffs.append(float(np.abs(served - want).max()) / scale)
                # The resize matters: the frames squeezed to 224×224 without it move the actions.
                squeezed = dict(obs)
                for k in keys(name)[0]:
                    small = torch.from_numpy(get(obs, k)).permute(2, 0, 1)[None].float()
                    small = torch.nn.functional.interpolate(small, (224, 224), mode="bilinear")
                    put(squeezed, k, small[0].permute(1, 2, 0).round().byte().numpy())
                moved = float(np.abs(ref.infer(squeezed, noise) - want).max()) / scale
                assert moved > 1e-2, moved
    assert max(diffs) <= 1e-4, diffs
    # verify's reference resizes the frames itself.
    verify = ["verify", str(bundle), str(ckpt), "--policyd", policyd, "--observations", "1"]
    assert main(verify) == 0


def export_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["openpi", *args]) == 2
    return capsys.readouterr().err


def test_a_checkpoint_that_does_not_match_its_config_is_refused(
    patched: None, tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LeRobot's loader would keep random weights here; the exporter names the tensors."""
    pi0 = openpi_checkpoint(tmp_path / "pi0", "pi05_libero", pi05=False)
    tok = str(tokenizer / "tokenizer.model")
    out = str(tmp_path / "bundle")
    err = export_error(
        capsys, str(pi0), "--config", "pi05_libero", "--out", out, "--tokenizer", tok
    )
    assert "do not match a pi0.5 model" in err
    assert "missing 14: " in err and "layers.0.input_layernorm.dense.bias" in err
    assert "unexpected 11: action_time_mlp_in.bias" in err
    assert not Path(out).exists()
    # One tensor short of a matching checkpoint: named.
    from safetensors.torch import load_file, save_file

    pi05 = openpi_checkpoint(tmp_path / "pi05", "pi05_libero")
    tensors = load_file(str(pi05 / "model.safetensors"))
    del tensors["action_out_proj.bias"]
    save_file(tensors, str(pi05 / "model.safetensors"))
    err = export_error(
        capsys, str(pi05), "--config", "pi05_libero", "--out", out, "--tokenizer", tok
    )
    assert (
        "missing 1: action_out_proj.bias;" not in err and "missing 1: action_out_proj.bias" in err
    )
    assert "unexpected" not in err


def test_jax_checkpoints_unknown_configs_and_unsupported_ones_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jax = tmp_path / "pi05_droid"
    (jax / "params").mkdir(parents=True)
    err = export_error(capsys, str(jax), "--config", "pi05_droid", "--out", str(tmp_path / "b"))
    assert "Orbax" in err and "convert_jax_model_to_pytorch.py" in err
    assert "--config_name pi05_droid" in err and "assets/droid" in err
    err = export_error(capsys, str(jax), "--config", "pi0_robot", "--out", str(tmp_path / "b"))
    assert "not one of openpi's configs" in err and "known: " in err and "pi05_libero" in err
    args = ["--config", "pi0_libero_low_mem_finetune", "--out", str(tmp_path / "b")]
    err = export_error(capsys, str(jax), *args)
    assert "LoRA" in err and "gemma_2b_lora" in err
    err = export_error(capsys, str(jax), "--config", "pi0_fast_droid", "--out", str(tmp_path / "b"))
    assert "pi0-FAST" in err


def test_missing_norm_stats_say_where_they_are(
    patched: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = openpi_checkpoint(tmp_path / "ck", "pi0_droid")
    stats = ckpt / "assets" / "droid" / "norm_stats.json"
    moved = tmp_path / "jax-assets" / "droid"
    moved.mkdir(parents=True)
    stats.rename(moved / "norm_stats.json")
    err = export_error(capsys, str(ckpt), "--config", "pi0_droid", "--out", str(tmp_path / "b"))
    assert "no norm_stats.json for asset 'droid'" in err and "--norm-stats" in err
    # --norm-stats takes the assets directory (or the asset's, or the file); the tokenizer is
    # looked for next, so the error moves on to it.
    err = export_error(
        capsys,
        str(ckpt),
        "--config",
        "pi0_droid",
        "--out",
        str(tmp_path / "b"),
        "--norm-stats",
        str(tmp_path / "jax-assets"),
        "--tokenizer",
        str(tmp_path / "nowhere.model"),
    )
    assert "no PaliGemma tokenizer" in err and "nowhere.model" in err


def test_openpis_simple_client_loop_runs_against_the_bundle(case: Case, policyd: str) -> None:
    """What openpi's examples/simple_client does for `--env LIBERO` / `--env DROID` (its file
    cannot be fetched here: CI reaches package registries only): the metadata, two warm-up
    requests, then steps timed from `server_timing`, on the bundle as exported (no injected
    noise), with its random observations (state in [0, 1), prompt "do something")."""
    from openpi_client import websocket_client_policy

    cams, state_keys = keys(case.name)
    rng = np.random.default_rng(11)

    def observation() -> dict[str, Any]:
        if "aloha" in case.name:  # `_random_observation_aloha`, for ALOHA and ALOHA_SIM
            names = ["cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"]
            return {
                "state": np.ones((14,)),
                "images": {c: rng.integers(256, size=(3, 224, 224), dtype=np.uint8) for c in names},
                "prompt": "do something",
            }
        obs: dict[str, Any] = {
            k: rng.integers(256, size=(224, 224, 3), dtype=np.uint8) for k in cams
        }
        obs.update({k: rng.random(SIZES[k]) for k in state_keys})
        obs["prompt"] = "do something"
        return obs

    with serve(policyd, case.bundle / "policyd.toml") as port:
        policy = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=port)
        assert policy.get_server_metadata() == METADATA.get(case.name, {})
        for _ in range(2):
            policy.infer(observation())
        for _ in range(3):
            action = policy.infer(observation())
            assert action["actions"].shape == (OPENPI[case.name][1], OPENPI[case.name][4])
            assert np.isfinite(action["actions"]).all()
            assert action["server_timing"]["infer_ms"] > 0


def test_verify_compares_the_bundle_with_openpis_pipeline(
    case: Case, policyd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`policyd-export verify` on an openpi bundle: served actions against openpi's pipeline
    on requests as the config's client sends them, with the statistics the export read (the
    manifest names them); a bundle whose un-normalisation is off by 0.5 fails it (exit 1).
    For pi05_libero, real-time chunking too: RTC chunks against openpi's loop with LeRobot's
    `RTCProcessor` (verify's four cases; the other configs skip them, to keep CI short)."""
    args = ["--policyd", policyd, "--observations", "2"]
    rtc = case.name == RTC_CONFIG
    full = ["verify", str(case.bundle), str(case.checkpoint), *args]
    assert main(full if rtc else [*full, "--no-rtc"]) == 0
    out = capsys.readouterr().out
    checks = 4 + (len(RTC_CASES) if rtc else 0)
    assert out.count("policyd vs openpi actions") == 2, out
    assert f"all {checks} checks passed" in out, out
    assert out.count("rtc d=") == (len(RTC_CASES) if rtc else 0), out
    args.append("--no-rtc")
    wrong = tmp_path / "bundle"
    shutil.copytree(case.bundle, wrong)
    config = tomllib.loads((wrong / "policyd.toml").read_text())
    action = config["outputs"][0]
    for key in ("mean", "min", "max"):
        if key in action:
            action[key][0] += 0.5
    (wrong / "policyd.toml").write_text(tomli_w.dumps(config))
    assert main(["verify", str(wrong), str(case.checkpoint), *args]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_hostile_sizes_and_statistics_are_refused_before_anything_is_built(
    patched: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 49, item 6: `action_dim = 1e12` used to be an uncaught exception, and NaN, negative
    or inverted statistics were written into a bundle policyd then refused: each exits 2 naming
    the file and the key."""
    import json

    ckpt = openpi_checkpoint(tmp_path / "ck", "pi0_droid")
    config = ckpt / "config.json"
    model = json.loads(config.read_text())
    out = str(tmp_path / "b")
    config.write_text(json.dumps({**model, "action_dim": 1e12}))
    err = export_error(capsys, str(ckpt), "--config", "pi0_droid", "--out", out)
    assert "config.json" in err and "action_dim" in err, err
    config.write_text("[" * 100_000 + "]" * 100_000)
    err = export_error(capsys, str(ckpt), "--config", "pi0_droid", "--out", out)
    assert "config.json" in err and "nested too deeply" in err, err
    config.write_text(json.dumps(model))
    stats_file = ckpt / "assets" / "droid" / "norm_stats.json"
    good = json.loads(stats_file.read_text())
    for part, stat, value, says in [
        ("state", "mean", float("nan"), "NaN or infinity"),
        ("actions", "std", -1.0, "negative"),
        ("actions", "q01", 1e9, "inverted"),
    ]:
        bad = json.loads(json.dumps(good))
        bad["norm_stats"][part][stat][0] = value
        stats_file.write_text(json.dumps(bad))
        err = export_error(capsys, str(ckpt), "--config", "pi0_droid", "--out", out)
        assert str(stats_file) in err and f"norm_stats.{part}.{stat}" in err and says in err, err
    assert not Path(out).exists()

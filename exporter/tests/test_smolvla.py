"""SmolVLA over a tiny SmolVLM written to a local directory (what `vlm_model_name` may name):
exported as a flow pipeline, the camera resized with padding inside the prefix graph, the
prompt tokenized in policyd with the VLM's tokenizer.json, equal to LeRobot's own inference."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from checkpoints import smolvla, tiny_smolvlm
from conftest import Exported, check_config, run_cli

from policyd_export.checkpoint import load
from policyd_export.reference import Reference
from policyd_export.verify import RTC_CASES, observations


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("smolvla")
    vlm = tiny_smolvlm(root / "vlm")
    ckpt = smolvla(root / "checkpoint", vlm)
    r = run_cli("lerobot", str(ckpt), "--out", str(root / "bundle"))
    assert r.returncode == 0, r.stderr
    return Exported(ckpt, root / "bundle", r.stdout)


def test_the_bundle_is_a_flow_pipeline_over_the_vlms_tokenizer(
    bundle: Exported, policyd: str
) -> None:
    config = tomllib.loads((bundle.bundle / "policyd.toml").read_text())
    assert config["sampler"]["flow_time"] == "lerobot"
    assert config["denoise"]["wire"] == {n: n for n in ("prefix_mask", "k", "v")}
    image = config["inputs"][0]
    assert image["shape"] == [48, 64, 3]  # the camera's own size: the graph resizes it
    prompt = config["inputs"][-1]["tokenizer"]
    assert prompt["file"] == "tokenizer.json" and prompt["format"] == "lerobot"
    assert "bos" not in prompt  # this tokenizer adds none, as SmolVLM's
    assert (bundle.bundle / "tokenizer.json").is_file()
    r = check_config(policyd, bundle.bundle / "policyd.toml")
    assert r.returncode == 0, r.stderr
    assert "LeRobot's euler_integrate" in r.stdout


def test_served_actions_equal_lerobot(bundle: Exported, policyd: str) -> None:
    """LeRobot pads prompts to their own length; policyd to 16 tokens, masked: the prompts sent
    have several lengths, so this checks the padding changes nothing."""
    r = run_cli("verify", str(bundle.bundle), str(bundle.checkpoint), "--policyd", policyd)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("observation ")]
    assert len(rows) == 4 and all(line.endswith("pass") for line in rows), r.stdout
    # Real-time chunking: a second chunk continuing the first equals LeRobot's RTC chunk.
    rtc = [line for line in r.stdout.splitlines() if line.startswith("rtc ")]
    assert len(rtc) == len(RTC_CASES) and all(line.endswith("pass") for line in rtc), r.stdout


@pytest.mark.parametrize(
    "prompt",
    ["pick up the red cube", "  fold_the towel ", "open the drawer\n", "ünï ✓", "put " * 30],
)
def test_tokens_equal_lerobots_preprocessor(prompt: str, bundle: Exported, policyd: str) -> None:
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    ckpt = load(bundle.checkpoint)
    ref = Reference(ckpt)
    obs = dict(observations(ckpt, 1, seed=1, prompt_key="task")[0], task=prompt)
    batch = ref.pre(ref._observation(obs))
    want_ids = batch[OBS_LANGUAGE_TOKENS][0].tolist()  # padded to its own length only
    want_mask = [bool(m) for m in batch[OBS_LANGUAGE_ATTENTION_MASK][0].tolist()]
    config = tomllib.loads((bundle.bundle / "policyd.toml").read_text())
    t = config["inputs"][-1]["tokenizer"]
    r = subprocess.run(
        [
            policyd,
            "tokenize",
            "--tokenizer",
            str(bundle.bundle / "tokenizer.json"),
            "--format",
            "lerobot",
            "--max-tokens",
            str(t["max_tokens"]),
            "--pad-id",
            str(t["pad_id"]),
        ],
        input=json.dumps({"prompt": prompt}) + "\n",
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[0])
    n = len(want_ids)
    assert got["ids"][:n] == want_ids and [bool(m) for m in got["mask"][:n]] == want_mask
    assert not any(got["mask"][n:]) and all(i == t["pad_id"] for i in got["ids"][n:])


def test_lerobot_robot_clients_task_reaches_the_prompt(
    bundle: Exported, policyd: str, tmp_path: Path
) -> None:
    """Over LeRobot's gRPC service: the observation's `task` is tokenized into the prompt (a
    VLA bundle needs no edits for robot_client), and a chunk comes back."""
    import policyd_test_robot as test_robot
    from lerobot.async_inference.helpers import (
        RemotePolicyConfig,
        map_robot_keys_to_lerobot_features,
    )
    from test_lerobot_client import Stub, observation, served

    robot = test_robot.PolicydTestRobot(test_robot.PolicydTestRobotConfig(seed=8))
    features = map_robot_keys_to_lerobot_features(robot)
    ckpt = str(bundle.checkpoint.resolve())
    with served(policyd, bundle, tmp_path) as s:
        stub = Stub(s.address)
        stub.setup(RemotePolicyConfig("smolvla", ckpt, features, 5, "cpu"))
        stub.observe(observation(robot, 2))
        actions = stub.actions()
        assert [a.get_timestep() for a in actions] == list(range(2, 7))
        assert all(bool(a.get_action().isfinite().all()) for a in actions)
        stub.close()
        assert "policyd_prompts_tokenized_total 1" in s.metrics()


def test_empty_cameras_are_filled_by_the_model_and_not_sent(
    tmp_path_factory: pytest.TempPathFactory, policyd: str
) -> None:
    """`empty_cameras = 1`: LeRobot adds a feature no robot sends and fills it (−1, masked)
    in `prepare_images`; the bundle binds the real camera only, and serves LeRobot's actions."""
    root = tmp_path_factory.mktemp("smolvla-empty")
    vlm = tiny_smolvlm(root / "vlm")
    ckpt = smolvla(root / "checkpoint", vlm, seed=2, empty_cameras=1)
    r = run_cli("lerobot", str(ckpt), "--out", str(root / "bundle"))
    assert r.returncode == 0, r.stderr
    config = tomllib.loads((root / "bundle" / "policyd.toml").read_text())
    keys = [b["key"] for b in config["inputs"]]
    assert keys == ["observation.images.cam0", "observation.state", "task"], keys
    # RTC is checked on the bundle above; here the cameras are the point.
    r = run_cli("verify", str(root / "bundle"), str(ckpt), "--policyd", policyd, "--no-rtc")
    assert r.returncode == 0, r.stdout + r.stderr

"""pi0 and pi0.5 (tiny, LeRobot's size tables patched in this process): exported as a flow
pipeline over a prefix and an action-expert step, served by policyd with the prompt (and for
pi0.5 the discretised state) tokenized in the server, equal to LeRobot's own inference with the
same noise."""

from __future__ import annotations

import json
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from checkpoints import gemma_tokenizer, pi0, tiny_pi0
from conftest import check_config

from policyd_export.checkpoint import load
from policyd_export.cli import main
from policyd_export.reference import Reference
from policyd_export.verify import RTC_CASES, observations, table, verify


class Pi0:
    def __init__(self, root: Path, pi05: bool):
        self.pi05 = pi05
        self.tokenizer = gemma_tokenizer(root / "tokenizer")
        self.checkpoint = pi0(root / "checkpoint", self.tokenizer, pi05=pi05)
        self.bundle = root / "bundle"
        assert main(["lerobot", str(self.checkpoint), "--out", str(self.bundle)]) == 0


@pytest.fixture(scope="module")
def patched() -> Iterator[None]:
    with tiny_pi0():
        yield


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def bundle(
    request: pytest.FixtureRequest, patched: None, tmp_path_factory: pytest.TempPathFactory
) -> Pi0:
    return Pi0(tmp_path_factory.mktemp(request.param), pi05=request.param == "pi05")


def test_the_bundle_is_a_flow_pipeline_with_the_prompt_tokenized(bundle: Pi0, policyd: str) -> None:
    config = tomllib.loads((bundle.bundle / "policyd.toml").read_text())
    assert config["sampler"]["kind"] == "flow" and config["sampler"]["flow_time"] == "lerobot"
    wired = ("prefix_mask", "k", "v") + (() if bundle.pi05 else ("state_padded",))
    assert config["denoise"]["wire"] == {n: n for n in wired}
    prompt = config["inputs"][-1]
    assert prompt["key"] == "task"
    assert prompt["tokenizer"]["format"] == ("pi05" if bundle.pi05 else "lerobot")
    state = config["inputs"][-2]
    assert ("tensor" in state) != bundle.pi05  # pi0.5: the state reaches the prompt only
    assert (bundle.bundle / "tokenizer.model").is_file()
    assert config["outputs"][0]["columns"] == 6
    manifest = json.loads((bundle.bundle / "export.json").read_text())
    rewrites = " ".join(r for g in manifest["graphs"] for r in g["rewrites"])
    assert "R1" in rewrites  # tract could not run the prefix without it
    assert ("R2" in rewrites) != bundle.pi05  # pi0's expert concatenates the expanded time
    r = check_config(policyd, bundle.bundle / "policyd.toml")
    assert r.returncode == 0, r.stderr
    assert "pipeline: flow" in r.stdout and "tokenizer" in r.stdout, r.stdout
    # The checkpoint has no rtc_config: `[rtc]` is written commented out, with LeRobot's
    # defaults (the horizon cut to the 10-row chunk), and uncommented it is a valid config.
    text = (bundle.bundle / "policyd.toml").read_text()
    assert "rtc" not in config and "# [rtc]\n# execution_horizon = 10\n" in text, text
    on = bundle.bundle / "policyd.rtc.toml"
    head, _, keys = text.partition("# [rtc]\n")
    on.write_text(head + "[rtc]\n" + "\n".join(k.removeprefix("# ") for k in keys.splitlines()))
    assert tomllib.loads(on.read_text())["rtc"]["prefix_attention_schedule"] == "linear"
    r = check_config(policyd, on)
    assert r.returncode == 0, r.stderr
    assert "rtc " in r.stdout, r.stdout


def test_a_checkpoints_rtc_config_becomes_the_bundles_rtc_table() -> None:
    """LeRobot's `rtc_config` as the checkpoint has it (on or off), the horizon cut to the
    chunk; GR00T has none (its RTC is keyed by rtc_ramp_rate, written commented out)."""
    from policyd_export import rtc

    config = {
        "rtc_config": {
            "enabled": False,
            "execution_horizon": 12,
            "prefix_attention_schedule": "EXP",
            "max_guidance_weight": 5.0,
        }
    }
    assert rtc.table(config, groot=False, rows=10) == {
        "enabled": False,
        "execution_horizon": 10,
        "prefix_attention_schedule": "exp",
        "max_guidance_weight": 5.0,
    }
    assert rtc.table({"rtc_config": None}, groot=False, rows=10) is None
    assert rtc.table(config, groot=True, rows=10) is None
    text = rtc.commented(groot=True, rows=8, ramp_rate=3.0)
    assert "# rtc_ramp_rate = 3.0" in text and "schedule" not in text, text


def test_served_actions_equal_lerobot(bundle: Pi0, policyd: str) -> None:
    """Four observations, then real-time chunking: a second chunk continuing the first
    equals LeRobot's `predict_action_chunk(inference_delay=, prev_chunk_left_over=)` for each
    of verify's cases (`RTC_CASES`)."""
    rows = verify(bundle.bundle, bundle.checkpoint, policyd=policyd)
    assert all(r.ok for r in rows), table(rows)
    assert len(rows) == 6 + len(RTC_CASES)
    assert sum(r.what.startswith("rtc ") for r in rows) == len(RTC_CASES)


def test_the_prompt_changes_lerobots_actions(bundle: Pi0) -> None:
    """So the parity above checks policyd's tokenization too (and for pi0.5 the state, which
    reaches the model only through the prompt)."""
    ckpt = load(bundle.checkpoint)
    ref = Reference(ckpt)
    obs = observations(ckpt, 2, seed=0, prompt_key="task")
    noise = np.random.default_rng(0).standard_normal((10, 32)).astype(np.float32)
    a = ref.actions(obs[0], noise)
    b = ref.actions(dict(obs[0], task="fold the towel twice"), noise)
    scale = float(np.abs(a).max())
    assert float(np.abs(a - b).max()) > 1e-3 * scale
    if bundle.pi05:
        c = ref.actions(dict(obs[0], **{"observation.state": obs[1]["observation.state"]}), noise)
        assert float(np.abs(a - c).max()) > 1e-3 * scale


PROMPTS = [
    "pick up the red cube",
    "put_the bowl on the stove",  # LeRobot's pi0 does not clean underscores (pi0.5, openpi do)
    "  fold the towel  ",
    "open the drawer\n",  # pi0: already ends with a newline, none added
    "ünïcödé ✓ pick",
    "pick up the red cube and put it in the bowl on the stove next to the towel " * 3,
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokens_equal_lerobots_preprocessor(prompt: str, bundle: Pi0, policyd: str) -> None:
    """policyd's token ids and mask against what the checkpoint's own preprocessor feeds the
    model (pi0: newline step, tokenizer; pi0.5: normaliser, the state discretised into the
    prompt, tokenizer), on the same observation."""
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    ckpt = load(bundle.checkpoint)
    ref = Reference(ckpt)
    obs = dict(observations(ckpt, 1, seed=1, prompt_key="task")[0], task=prompt)
    batch = ref.pre(ref._observation(obs))
    want_ids = batch[OBS_LANGUAGE_TOKENS][0].tolist()
    want_mask = [bool(m) for m in batch[OBS_LANGUAGE_ATTENTION_MASK][0].tolist()]
    request: dict = {"prompt": prompt}
    if bundle.pi05:
        request["state"] = batch["observation.state"][0].tolist()  # normalised, as policyd's
    r = subprocess.run(
        [
            policyd,
            "tokenize",
            "--tokenizer",
            str(bundle.bundle / "tokenizer.model"),
            "--format",
            "pi05" if bundle.pi05 else "lerobot",
            "--max-tokens",
            str(len(want_ids)),
        ],
        input=json.dumps(request) + "\n",
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[0])
    assert got["ids"] == want_ids
    assert [bool(m) for m in got["mask"]] == want_mask


class Fine:
    """A pi0/pi0.5 fine-tune as LeRobot users train them: cameras recorded at the dataset's
    resolution (not the model's 224×224) and relative actions with the gripper absolute."""

    def __init__(self, root: Path, pi05: bool, image: tuple[int, int]):
        self.pi05 = pi05
        self.image = image
        tokenizer = gemma_tokenizer(root / "tokenizer")
        self.checkpoint = pi0(
            root / "checkpoint", tokenizer, pi05=pi05, image=image, relative=True, seed=3
        )
        self.bundle = root / "bundle"
        assert main(["lerobot", str(self.checkpoint), "--out", str(self.bundle)]) == 0


@pytest.fixture(scope="module", params=[("pi0", (480, 640)), ("pi05", (256, 256))])
def fine(
    request: pytest.FixtureRequest, patched: None, tmp_path_factory: pytest.TempPathFactory
) -> Fine:
    kind, image = request.param
    return Fine(tmp_path_factory.mktemp(f"{kind}-fine"), kind == "pi05", image)


def test_real_camera_sizes_and_relative_actions_export(fine: Fine) -> None:
    config = tomllib.loads((fine.bundle / "policyd.toml").read_text())
    h, w = fine.image
    camera = config["inputs"][0]
    # The camera arrives at its recorded size, only normalised: the graph resizes with padding.
    assert camera["shape"] == [h, w, 3] and camera["scale"] == 1.0 / 255.0
    assert "offset" not in camera
    output = config["outputs"][0]
    assert output["relative_to"] == "observation.state"
    assert output["relative_mask"] == [True] * 5 + [False], "the gripper stays absolute"


def test_real_camera_sizes_and_relative_actions_equal_lerobot(
    fine: Fine, policyd: str, tmp_path: Path
) -> None:
    rows = verify(fine.bundle, fine.checkpoint, policyd=policyd, rtc=False)
    assert all(r.ok for r in rows), table(rows)
    # Without the offset the same bundle is off: the check above can fail.
    import shutil

    broken = tmp_path / "bundle"
    shutil.copytree(fine.bundle, broken)
    config = tomllib.loads((broken / "policyd.toml").read_text())
    del config["outputs"][0]["relative_to"], config["outputs"][0]["relative_mask"]
    import tomli_w

    (broken / "policyd.toml").write_text(tomli_w.dumps(config))
    rows = verify(broken, fine.checkpoint, policyd=policyd, rtc=False)
    assert not all(r.ok for r in rows), table(rows)

"""pi0 (tiny, LeRobot's size tables patched in this process): exported as a flow pipeline over
a prefix and an action-expert step, served by policyd with the prompt tokenized in the server,
equal to LeRobot's own inference with the same noise."""

from __future__ import annotations

import json
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from checkpoints import gemma_tokenizer, pi0, tiny_pi0

from policyd_export.checkpoint import load
from policyd_export.cli import main
from policyd_export.reference import Reference
from policyd_export.verify import observations, table, verify


class Pi0:
    def __init__(self, root: Path):
        self.tokenizer = gemma_tokenizer(root / "tokenizer")
        self.checkpoint = pi0(root / "checkpoint", self.tokenizer)
        self.bundle = root / "bundle"
        assert main(["lerobot", str(self.checkpoint), "--out", str(self.bundle)]) == 0


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pi0]:
    with tiny_pi0():
        yield Pi0(tmp_path_factory.mktemp("pi0"))


def test_the_bundle_is_a_flow_pipeline_with_the_prompt_tokenized(bundle: Pi0, policyd: str) -> None:
    config = tomllib.loads((bundle.bundle / "policyd.toml").read_text())
    assert config["sampler"]["kind"] == "flow" and config["sampler"]["flow_time"] == "lerobot"
    assert config["denoise"]["wire"] == {n: n for n in ("prefix_mask", "k", "v", "state_padded")}
    prompt = config["inputs"][-1]
    assert prompt["key"] == "task" and prompt["tokenizer"]["format"] == "lerobot_pi0"
    assert (bundle.bundle / "tokenizer.model").is_file()
    assert config["outputs"][0]["columns"] == 6
    manifest = json.loads((bundle.bundle / "export.json").read_text())
    rewrites = " ".join(r for g in manifest["graphs"] for r in g["rewrites"])
    assert "R1" in rewrites and "R2" in rewrites  # tract could not run the graphs without
    r = subprocess.run(
        [policyd, "check-config", str(bundle.bundle / "policyd.toml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "pipeline: flow" in r.stdout and "tokenizer" in r.stdout, r.stdout


def test_served_actions_equal_lerobot(bundle: Pi0, policyd: str) -> None:
    rows = verify(bundle.bundle, bundle.checkpoint, policyd=policyd)
    assert all(r.ok for r in rows), table(rows)
    assert len(rows) == 6


def test_the_prompt_changes_lerobots_actions(bundle: Pi0) -> None:
    """So the parity above checks policyd's tokenization too."""
    ckpt = load(bundle.checkpoint)
    ref = Reference(ckpt)
    obs = observations(ckpt, 1, seed=0, prompt_key="task")[0]
    noise = np.random.default_rng(0).standard_normal((10, 32)).astype(np.float32)
    a = ref.actions(obs, noise)
    b = ref.actions(dict(obs, task="fold the towel twice"), noise)
    assert float(np.abs(a - b).max()) > 1e-3 * float(np.abs(a).max())


@pytest.mark.parametrize(
    "prompt",
    [
        "pick up the red cube",
        "put_the bowl on the stove",  # LeRobot does not clean underscores (openpi does)
        "  fold the towel  ",
        "open the drawer\n",  # already ends with a newline: none added
        "ünïcödé ✓ pick",
        "pick up the red cube and put it in the bowl on the stove next to the towel",  # > 16
    ],
)
def test_tokens_equal_lerobots_tokenizer(prompt: str, bundle: Pi0, policyd: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundle.tokenizer))
    tok.padding_side = "right"  # as LeRobot's TokenizerProcessorStep sets it
    text = prompt if prompt.endswith("\n") else prompt + "\n"  # Pi0NewLineProcessor
    want = tok(text, max_length=16, padding="max_length", truncation=True)
    r = subprocess.run(
        [
            policyd,
            "tokenize",
            "--tokenizer",
            str(bundle.bundle / "tokenizer.model"),
            "--format",
            "lerobot_pi0",
            "--max-tokens",
            "16",
        ],
        input=json.dumps({"prompt": prompt}) + "\n",
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[0])
    assert got["ids"] == want["input_ids"]
    assert [bool(m) for m in got["mask"]] == [bool(m) for m in want["attention_mask"]]

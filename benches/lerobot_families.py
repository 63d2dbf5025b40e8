"""Exported LeRobot policies: LeRobot's own torch inference vs policyd's engines, per chunk.

For each family, in one run on this machine: a seeded random-weight checkpoint of a realistic
shape is made with LeRobot's classes, exported with `policyd-export` (timed), then
- LeRobot: its server-side path (preprocessor → predict_action_chunk → postprocessor), with
  torch limited to 1 and to 2 threads;
- policyd: the bundle served by the given binary, driven by openpi-client on loopback, one
  request at a time; the reply's `policy_timing.infer_ms` (the engine) and the client's round
  trip (decode, engine, encode, transport); then the engine again with `engine.threads = 2`;
- policyd on the `ort` backend (onnxruntime from this venv's PyPI wheel), 1 and 2 threads;
p50 and p99 over `--n` chunks after 3 warm-up chunks. Every cell of a row is measured in the
same run, one after another, so the ratios compare like with like on a noisy machine.

    .venv-export/bin/python benches/lerobot_families.py --policyd target/release/policyd

Prints a Markdown table (docs/benchmarks.md, "Exported LeRobot policies").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
import tomli_w
import torch
from openpi_client import websocket_client_policy
from policyd_export.bundle import read_manifest
from policyd_export.checkpoint import load
from policyd_export.cli import main as export_main
from policyd_export.reference import Reference
from policyd_export.verify import observations, serve

ROOT = Path(__file__).resolve().parents[1]
# The test suite's checkpoint makers (LeRobot's classes, seeded random weights).
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
checkpoints = importlib.import_module("checkpoints")

FAMILIES = {
    # name: (maker, kwargs)
    "ACT, 1 camera 96×128": (checkpoints.act, {"h": 96, "w": 128, "full": True}),
    "ACT, 1 camera 480×640": (checkpoints.act, {"h": 480, "w": 640, "full": True}),
    "Diffusion, DDIM-10": (checkpoints.diffusion, {"full": True}),
    "Diffusion, DDPM-100": (
        checkpoints.diffusion,
        {"full": True, "scheduler": "DDPM", "steps": None},
    ),
}
#: pi0 / pi0.5 at test size (LeRobot's PaliGemma size tables patched in this process; the
#: real 3.3B-parameter models take seconds per chunk on a CPU: a Jetson job), and SmolVLA over
#: the tests' tiny SmolVLM.
TINY_PI = {"pi0, tiny (test sizes)": False, "pi0.5, tiny (test sizes)": True}
#: pi0 at its real geometry (PaliGemma's Gemma-2B and the 300M action expert at their real
#: widths, heads and MLP sizes; SigLIP so400m on a 224×224 camera: 256 image tokens; a chunk of
#: 50) but 2 of its 18 layers (and 2 of SigLIP's 27), so that it fits this machine: what a layer
#: costs at the real shapes, each engine against torch.
REAL_PI_LAYERS = 2
REAL_PI = {
    f"pi0, real widths, {REAL_PI_LAYERS} of 18 layers, chunk 50": False,
    f"pi0.5, real widths, {REAL_PI_LAYERS} of 18 layers, chunk 50": True,
}


@contextlib.contextmanager
def real_width_pi0(layers: int, pi05: bool) -> Iterator[None]:
    """LeRobot's pi0 (or pi0.5) size tables at the real widths with `layers` layers."""
    import lerobot.policies.pi0.modeling_pi0 as pi0_module
    import lerobot.policies.pi05.modeling_pi05 as pi05_module
    import pytest

    m = pi05_module if pi05 else pi0_module
    original = m.PaliGemmaForConditionalGenerationWithPiGemma
    real_gemma = m.get_gemma_config

    class FewLayers(original):
        def __init__(self, config: object) -> None:
            config.vision_config.num_hidden_layers = layers
            # The prompt's ids come from the tests' small tokenizer: a small embedding table
            # (a lookup, whatever its size; the real 257k rows would take 2 GB).
            config.text_config.vocab_size = checkpoints.PI_VOCAB
            super().__init__(config)

    def gemma(variant: str) -> object:
        c = real_gemma(variant)
        c.depth = layers
        return c

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(m, "get_gemma_config", gemma)
        mp.setattr(m, "PaliGemmaForConditionalGenerationWithPiGemma", FewLayers)
        yield


#: GR00T N1.7 at its real widths with an eighth of its layers (`checkpoints.GROOT_REAL`), two
#: 480×640 cameras (resized to 256 and cropped in the prefix graph, as LeRobot's processor
#: does), 40 steps of 132-wide actions, 4 flow steps: LeRobot's fp32 path (`use_bf16 = False`).
REAL_GROOT = "GR00T N1.7, real widths, 1/8 of the layers, 2 cameras 480×640"
GROOT_480 = {
    "observation.images.front": (3, 480, 640),
    "observation.images.wrist": (3, 480, 640),
}

#: Chunks measured per cell where one chunk takes seconds.
FEW = {"Diffusion, DDPM-100": 5, "ACT, 1 camera 480×640": 15}
#: Chunks measured for the real-width pi0 (seconds each).
FEW_REAL = 8


def pct(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def torch_times(ckpt: Path, obs: list[dict], n: int, threads: int) -> list[float]:
    torch.set_num_threads(threads)
    ref = Reference(ckpt)
    times = []
    for i in range(n + 3):
        t = time.perf_counter()
        ref.actions(obs[i % len(obs)])
        if i >= 3:
            times.append((time.perf_counter() - t) * 1e3)
    return times


#: The onnxruntime library the `ort` rows load: this venv's wheel.
ORT_LIBRARY = Path(onnxruntime.__file__).parent / "capi"


def policyd_times(
    binary: str,
    bundle: Path,
    obs: list[dict],
    n: int,
    threads: int = 1,
    backend: str = "cpu",
) -> tuple[list, list]:
    """The bundle served as exported, with `engine.threads` (and the backend) set."""
    engine, trip = [], []
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    config["engine"]["threads"] = threads
    # A DDPM-100 chunk on one thread can take longer than the 10 s stall alarm.
    config["engine"]["timeout_ms"] = 0
    if backend == "ort":
        config["engine"]["backend"] = "ort"
        config["engine"]["ort_library"] = str(ORT_LIBRARY)
    config.pop("lerobot", None)
    path = bundle / f"policyd-{backend}-{threads}t.toml"
    path.write_text(tomli_w.dumps(config))
    with serve(binary, path) as port:
        client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
        for i in range(n + 3):
            t = time.perf_counter()
            reply = client.infer(obs[i % len(obs)])
            if i >= 3:
                trip.append((time.perf_counter() - t) * 1e3)
                engine.append(float(reply["policy_timing"]["infer_ms"]))
    return engine, trip


def measure(name: str, ckpt: Path, bundle: Path, n: int, binary: str) -> tuple | None:
    """Export, then LeRobot at 1 and 2 threads, then policyd: one table row."""
    t = time.perf_counter()
    if export_main(["lerobot", str(ckpt), "--out", str(bundle)]) != 0:
        return None
    export_s = time.perf_counter() - t
    c = load(ckpt)
    # The prompt under the key the bundle reads (GR00T's is not a LeRobot tokenizer step).
    obs = observations(c, 8, seed=0, prompt_key=read_manifest(bundle).get("prompt_key"))
    t1 = pct(torch_times(ckpt, obs, n, 1))
    t2 = pct(torch_times(ckpt, obs, n, 2))
    engine, trip = policyd_times(binary, bundle, obs, n)
    e, r = pct(engine), pct(trip)
    e2 = pct(policyd_times(binary, bundle, obs, n, threads=2)[0])
    o1 = pct(policyd_times(binary, bundle, obs, n, threads=1, backend="ort")[0])
    o2 = pct(policyd_times(binary, bundle, obs, n, threads=2, backend="ort")[0])
    print(
        f"{name}: export {export_s:.0f} s, torch 1t {t1}, 2t {t2}, policyd engine {e}, "
        f"round trip {r}, engine on 2 threads {e2}, ort 1t {o1}, ort 2t {o2}",
        file=sys.stderr,
        flush=True,
    )
    return (name, export_s, t1, t2, e, r, e2, o1, o2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    p.add_argument("--n", type=int, default=30, help="chunks measured per cell")
    p.add_argument(
        "--only",
        help="run the families whose name contains one of these (comma-separated)",
    )
    args = p.parse_args()
    rows = []
    wanted = args.only.split(",") if args.only else None

    def skip(name: str) -> bool:
        return wanted is not None and not any(w in name for w in wanted)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, (make, kw) in FAMILIES.items():
            if skip(name):
                continue
            n = min(args.n, FEW.get(name, args.n))
            ckpt = make(tmp / f"{len(rows)}-ckpt", **kw)
            rows.append(
                measure(name, ckpt, tmp / f"{len(rows)}-bundle", n, args.policyd)
            )
        for name, pi05 in TINY_PI.items():
            if skip(name):
                continue
            with checkpoints.tiny_pi0():
                tok = checkpoints.gemma_tokenizer(tmp / f"{len(rows)}-tok")
                ckpt = checkpoints.pi0(tmp / f"{len(rows)}-ckpt", tok, pi05=pi05)
                rows.append(
                    measure(
                        name, ckpt, tmp / f"{len(rows)}-bundle", args.n, args.policyd
                    )
                )
        for name, pi05 in REAL_PI.items():
            if skip(name):
                continue
            with real_width_pi0(REAL_PI_LAYERS, pi05):
                tok = checkpoints.gemma_tokenizer(tmp / f"{len(rows)}-tok")
                ckpt = checkpoints.pi0(
                    tmp / f"{len(rows)}-ckpt", tok, pi05=pi05, chunk=50
                )
                rows.append(
                    measure(
                        name, ckpt, tmp / f"{len(rows)}-bundle", FEW_REAL, args.policyd
                    )
                )
        if not skip(REAL_GROOT):
            vlm = checkpoints.tiny_qwen3vl(tmp / "qwen3vl-real", real=True)
            root = tmp / f"{len(rows)}-groot"
            ckpt = checkpoints.groot(root, vlm, real=True, cameras=GROOT_480)
            rows.append(
                measure(REAL_GROOT, ckpt, tmp / f"{len(rows)}-bundle", FEW_REAL, args.policyd)
            )
        if not skip("SmolVLA, tiny (test sizes)"):
            vlm = checkpoints.tiny_smolvlm(tmp / "smolvlm")
            ckpt = checkpoints.smolvla(tmp / f"{len(rows)}-ckpt", vlm)
            name = "SmolVLA, tiny (test sizes)"
            rows.append(
                measure(name, ckpt, tmp / f"{len(rows)}-bundle", args.n, args.policyd)
            )
    if None in rows:
        return 1
    ms = lambda t: f"{t[0]:.1f} / {t[1]:.1f} ms"
    print(
        "| policy | export | torch 1t | torch 2t | cpu 1t | cpu 1t round trip | cpu 2t | "
        "ort 1t | ort 2t | cpu/torch 1t | cpu/torch 2t | ort/torch 1t | ort/torch 2t |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, export_s, t1, t2, e, r, e2, o1, o2 in rows:
        print(
            f"| {name} | {export_s:.0f} s | {ms(t1)} | {ms(t2)} | {ms(e)} | {ms(r)} | "
            f"{ms(e2)} | {ms(o1)} | {ms(o2)} | {e[0] / t1[0]:.2f} | {e2[0] / t2[0]:.2f} | "
            f"{o1[0] / t1[0]:.2f} | {o2[0] / t2[0]:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

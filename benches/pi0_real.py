"""pi0 at its real size (issue 36): can `policyd-export` export it, and in how much memory?

LeRobot 0.6.1's pi0 as its config builds it (SigLIP So400m, Gemma 2B and the 300M action
expert: 3.3B parameters), random weights, two 224×224 cameras, a chunk of 50, the exporter
tests' SentencePiece tokenizer (PaliGemma's needs the Hub), statistics far from identity. The
checkpoint is written by a child process; `policyd-export lerobot` then runs in a fresh one,
and `policyd check-config` on the bundle. For each: exit, seconds, peak RSS (VmHWM) and the
peak of anonymous memory alone (RssAnon, polled every 50 ms: onnxruntime and safetensors map
their files, and those clean file pages count in RSS but the kernel can drop them).

    .venv-export/bin/python benches/pi0_real.py --policyd target/debug/policyd [--keep DIR]
        [--pi05] [--serve N]
    .venv-export/bin/python benches/pi0_real.py --policyd target/debug/policyd --parity DIR

Needs about 30 GB of disk (the checkpoint and the bundle, 13 GB each). Prints what it measured
(docs/benchmarks.md, "pi0 at its real size").
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
sys.path.insert(0, str(ROOT / "benches"))
# Its timing of a child process and its serving rows.
smolvla_real = importlib.import_module("smolvla_real")
timed, _kb = smolvla_real.timed, smolvla_real._kb


def build(out: Path, pi05: bool) -> None:
    checkpoints = importlib.import_module("checkpoints")
    tokenizer = checkpoints.gemma_tokenizer(out.parent / "tokenizer")
    checkpoints.pi0(out, tokenizer, cameras=2, chunk=50, pi05=pi05)
    import json

    params = json.loads((out / "config.json").read_text())
    print(
        f"checkpoint: type {params['type']}, {(out / 'model.safetensors').stat().st_size / 1e9:.2f} GB"
    )


def parity(root: Path, policyd: str) -> None:
    """One observation through policyd (the bundle's config with the noise injected, as
    `policyd-export verify` does), then, once policyd has exited, LeRobot's own inference on
    it: both hold the 3.3B model, and this machine does not fit both at once."""
    import numpy as np
    import torch
    from openpi_client import websocket_client_policy
    from policyd_export.bundle import read_manifest
    from policyd_export.checkpoint import load
    from policyd_export.reference import Reference
    from policyd_export.verify import injected_config, observations, served

    bundle, ckpt_dir = root / "bundle", root / "checkpoint"
    manifest = read_manifest(bundle)
    ckpt = load(ckpt_dir)
    obs = observations(ckpt, 1, seed=0, prompt_key=manifest.get("prompt_key"))[0]
    noise = np.random.default_rng(1).standard_normal(manifest["noise"]["shape"]).astype("f4")
    with tempfile.TemporaryDirectory() as d:
        config, _ = injected_config(bundle, manifest, Path(d))
        t0 = time.monotonic()
        with served(policyd, config, timeout=3600) as (port, pid):
            ready = time.monotonic() - t0
            load_peak = _kb(pid, "VmHWM") / 1e6
            client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
            t1 = time.monotonic()
            got = np.asarray(client.infer({**obs, "noise": noise})["actions"], np.float64)
            chunk = time.monotonic() - t1
            peak = _kb(pid, "VmHWM") / 1e6
    print(
        f"policyd cpu, 1 thread: ready in {ready:.0f} s (peak RSS {load_peak:.2f} GB), one "
        f"chunk {chunk:.0f} s, peak RSS {peak:.2f} GB"
    )
    t2 = time.monotonic()
    want = Reference(ckpt).actions(obs, noise).astype(np.float64)
    lerobot = time.monotonic() - t2
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    print(
        f"LeRobot (load and one chunk, {torch.get_num_threads()} torch threads): {lerobot:.0f} "
        f"s; policyd vs LeRobot: max abs diff {diff:.2e}, action scale {scale:.2f}, relative "
        f"{diff / scale:.1e}, shape {list(got.shape)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    ap.add_argument("--keep", help="a directory to keep the checkpoint and bundle in")
    # The child that writes the checkpoint.
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument(
        "--parity",
        help="a kept directory: serve its bundle for one observation, then LeRobot on the same",
    )
    ap.add_argument("--pi05", action="store_true", help="pi0.5 instead of pi0")
    ap.add_argument(
        "--serve",
        type=int,
        default=0,
        help="then serve on cpu and ort at 1 and 2 threads and run LeRobot's torch: N chunks "
        "each (benches/smolvla_real.py's rows)",
    )
    args = ap.parse_args()
    if args.build:
        build(Path(args.build), args.pi05)
        return
    if args.parity:
        parity(Path(args.parity), args.policyd)
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.keep or d)
        ckpt = tmp / "checkpoint"
        child = [sys.executable, __file__, "--build", str(ckpt)] + (["--pi05"] if args.pi05 else [])
        secs, peak, anon, r = timed(child)
        print(
            f"build: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB, anon {anon:.2f} GB"
        )
        print(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:])
        if r.returncode:
            raise SystemExit(1)
        exe = Path(sys.executable).parent / "policyd-export"
        bundle = tmp / "bundle"
        secs, peak, anon, r = timed([str(exe), "lerobot", str(ckpt), "--out", str(bundle)])
        print(
            f"export: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB, anon {anon:.2f} GB"
        )
        print(r.stdout[-1500:] if r.returncode == 0 else r.stderr[-3000:])
        if r.returncode:
            raise SystemExit(1)
        files = ", ".join(
            f"{f.name} {f.stat().st_size / 1e9:.2f} GB" for f in sorted(bundle.glob("*.onnx*"))
        )
        print(f"bundle: {files}")
        secs, peak, anon, r = timed([args.policyd, "check-config", str(bundle / "policyd.toml")])
        print(
            f"check-config: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB, anon {anon:.2f} GB"
        )
        print(
            "\n".join(line for line in r.stdout.splitlines() if "total" in line or "model" in line)
        )
        if args.serve:
            smolvla_real.serve_rows(args.policyd, bundle, ckpt, args.serve)


if __name__ == "__main__":
    main()

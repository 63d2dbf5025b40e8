"""pi0 at its real size (issue 36): can `policyd-export` export it, and in how much memory?

LeRobot 0.6.1's pi0 as its config builds it (SigLIP So400m, Gemma 2B and the 300M action
expert: 3.3B parameters), random weights, two 224×224 cameras, a chunk of 50, the exporter
tests' SentencePiece tokenizer (PaliGemma's needs the Hub), statistics far from identity. The
checkpoint is written by a child process; `policyd-export lerobot` then runs in a fresh one,
and `policyd check-config` on the bundle. For each: exit, seconds, peak RSS (VmHWM) and the
peak of anonymous memory alone (RssAnon, polled every 50 ms: onnxruntime and safetensors map
their files, and those clean file pages count in RSS but the kernel can drop them).

    .venv-export/bin/python benches/pi0_real.py --policyd target/debug/policyd [--keep DIR]

Needs about 30 GB of disk (the checkpoint and the bundle, 13 GB each). Prints what it measured
(docs/benchmarks.md, "pi0 at its real size").
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter" / "tests"))


def build(out: Path) -> None:
    checkpoints = importlib.import_module("checkpoints")
    tokenizer = checkpoints.gemma_tokenizer(out.parent / "tokenizer")
    checkpoints.pi0(out, tokenizer, cameras=2, chunk=50)
    import json

    params = json.loads((out / "config.json").read_text())
    print(
        f"checkpoint: type {params['type']}, {(out / 'model.safetensors').stat().st_size / 1e9:.2f} GB"
    )


def _kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def timed(
    cmd: list[str],
) -> tuple[float, float, float, subprocess.CompletedProcess[str]]:
    """Seconds, peak RSS and peak anonymous memory (GB) of `cmd`, polled every 50 ms."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = anon = 0
    while proc.poll() is None:
        try:
            peak = max(peak, _kb(proc.pid, "VmHWM"))
            anon = max(anon, _kb(proc.pid, "RssAnon"))
        except OSError:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return time.monotonic() - t0, peak / 1e6, anon / 1e6, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    ap.add_argument("--keep", help="a directory to keep the checkpoint and bundle in")
    ap.add_argument(
        "--build", help=argparse.SUPPRESS
    )  # the child that writes the checkpoint
    args = ap.parse_args()
    if args.build:
        build(Path(args.build))
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.keep or d)
        ckpt = tmp / "checkpoint"
        secs, peak, anon, r = timed([sys.executable, __file__, "--build", str(ckpt)])
        print(
            f"build: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB, anon {anon:.2f} GB"
        )
        print(
            r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
        )
        if r.returncode:
            raise SystemExit(1)
        exe = Path(sys.executable).parent / "policyd-export"
        bundle = tmp / "bundle"
        secs, peak, anon, r = timed(
            [str(exe), "lerobot", str(ckpt), "--out", str(bundle)]
        )
        print(
            f"export: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB, anon {anon:.2f} GB"
        )
        print(r.stdout[-1500:] if r.returncode == 0 else r.stderr[-3000:])
        if r.returncode:
            raise SystemExit(1)
        files = ", ".join(
            f"{f.name} {f.stat().st_size / 1e9:.2f} GB"
            for f in sorted(bundle.glob("*.onnx*"))
        )
        print(f"bundle: {files}")
        secs, peak, anon, r = timed(
            [args.policyd, "check-config", str(bundle / "policyd.toml")]
        )
        print(
            f"check-config: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB, anon {anon:.2f} GB"
        )
        print(
            "\n".join(
                line
                for line in r.stdout.splitlines()
                if "total" in line or "model" in line
            )
        )


if __name__ == "__main__":
    main()

"""Real-time chunking in a closed loop: how far the arm jumps where one chunk hands over to the
next, with policyd's `[rtc]` and without it (the client replacing the chunk, or averaging the
overlap as LeRobot's `robot_client` does with `aggregate_fn = weighted_average`).

A simulated robot runs at 30 Hz: each tick it executes the action queued for that timestep
(a position robot: its state becomes the action), and when at most half a chunk is left it
sends an `observe` (its state, a camera frame, the task) over policyd's WebSocket without
waiting; a chunk that arrives replaces the queue from the current timestep on (or, averaged,
blends the overlap 0.3 old + 0.7 new). policyd releases each chunk 100 ms after the
observation (`pacing.latency_budget_ms`: three control periods, as a VLA on a board takes), so
the robot executes about three actions of the old chunk while the new one is computed.

The jump at a boundary is max |a_new(t) − a_old(t)| over the joints, at the first timestep
the robot executes from the new chunk, in the robot's units: what it would have done next
against what it does. The policy is the exporter tests' SmolVLA (tiny, random weights: the
numbers show the mechanism, not a trained policy's motion) exported by this checkout.

    .venv-export/bin/python benches/rtc_closed_loop.py --policyd target/release/policyd

Prints a Markdown table and writes one joint over time to --plot (docs/pacing.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
from openpi_client import msgpack_numpy
from policyd_export.cli import main as export_main
from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
checkpoints = importlib.import_module("checkpoints")
FPS = 30.0
BUDGET_MS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def serving(binary: str, bundle: Path, rtc: bool, tmp: Path) -> Iterator[int]:
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    for section in ("engine", "denoise"):
        config[section]["model"] = str(bundle / config[section]["model"])
    for binding in config["inputs"]:
        if "tokenizer" in binding:
            binding["tokenizer"]["file"] = str(bundle / binding["tokenizer"]["file"])
    config.pop("lerobot", None)
    config["pacing"] = {"fps": FPS, "latency_budget_ms": BUDGET_MS}
    if rtc:
        config["rtc"] = {"execution_horizon": 10}
    path = tmp / f"policyd-{'rtc' if rtc else 'plain'}.toml"
    path.write_text(tomli_w.dumps(config))
    port = free_port()
    proc = subprocess.Popen([binary, "--config", str(path), "--port", str(port)])
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{port}/healthz", timeout=1
            ) as r:
                if r.status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("policyd did not start")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def run(port: int, mode: str, seconds: float, seed: int) -> dict[str, Any]:
    """The robot's loop for `seconds`: the jumps at chunk boundaries, the executed trajectory,
    and each chunk's latency as the robot saw it."""
    rng = np.random.default_rng(seed)
    frame = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    chunks: queue.Queue[dict[str, Any]] = queue.Queue()
    sent_at: dict[int, float] = {}
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        ws.recv(timeout=30)  # the metadata

        def receive() -> None:
            with contextlib.suppress(Exception):
                while True:
                    chunks.put(msgpack_numpy.unpackb(ws.recv()))

        threading.Thread(target=receive, daemon=True).start()
        plan: dict[int, np.ndarray] = {}
        state = np.zeros(6, np.float32)
        executed: list[tuple[int, np.ndarray]] = []
        jumps: list[float] = []
        latencies: list[float] = []
        waiting = False
        t = 0
        next_tick = time.monotonic()
        end = next_tick + seconds
        while time.monotonic() < end:
            while not chunks.empty():
                push = chunks.get()
                if push.get("type") != "actions":
                    continue
                waiting = False
                latencies.append(
                    time.monotonic() - sent_at.get(int(push["obs_timestep"]), 0)
                )
                new = {
                    int(s): np.asarray(a, np.float32)
                    for s, a in zip(push["timesteps"], push["actions"], strict=True)
                    if int(s) >= t
                }
                if t in new and t in plan:
                    jumps.append(float(np.abs(new[t] - plan[t]).max()))
                if mode == "average":
                    new = {
                        s: 0.3 * plan[s] + 0.7 * a if s in plan else a
                        for s, a in new.items()
                    }
                plan = {s: a for s, a in plan.items() if s < t} | new
            if t in plan:
                state = plan.pop(t)
                executed.append((t, state))
            left = sum(1 for s in plan if s > t)
            if not waiting and left <= 5:
                frame_t = np.roll(frame, t, axis=1)
                obs = {
                    "endpoint": "observe",
                    "timestep": t,
                    "timestamp": t / FPS,
                    "must_go": True,
                    "observation.state": state,
                    "observation.images.cam0": frame_t,
                    "task": "pick up the red cube",
                }
                sent_at[t] = time.monotonic()
                ws.send(msgpack_numpy.packb(obs))
                waiting = True
            t += 1
            next_tick += 1 / FPS
            time.sleep(max(0.0, next_tick - time.monotonic()))
    return {"jumps": jumps, "executed": executed, "latencies": latencies}


def engine_ms(port: int) -> float:
    """The engine's mean time per chunk (`policyd_engine_duration_seconds`, sum over count):
    what RTC costs is the difference between the runs with and without it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f"policyd_engine_duration_seconds_{key}"):
                values[key] = float(line.split()[-1])
    return 1e3 * values["sum"] / max(values["count"], 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policyd", required=True)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--plot", type=Path, help="write one joint's trajectory (PNG) here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        vlm = checkpoints.tiny_smolvlm(tmp / "vlm")
        ckpt = checkpoints.smolvla(tmp / "checkpoint", vlm)
        bundle = tmp / "bundle"
        assert export_main(["lerobot", str(ckpt), "--out", str(bundle)]) == 0
        results = {}
        for name, rtc, mode in [
            ("replace, no RTC", False, "replace"),
            ("weighted_average, no RTC", False, "average"),
            ("replace, policyd [rtc]", True, "replace"),
        ]:
            with serving(args.policyd, bundle, rtc, tmp) as port:
                results[name] = run(port, mode, args.seconds, seed=1)
                results[name]["engine_ms"] = engine_ms(port)
    print(
        f"{args.seconds:.0f} s at {FPS:.0f} Hz, latency budget {BUDGET_MS} ms, chunks of 10\n"
    )
    print(
        "| client / server | boundaries | jump mean | jump max | chunk latency p50 "
        "| engine per chunk |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        j = np.asarray(r["jumps"])
        lat = np.median(r["latencies"]) * 1e3 if r["latencies"] else float("nan")
        print(
            f"| {name} | {j.size} | {j.mean():.3f} | {j.max():.3f} | {lat:.0f} ms "
            f"| {r['engine_ms']:.1f} ms |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 3.2))
        for name, r in results.items():
            steps = [s for s, _ in r["executed"]][:150]
            ax.plot(steps, [a[0] for _, a in r["executed"]][:150], label=name, lw=1.2)
        ax.set_xlabel("timestep (30 Hz)")
        ax.set_ylabel("joint 0 (robot units)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()

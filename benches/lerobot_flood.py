"""A WebSocket robot's latency while a LeRobot client floods the gRPC service with
observations (issue 37's fairness question), against the same robot alone and beside a
CPU-only load of the same size as the flooding client.

One policyd serves a small ACT (one 96×128 camera, a few ms a chunk) on both front ends. The
robot is openpi-client in a closed loop over the WebSocket. The flood is one LeRobot client
(LeRobot's stub and chunking) sending 480×640 observations back to back, as fast as the
service takes them, with a second thread polling `GetActions`. The control replaces the flood
with a Python process that only spins (the flooder's own CPU, without the server's share).
Each phase runs `--secs` seconds in the same server process.

    .venv-export/bin/python benches/lerobot_flood.py --policyd target/release/policyd --secs 10

Prints a Markdown table (docs/benchmarks.md, "A gRPC flood beside a WebSocket robot").
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import grpc
import numpy as np
import tomli_w
from lerobot.async_inference.helpers import RemotePolicyConfig
from lerobot.transport import services_pb2, services_pb2_grpc
from lerobot.transport.utils import grpc_channel_options, send_bytes_in_chunks
from openpi_client import websocket_client_policy
from policyd_export.cli import main as export_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
sys.path.insert(0, str(ROOT / "benches"))
checkpoints = importlib.import_module("checkpoints")
la = importlib.import_module("lerobot_async")


def robot(port: int, secs: float) -> np.ndarray:
    """Closed-loop WebSocket requests for `secs`: their latencies in ms."""
    client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
    rng = np.random.default_rng(1)
    obs = {
        "observation.state": rng.standard_normal(6).astype(np.float32),
        "observation.images.cam0": rng.integers(0, 256, (96, 128, 3), dtype=np.uint8),
    }
    for _ in range(5):
        client.infer(obs)
    lat = []
    end = time.monotonic() + secs
    while time.monotonic() < end:
        t0 = time.perf_counter()
        client.infer(obs)
        lat.append(time.perf_counter() - t0)
    return np.asarray(lat) * 1e3


def flood(address: str, ckpt: Path, stop: threading.Event, counts: dict) -> None:
    """One LeRobot client sending observations back to back until `stop`."""
    channel = grpc.insecure_channel(address, grpc_channel_options())
    stub = services_pb2_grpc.AsyncInferenceStub(channel)
    stub.Ready(services_pb2.Empty())
    config = RemotePolicyConfig("act", str(ckpt), la.features(), 10, "cpu")
    stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(config)))
    rng = np.random.default_rng(2)
    data = pickle.dumps(la.observation(rng, 0))

    def poll() -> None:
        while not stop.is_set():
            stub.GetActions(services_pb2.Empty())

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    while not stop.is_set():
        try:
            stub.SendObservations(send_bytes_in_chunks(data, services_pb2.Observation))
            counts["taken"] += 1
        except grpc.RpcError:
            counts["refused"] += 1
    poller.join(5)
    channel.close()


def row(name: str, lat: np.ndarray, extra: str = "") -> str:
    return (
        f"| {name} | {len(lat)} | {np.percentile(lat, 50):.2f} ms | "
        f"{np.percentile(lat, 99):.2f} ms | {extra} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    ap.add_argument("--secs", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ckpt = checkpoints.act(tmp / "ckpt", h=96, w=128)
        bundle = tmp / "bundle"
        if export_main(["lerobot", str(ckpt), "--out", str(bundle)]) != 0:
            raise SystemExit("export failed")
        config = tomllib.loads((bundle / "policyd.toml").read_text())
        config["engine"]["model"] = str(bundle / config["engine"]["model"])
        grpc_port, ws_port = la.free_port(), la.free_port()
        config["lerobot"]["listen"] = f"127.0.0.1:{grpc_port}"
        (tmp / "policyd.toml").write_text(tomli_w.dumps(config))
        cmd = [str(Path(args.policyd).resolve()), "--config", str(tmp / "policyd.toml")]
        rows = []
        with la.server([*cmd, "--port", str(ws_port)], grpc_port, tmp):
            rows.append(row("alone", robot(ws_port, args.secs)))
            spin = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import time\nt=time.monotonic()+1e9\nwhile 1: pass",
                ]
            )
            try:
                lat = robot(ws_port, args.secs)
                rows.append(row("beside a spinning process (CPU-only control)", lat))
            finally:
                spin.kill()
            stop, counts = threading.Event(), {"taken": 0, "refused": 0}
            flooder = threading.Thread(
                target=flood, args=(f"127.0.0.1:{grpc_port}", ckpt, stop, counts)
            )
            flooder.start()
            time.sleep(1.0)
            try:
                lat = robot(ws_port, args.secs)
            finally:
                stop.set()
                flooder.join(30)
            rate = (counts["taken"] + counts["refused"]) / (args.secs + 1.0)
            rows.append(
                row(
                    "beside a gRPC observation flood",
                    lat,
                    f"{rate:.0f} observations/s sent, {counts['refused']} refused",
                )
            )
    print(
        f"ACT, one 96×128 camera; the robot in a closed loop for {args.secs:.0f} s per row\n"
    )
    print("| WebSocket robot | requests | p50 | p99 | load |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()

"""LeRobot's async inference, served by LeRobot's own `policy_server` and by policyd's
`[lerobot]` gRPC service: the same policy, the same client calls, one run on this machine.

The policy is ACT at LeRobot's default sizes (52M parameters) reading one camera at 96×128;
the client sends SO-101 observations with a 480×640 camera, as `robot_client` does (one pickled
`TimedObservation` per `SendObservations`, LeRobot's chunking, `GetActions` until a chunk
comes), so both servers resize the frame and run the same network. Per chunk:
- client latency: from the observation's send to its actions unpickled in the client;
- server CPU: the server process's user + system time (/proc) over the run, per chunk;
- bytes: the observation's pickle, the reply's pickle.

    .venv-export/bin/python benches/lerobot_async.py --policyd target/release/policyd --n 30

`--policyd` may be given more than once (`--policyd before=/tmp/policyd-old --policyd
after=target/release/policyd`): each binary is measured in turn, in the same run.

Prints a Markdown table (docs/benchmarks.md, "LeRobot's async inference").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import tomli_w
from lerobot.async_inference.helpers import RemotePolicyConfig, TimedObservation
from lerobot.transport import services_pb2, services_pb2_grpc
from lerobot.transport.utils import grpc_channel_options, send_bytes_in_chunks
from policyd_export.cli import main as export_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
checkpoints = importlib.import_module("checkpoints")
MOTORS = [
    "shoulder_pan",
    "shoulder_lift",
    "elbow_flex",
    "wrist_flex",
    "wrist_roll",
    "gripper",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode})")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), 0.5),
        ):
            return
        if time.monotonic() > deadline:
            raise SystemExit("server did not start")
        time.sleep(0.1)


@contextlib.contextmanager
def server(args: list[str], port: int, cwd: Path) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd
    )
    try:
        wait_port(port, proc)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def features() -> dict:
    return {
        "observation.state": {
            "dtype": "float32",
            "shape": (6,),
            "names": [f"{m}.pos" for m in MOTORS],
        },
        "observation.images.cam0": {
            "dtype": "image",
            "shape": (480, 640, 3),
            "names": ["height", "width", "channels"],
            "info": {"is_depth_map": False},
        },
    }


def observation(rng: np.random.Generator, step: int) -> TimedObservation:
    raw: dict = {f"{m}.pos": float(rng.uniform(-90, 90)) for m in MOTORS}
    raw["cam0"] = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
    raw["task"] = ""
    return TimedObservation(time.time(), step, raw, must_go=True)


def measure(address: str, pid: int, ckpt: Path, n: int) -> dict:
    channel = grpc.insecure_channel(address, grpc_channel_options())
    stub = services_pb2_grpc.AsyncInferenceStub(channel)
    stub.Ready(services_pb2.Empty())
    config = RemotePolicyConfig("act", str(ckpt), features(), 10, "cpu")
    stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(config)))
    rng = np.random.default_rng(0)
    lat, sent, got = [], [], []
    cpu0 = 0.0
    for i in range(n + 3):
        if i == 3:
            cpu0 = cpu_seconds(pid)
        data = pickle.dumps(observation(rng, i * 10))
        t0 = time.perf_counter()
        stub.SendObservations(send_bytes_in_chunks(data, services_pb2.Observation))
        while True:
            reply = stub.GetActions(services_pb2.Empty()).data
            if reply:
                actions = pickle.loads(reply)  # the server under test wrote it
                break
        t1 = time.perf_counter()
        assert len(actions) == 10
        if i >= 3:
            lat.append(t1 - t0)
            sent.append(len(data))
            got.append(len(reply))
    cpu = (cpu_seconds(pid) - cpu0) / n
    channel.close()
    a = np.asarray(lat) * 1e3
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "cpu": cpu * 1e3,
        "sent": int(np.mean(sent)),
        "got": int(np.mean(got)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--policyd",
        action="append",
        help="a policyd binary, or NAME=PATH; repeat to compare builds in one run",
    )
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ckpt = checkpoints.act(tmp / "ckpt", h=96, w=128, full=True)
        bundle = tmp / "bundle"
        if export_main(["lerobot", str(ckpt), "--out", str(bundle)]) != 0:
            raise SystemExit("export failed")
        config = tomllib.loads((bundle / "policyd.toml").read_text())
        config["engine"]["model"] = str(bundle / config["engine"]["model"])
        grpc_port = free_port()
        config["lerobot"]["listen"] = f"127.0.0.1:{grpc_port}"
        (tmp / "policyd.toml").write_text(tomli_w.dumps(config))
        rows = {}
        binaries = args.policyd or [str(ROOT / "target/release/policyd")]
        for entry in binaries:
            name, _, path = entry.rpartition("=")
            with server(
                [
                    str(Path(path).resolve()),
                    "--config",
                    str(tmp / "policyd.toml"),
                    "--port",
                    str(free_port()),
                ],
                grpc_port,
                tmp,
            ) as p:
                label = f"policyd ({name})" if name else "policyd"
                rows[label] = measure(f"127.0.0.1:{grpc_port}", p.pid, ckpt, args.n)
        port = free_port()
        upstream = [
            sys.executable,
            "-m",
            "lerobot.async_inference.policy_server",
            "--host=127.0.0.1",
            f"--port={port}",
            "--fps=30",
            "--inference_latency=0",
        ]
        with server(upstream, port, tmp) as p:
            rows["LeRobot policy_server"] = measure(
                f"127.0.0.1:{port}", p.pid, ckpt, args.n
            )
    print(
        f"ACT (52M), 480×640 camera resized to 96×128, {args.n} chunks of 10 actions\n"
    )
    print("| server | latency p50 | p99 | server CPU / chunk | observation | reply |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['p50']:.1f} ms | {r['p99']:.1f} ms | {r['cpu']:.1f} ms "
            f"| {r['sent']:,} B | {r['got']:,} B |"
        )


if __name__ == "__main__":
    main()

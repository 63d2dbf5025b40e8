"""Two policyd servers on the same observations: the actions they return must agree, and their
latencies are measured side by side (requests alternate A, B, A, B, … so a noisy machine
affects both alike). Used by cross/jetson-verify to hold the TensorRT backend against the CPU
backend on a Jetson; works against any two servers speaking openpi.

    python benches/compare_backends.py PORT_A PORT_B [--profile aloha] [--n 200] [--atol 0.05]
                                       [--seed]

`--seed` sends a `seed` with each observation (the request's index), so that two servers of a
pipeline (configs/flow.toml, configs/diffusion.toml) draw the same noise and must agree.

Prints max |A - B| over every action, round-trip p50/p99 and the servers' own infer_ms p50 for
each, and exits 1 if the actions differ by more than --atol (fp16 engines differ from fp32 by
about 1e-3 on the demo models).
"""

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests/interop"))
from openpi_client import websocket_client_policy as wcp
from profiles import observation

ap = argparse.ArgumentParser()
ap.add_argument("port_a", type=int)
ap.add_argument("port_b", type=int)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument(
    "--profile",
    default="aloha",
    choices=["aloha", "droid", "libero", "flow", "diffusion"],
)
ap.add_argument("--n", type=int, default=200)
ap.add_argument("--warmup", type=int, default=20)
ap.add_argument("--atol", type=float, default=0.05)
ap.add_argument("--seed", action="store_true")
args = ap.parse_args()

clients = [wcp.WebsocketClientPolicy(args.host, p) for p in (args.port_a, args.port_b)]
rng = np.random.default_rng(0)
rtt = [[], []]
infer = [[], []]
worst = 0.0
for i in range(args.warmup + args.n):
    obs = observation(args.profile, rng)
    if args.seed:
        obs["seed"] = i
    actions = []
    for k, c in enumerate(clients):
        t = time.perf_counter()
        reply = c.infer(obs)
        dt = (time.perf_counter() - t) * 1e3
        actions.append(np.asarray(reply["actions"], dtype=np.float64))
        if i >= args.warmup:
            rtt[k].append(dt)
            infer[k].append(reply["server_timing"]["infer_ms"])
    if actions[0].shape != actions[1].shape:
        sys.exit(f"shapes differ: {actions[0].shape} vs {actions[1].shape}")
    worst = max(worst, float(np.max(np.abs(actions[0] - actions[1]))))

for k, name in enumerate(("A", "B")):
    r = np.array(rtt[k])
    print(
        f"{name} port {(args.port_a, args.port_b)[k]}: round trip p50 {np.percentile(r, 50):.2f} ms, "
        f"p99 {np.percentile(r, 99):.2f} ms, max {r.max():.2f} ms; "
        f"server infer_ms p50 {np.percentile(infer[k], 50):.2f}"
    )
print(
    f"B/A round-trip p50 ratio {np.percentile(rtt[1], 50) / np.percentile(rtt[0], 50):.2f}"
)
print(f"max |A - B| over {args.n} observations: {worst:.3e} (tolerance {args.atol})")
sys.exit(0 if worst <= args.atol else 1)

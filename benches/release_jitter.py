"""Release jitter under a latency budget: starts policyd (LIBERO demo, 25 ms budget), sends
N requests with the real openpi-client, stops it with SIGTERM and prints the server's own
release summary (|release - target| p50/p99/max, misses) and the client's round trips.

    cargo build --release
    .venv-test/bin/python benches/release_jitter.py target/release/policyd 1000
"""

import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from openpi_client import websocket_client_policy as wcp

ROOT = pathlib.Path(__file__).resolve().parents[1]
binary, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1000
port = 8177
libero = (ROOT / "configs/libero.toml").read_text()
body = libero[libero.index("[[inputs]]") :]
with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as cfg:
    cfg.write(
        f'[server]\nport = {port}\n[engine]\nmodel = "{ROOT}/models/libero.onnx"\n'
        f"[pacing]\nlatency_budget_ms = 25.0\n{body}"
    )
proc = subprocess.Popen(
    [binary, "--config", cfg.name], stderr=subprocess.PIPE, env={"RUST_LOG": "info"}
)
time.sleep(2)
client = wcp.WebsocketClientPolicy("127.0.0.1", port)
rng = np.random.default_rng(0)
obs = {
    "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
    "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
    "observation/state": rng.random(8),
    "prompt": "pick",
}
rtt = []
for _ in range(n):
    t = time.perf_counter()
    client.infer(obs)
    rtt.append((time.perf_counter() - t) * 1e3)
proc.send_signal(signal.SIGTERM)
log = proc.communicate(timeout=30)[1].decode()
print(
    next(
        (line for line in log.splitlines() if "paced replies" in line),
        "no release summary",
    )
)
r = np.array(rtt)
print(
    f"client round trip ms: p50 {np.percentile(r, 50):.3f} p99 {np.percentile(r, 99):.3f}"
)

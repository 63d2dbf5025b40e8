"""One real inference from a policyd already started (e.g. the aarch64 build under qemu):
waits for /healthz, then sends an ALOHA observation with the real openpi-client and checks the
actions against the demo model run by onnxruntime."""

import pathlib
import sys
import time
import urllib.request

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests/interop"))
from openpi_client import websocket_client_policy as wcp
from profiles import observation
from test_openpi import expected

port = int(sys.argv[1])
deadline = time.time() + 300
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:  # not listening yet (urllib's errors are OSErrors)
        pass
    if time.time() > deadline:
        sys.exit("policyd did not become healthy within 300 s")
    time.sleep(0.5)
obs = observation("aloha", np.random.default_rng(7))
reply = wcp.WebsocketClientPolicy("127.0.0.1", port).infer(obs)
want, _ = expected("aloha", obs)
diff = float(np.max(np.abs(reply["actions"] - want)))
assert reply["actions"].shape == want.shape and diff <= 1e-4, diff
print(
    f"one inference from the aarch64 build: actions {reply['actions'].shape}, max |diff| {diff:.2e}, "
    f"server {reply['server_timing']['infer_ms']:.1f} ms"
)

"""The Python baseline for `policyd bench --compare`: openpi's own server code (the PyPI package
`openpi-server`, openpi's WebsocketPolicyServer) wrapping an onnxruntime policy over the same
ONNX model, with the same input and output transforms, as a policyd config.

    pip install openpi-server onnxruntime numpy
    python3 benches/python_server.py --config configs/aloha.toml --port 8001

The transforms are openpi's, as policyd applies them from the config: HWC<->CHW layout,
`((x*scale + offset) - mean) / (std + 1e-6)` on inputs, `x*(std + 1e-6) + mean` on outputs, the
first `pacing.actions_per_chunk` rows kept. onnxruntime gets one thread (`--threads`), as
policyd's CPU engine uses one, so engine time stays comparable.
"""
import argparse
import logging
import pathlib
import time
import tomllib

import numpy as np
import onnxruntime as ort
from openpi_server import WebsocketPolicyServer


def lookup(obs, key):
    """A config key: a flat key (DROID's `observation/image`) or a nested path (`images/cam_high`)."""
    if key in obs:
        return obs[key]
    node = obs
    for part in key.split("/"):
        node = node[part]
    return node


class OnnxPolicy:
    def __init__(self, config_path: pathlib.Path, threads: int):
        cfg = tomllib.loads(config_path.read_text())
        model = (config_path.parent / cfg["engine"]["model"]).resolve()
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.inputs = []
        for b in cfg["inputs"]:
            if b["dtypes"][0] == "text":
                continue
            mean = np.asarray(b.get("mean", []), np.float32)
            std = np.asarray(b.get("std", []), np.float32)
            self.inputs.append((b["key"], b["tensor"], b.get("layout", "none"),
                                np.float32(b.get("scale", 1.0)), np.float32(b.get("offset", 0.0)),
                                mean, std))
        self.outputs = [(o["tensor"], o.get("key", "actions"), o.get("dtype", "float32"),
                         np.asarray(o.get("mean", []), np.float32), np.asarray(o.get("std", []), np.float32))
                        for o in cfg["outputs"]]
        self.chunk = cfg.get("pacing", {}).get("actions_per_chunk", 0)
        self.metadata = cfg.get("metadata", {})

    def infer(self, obs):
        feed = {}
        for key, tensor, layout, scale, offset, mean, std in self.inputs:
            x = np.asarray(lookup(obs, key))
            if layout == "hwc_to_chw":
                x = x.transpose(2, 0, 1)
            elif layout == "chw_to_hwc":
                x = x.transpose(1, 2, 0)
            x = x.astype(np.float32) * scale + offset
            if mean.size:
                x = (x - mean) / (std + 1e-6)
            feed[tensor] = np.ascontiguousarray(x[None], np.float32)
        start = time.monotonic()
        outs = dict(zip(self.names, self.session.run(None, feed)))
        infer_ms = (time.monotonic() - start) * 1000
        result = {}
        for tensor, key, dtype, mean, std in self.outputs:
            a = outs[tensor][0]
            if self.chunk:
                a = a[: self.chunk]
            if mean.size:
                a = a * (std + 1e-6) + mean
            result[key] = a.astype(dtype)
        result["policy_timing"] = {"infer_ms": infer_ms}
        return result

    def reset(self):
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=pathlib.Path, required=True, help="a policyd config (its model, bindings, transforms)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    policy = OnnxPolicy(args.config, args.threads)
    WebsocketPolicyServer(policy, host=args.host, port=args.port, metadata=policy.metadata).serve_forever()


if __name__ == "__main__":
    main()

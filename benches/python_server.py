"""The Python baseline for `policyd bench --compare`: openpi's own server code (the PyPI package
`openpi-server`, openpi's WebsocketPolicyServer) wrapping an onnxruntime policy over the same
ONNX model, with the same input and output transforms, as a policyd config.

    pip install openpi-server onnxruntime numpy
    python3 benches/python_server.py --config configs/aloha.toml --port 8001

A pipeline config (`[denoise]`, `[sampler]`) runs the same loop in numpy: openpi's flow
integration, diffusers' DDPM/DDIM formulas; a tokenized prompt is tokenized with sentencepiece
as openpi does (pi0 and plain formats). The transforms are openpi's, as policyd applies them
from the config: HWC<->CHW layout,
`((x*scale + offset) - mean) / (std + 1e-6)` on inputs, `x*(std + 1e-6) + mean` on outputs, the
first `pacing.actions_per_chunk` rows kept. onnxruntime gets one thread (`--threads`), as
policyd's CPU engine uses one, so engine time stays comparable.
"""

import argparse
import logging
import math
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


class Tokenizer:
    """openpi's `PaligemmaTokenizer.tokenize` (pi0 and plain formats) over sentencepiece."""

    def __init__(self, path, fmt, max_len):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_proto=path.read_bytes())
        self.fmt, self.max_len = fmt, max_len

    def __call__(self, prompt):
        if self.fmt == "plain":
            tokens = self.sp.encode(prompt, add_bos=True)
        else:
            cleaned = prompt.strip().replace("_", " ").replace("\n", " ")
            tokens = self.sp.encode(cleaned, add_bos=True) + self.sp.encode("\n")
        n = min(len(tokens), self.max_len)
        ids = np.zeros(self.max_len, np.int32)
        ids[:n] = tokens[:n]
        return ids[None], (np.arange(self.max_len) < n)[None]


class Sampler:
    """The pipeline loop in numpy: openpi's flow integration, diffusers' DDPM/DDIM."""

    def __init__(self, s):
        self.kind, self.steps = s["kind"], s["steps"]
        self.x, self.time, self.output = s["x"], s["time"], s["output"]
        if self.kind != "flow":
            T = s.get("num_train_timesteps", 1000)
            sched = s.get("beta_schedule", "linear")
            b0, b1 = s.get("beta_start", 0.0001), s.get("beta_end", 0.02)
            if sched == "squaredcos_cap_v2":
                ab = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
                betas = np.array(
                    [min(1 - ab((i + 1) / T) / ab(i / T), 0.999) for i in range(T)],
                    np.float32,
                )
            elif sched == "scaled_linear":
                betas = np.linspace(b0**0.5, b1**0.5, T, dtype=np.float32) ** 2
            else:
                betas = np.linspace(b0, b1, T, dtype=np.float32)
            self.ac = np.cumprod(1 - betas, dtype=np.float32)
            self.clip = (
                s.get("clip_sample_range", 1.0) if s.get("clip_sample", True) else None
            )

    def run(self, step, shape, seed, steps):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(shape).astype(np.float32)
        if self.kind == "flow":
            dt, t = np.float32(-1.0 / steps), np.float32(1.0)
            while t >= -dt / 2:
                x = x + dt * step(x, np.array([t], np.float32))
                t = np.float32(t + dt)
            return x
        ratio = len(self.ac) // steps
        for t in (np.arange(steps) * ratio)[::-1]:
            m = step(x, np.array([t], np.int64))
            prev = t - ratio
            a_t, a_prev = self.ac[t], (self.ac[prev] if prev >= 0 else np.float32(1))
            x0 = (x - np.sqrt(1 - a_t) * m) / np.sqrt(a_t)
            if self.clip is not None:
                x0 = np.clip(x0, -self.clip, self.clip)
            if self.kind == "ddim":
                x = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * m
            else:
                cur = a_t / a_prev
                x = (
                    np.sqrt(a_prev) * (1 - cur) / (1 - a_t) * x0
                    + np.sqrt(cur) * (1 - a_prev) / (1 - a_t) * x
                )
                if t > 0:
                    var = max((1 - a_prev) / (1 - a_t) * (1 - cur), 1e-20)
                    x = x + np.sqrt(var) * rng.standard_normal(shape).astype(np.float32)
        return x


class OnnxPolicy:
    def __init__(self, config_path: pathlib.Path, threads: int):
        cfg = tomllib.loads(config_path.read_text())
        model = (config_path.parent / cfg["engine"]["model"]).resolve()
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(model), so, providers=["CPUExecutionProvider"]
        )
        self.names = [o.name for o in self.session.get_outputs()]
        self.pipeline = None
        if "denoise" in cfg:
            step = (config_path.parent / cfg["denoise"]["model"]).resolve()
            expert = ort.InferenceSession(
                str(step), so, providers=["CPUExecutionProvider"]
            )
            sampler = Sampler(cfg["sampler"])
            shape = next(i.shape for i in expert.get_inputs() if i.name == sampler.x)
            self.pipeline = (expert, sampler, cfg["denoise"].get("wire", {}), shape)
        self.tokens = []
        self.inputs = []
        for b in cfg["inputs"]:
            if "tokenizer" in b:
                t = b["tokenizer"]
                tok = Tokenizer(
                    (config_path.parent / t["file"]).resolve(),
                    t["format"],
                    t["max_tokens"],
                )
                self.tokens.append((b["key"], b["tensor"], t["mask_tensor"], tok))
                continue
            if b["dtypes"][0] == "text":
                continue
            mean = np.asarray(b.get("mean", []), np.float32)
            std = np.asarray(b.get("std", []), np.float32)
            self.inputs.append(
                (
                    b["key"],
                    b["tensor"],
                    b.get("layout", "none"),
                    np.float32(b.get("scale", 1.0)),
                    np.float32(b.get("offset", 0.0)),
                    mean,
                    std,
                )
            )
        self.outputs = [
            (
                o["tensor"],
                o.get("key", "actions"),
                o.get("dtype", "float32"),
                np.asarray(o.get("mean", []), np.float32),
                np.asarray(o.get("std", []), np.float32),
            )
            for o in cfg["outputs"]
        ]
        self.chunk = cfg.get("pacing", {}).get("actions_per_chunk", 0)
        self.metadata = cfg.get("metadata", {})

    def infer(self, obs):
        feed = {}
        for key, tensor, layout, scale, offset, mean, std in self.inputs:
            x = np.asarray(lookup(obs, key))
            # The last three axes, as policyd's layouts (a stack of frames keeps its first).
            if layout == "hwc_to_chw":
                x = np.moveaxis(x, -1, -3)
            elif layout == "chw_to_hwc":
                x = np.moveaxis(x, -3, -1)
            x = x.astype(np.float32) * scale + offset
            if mean.size:
                x = (x - mean) / (std + 1e-6)
            feed[tensor] = np.ascontiguousarray(x[None], np.float32)
        for key, ids_name, mask_name, tok in self.tokens:
            prompt = obs.get(key, "")
            feed[ids_name], feed[mask_name] = tok(str(prompt))
        start = time.monotonic()
        outs = dict(zip(self.names, self.session.run(None, feed)))
        timing = {}
        if self.pipeline:
            expert, sampler, wire, shape = self.pipeline
            fixed = {to: outs[frm] for to, frm in wire.items()}
            steps = int(
                obs.get("sampling_params", {}).get("num_inference_steps", sampler.steps)
            )
            prefix_done = time.monotonic()
            engine = [0.0]

            def step(x, t):
                t0 = time.monotonic()
                out = expert.run(
                    [sampler.output], dict(fixed, **{sampler.x: x, sampler.time: t})
                )[0]
                engine[0] += time.monotonic() - t0
                return out

            outs = {sampler.x: sampler.run(step, shape, obs.get("seed"), steps)}
            end = time.monotonic()
            timing = {
                "prefix_ms": (prefix_done - start) * 1000,
                "denoise_ms": (end - prefix_done) * 1000,
                "steps": steps,
                "step_engine_ms": engine[0] * 1000,
            }
        infer_ms = (time.monotonic() - start) * 1000
        result = {}
        for tensor, key, dtype, mean, std in self.outputs:
            a = outs[tensor][0]
            if self.chunk:
                a = a[: self.chunk]
            if mean.size:
                a = a * (std + 1e-6) + mean
            result[key] = a.astype(dtype)
        result["policy_timing"] = {"infer_ms": infer_ms, **timing}
        return result

    def reset(self):
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        type=pathlib.Path,
        required=True,
        help="a policyd config (its model, bindings, transforms)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument(
        "--threads", type=int, default=1, help="onnxruntime intra-op threads"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    policy = OnnxPolicy(args.config, args.threads)
    WebsocketPolicyServer(
        policy, host=args.host, port=args.port, metadata=policy.metadata
    ).serve_forever()


if __name__ == "__main__":
    main()

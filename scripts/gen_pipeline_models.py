#!/usr/bin/env python3
"""The two demo pipelines (prefix graph + step graph), small but shaped like the real thing:

- flow (pi0-shaped, configs/flow.toml): the prefix takes three 224x224 cameras, the state [32]
  and a tokenized prompt (ids + mask [48]) and gives `prefix_features` [1, 64] and the state
  back; the action expert takes those, the noisy chunk `x_t` [1, 50, 32] and `time` [1] and
  gives the velocity `v_t`. openpi's sampler integrates it over 10 Euler steps.
- diffusion (LeRobot PushT-shaped, configs/diffusion.toml): the encoder takes 2 observation
  steps of the state [2] and a 96x96 image and gives `global_cond` [1, 68]; the denoiser takes
  the noisy chunk `x` [1, 16, 2], an int64 `timestep` [1] and the condition and predicts the
  noise. DDIM, 10 steps of 100 training timesteps.

Each step graph depends on its prefix, its sample and its time, so a wrong wire, time or
update shows. Run from the repository root (needs onnx and numpy); deterministic; the models
are committed under models/.
"""

import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = pathlib.Path(__file__).resolve().parent.parent / "models"


class Graph:
    def __init__(self, rng):
        self.rng, self.inits, self.nodes, self.n = rng, [], [], 0

    def w(self, shape, scale=1.0):
        fan_in = shape[0] if len(shape) > 1 else 1
        return self.const(
            (self.rng.standard_normal(shape) / np.sqrt(fan_in) * scale).astype(
                np.float32
            )
        )

    def const(self, arr):
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def op(self, kind, inputs, **attrs):
        self.n += 1
        out = f"t{self.n}"
        self.nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def dense(self, x, n_in, n_out, act="Relu", scale=1.0):
        y = self.op("Gemm", [x, self.w((n_in, n_out), scale), self.w((n_out,), 0.1)])
        return self.op(act, [y]) if act else y

    def camera(self, name, size):
        c = self.op(
            "Conv",
            [name, self.w((4, 3, 8, 8), 2.0 / 8), self.w((4,), 0.1)],
            strides=[8, 8],
            kernel_shape=[8, 8],
        )
        c = self.op("Relu", [c])
        k = size // 8 // 4
        c = self.op("AveragePool", [c], kernel_shape=[k, k], strides=[k, k])
        return self.op("Flatten", [c], axis=1), 4 * 4 * 4

    def time_embedding(self, t, dim=16):
        """sin/cos of the (float) time at `dim/2` frequencies: [1] -> [1, dim]."""
        freqs = self.const(
            (np.exp(np.linspace(0, np.log(100.0), dim // 2))).astype(np.float32)[None]
        )
        tt = self.op("Unsqueeze", [t, self.const(np.array([1], np.int64))])
        arg = self.op("Mul", [tt, freqs])
        return self.op("Concat", [self.op("Sin", [arg]), self.op("Cos", [arg])], axis=1)

    def model(self, name, inputs, outputs):
        graph = helper.make_graph(
            self.nodes, name, inputs, outputs, initializer=self.inits
        )
        m = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", 17)],
            producer_name="policyd scripts/gen_pipeline_models.py",
        )
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


def vi(name, ty, shape):
    return helper.make_tensor_value_info(name, ty, shape)


def flow_prefix(rng, vocab=4000, tokens=48):
    g = Graph(rng)
    cams = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
    feats = [g.camera(c, 224) for c in cams]
    emb = g.op("Gather", [g.w((vocab, 32)), "tokenized_prompt"], axis=0)
    mask = g.op("Cast", ["tokenized_prompt_mask"], to=TensorProto.FLOAT)
    masked = g.op(
        "Mul", [emb, g.op("Unsqueeze", [mask, g.const(np.array([2], np.int64))])]
    )
    total = g.op("ReduceSum", [masked, g.const(np.array([1], np.int64))], keepdims=0)
    count = g.op(
        "Max",
        [
            g.op("ReduceSum", [mask, g.const(np.array([1], np.int64))], keepdims=1),
            g.const(np.array([1.0], np.float32)),
        ],
    )
    prompt = g.op("Div", [total, count])
    state = g.dense("state", 32, 64)
    cat = g.op("Concat", [f for f, _ in feats] + [prompt, state], axis=1)
    n = sum(k for _, k in feats) + 32 + 64
    h = g.dense(cat, n, 128)
    g.nodes.append(
        helper.make_node(
            "Gemm", [h, g.w((128, 64)), g.w((64,), 0.1)], ["prefix_features"]
        )
    )
    g.nodes.append(helper.make_node("Identity", ["state"], ["state_out"]))
    inputs = [vi(c, TensorProto.FLOAT, [1, 3, 224, 224]) for c in cams] + [
        vi("state", TensorProto.FLOAT, [1, 32]),
        vi("tokenized_prompt", TensorProto.INT32, [1, tokens]),
        vi("tokenized_prompt_mask", TensorProto.BOOL, [1, tokens]),
    ]
    outputs = [
        vi("prefix_features", TensorProto.FLOAT, [1, 64]),
        vi("state_out", TensorProto.FLOAT, [1, 32]),
    ]
    return g.model("policyd_demo_flow_prefix", inputs, outputs)


def flow_expert(rng, horizon=50, dim=32):
    g = Graph(rng)
    cond = g.op(
        "Concat", ["prefix_features", "state", g.time_embedding("time")], axis=1
    )
    h = g.dense(cond, 64 + 32 + 16, 128)
    bias = g.dense(h, 128, dim, act=None)  # [1, dim]
    xa = g.op("MatMul", ["x_t", g.w((dim, dim))])  # [1, H, dim]
    pre = g.op("Add", [xa, g.op("Unsqueeze", [bias, g.const(np.array([1], np.int64))])])
    g.nodes.append(helper.make_node("Tanh", [pre], ["v_t"]))
    inputs = [
        vi("prefix_features", TensorProto.FLOAT, [1, 64]),
        vi("state", TensorProto.FLOAT, [1, 32]),
        vi("x_t", TensorProto.FLOAT, [1, horizon, dim]),
        vi("time", TensorProto.FLOAT, [1]),
    ]
    return g.model(
        "policyd_demo_flow_expert",
        inputs,
        [vi("v_t", TensorProto.FLOAT, [1, horizon, dim])],
    )


def diffusion_encoder(rng, steps=2):
    g = Graph(rng)
    img = g.op("Reshape", ["image", g.const(np.array([steps, 3, 96, 96], np.int64))])
    f, k = g.camera(img, 96)  # [steps, 64]
    per_step = g.dense(f, k, 32)  # [steps, 32]
    st = g.op("Reshape", ["state", g.const(np.array([steps, 2], np.int64))])
    both = g.op("Concat", [per_step, st], axis=1)  # [steps, 34]
    g.nodes.append(
        helper.make_node(
            "Reshape",
            [both, g.const(np.array([1, steps * 34], np.int64))],
            ["global_cond"],
        )
    )
    inputs = [
        vi("state", TensorProto.FLOAT, [1, steps, 2]),
        vi("image", TensorProto.FLOAT, [1, steps, 3, 96, 96]),
    ]
    return g.model(
        "policyd_demo_diffusion_encoder",
        inputs,
        [vi("global_cond", TensorProto.FLOAT, [1, steps * 34])],
    )


def diffusion_unet(rng, horizon=16, dim=2, cond=68):
    g = Graph(rng)
    t = g.op(
        "Div",
        [
            g.op("Cast", ["timestep"], to=TensorProto.FLOAT),
            g.const(np.array([100.0], np.float32)),
        ],
    )
    c = g.op("Concat", ["global_cond", g.time_embedding(t)], axis=1)
    h = g.dense(c, cond + 16, 64)
    film = g.dense(h, 64, horizon * dim, act=None)
    film = g.op("Reshape", [film, g.const(np.array([1, horizon, dim], np.int64))])
    mixed = g.op("MatMul", ["x", g.w((dim, dim))])
    g.nodes.append(helper.make_node("Add", [mixed, film], ["noise_pred"]))
    inputs = [
        vi("x", TensorProto.FLOAT, [1, horizon, dim]),
        vi("timestep", TensorProto.INT64, [1]),
        vi("global_cond", TensorProto.FLOAT, [1, cond]),
    ]
    return g.model(
        "policyd_demo_diffusion_unet",
        inputs,
        [vi("noise_pred", TensorProto.FLOAT, [1, horizon, dim])],
    )


def main():
    for i, (name, build) in enumerate(
        [
            ("flow_prefix", flow_prefix),
            ("flow_expert", flow_expert),
            ("diffusion_encoder", diffusion_encoder),
            ("diffusion_unet", diffusion_unet),
        ]
    ):
        path = OUT / f"{name}.onnx"
        path.write_bytes(build(np.random.default_rng(777 + i)).SerializeToString())
        print(f"wrote {path.relative_to(OUT.parent)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

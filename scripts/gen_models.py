"""Generate policyd's demo policies (small ONNX models with the real openpi profiles' I/O).

Each model does real work on every input, so a wrong binding changes the output:
per camera a strided conv (8x8, stride 8) + ReLU + 7x7 average pooling, with weights of its
own; an MLP over the state; a head that maps all features to the action chunk (tanh-bounded).
They are cheap (well under 1 ms on one core) so that benchmarks of the demo measure serving.

Run from the repository root (needs `onnx` and `numpy`):
    python3 scripts/gen_models.py
The output is deterministic (fixed seed), and the models are committed under models/.
"""

import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "models"

# name -> (camera engine inputs, state engine inputs with their sizes, action horizon, action dim)
PROFILES = {
    "aloha": (
        ["cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"],
        [("state", 14)],
        50,
        14,
    ),
    "droid": (
        ["exterior_image_1_left", "wrist_image_left"],
        [("joint_position", 7), ("gripper_position", 1)],
        10,
        8,
    ),
    "libero": (["image", "wrist_image"], [("state", 8)], 10, 7),
    # No cameras: what a request costs to serve with almost no data (`policyd bench --profile tiny`).
    "tiny": ([], [("state", 8)], 10, 7),
}
CONV_CH = 4
POOL_OUT = 4  # 224 / 8 = 28, pooled 7x7 -> 4x4
HIDDEN = 256


def build(name, cams, states, horizon, dim, rng):
    inits, nodes, feats = [], [], []

    def w(shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def const(nm, arr):
        inits.append(numpy_helper.from_array(arr, nm))
        return nm

    inputs = []
    for cam in cams:
        inputs.append(
            helper.make_tensor_value_info(cam, TensorProto.FLOAT, [1, 3, 224, 224])
        )
        cw = const(f"{cam}_conv_w", w((CONV_CH, 3, 8, 8), 3 * 64) * 2.0)
        cb = const(f"{cam}_conv_b", w((CONV_CH,), 1) * 0.1)
        nodes += [
            helper.make_node(
                "Conv", [cam, cw, cb], [f"{cam}_c"], strides=[8, 8], kernel_shape=[8, 8]
            ),
            helper.make_node("Relu", [f"{cam}_c"], [f"{cam}_r"]),
            helper.make_node(
                "AveragePool",
                [f"{cam}_r"],
                [f"{cam}_p"],
                kernel_shape=[7, 7],
                strides=[7, 7],
            ),
            helper.make_node("Flatten", [f"{cam}_p"], [f"{cam}_f"], axis=1),
        ]
        feats.append((f"{cam}_f", CONV_CH * POOL_OUT * POOL_OUT))
    for st, n in states:
        inputs.append(helper.make_tensor_value_info(st, TensorProto.FLOAT, [1, n]))
        sw = const(f"{st}_w", w((n, 64), n))
        sb = const(f"{st}_b", w((64,), 1) * 0.1)
        nodes += [
            helper.make_node("Gemm", [st, sw, sb], [f"{st}_g"]),
            helper.make_node("Relu", [f"{st}_g"], [f"{st}_f"]),
        ]
        feats.append((f"{st}_f", 64))
    total = sum(n for _, n in feats)
    nodes.append(
        helper.make_node("Concat", [f for f, _ in feats], ["features"], axis=1)
    )
    w1 = const("head_w1", w((total, HIDDEN), total) * 2.0)
    b1 = const("head_b1", w((HIDDEN,), 1) * 0.1)
    w2 = const("head_w2", w((HIDDEN, horizon * dim), HIDDEN) * 1.5)
    b2 = const("head_b2", w((horizon * dim,), 1) * 0.1)
    shape = const("out_shape", np.array([1, horizon, dim], dtype=np.int64))
    nodes += [
        helper.make_node("Gemm", ["features", w1, b1], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h1r"]),
        helper.make_node("Gemm", ["h1r", w2, b2], ["h2"]),
        helper.make_node("Tanh", ["h2"], ["h2t"]),
        helper.make_node("Reshape", ["h2t", shape], ["actions"]),
    ]
    out = helper.make_tensor_value_info("actions", TensorProto.FLOAT, [1, horizon, dim])
    graph = helper.make_graph(
        nodes, f"policyd_demo_{name}", inputs, [out], initializer=inits
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="policyd scripts/gen_models.py",
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build_prompted(rng, vocab=4000, max_tokens=48, emb=32, horizon=10, dim=7):
    """A policy that reads its task as token ids and a mask, as pi0-class models do: the
    masked mean of the tokens' embeddings joins an MLP of the state, so every token the mask
    keeps changes the actions and a padded one does not."""

    def w(shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    inits = []

    def const(nm, arr):
        inits.append(numpy_helper.from_array(arr, nm))
        return nm

    inputs = [
        helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 8]),
        helper.make_tensor_value_info(
            "tokenized_prompt", TensorProto.INT32, [1, max_tokens]
        ),
        helper.make_tensor_value_info(
            "tokenized_prompt_mask", TensorProto.BOOL, [1, max_tokens]
        ),
    ]
    table = const("embedding", w((vocab, emb), 1))
    nodes = [
        helper.make_node("Gather", [table, "tokenized_prompt"], ["tok_e"], axis=0),
        helper.make_node(
            "Cast", ["tokenized_prompt_mask"], ["mask_f"], to=TensorProto.FLOAT
        ),
        helper.make_node(
            "Unsqueeze", ["mask_f", const("ax2", np.array([2], np.int64))], ["mask_u"]
        ),
        helper.make_node("Mul", ["tok_e", "mask_u"], ["tok_m"]),
        helper.make_node(
            "ReduceSum",
            ["tok_m", const("ax1", np.array([1], np.int64))],
            ["tok_s"],
            keepdims=0,
        ),
        helper.make_node(
            "ReduceSum",
            ["mask_f", const("ax1b", np.array([1], np.int64))],
            ["count"],
            keepdims=1,
        ),
        helper.make_node(
            "Max", ["count", const("one", np.array([1.0], np.float32))], ["count1"]
        ),
        helper.make_node("Div", ["tok_s", "count1"], ["prompt_f"]),
        helper.make_node(
            "Gemm",
            [
                "state",
                const("state_w", w((8, 64), 8)),
                const("state_b", w((64,), 1) * 0.1),
            ],
            ["state_g"],
        ),
        helper.make_node("Relu", ["state_g"], ["state_f"]),
        helper.make_node("Concat", ["state_f", "prompt_f"], ["features"], axis=1),
        helper.make_node(
            "Gemm",
            [
                "features",
                const("head_w1", w((64 + emb, HIDDEN), 64 + emb) * 2.0),
                const("head_b1", w((HIDDEN,), 1) * 0.1),
            ],
            ["h1"],
        ),
        helper.make_node("Relu", ["h1"], ["h1r"]),
        helper.make_node(
            "Gemm",
            [
                "h1r",
                const("head_w2", w((HIDDEN, horizon * dim), HIDDEN) * 1.5),
                const("head_b2", w((horizon * dim,), 1) * 0.1),
            ],
            ["h2"],
        ),
        helper.make_node("Tanh", ["h2"], ["h2t"]),
        helper.make_node(
            "Reshape",
            ["h2t", const("out_shape", np.array([1, horizon, dim], np.int64))],
            ["actions"],
        ),
    ]
    out = helper.make_tensor_value_info("actions", TensorProto.FLOAT, [1, horizon, dim])
    graph = helper.make_graph(
        nodes, "policyd_demo_prompted", inputs, [out], initializer=inits
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="policyd scripts/gen_models.py",
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main():
    OUT.mkdir(exist_ok=True)
    for i, (name, spec) in enumerate(PROFILES.items()):
        model = build(name, *spec, np.random.default_rng(1234 + i))
        path = OUT / f"{name}.onnx"
        path.write_bytes(model.SerializeToString())
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")
    # Its own seed, after the others, so that adding it left them byte-identical.
    path = OUT / "prompted.onnx"
    path.write_bytes(build_prompted(np.random.default_rng(4321)).SerializeToString())
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

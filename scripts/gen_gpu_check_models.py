"""Generate the two ONNX models cross/gpu-check builds into TensorRT plans, beside the demo models:

- models/gpu-check/conditional.onnx: an `If` whose condition depends on the input (the sign of
  the state's sum), the kind of control flow TensorRT cannot capture into a CUDA graph; policyd
  must fall back to plain enqueues and answer every request.
- models/gpu-check/instancenorm.onnx: an InstanceNormalization layer, which TensorRT 8.x runs
  as a plugin (InstanceNormalization_TRT): the plan only loads once libnvinfer_plugin is
  initialised.

Both take the tiny profile's input (`state` [1, 8]) and return `actions` [1, 10, 7], so
configs/tiny.toml serves them with only the model changed.

Run from the repository root (needs `onnx` and `numpy`):
    python3 scripts/gen_gpu_check_models.py
The output is deterministic (fixed seed), and the models are committed.
"""

import pathlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "models" / "gpu-check"
H, D = 10, 7


def io():
    return (
        helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 8]),
        helper.make_tensor_value_info("actions", TensorProto.FLOAT, [1, H, D]),
    )


def finish(name, nodes, inits):
    inp, out = io()
    graph = helper.make_graph(
        nodes, f"policyd_gpu_check_{name}", [inp], [out], initializer=inits
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="policyd scripts/gen_gpu_check_models.py",
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def conditional(rng):
    w = numpy_helper.from_array(
        (rng.standard_normal((8, H * D)) / 3).astype(np.float32), "w"
    )
    shape = numpy_helper.from_array(np.array([1, H, D], dtype=np.int64), "shape")
    zero = numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")
    branch_out = lambda n: helper.make_tensor_value_info(
        n, TensorProto.FLOAT, [1, H * D]
    )
    then_g = helper.make_graph(
        [helper.make_node("Tanh", ["h"], ["t"])], "then", [], [branch_out("t")]
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["h"], ["n"]), helper.make_node("Tanh", ["n"], ["e"])],
        "else",
        [],
        [branch_out("e")],
    )
    nodes = [
        helper.make_node("MatMul", ["state", "w"], ["h"]),
        helper.make_node("ReduceSum", ["state"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Reshape", ["y", "shape"], ["actions"]),
    ]
    return finish("conditional", nodes, [w, shape, zero])


def instancenorm(rng):
    c = 2
    to3 = numpy_helper.from_array(np.array([1, c, 8 // c], dtype=np.int64), "to3")
    to2 = numpy_helper.from_array(np.array([1, 8], dtype=np.int64), "to2")
    scale = numpy_helper.from_array(np.array([1.5, 0.5], dtype=np.float32), "scale")
    bias = numpy_helper.from_array(np.array([0.1, -0.2], dtype=np.float32), "bias")
    w = numpy_helper.from_array(
        (rng.standard_normal((8, H * D)) / 3).astype(np.float32), "w"
    )
    shape = numpy_helper.from_array(np.array([1, H, D], dtype=np.int64), "shape")
    nodes = [
        helper.make_node("Reshape", ["state", "to3"], ["x3"]),
        helper.make_node(
            "InstanceNormalization", ["x3", "scale", "bias"], ["n3"], epsilon=1e-5
        ),
        helper.make_node("Reshape", ["n3", "to2"], ["n2"]),
        helper.make_node("MatMul", ["n2", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Reshape", ["t", "shape"], ["actions"]),
    ]
    return finish("instancenorm", nodes, [to3, to2, scale, bias, w, shape])


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for i, (name, build) in enumerate(
        [("conditional", conditional), ("instancenorm", instancenorm)]
    ):
        model = build(np.random.default_rng(4321 + i))
        path = OUT / f"{name}.onnx"
        path.write_bytes(model.SerializeToString())
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

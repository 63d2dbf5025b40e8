"""Minimal ONNX graphs for the tract-onnx 0.23 problems the rewrites work around.

Each builder returns a self-contained model (opset 18, static shapes) and the inputs to feed it.
`python -m policyd_export.tract_bugs DIR` writes them as `<name>.onnx` with `<name>.npz`
inputs: the reproducers of docs/export.md, ready to attach to an upstream report.

- `cumsum_int64`: `CumSum(Cast(x > 0, to=INT64))`, the position ids of every VLA prefix
  (`cumsum(pad_mask) − 1`). tract fails: `TDim is not a number` evaluating the CumSum.
- `concat_expand_matmul`: `MatMul(Concat(a, Expand(b)), W)`, SmolVLA's and pi0's
  `action_time_mlp_in`. tract fails in declutter: `Trying to substitute a 1,50,96,F32 by
  1,1,96,F32`.
- `pow3`: `Pow(MatMul(x, W), 3)`, GELU-tanh's cube. Correct, but slow in tract right after a
  matmul (the speed rewrite R3).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 18)]


def _model(
    nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any]
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "repro", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="policyd-export")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def cumsum_int64() -> tuple[onnx.ModelProto, dict[str, NDArray[Any]]]:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("positions", TensorProto.FLOAT, [1, 8])
    nodes = [
        helper.make_node("Greater", ["x", "zero"], ["mask"]),
        helper.make_node("Cast", ["mask"], ["mask64"], to=TensorProto.INT64),
        helper.make_node("CumSum", ["mask64", "axis"], ["count"]),
        helper.make_node("Sub", ["count", "one"], ["ids"]),
        helper.make_node("Cast", ["ids"], ["positions"], to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "axis"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    feeds = {"x": np.array([[1, 1, 1, 1, 1, -1, -1, -1]], np.float32)}
    return _model(nodes, [x], [y], inits), feeds


def concat_expand_matmul() -> tuple[onnx.ModelProto, dict[str, NDArray[Any]]]:
    rng = np.random.default_rng(0)
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 50, 96])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 1, 96])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 50, 96])
    nodes = [
        helper.make_node("Expand", ["b", "shape"], ["b50"]),
        helper.make_node("Concat", ["a", "b50"], ["ab"], axis=-1),
        helper.make_node("MatMul", ["ab", "w"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1, 50, 96], np.int64), "shape"),
        numpy_helper.from_array(rng.standard_normal((192, 96)).astype(np.float32) / 10, "w"),
    ]
    feeds = {
        "a": rng.standard_normal((1, 50, 96)).astype(np.float32),
        "b": rng.standard_normal((1, 1, 96)).astype(np.float32),
    }
    return _model(nodes, [a, b], [y], inits), feeds


def pow3() -> tuple[onnx.ModelProto, dict[str, NDArray[Any]]]:
    rng = np.random.default_rng(1)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024, 384])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024, 384])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Pow", ["h", "three"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((384, 384)).astype(np.float32) / 20, "w"),
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
    ]
    feeds = {"x": rng.standard_normal((1, 1024, 384)).astype(np.float32)}
    return _model(nodes, [x], [y], inits), feeds


ALL = {"cumsum_int64": cumsum_int64, "concat_expand_matmul": concat_expand_matmul, "pow3": pow3}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m policyd_export.tract_bugs DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, build in ALL.items():
        model, feeds = build()
        onnx.save_model(model, str(out / f"{name}.onnx"))
        np.savez(out / f"{name}.npz", allow_pickle=False, **feeds)
        print(out / f"{name}.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

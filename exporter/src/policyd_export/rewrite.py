"""Graph rewrites that make an ONNX graph run on tract-onnx 0.23, each an identity in exact math.

tract 0.23 fails on two patterns that the dynamo exporter writes into every VLA graph, and runs a
third ~20x slower than it should (docs/export.md, "tract"):

- R1 `CumSum` over `Cast(to=INT64)`: tract casts to its symbolic TDim type, which CumSum cannot
  evaluate. The CumSum runs on int32 instead and its result is cast back to int64.
- R2 `MatMul(Concat(..., Expand(b), ...), W)` with a constant W: tract's ConcatThenEinsum
  optimisation loses the Expand's broadcast. The MatMul is split by W's rows into one MatMul
  per concatenated part (the Expand's source, unexpanded), added up: the Add broadcasts.
- R3 `Pow(x, 3)`: becomes `x·x·x` (tract's libm-backed Pow is slow after a matmul).

`rewrite` returns the new model and what it changed; `check_same` runs both in onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper


@dataclass
class Report:
    cumsum_int64: list[str] = field(default_factory=list)  # R1: CumSum nodes retyped
    concat_expand_matmul: list[str] = field(default_factory=list)  # R2: MatMul nodes split
    pow3: list[str] = field(default_factory=list)  # R3: Pow nodes unrolled

    def total(self) -> int:
        return len(self.cumsum_int64) + len(self.concat_expand_matmul) + len(self.pow3)

    def lines(self) -> list[str]:
        return [
            f"R1 CumSum over Cast(to=INT64): {len(self.cumsum_int64)}",
            f"R2 MatMul over Concat with Expand: {len(self.concat_expand_matmul)}",
            f"R3 Pow(x, 3): {len(self.pow3)}",
        ]


class _Graph:
    """Producers, consumers and constants of a graph, for pattern matching."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None = None):
        self.model = model
        # Where the weights of a graph loaded without its external data are read from.
        self.base_dir = str(base_dir) if base_dir is not None else ""
        self.g = model.graph
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.inits = {i.name: i for i in self.g.initializer}
        self.names: set[str] = set(self.producer) | set(self.inits)
        self.names |= {i.name for i in self.g.input}
        self._n = 0

    def fresh(self, base: str) -> str:
        while True:
            self._n += 1
            name = f"{base}__policyd{self._n}"
            if name not in self.names:
                self.names.add(name)
                return name

    def constant(self, name: str) -> NDArray[Any] | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name], self.base_dir)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f, dtype=np.float32)
                if a.name == "value_int":
                    return np.array(a.i, dtype=np.int64)
        return None


def _attr(node: onnx.NodeProto, name: str, default: int | None = None) -> int | None:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for vi in (
        list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    ):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    for init in model.graph.initializer:
        out[init.name] = list(init.dims)
    return out


def rewrite(model: onnx.ModelProto, base_dir: Path | None = None) -> tuple[onnx.ModelProto, Report]:
    """Applies R1–R3 to a copy of `model`; returns it and what changed (nothing: an equal copy).
    A graph loaded without its external data (`onnx.load(..., load_external_data=False)`: a
    copy is then cheap) reads the few weights a rewrite needs from `base_dir`."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    report = Report()
    shapes = _shapes(model)
    gr = _Graph(model, base_dir)
    new_nodes: list[onnx.NodeProto] = []
    dropped_info: set[str] = set()
    for node in model.graph.node:
        # R1
        if node.op_type == "CumSum":
            src = gr.producer.get(node.input[0])
            if src is not None and src.op_type == "Cast" and _attr(src, "to") == TensorProto.INT64:
                as32 = gr.fresh(node.input[0])
                sum32 = gr.fresh(node.output[0])
                new_nodes.append(
                    helper.make_node("Cast", [src.input[0]], [as32], to=TensorProto.INT32)
                )
                node32 = onnx.NodeProto.FromString(node.SerializeToString())
                node32.input[0] = as32
                node32.output[0] = sum32
                new_nodes.append(node32)
                new_nodes.append(
                    helper.make_node("Cast", [sum32], [node.output[0]], to=TensorProto.INT64)
                )
                report.cumsum_int64.append(node.name or node.output[0])
                continue
        # R2
        if node.op_type == "MatMul" and node.input[1] in gr.inits:
            cat = gr.producer.get(node.input[0])
            rank = len(shapes.get(node.input[0]) or [])
            if (
                cat is not None
                and cat.op_type == "Concat"
                and rank > 0
                and _attr(cat, "axis")
                in (
                    -1,
                    rank - 1,
                )
            ):
                parts = list(cat.input)
                maybe = [(shapes.get(p) or [None])[-1] for p in parts]
                widths = [w for w in maybe if w is not None]
                expands = [gr.producer.get(p) for p in parts]
                has_expand = any(e is not None and e.op_type == "Expand" for e in expands)
                w = numpy_helper.to_array(gr.inits[node.input[1]], gr.base_dir)
                if (
                    has_expand
                    and len(widths) == len(parts)
                    and w.ndim == 2
                    and sum(widths) == w.shape[0]
                ):
                    row = 0
                    acc = None
                    for part, width, exp in zip(parts, widths, expands, strict=True):
                        source = part
                        if exp is not None and exp.op_type == "Expand":
                            src_shape = shapes.get(exp.input[0]) or [None]
                            if src_shape[-1] == width:
                                source = exp.input[0]  # the Add below broadcasts instead
                        wname = gr.fresh(node.input[1])
                        model.graph.initializer.append(
                            numpy_helper.from_array(w[row : row + width], wname)
                        )
                        row += width
                        prod = gr.fresh(node.output[0])
                        new_nodes.append(helper.make_node("MatMul", [source, wname], [prod]))
                        if acc is None:
                            acc = prod
                        else:
                            total = gr.fresh(node.output[0])
                            new_nodes.append(helper.make_node("Add", [acc, prod], [total]))
                            acc = total
                    # The last Add writes the MatMul's own output name.
                    new_nodes[-1].output[0] = node.output[0]
                    report.concat_expand_matmul.append(node.name or node.output[0])
                    continue
        # R3
        if node.op_type == "Pow":
            c = gr.constant(node.input[1])
            if c is not None and c.size == 1 and float(c.reshape(-1)[0]) == 3.0:
                sq = gr.fresh(node.output[0])
                new_nodes.append(helper.make_node("Mul", [node.input[0], node.input[0]], [sq]))
                new_nodes.append(helper.make_node("Mul", [sq, node.input[0]], [node.output[0]]))
                report.pow3.append(node.name or node.output[0])
                continue
        new_nodes.append(node)
    if report.total() == 0:
        return model, report
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    dropped_info |= {n.output[0] for n in new_nodes}
    _cleanup(model, dropped_info)
    if base_dir is None:
        # A graph whose weights lie elsewhere is checked once written (`graphs.export`): the
        # checker looks for its data file from the working directory.
        onnx.checker.check_model(model, full_check=False)
    return model, report


def _cleanup(model: onnx.ModelProto, rewritten: set[str]) -> None:
    """Removes nodes nobody reads, initializers nobody uses, and stale value_info."""
    g = model.graph
    outputs = {o.name for o in g.output}
    while True:
        used = {i for n in g.node for i in n.input} | outputs
        keep = [n for n in g.node if any(o in used for o in n.output if o)]
        if len(keep) == len(g.node):
            break
        del g.node[:]
        g.node.extend(keep)
    used = {i for n in g.node for i in n.input} | outputs
    inits = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    produced = {o for n in g.node for o in n.output}
    infos = [v for v in g.value_info if v.name in produced and v.name not in rewritten]
    del g.value_info[:]
    g.value_info.extend(infos)


def random_feeds(model_path: str | Path, seed: int = 0) -> dict[str, NDArray[Any]]:
    """Inputs for a graph with static shapes: floats N(0, 1), integers 0, booleans true."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if "float" in i.type:
            dt = np.float16 if "float16" in i.type else np.float32
            feeds[i.name] = rng.standard_normal(shape).astype(dt)
        elif "bool" in i.type:
            feeds[i.name] = np.ones(shape, dtype=bool)
        else:
            feeds[i.name] = np.zeros(shape, dtype=np.int64 if "int64" in i.type else np.int32)
    return feeds


def run_once(path: str | Path, feeds: dict[str, Any], prepack: bool = True) -> list[NDArray[Any]]:
    """One onnxruntime run of a graph; the session (a copy of its weights) is gone after.
    `prepack=False` spares the copy of every MatMul weight onnxruntime's CPU kernels make."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [np.asarray(x) for x in sess.run(None, feeds)]


def max_diff(a: list[NDArray[Any]], b: list[NDArray[Any]]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        diff = np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64))
        worst = max(worst, float(diff.max()) if diff.size else 0.0)
    return worst


def check_same(original: str | Path, rewritten: str | Path, feeds: dict[str, Any]) -> float:
    """Largest absolute difference between the two graphs' outputs in onnxruntime (one session
    at a time: a large graph's weights are held once)."""
    return max_diff(run_once(original, feeds), run_once(rewritten, feeds))


#: Past this many bytes a graph's weights go to `<graph>.onnx.data` (ONNX's protobuf limit is
#: 2 GB, and below it too, since a graph loads in less memory that way: tract copies the weights
#: in one tensor at a time instead of decoding the whole protobuf first. A real SmolVLA served
#: on `cpu` peaked at 1.56× its graphs as single files, 1.32× with external data; on `ort`
#: 1.30× and 1.18×: docs/benchmarks.md). Below it a graph is one file.
EXTERNAL_OVER = 256_000_000


def stays_external(model: onnx.ModelProto, data: Path) -> bool:
    """Whether `place` keeps the weights of `model` (loaded without them, from `data`) in a
    file of their own."""
    return data.stat().st_size + int(model.ByteSize()) > EXTERNAL_OVER


def place(model: onnx.ModelProto, data: Path, path: Path) -> None:
    """Writes `model`, loaded without its external data (which lies in `data`, beside it), to
    `path`. A large graph keeps its weights where they are: `data` becomes `<path>.data`, and
    what the rewrites added is appended to it, so the weights are never all in memory; a small
    one is read back in and written whole, as one file. `data` is gone after."""
    if not stays_external(model, data):
        onnx.load_external_data_for_model(model, str(data.parent))
        onnx.save_model(model, str(path))
        data.unlink()
        return
    target = path.parent / (path.name + ".data")
    data.rename(target)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location" and entry.value == data.name:
                entry.value = target.name
    # Only tensors that carry their bytes (the rewrites' new ones) are written: appended.
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=target.name,
    )


def save(model: onnx.ModelProto, path: Path, external_over: int = EXTERNAL_OVER) -> None:
    """Saves a graph; over `external_over` bytes its weights go to `<name>.data` beside it
    (ONNX's protobuf limit is 2 GB; tract reads external data inside the model's directory)."""
    if model.ByteSize() > external_over:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
        )
        # onnx 1.23 creates the data file 0600: as readable as the graph, for a service user.
        (path.parent / (path.name + ".data")).chmod(path.stat().st_mode & 0o777)
    else:
        onnx.save_model(model, str(path))

"""What makes tract's libm-backed element-wise ops slow right after a MatMul? (issue 31)

../shared/docs/export.md measured `Sin` alone at 3.4 ms and `MatMul -> Sin` at 72 ms on
[1, 1024, 384], and guessed an AVX->SSE transition penalty. This runs the experiment that tells
the guesses apart, each cell timed per op by `cargo bench --bench tract_profile`:

- the same op with and without a MatMul before it, on inputs of the same magnitude: if the
  MatMul's vector state slowed the op down, it stays slow after the MatMul whatever the values;
- the op alone on small and on large values, and after MatMuls whose weights give small and
  large outputs: if the values decide, the op is slow on large values with or without a MatMul.

    .venv-export/bin/python benches/tract_libm.py [--runs 5]

Prints a Markdown table (docs/tract-report.md).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
SHAPE = [1, 1024, 384]


def graph(op: str, matmul_scale: float | None) -> onnx.ModelProto:
    """`op` on x, or on x @ W with W ~ N(0, 1) * matmul_scale / sqrt(384)."""
    nodes, inits = [], []
    src = "x"
    if matmul_scale is not None:
        w = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
        inits.append(
            numpy_helper.from_array(w * np.float32(matmul_scale / 384**0.5), "W")
        )
        nodes.append(helper.make_node("MatMul", ["x", "W"], ["m"]))
        src = "m"
    if op == "Pow3":
        inits.append(numpy_helper.from_array(np.array(3.0, np.float32), "three"))
        nodes.append(helper.make_node("Pow", [src, "three"], ["y"]))
    elif op == "MulMul":
        nodes.append(helper.make_node("Mul", [src, src], ["sq"]))
        nodes.append(helper.make_node("Mul", ["sq", src], ["y"]))
    else:
        nodes.append(helper.make_node(op, [src], ["y"]))
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def profile(path: Path, runs: int, scale: float, zero_upper: bool) -> dict[str, float]:
    """ms per run by op, from tract_profile."""
    r = subprocess.run(
        ["cargo", "bench", "-q", "--bench", "tract_profile", "--", str(path), str(runs)]
        + ["--scale", str(scale)]
        + (["--vzeroupper"] if zero_upper else []),
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    ops = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s+(\S+)\s+([\d.]+)\s+[\d.]+ %", line)
        if m:
            ops[m.group(1)] = float(m.group(2))
    return ops


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    # (label, op, matmul weight scale or None, input scale): the MatMul's outputs have about
    # the input's spread times the weight scale / sqrt(3) (x uniform on [-s, s]).
    cells = []
    for op in ["Sin", "Pow3", "MulMul", "Tanh"]:
        cells += [
            (op, None, 1.0),
            (op, None, 100.0),
            (op, 1.0, 1.0),
            (op, 100.0, 1.0),
        ]
    print(
        "| op | before it | std of the values reaching it | op ms | op ms, vzeroupper before "
        "each node | MatMul ms |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for op, w, s in cells:
            path = Path(tmp) / f"{op}-{w}-{s}.onnx"
            onnx.save(graph(op, w), str(path))
            ops = profile(path, args.runs, s, False)
            cleared = profile(path, args.runs, s, True)
            matmul = sum(v for k, v in ops.items() if "MatMul" in k or "EinSum" in k)
            mine = sum(
                v for k, v in ops.items() if not ("MatMul" in k or "EinSum" in k)
            )
            mine_z = sum(
                v for k, v in cleared.items() if not ("MatMul" in k or "EinSum" in k)
            )
            # x is uniform on [-s, s]: std s / sqrt(3), times w after the MatMul.
            spread = s / 3**0.5 * (1 if w is None else w)
            before = "nothing" if w is None else "MatMul"
            mm = f"{matmul:.2f}" if w is not None else "—"
            print(
                f"| {op} | {before} | {spread:.3g} | {mine:.2f} | {mine_z:.2f} | {mm} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

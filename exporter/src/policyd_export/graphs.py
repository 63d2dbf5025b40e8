"""Tracing a wrapper module into an ONNX graph policyd can load, and checking it at once.

The dynamo exporter (`torch.onnx.export(..., dynamo=True)`) at opset 18, static shapes, batch 1:
the legacy exporter writes invalid VLA graphs and fails on Diffusion's crop (docs/export.md).
Every graph then goes through the tract rewrites (`rewrite.py`) and is compared with the torch
module in onnxruntime before it is kept.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from . import rewrite
from .errors import ExportError


@dataclass
class Graph:
    file: str
    inputs: list[str]
    outputs: list[str]
    #: onnxruntime on the saved graph vs the torch module, on the export's example inputs.
    max_abs_diff: float
    rewrites: list[str]
    seconds: float
    #: One onnxruntime run of the saved graph on one thread of this machine (after a first,
    #: warming run): what the bundle's engine.timeout_ms is sized from.
    run_seconds: float = 0.0


def export(
    module: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    input_names: list[str],
    output_names: list[str],
    path: Path,
    verbose: bool = False,
) -> Graph:
    """Exports `module(*args)` to `path`, rewritten for tract and checked against torch."""
    start = time.monotonic()
    module = module.eval()
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    for name in ("torch.onnx", "onnxscript"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        with torch.no_grad(), quiet:
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=18,
                input_names=input_names,
                output_names=output_names,
                verbose=verbose,
            )
            if program is None:
                raise ExportError("torch.onnx.export returned no program")
            program.optimize()
            raw = path.with_suffix(".raw.onnx")
            # The weights in a file of their own from the start: nothing after this holds
            # them all in memory but onnxruntime's session (a real pi0's prefix is 11.6 GB).
            program.save(str(raw), external_data=True)
            del program
    except Exception as e:  # the exporter raises many types; all mean the same to a user
        raise ExportError(f"torch.onnx.export failed for {path.name}: {e}") from e
    data = raw.parent / (raw.name + ".data")
    model = onnx.load(str(raw), load_external_data=False)
    rewritten, report = rewrite.rewrite(model, base_dir=raw.parent)
    del model
    feeds = {n: a.detach().cpu().numpy() for n, a in zip(input_names, args, strict=True)}
    with torch.no_grad():
        want = module(*args)
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    # A graph whose weights stay in their file is not prepacked by onnxruntime (prepacking
    # copies every MatMul weight once more).
    external = rewrite.stays_external(rewritten, data)
    # The graph as traced, run before its weights move (one session at a time).
    before = rewrite.run_once(raw, feeds, prepack=not external) if report.total() else None
    rewrite.place(rewritten, data, path)
    del rewritten
    raw.unlink()
    if report.total():
        onnx.checker.check_model(str(path), full_check=False)
    import onnxruntime as ort

    # One thread, as policyd's engine runs by default (engine.threads = 1): the run timed
    # below sizes the bundle's engine.timeout_ms.
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    if external:
        options.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    timed = time.monotonic()
    sess.run(None, feeds)
    run_seconds = time.monotonic() - timed
    del sess
    if before is not None:
        # Relative to the outputs' size: the rewrites reorder float32 sums, whose rounding
        # grows with the values (an absolute 1e-5 failed, by 2.3e-5, a real-width GR00T step
        # whose velocities reached 76).
        same = rewrite.max_diff(before, got)
        scale = max([1.0, *(float(np.abs(b).max()) for b in before if b.size)])
        if same > 1e-5 * scale:
            raise ExportError(
                f"{path.name}: the tract rewrites changed the outputs by {same:.3g} "
                f"(largest output {scale:.3g})"
            )
    diff = max(
        float(np.abs(g.astype(np.float64) - w.detach().cpu().numpy().astype(np.float64)).max())
        for g, w in zip(got, want, strict=True)
    )
    return Graph(
        file=path.name,
        inputs=input_names,
        outputs=output_names,
        max_abs_diff=diff,
        rewrites=[line for line in report.lines() if not line.endswith(": 0")],
        seconds=time.monotonic() - start,
        run_seconds=run_seconds,
    )

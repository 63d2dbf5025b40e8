"""Peak memory of exporting one graph (issue 36): a module of plain Linear layers holding
`--gb` GB of float32 weights, through the exporter's `graphs.export` (trace, rewrites, the
onnxruntime check), in a fresh process whose peak RSS (VmHWM) is printed beside the weights'
size. Past 2 GB the graph is written with external data, as a real pi0's prefix (11.6 GB) is.

    .venv-export/bin/python benches/export_memory.py --gb 2.4

Prints one line: weights, peak RSS, their ratio, the graph files written, seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class Stack(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=2.4)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "exporter" / "src"))
    from policyd_export import graphs

    width = int((args.gb * 1e9 / 4 / args.layers) ** 0.5)
    torch.manual_seed(0)
    with torch.no_grad():
        module = Stack(width, args.layers).eval()
    weights = sum(p.numel() * 4 for p in module.parameters()) / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        g = graphs.export(module, (torch.randn(1, width),), ["x"], ["y"], Path(tmp) / "m.onnx")
        secs = time.monotonic() - start
        files = sorted(f"{f.name} {f.stat().st_size / 1e9:.2f} GB" for f in Path(tmp).iterdir())
    peak = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1000
    print(
        f"weights {weights:.2f} GB, peak RSS {peak / 1e9:.2f} GB ({peak / 1e9 / weights:.2f}x); "
        f"{', '.join(files)}; diff {g.max_abs_diff:.1e}; {secs:.0f} s"
    )


if __name__ == "__main__":
    main()

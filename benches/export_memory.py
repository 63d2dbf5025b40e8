"""Peak memory of exporting one graph (issue 36): a module of plain Linear layers holding
`--gb` GB of float32 weights, through the exporter's `graphs.export` (trace, rewrites, the
onnxruntime check), in a fresh process whose peak RSS (VmHWM) is printed beside the weights'
size. Past 2 GB the graph is written with external data, as a real pi0's prefix (11.6 GB) is.

    .venv-export/bin/python benches/export_memory.py --gb 2.4

Prints one line: weights, peak RSS, their ratio, the peak of anonymous memory alone (RssAnon,
sampled every 20 ms: onnxruntime maps an external data file instead of copying it, and those
clean file pages count in RSS but the kernel can drop them), the graph files written, seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class Stack(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width) for _ in range(layers)
        )

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
    anon = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon[0] = max(anon[0], status_kb("RssAnon"))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        g = graphs.export(
            module, (torch.randn(1, width),), ["x"], ["y"], Path(tmp) / "m.onnx"
        )
        secs = time.monotonic() - start
        files = sorted(
            f"{f.name} {f.stat().st_size / 1e9:.2f} GB" for f in Path(tmp).iterdir()
        )
    done.set()
    sampler.join()
    peak = status_kb("VmHWM") / 1e6
    a = anon[0] / 1e6
    print(
        f"weights {weights:.2f} GB, peak RSS {peak:.2f} GB ({peak / weights:.2f}x), anonymous "
        f"{a:.2f} GB ({a / weights:.2f}x); {', '.join(files)}; diff {g.max_abs_diff:.1e}; "
        f"{secs:.0f} s"
    )


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    main()

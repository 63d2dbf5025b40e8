"""Where SmolVLA's time goes at its real size (issue 52's first step): per stage and per op
class, in onnxruntime, in tract (through policyd) and in LeRobot's torch, at 1 and 2 threads.

The checkpoint and bundle are `benches/smolvla_real.py`'s (SmolVLM2-500M's geometry, random
weights, two 480×640 cameras, chunk 50, 10 flow steps). Then, one process at a time:

- onnxruntime (this venv's wheel, the library policyd's `ort` backend loads): the prefix graph
  and the step graph run as policyd runs them (the step graph fed the prefix's outputs), with
  onnxruntime's own profiler; node time summed by op type (the optimised graph's node names
  no longer say which module a node came from, so its stages are the two graphs). At 2
  threads also with the pool spinning between ops (`engine.spinning`).
- tract: policyd's `cpu` backend serving the bundle; each reply's `policy_timing` gives the
  prefix and the 10 steps apart.
- torch: LeRobot's `predict_action_chunk` on the same observations, the stages timed with
  forward hooks (the vision tower and connector; the first call of the VLM-with-expert, which
  runs the prefix through the text layers; its later calls, one per step), and aten ops summed
  by torch's profiler.

    .venv-export/bin/python benches/smolvla_profile.py --policyd target/release/policyd --n 3

Prints Markdown tables (docs/benchmarks.md, "SmolVLA: where the time goes").
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
real = importlib.import_module("smolvla_real")

STAGES = ("vision", "connector", "text layers", "expert", "other")


def ort_profile(
    bundle: Path, feeds: dict[str, Any], threads: int, runs: int, spin: bool
) -> dict[str, Any]:
    """The prefix and one step graph, profiled: ms per chunk by graph and by op type.
    `spin`: the pool's threads spin between ops (onnxruntime's default; policyd turns it off
    above one thread, so that they do not hold a core the serving threads need)."""
    import numpy as np
    import onnxruntime as ort

    cfg = tomllib.loads((bundle / "policyd.toml").read_text())
    wire: dict[str, str] = cfg["denoise"].get("wire", {})
    sampler = cfg["sampler"]

    def session(model: Path) -> Any:
        o = ort.SessionOptions()
        o.intra_op_num_threads = threads
        o.inter_op_num_threads = 1
        o.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if spin else "0"
        )
        o.enable_profiling = True
        o.profile_file_prefix = str(bundle / f"ort-{model.stem}-{threads}")
        return ort.InferenceSession(str(model), o, providers=["CPUExecutionProvider"])

    prefix = session(bundle / cfg["engine"]["model"])
    step = session(bundle / cfg["denoise"]["model"])
    p_in = {i.name: feeds[i.name] for i in prefix.get_inputs()}
    out_names = [o.name for o in prefix.get_outputs()]
    wall = collections.defaultdict(float)
    for r in range(runs + 1):
        t0 = time.perf_counter()
        outs = dict(zip(out_names, prefix.run(None, p_in), strict=True))
        t1 = time.perf_counter()
        s_in: dict[str, Any] = {}
        for i in step.get_inputs():
            if i.name in wire:
                s_in[i.name] = outs[wire[i.name]]
            elif i.name == sampler["x"]:
                s_in[i.name] = np.zeros(
                    [d if isinstance(d, int) else 1 for d in i.shape], np.float32
                )
            elif i.name == sampler["time"]:
                s_in[i.name] = np.full(
                    [d if isinstance(d, int) else 1 for d in i.shape], 0.5, np.float32
                )
        for _ in range(int(sampler["steps"])):
            step.run(None, s_in)
        t2 = time.perf_counter()
        if r:  # the first run warms up
            wall["prefix"] += (t1 - t0) * 1e3 / runs
            wall["steps"] += (t2 - t1) * 1e3 / runs
    by_op: dict[str, float] = collections.defaultdict(float)
    for sess, graph in ((prefix, "prefix"), (step, "step")):
        events = json.loads(Path(sess.end_profiling()).read_text())
        # Every run's nodes, the warm-up's included: scaled to one chunk below.
        calls = runs + 1 if graph == "prefix" else (runs + 1) * int(sampler["steps"])
        per_chunk = 1 if graph == "prefix" else int(sampler["steps"])
        for e in events:
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            ms = e["dur"] / 1e3 / calls * per_chunk
            by_op[e["args"]["op_name"]] += ms
    return {"wall": dict(wall), "op": dict(by_op)}


def tract_stages(
    policyd: str, bundle: Path, obs: list[dict[str, Any]], threads: int
) -> dict[str, float]:
    """policyd's `cpu` backend: the prefix and the steps of each chunk, from its replies."""
    from openpi_client import websocket_client_policy
    from policyd_export.verify import served

    cfg = tomllib.loads((bundle / "policyd.toml").read_text())
    cfg["engine"].update(backend="cpu", threads=threads)
    path = bundle / f"profile-cpu-{threads}.toml"
    path.write_text(tomli_w.dumps(cfg))
    rows: list[tuple[float, float]] = []
    with served(policyd, path, timeout=900) as (port, _pid):
        client = websocket_client_policy.WebsocketClientPolicy(port=port)
        for i, o in enumerate(obs):
            t = client.infer(dict(o))["policy_timing"]
            if i:
                rows.append((t["prefix_ms"], t["denoise_ms"]))
    return {
        "prefix": sum(r[0] for r in rows) / len(rows),
        "steps": sum(r[1] for r in rows) / len(rows),
    }


def torch_profile(ref: Any, obs: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    """LeRobot's torch path: stages by forward hooks, aten ops by torch's profiler."""
    import torch

    torch.set_num_threads(threads)
    model = ref.policy.model
    vwe = model.vlm_with_expert
    vlm = vwe.vlm.model
    timings: dict[str, list[float]] = collections.defaultdict(list)
    starts: dict[str, float] = {}

    def hook(name: str, module: Any) -> None:
        def pre(*_: Any) -> None:
            starts[name] = time.perf_counter()

        def post(*_: Any) -> None:
            timings[name].append((time.perf_counter() - starts[name]) * 1e3)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    hook("vision", vlm.vision_model)
    hook("connector", vlm.connector)
    # LeRobot calls `vlm_with_expert.forward(...)` itself, which bypasses module hooks: the
    # method is wrapped instead.
    forward = vwe.forward

    def timed_forward(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = forward(*a, **k)
        timings["vlm_with_expert"].append((time.perf_counter() - t) * 1e3)
        return out

    vwe.forward = timed_forward
    ref.actions(obs[0])
    stage: dict[str, float] = collections.defaultdict(float)
    total = 0.0
    for o in obs[1:]:
        timings.clear()
        t0 = time.perf_counter()
        ref.actions(o)
        total += (time.perf_counter() - t0) * 1e3
        calls = timings["vlm_with_expert"]
        stage["vision"] += sum(timings["vision"])
        stage["connector"] += sum(timings["connector"])
        stage["text layers"] += calls[0]
        stage["expert"] += sum(calls[1:])
    n = len(obs) - 1
    stage = {k: v / n for k, v in stage.items()}
    stage["other"] = total / n - sum(stage.values())
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        ref.actions(obs[1])
    ops = {
        e.key: e.self_cpu_time_total / 1e3
        for e in prof.key_averages()
        if e.key.startswith("aten::")
    }
    return {"total": total / n, "stage": stage, "op": ops}


def op_class(op: str) -> str:
    """ONNX op types and aten ops in the same few classes."""
    o = op.lower().removeprefix("aten::")
    if o in (
        "gemm",
        "matmul",
        "fusedmatmul",
        "matmulinteger",
        "addmm",
        "mm",
        "bmm",
        "linear",
        "matmulnbits",
    ):
        return "matrix products"
    if "attention" in o or o in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "scaled_dot_product_attention",
        "baddbmm",
    ):
        return "fused attention"
    if o in ("conv", "convolution", "_convolution", "mkldnn_convolution"):
        return "convolution"
    if o in ("softmax", "_softmax"):
        return "softmax"
    if o in ("where", "isnan", "masked_fill", "masked_fill_"):
        return "masking (Where, IsNaN)"
    if "norm" in o or o in ("reducemean", "pow", "sqrt", "rsqrt"):
        return "normalisation"
    if o in (
        "gelu",
        "silu",
        "sigmoid",
        "tanh",
        "erf",
        "mul",
        "add",
        "sub",
        "div",
        "neg",
        "exp",
        "cos",
        "sin",
    ):
        return "elementwise"
    if o in ("cast", "to", "_to_copy", "copy_"):
        return "casts and copies"
    if o in (
        "transpose",
        "reshape",
        "concat",
        "cat",
        "slice",
        "gather",
        "unsqueeze",
        "squeeze",
        "expand",
        "view",
        "permute",
        "contiguous",
        "clone",
        "split",
        "index",
        "shape",
        "constantofshape",
        "range",
        "identity",
    ):
        return "layout (reshape, transpose, concat, gather)"
    return "other"


def classes(ops: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for k, v in ops.items():
        out[op_class(k)] += v
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    ap.add_argument(
        "--n", type=int, default=3, help="chunks measured per engine and thread count"
    )
    args = ap.parse_args()
    import numpy as np
    from policyd_export.bundle import read_manifest
    from policyd_export.checkpoint import load
    from policyd_export.reference import Reference
    from policyd_export.verify import observations

    exe = Path(sys.executable).parent / "policyd-export"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        vlm = real.real_smolvlm(tmp / "vlm")
        ckpt = real.smolvla(tmp / "checkpoint", vlm)
        bundle = tmp / "bundle"
        secs, peak, _, r = real.timed(
            [str(exe), "lerobot", str(ckpt), "--out", str(bundle)]
        )
        print(
            f"export: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB",
            flush=True,
        )
        if r.returncode:
            raise SystemExit(r.stderr)
        ck = load(ckpt)
        manifest = read_manifest(bundle)
        obs = observations(
            ck, args.n + 1, seed=0, prompt_key=manifest.get("prompt_key")
        )
        results: dict[str, dict[int, Any]] = collections.defaultdict(dict)
        for threads in (1, 2):
            results["tract"][threads] = tract_stages(args.policyd, bundle, obs, threads)
            print(f"tract {threads}: {results['tract'][threads]}", flush=True)
        # onnxruntime's feeds: the prefix's inputs as policyd fills them for the first
        # observation (the engine's own tensors, written by policyd's bindings, are not at
        # hand here: deterministic stand-ins of the same shapes and types time the same).
        import onnxruntime as ort

        prefix = ort.InferenceSession(
            str(
                bundle
                / tomllib.loads((bundle / "policyd.toml").read_text())["engine"][
                    "model"
                ]
            ),
            providers=["CPUExecutionProvider"],
        )
        rng = np.random.default_rng(0)
        types = {
            "tensor(float)": np.float32,
            "tensor(int64)": np.int64,
            "tensor(bool)": np.bool_,
            "tensor(uint8)": np.uint8,
            "tensor(int32)": np.int32,
        }
        feeds: dict[str, Any] = {}
        for i in prefix.get_inputs():
            shape = [s if isinstance(s, int) else 1 for s in i.shape]
            t = types[i.type]
            if t == np.bool_:
                feeds[i.name] = np.ones(shape, t)
            elif t in (np.int64, np.int32):
                feeds[i.name] = rng.integers(0, 100, shape).astype(t)
            else:
                feeds[i.name] = rng.standard_normal(shape).astype(t)
        del prefix
        for threads in (1, 2):
            # As policyd's `ort` backend runs it: spinning only with one thread.
            results["ort"][threads] = ort_profile(
                bundle, feeds, threads, args.n, threads == 1
            )
            print(f"ort {threads}: {results['ort'][threads]['wall']}", flush=True)
        results["ort spinning"][2] = ort_profile(bundle, feeds, 2, args.n, True)
        print(f"ort 2, spinning: {results['ort spinning'][2]['wall']}", flush=True)
        ref = Reference(ck)
        for threads in (1, 2):
            results["torch"][threads] = torch_profile(ref, obs, threads)
            print(f"torch {threads}: {results['torch'][threads]['stage']}", flush=True)
    print_tables(results)


def print_tables(results: dict[str, dict[int, Any]]) -> None:
    print("\n| per chunk, ms | tract 1 | tract 2 | ort 1 | ort 2 | torch 1 | torch 2 |")
    print("|---|---|---|---|---|---|---|")
    rows = {
        "prefix (vision + connector + text layers)": lambda e, t: (
            results[e][t]["prefix"]
            if e == "tract"
            else results[e][t]["wall"]["prefix"]
            if e == "ort"
            else sum(
                results[e][t]["stage"][s]
                for s in ("vision", "connector", "text layers")
            )
        ),
        "10 expert steps": lambda e, t: (
            results[e][t]["steps"]
            if e == "tract"
            else results[e][t]["wall"]["steps"]
            if e == "ort"
            else results[e][t]["stage"]["expert"]
        ),
    }
    for name, f in rows.items():
        cells = [f"{f(e, t):.0f}" for e in ("tract", "ort", "torch") for t in (1, 2)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    spin = results["ort spinning"][2]["wall"]
    print(
        f"\nort at 2 threads with its pool spinning between ops: prefix {spin['prefix']:.0f} ms, "
        f"10 steps {spin['steps']:.0f} ms"
    )
    # onnxruntime's profile names the optimised graph's nodes, which no longer say which
    # module they came from: its split is the two graphs' (above). torch's, by stage:
    print("\n| torch, stage, ms per chunk | 1 thread | 2 threads |")
    print("|---|---|---|")
    for s in STAGES:
        cells = [f"{results['torch'][t]['stage'].get(s, 0.0):.0f}" for t in (1, 2)]
        print(f"| {s} | " + " | ".join(cells) + " |")
    print("\n| op class, ms per chunk | ort 1 | ort 2 | torch 1 | torch 2 |")
    print("|---|---|---|---|---|")
    cls = {
        (e, t): classes(results[e][t]["op"]) for e in ("ort", "torch") for t in (1, 2)
    }
    names = sorted(
        {k for c in cls.values() for k in c}, key=lambda k: -cls[("ort", 1)].get(k, 0)
    )
    for k in names:
        cells = [
            f"{cls[(e, t)].get(k, 0.0):.0f}" for e in ("ort", "torch") for t in (1, 2)
        ]
        print(f"| {k} | " + " | ".join(cells) + " |")
    print("\nonnxruntime's op types, 1 thread (ms per chunk):")
    top = sorted(results["ort"][1]["op"].items(), key=lambda kv: -kv[1])[:15]
    print(", ".join(f"{k} {v:.0f}" for k, v in top))
    print("torch's aten ops, 1 thread (self CPU ms, one chunk):")
    top = sorted(results["torch"][1]["op"].items(), key=lambda kv: -kv[1])[:15]
    print(", ".join(f"{k} {v:.0f}" for k, v in top))


if __name__ == "__main__":
    main()

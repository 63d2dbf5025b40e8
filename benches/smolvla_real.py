"""SmolVLA at its real geometry, exported, checked and verified against LeRobot with no edits
to the bundle (issue 36): the export's time and peak memory, `check-config`, and `verify`,
which failed on policyd's default `engine.timeout_ms` before the exporter sized it.

The VLM is written offline from SmolVLM2-500M's published config (SmolLM2's 960-wide, 32-layer
text model, of which SmolVLA keeps 16; SigLIP's 768-wide, 12-layer vision model at 512×512),
with random weights and the tests' byte-level tokenizer; the checkpoint is LeRobot 0.6.1's
SmolVLA default over it (chunk 50, two 480×640 cameras), with statistics far from identity.

    .venv-export/bin/python benches/smolvla_real.py --policyd target/release/policyd

With `--serve N`, the bundle is then served on `cpu` (tract) and `ort` (the onnxruntime wheel
of this venv) at 1 and 2 engine threads: the time to ready, the peak RSS while loading (at
ready) and after N chunks, and per-chunk latency through openpi-client (after one warm-up
chunk); then LeRobot's own `select_action` path (`Reference.actions`: preprocessor, torch
`predict_action_chunk`, postprocessor) on the same observations at 1 and 2 torch threads.

Prints what it measured (docs/benchmarks.md, "SmolVLA at its real size").
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter" / "tests"))
checkpoints = importlib.import_module("checkpoints")


def real_smolvlm(out: Path) -> Path:
    """The tests' tiny SmolVLM directory with SmolVLM2-500M's widths and depths."""
    checkpoints.tiny_smolvlm(out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"].update(
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=64,
        vocab_size=49280,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    )
    config["vision_config"].update(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=512,
        patch_size=16,
    )
    config["scale_factor"] = 4
    (out / "config.json").write_text(json.dumps(config))
    return out


def smolvla(out: Path, vlm: Path) -> Path:
    import torch
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import (
        make_smolvla_pre_post_processors,
    )

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    inputs = {"observation.state": PolicyFeature(FeatureType.STATE, (6,))}
    for cam in ("front", "wrist"):
        inputs[f"observation.images.{cam}"] = PolicyFeature(
            FeatureType.VISUAL, (3, 480, 640)
        )
    cfg = SmolVLAConfig(
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (6,))},
        vlm_model_name=str(vlm),
        load_vlm_weights=False,
        device="cpu",
    )
    policy = SmolVLAPolicy(cfg)
    params = sum(p.numel() for p in policy.parameters())
    features = {**cfg.input_features, **cfg.output_features}
    pre, post = make_smolvla_pre_post_processors(
        cfg, dataset_stats=checkpoints._stats(g, features)
    )
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    print(f"checkpoint: {params:,} parameters")
    return out


def timed(cmd: list[str]) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """Wall seconds, peak RSS and peak anonymous memory (GB) of `cmd` itself, polled from /proc
    every 50 ms (anonymous alone: files mapped by onnxruntime or safetensors count in RSS as
    clean pages the kernel can drop)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = anon = 0
    while proc.poll() is None:
        try:
            peak = max(peak, _kb(proc.pid, "VmHWM"))
            anon = max(anon, _kb(proc.pid, "RssAnon"))
        except OSError:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return time.monotonic() - t0, peak / 1e6, anon / 1e6, r


def _kb(pid: int, field: str) -> int:
    """A /proc/PID/status field (VmHWM, VmRSS) in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _percentiles(ms: list[float]) -> str:
    s = sorted(ms)
    p50 = s[len(s) // 2]
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return f"p50 {p50:.0f} ms, p99 {p99:.0f} ms (n = {len(s)})"


def serve_rows(policyd: str, bundle: Path, ckpt: Path, n: int) -> None:
    """policyd on cpu and ort at 1 and 2 threads, then LeRobot's torch path, same inputs."""
    import numpy as np
    import onnxruntime
    import torch
    from openpi_client import websocket_client_policy
    from policyd_export.bundle import read_manifest
    from policyd_export.checkpoint import load
    from policyd_export.reference import Reference
    from policyd_export.verify import observations, served

    ck = load(ckpt)
    manifest = read_manifest(bundle)
    obs = observations(ck, n + 1, seed=0, prompt_key=manifest.get("prompt_key"))
    base = tomllib.loads((bundle / "policyd.toml").read_text())
    capi = Path(onnxruntime.__file__).parent / "capi"
    ort_library = max(glob.glob(str(capi / "libonnxruntime.so.*")))
    for backend in ("cpu", "ort"):
        for threads in (1, 2):
            cfg = json.loads(json.dumps(base))
            cfg["engine"].update(backend=backend, threads=threads)
            if backend == "ort":
                cfg["engine"]["ort_library"] = ort_library
            path = bundle / f"bench-{backend}-{threads}.toml"
            path.write_text(tomli_w.dumps(cfg))
            t0 = time.monotonic()
            with served(policyd, path, timeout=900) as (port, pid):
                ready = time.monotonic() - t0
                load_peak = _kb(pid, "VmHWM") / 1e6
                client = websocket_client_policy.WebsocketClientPolicy(port=port)
                ms = []
                for i, o in enumerate(obs):
                    t = time.monotonic()
                    client.infer(dict(o))
                    if i:
                        ms.append((time.monotonic() - t) * 1e3)
                serve_peak = _kb(pid, "VmHWM") / 1e6
                print(
                    f"policyd {backend}, {threads} thread(s): ready in {ready:.1f} s, peak RSS "
                    f"{load_peak:.2f} GB loading, {serve_peak:.2f} GB serving; per chunk "
                    f"{_percentiles(ms)}",
                    flush=True,
                )
    ref = Reference(ck)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        ref.actions(obs[0])
        ms = []
        for o in obs[1:]:
            t = time.monotonic()
            np.asarray(ref.actions(o))
            ms.append((time.monotonic() - t) * 1e3)
        print(
            f"LeRobot torch, {threads} thread(s): per chunk {_percentiles(ms)}; process peak "
            f"RSS {_kb(os.getpid(), 'VmHWM') / 1e6:.2f} GB",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    ap.add_argument(
        "--serve", type=int, default=0, help="chunks to time per backend (0: none)"
    )
    args = ap.parse_args()
    exe = Path(sys.executable).parent / "policyd-export"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        vlm = real_smolvlm(tmp / "vlm")
        ckpt = smolvla(tmp / "checkpoint", vlm)
        bundle = tmp / "bundle"
        secs, peak, _, r = timed([str(exe), "lerobot", str(ckpt), "--out", str(bundle)])
        print(f"export: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB")
        if r.returncode:
            raise SystemExit(r.stderr)
        size = sum(f.stat().st_size for f in bundle.glob("*.onnx*"))
        engine = tomllib.loads((bundle / "policyd.toml").read_text())["engine"]
        print(f"bundle: graphs {size / 1e9:.2f} GB; [engine] {engine}")
        secs, peak, _, r = timed(
            [args.policyd, "check-config", str(bundle / "policyd.toml")]
        )
        print(
            f"check-config: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB"
        )
        lines = r.stdout.splitlines()
        print(
            "\n".join(
                line for line in lines if "total" in line or "intermediate" in line
            )
        )
        # Issue 36's bound: 1.25 × the weights plus the plan's buffers (the budget's other
        # lines: slots, connections, tokenizer, the engine's intermediate tensors).
        weights = next(
            int(x.rsplit("= ", 1)[1]) for x in lines if "weights as stored" in x
        )
        total = next(
            int(x.split("= ", 1)[1].split()[0]) for x in lines if "total = " in x
        )
        bound = 1.25 * weights + (total - weights)
        print(
            f"bound: 1.25 × {weights / 1e9:.3f} GB + {(total - weights) / 1e9:.3f} GB = "
            f"{bound / 1e9:.2f} GB"
        )
        secs, peak, _, r = timed(
            [str(exe), "verify", str(bundle), str(ckpt), "--policyd", args.policyd]
            + ["--observations", "2"]
        )
        print(f"verify: exit {r.returncode}, {secs:.0f} s")
        print(r.stdout[-1500:])
        if args.serve:
            serve_rows(args.policyd, bundle, ckpt, args.serve)


if __name__ == "__main__":
    main()

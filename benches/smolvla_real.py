"""SmolVLA at its real geometry, exported, checked and verified against LeRobot with no edits
to the bundle (issue 36): the export's time and peak memory, `check-config`, and `verify`,
which failed on policyd's default `engine.timeout_ms` before the exporter sized it.

The VLM is written offline from SmolVLM2-500M's published config (SmolLM2's 960-wide, 32-layer
text model, of which SmolVLA keeps 16; SigLIP's 768-wide, 12-layer vision model at 512×512),
with random weights and the tests' byte-level tokenizer; the checkpoint is LeRobot 0.6.1's
SmolVLA default over it (chunk 50, two 480×640 cameras), with statistics far from identity.

    .venv-export/bin/python benches/smolvla_real.py --policyd target/release/policyd

Prints what it measured (docs/benchmarks.md, "SmolVLA at its real size").
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

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


def timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds and the peak RSS (GB) of `cmd` itself, polled from /proc every 50 ms."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            hwm = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
            peak = max(peak, int(hwm.split()[1]))
        except (OSError, StopIteration):
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return time.monotonic() - t0, peak / 1e6, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policyd", default=str(ROOT / "target/release/policyd"))
    args = ap.parse_args()
    exe = Path(sys.executable).parent / "policyd-export"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        vlm = real_smolvlm(tmp / "vlm")
        ckpt = smolvla(tmp / "checkpoint", vlm)
        bundle = tmp / "bundle"
        secs, peak, r = timed([str(exe), "lerobot", str(ckpt), "--out", str(bundle)])
        print(f"export: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB")
        if r.returncode:
            raise SystemExit(r.stderr)
        size = sum(f.stat().st_size for f in bundle.glob("*.onnx*"))
        engine = tomllib.loads((bundle / "policyd.toml").read_text())["engine"]
        print(f"bundle: graphs {size / 1e9:.2f} GB; [engine] {engine}")
        secs, peak, r = timed(
            [args.policyd, "check-config", str(bundle / "policyd.toml")]
        )
        print(
            f"check-config: exit {r.returncode}, {secs:.0f} s, peak RSS {peak:.2f} GB"
        )
        print("\n".join(line for line in r.stdout.splitlines() if "total" in line))
        secs, peak, r = timed(
            [str(exe), "verify", str(bundle), str(ckpt), "--policyd", args.policyd]
            + ["--observations", "2"]
        )
        print(f"verify: exit {r.returncode}, {secs:.0f} s")
        print(r.stdout[-1500:])


if __name__ == "__main__":
    main()

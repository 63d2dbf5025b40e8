"""The `policyd-export` command.

    policyd-export lerobot CHECKPOINT_DIR --out BUNDLE_DIR [--force]
    policyd-export openpi CHECKPOINT_DIR --config NAME --out BUNDLE_DIR [--norm-stats DIR]
                          [--frame-size HxW]
    policyd-export verify BUNDLE_DIR CHECKPOINT_DIR [--policyd PATH] [--norm-stats FILE]
                          [--no-rtc]
    policyd-export rewrite IN.onnx OUT.onnx

Exit status: 0 done, 1 verify found a difference, 2 bad input (the message says what to fix).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .errors import ExportError
from .registry import SUPPORTED
from .remote_code import FLAG, guard

SUPPORTED_HELP = f"supported policy types: {', '.join(SUPPORTED)}"


def _lerobot(args: argparse.Namespace) -> int:
    from . import bundle
    from .checkpoint import load
    from .families import Request, export

    start = time.monotonic()
    ckpt = load(args.checkpoint)
    out = Path(args.out)
    tmp = bundle.prepare(out, args.force)
    try:
        tokenizer = Path(args.tokenizer) if args.tokenizer else None
        request = Request(
            tmp,
            verbose=args.verbose,
            tokenizer=tokenizer,
            base=Path(args.base) if args.base else None,
            vlm=Path(args.vlm) if args.vlm else None,
        )
        exported = export(ckpt, request)
        bundle.write(tmp, bundle.lerobot_source(ckpt, args.lerobot_name), exported)
        bundle.commit(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"exported the LeRobot {ckpt.type} policy in {time.monotonic() - start:.1f} s to {out}/")
    for g in exported.graphs:
        rewrites = f"; tract rewrites: {', '.join(g.rewrites)}" if g.rewrites else ""
        print(
            f"  {g.file}: {', '.join(g.inputs)} -> {', '.join(g.outputs)}; onnxruntime vs "
            f"torch max abs diff {g.max_abs_diff:.2e}{rewrites}"
        )
    print(f"  {bundle.CONFIG}, {bundle.TRT_CONFIG}, {bundle.TRT_SCRIPT}, {bundle.MANIFEST}")
    print(f"next: policyd check-config {out / bundle.CONFIG}")
    print(f"      policyd-export verify {out} {args.checkpoint}")
    return 0


def _frame_size(text: str) -> tuple[int, int]:
    """`480x640` → (480, 640)."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give HEIGHTxWIDTH, e.g. 480x640") from None
    return h, w


def _openpi(args: argparse.Namespace) -> int:
    from . import bundle, openpi

    start = time.monotonic()
    ckpt = openpi.load(
        args.checkpoint,
        args.config,
        Path(args.norm_stats) if args.norm_stats else None,
        args.frame_size,
    )
    out = Path(args.out)
    tmp = bundle.prepare(out, args.force)
    try:
        tokenizer = Path(args.tokenizer) if args.tokenizer else None
        exported = openpi.export(ckpt, tmp, verbose=args.verbose, tokenizer=tokenizer)
        bundle.write(tmp, openpi.source(ckpt), exported)
        bundle.commit(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(
        f"exported openpi's {ckpt.config.name} checkpoint in {time.monotonic() - start:.1f} s "
        f"to {out}/ (norm stats: {ckpt.norm_stats})"
    )
    for g in exported.graphs:
        print(f"  {g.file}: onnxruntime vs torch max abs diff {g.max_abs_diff:.2e}")
    print(f"next: policyd check-config {out / bundle.CONFIG}")
    print(f"      policyd-export verify {out} {args.checkpoint}")
    print(f"      policyd --config {out / bundle.CONFIG}   (openpi's clients, port 8000)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .verify import table, verify

    rows = verify(
        Path(args.bundle),
        Path(args.checkpoint),
        policyd=args.policyd,
        n=args.observations,
        rtol=args.rtol,
        norm_stats=Path(args.norm_stats) if args.norm_stats else None,
        rtc=not args.no_rtc,
    )
    print(table(rows))
    failed = [r for r in rows if not r.ok]
    if failed:
        print(f"verify: {len(failed)} of {len(rows)} checks failed", file=sys.stderr)
        return 1
    print(f"verify: all {len(rows)} checks passed")
    return 0


def _rewrite(args: argparse.Namespace) -> int:
    import onnx

    from . import rewrite

    src = Path(args.input)
    if not src.is_file():
        raise ExportError(f"{src}: no such ONNX file")
    try:
        model = onnx.load(str(src))
    except Exception as e:
        raise ExportError(f"{src}: not an ONNX model ({e})") from e
    rewritten, report = rewrite.rewrite(model)
    out = Path(args.output)
    rewrite.save(rewritten, out)
    for line in report.lines():
        print(line)
    if report.total():
        diff = rewrite.check_same(src, out, rewrite.random_feeds(src))
        print(f"onnxruntime, original vs rewritten, max abs diff: {diff:.2e}")
        if diff > 1e-4:
            print("rewrite: the rewritten graph differs; do not use it", file=sys.stderr)
            return 1
    return 0


def _trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        FLAG,
        action="store_true",
        help="let transformers import Python that came with the checkpoint or a model it names "
        "(an `auto_map` in their configs); refused by default",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="policyd-export",
        description="Turn LeRobot and openpi checkpoints into policyd bundles and check them.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "lerobot",
        help="export a LeRobot checkpoint directory into a bundle",
        description=f"Export a LeRobot pretrained_model directory ({SUPPORTED_HELP}).",
    )
    e.add_argument(
        "checkpoint",
        help="what save_pretrained wrote: config.json, "
        "model.safetensors, policy_{pre,post}processor*.json and their stats",
    )
    e.add_argument("--out", required=True, help="the bundle directory to write")
    e.add_argument("--force", action="store_true", help="replace --out if it exists")
    e.add_argument("--verbose", action="store_true", help="show the ONNX exporter's output")
    e.add_argument(
        "--tokenizer",
        help="pi0: the tokenizer's directory (or its tokenizer.model), when the checkpoint "
        "names one that is neither a local directory nor in the Hugging Face cache",
    )
    e.add_argument(
        "--base",
        help="groot: the base model's directory (its config.json: the network's sizes; its "
        "weights are not read), when base_model_path is neither a local directory nor cached",
    )
    e.add_argument(
        "--vlm",
        help="groot: the VLM's directory (tokenizer.json, chat template, image processor "
        "config), when the checkpoint's VLM is neither a local directory nor cached",
    )
    e.add_argument(
        "--lerobot-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a pretrained_name_or_path LeRobot's robot_client may ask for (its "
        "--policy.pretrained_name_or_path, e.g. a Hub id); repeatable. The checkpoint's own "
        "path, and its Hub id when it lies in the Hugging Face cache, are always mapped",
    )
    _trust_flag(e)
    e.set_defaults(run=_lerobot)
    o = sub.add_parser(
        "openpi",
        help="export an openpi PyTorch checkpoint (pi0, pi0.5) into a bundle",
        description="Export a checkpoint openpi's convert_jax_model_to_pytorch.py wrote, with "
        "the transforms of the openpi training config that made it (see docs/openpi.md).",
    )
    o.add_argument("checkpoint", help="model.safetensors, config.json (and assets/)")
    o.add_argument(
        "--config", required=True, help="openpi's training config name, e.g. pi05_libero"
    )
    o.add_argument("--out", required=True, help="the bundle directory to write")
    o.add_argument(
        "--norm-stats",
        help="norm_stats.json, or a directory holding it (or <asset_id>/norm_stats.json); "
        "default: CHECKPOINT/assets/<asset_id>/",
    )
    o.add_argument(
        "--tokenizer",
        help="paligemma_tokenizer.model (default: openpi's ~/.cache/openpi/big_vision/ copy)",
    )
    o.add_argument(
        "--frame-size",
        type=_frame_size,
        default=(224, 224),
        metavar="HxW",
        help="the size every camera sends (default 224x224, what openpi's clients send); "
        "another size is resized in the graph as openpi's ResizeImages does",
    )
    o.add_argument("--force", action="store_true", help="replace --out if it exists")
    o.add_argument("--verbose", action="store_true", help="show the ONNX exporter's output")
    o.set_defaults(run=_openpi)
    v = sub.add_parser(
        "verify",
        help="serve a bundle with policyd and compare its actions with LeRobot's (or openpi's)",
        description="Serve BUNDLE with policyd, send observations with openpi-client, and "
        "compare each reply with LeRobot's own inference from CHECKPOINT (for a bundle of an "
        "openpi checkpoint: openpi's pipeline, re-implemented from openpi's source, around "
        "the same weights). Exit 1 on a difference past the tolerance.",
    )
    v.add_argument("bundle")
    v.add_argument("checkpoint")
    v.add_argument("--policyd", help="the policyd binary (default: $POLICYD_BIN, then PATH)")
    v.add_argument("--observations", type=int, default=4, help="observations sent (default 4)")
    v.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="tolerance relative to the largest action magnitude (default 1e-4)",
    )
    v.add_argument(
        "--norm-stats",
        help="an openpi bundle's norm_stats.json (default: the file the export read)",
    )
    v.add_argument(
        "--no-rtc",
        action="store_true",
        help="skip the real-time chunking checks (four more servers; on by default for a "
        "flow bundle whose actions are not relative)",
    )
    _trust_flag(v)
    v.set_defaults(run=_verify)
    r = sub.add_parser(
        "rewrite",
        help="apply the tract rewrites (R1-R3) to any ONNX file",
        description="Rewrite the graph patterns tract-onnx 0.23 cannot run (CumSum over an "
        "int64 Cast, MatMul over a Concat with an Expand) or runs slowly (Pow(x, 3)), and "
        "check the result equals the original in onnxruntime.",
    )
    r.add_argument("input")
    r.add_argument("output")
    r.set_defaults(run=_rewrite)
    return p


def main(argv: list[str] | None = None) -> int:
    # Nothing is ever fetched: a checkpoint is a local directory.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parser().parse_args(argv)
    try:
        with guard(getattr(args, "trust_remote_code", False)):
            code: int = args.run(args)
        return code
    except ExportError as e:
        print(f"policyd-export: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""A bundle: everything policyd needs to serve one exported policy, in one directory.

    policyd.toml            the CPU config (`policyd --config BUNDLE/policyd.toml`)
    *.onnx                  the graphs (weights in `<graph>.onnx.data` past 256 MB)
    policyd.tensorrt.toml   the same policy on TensorRT plans, once built on the board
    build-plans.sh          trtexec commands that build those plans (run on the Jetson)
    export.json             what was exported and checked (read by `policyd-export verify`)

The bundle is written into a temporary directory beside the target and renamed into place, so
a failed export leaves nothing behind.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import tomli_w

from . import __version__
from .checkpoint import Checkpoint
from .errors import ExportError, read_json
from .families import Exported, Signature

MANIFEST = "export.json"
CONFIG = "policyd.toml"
TRT_CONFIG = "policyd.tensorrt.toml"
TRT_SCRIPT = "build-plans.sh"


class ManifestInput(TypedDict):
    """One feature the bundle reads: its LeRobot key, the request key, its type and shape."""

    feature: str
    key: str
    type: str
    shape: list[int]


class GraphRecord(TypedDict):
    """One exported graph (`graphs.Graph`, as written)."""

    file: str
    inputs: list[str]
    outputs: list[str]
    max_abs_diff: float
    rewrites: list[str]
    seconds: float
    run_seconds: float


class Manifest(Signature):
    """`manifest.json`: what `policyd-export verify` needs to rebuild LeRobot's side of the
    comparison (the checkpoint, its inputs, the graphs) and the family's signature."""

    exporter: str
    checkpoint: str
    policy_type: str
    inputs: list[ManifestInput]
    graphs: list[GraphRecord]


def prepare(out: Path, force: bool) -> Path:
    """A fresh temporary directory beside `out`; `out` itself may exist only with `force`."""
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def commit(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    out.chmod(0o755)


def _toml(header: str, body: dict[str, Any]) -> str:
    lines = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    return lines + "\n" + tomli_w.dumps(body)


def lerobot_names(path: Path, extra: list[str]) -> list[str]:
    """The names LeRobot's robot_client may send as `pretrained_name_or_path` for this
    checkpoint: `extra`, its resolved path, and its Hub id if it lies in the Hugging Face cache
    (`.../models--user--name/snapshots/<revision>/...`)."""
    names = list(extra)
    resolved = path.resolve()
    names.append(str(resolved))
    for part in resolved.parts:
        if part.startswith("models--"):
            names.append(part.removeprefix("models--").replace("--", "/", 1))
            break
    return list(dict.fromkeys(names))


#: policyd's default `engine.timeout_ms`, and how many measured chunks a bundle's allows.
DEFAULT_TIMEOUT_MS = 10_000
TIMEOUT_CHUNKS = 10


def chunk_seconds(exported: Exported) -> float:
    """One chunk as measured at export with onnxruntime on this machine: each graph once, a
    pipeline's step graph once per default sampler step."""
    step = exported.config.get("denoise", {}).get("model")
    steps = int(exported.config.get("sampler", {}).get("steps", 1))
    return sum(g.run_seconds * (steps if g.file == step else 1) for g in exported.graphs)


def sized_engine(exported: Exported) -> tuple[dict[str, Any], str]:
    """`[engine]` with the keys that depend on a chunk's time, and the header lines that say
    so: `timeout_ms` (a run longer marks the engine stalled) at ten measured chunks and at
    least policyd's default; one warm-up run instead of three for a chunk past a second."""
    chunk = chunk_seconds(exported)
    engine = dict(exported.config["engine"])
    # Whole seconds, rounded up.
    timeout = max(DEFAULT_TIMEOUT_MS, math.ceil(chunk * TIMEOUT_CHUNKS) * 1000)
    engine["timeout_ms"] = timeout
    note = (
        f"engine.timeout_ms = {timeout}: one chunk took {chunk * 1000:.0f} ms with onnxruntime on\n"
        f"the exporting machine; the timeout allows {TIMEOUT_CHUNKS} such chunks (and at least "
        f"policyd's default,\n{DEFAULT_TIMEOUT_MS} ms). Raise it for a slower board."
    )
    if chunk > 1.0:
        engine["warmup_runs"] = 1
        note += (
            "\nengine.warmup_runs = 1: a chunk takes seconds, so one warm-up run, not three.\n"
            "Under systemd, a chunk longer than the unit's WatchdogSec= (5 s) restarts the\n"
            "service: raise WatchdogSec= (sudo systemctl edit policyd) above the chunk time."
        )
    return engine, note


@dataclass
class Source:
    """What a bundle was exported from, as its config header and manifest say it."""

    path: Path
    #: The manifest's `policy_type` (a LeRobot type, or `openpi/<config>`).
    policy_type: str
    #: "the LeRobot pi0 checkpoint", "openpi's pi05_libero checkpoint".
    describe: str
    #: Header lines on the request keys and the normalisation.
    serving: str
    inputs: list[ManifestInput]
    #: `[[lerobot.serve]]` entries: LeRobot's robot_client reaches the policy over its gRPC
    #: service (None: a bundle no LeRobot client can describe, e.g. openpi's).
    lerobot: list[dict[str, str]] | None


def lerobot_source(ckpt: Checkpoint, client_names: list[str] | None = None) -> Source:
    """A LeRobot checkpoint as a bundle's source: its features, and the names its
    robot_client may ask for."""
    return Source(
        path=ckpt.path,
        policy_type=ckpt.type,
        describe=f"the LeRobot {ckpt.type} checkpoint",
        serving=(
            "Request keys are the LeRobot observation names, images uint8 HWC at the checkpoint's\n"
            "resolution. Normalisation is the checkpoint's own (policy_preprocessor /\n"
            "policy_postprocessor statistics).\n"
        ),
        inputs=[
            {
                "feature": f.key,
                "key": ckpt.wire_keys.get(f.key, f.key),
                "type": f.type,
                "shape": list(f.shape),
            }
            for f in ckpt.inputs
        ],
        lerobot=[
            {"pretrained": n, "policy_type": ckpt.type}
            for n in lerobot_names(ckpt.path, client_names or [])
        ],
    )


def write(tmp: Path, source: Source, exported: Exported) -> None:
    """Writes the configs, the TensorRT script and the manifest next to the graphs in `tmp`."""
    engine, timing = sized_engine(exported)
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 8000},
        **exported.config,
        "engine": engine,
    }
    lerobot = ""
    if source.lerobot is not None:
        # On LeRobot's port and only from this machine until the operator opens it (the
        # service has no authentication).
        config["lerobot"] = {"listen": "127.0.0.1:8080", "serve": source.lerobot}
        lerobot = (
            "LeRobot's robot_client connects to [lerobot] listen (127.0.0.1:8080: this machine\n"
            "only; set 0.0.0.0:8080 and lerobot.allow for a robot on the network) with one of the\n"
            "[[lerobot.serve]] names as --policy.pretrained_name_or_path (see docs/lerobot.md).\n"
        )
    header = (
        f"policyd config written by policyd-export {__version__} from {source.describe}\n"
        f"{source.path.resolve()}\n"
        "Serve it with `policyd --config policyd.toml`.\n" + source.serving + lerobot + timing
    )
    graphs = [g.file for g in exported.graphs]
    (tmp / CONFIG).write_text(_toml(header, config) + exported.config_tail)
    trt = copy.deepcopy(config)
    trt["engine"].update(backend="tensorrt", model=_plan(trt["engine"]["model"]))
    if "denoise" in trt:
        trt["denoise"]["model"] = _plan(trt["denoise"]["model"])
    trt_header = (
        "The same policy on TensorRT: build the plans on the board first (./build-plans.sh),\n"
        "then `policyd --config policyd.tensorrt.toml` (a policyd built with --features "
        "tensorrt)."
    )
    (tmp / TRT_CONFIG).write_text(_toml(trt_header, trt) + exported.config_tail)
    script = [
        "#!/bin/sh",
        "# Builds this bundle's TensorRT plans with trtexec on the Jetson that will serve them",
        "# (a plan is specific to its GPU and TensorRT version). TRTEXEC overrides the path;",
        "# extra arguments go to every trtexec call (e.g. --memPoolSize=workspace:2048M).",
        "set -eu",
        'cd "$(dirname "$0")"',
        "TRTEXEC=${TRTEXEC:-$(command -v trtexec || echo /usr/src/tensorrt/bin/trtexec)}",
    ]
    for g in graphs:
        flags = " ".join(exported.trt_flags.get(g, []))
        script.append(
            f'"$TRTEXEC" --onnx={g} --saveEngine={_plan(g)} {flags} "$@"'.replace("  ", " ")
        )
    script.append('echo "plans built; serve with: policyd --config policyd.tensorrt.toml"')
    (tmp / TRT_SCRIPT).write_text("\n".join(script) + "\n")
    (tmp / TRT_SCRIPT).chmod(0o755)
    manifest: Manifest = {
        "exporter": __version__,
        "checkpoint": str(source.path.resolve()),
        "policy_type": source.policy_type,
        "inputs": source.inputs,
        "graphs": [
            GraphRecord(
                file=g.file,
                inputs=g.inputs,
                outputs=g.outputs,
                max_abs_diff=g.max_abs_diff,
                rewrites=g.rewrites,
                seconds=g.seconds,
                run_seconds=g.run_seconds,
            )
            for g in exported.graphs
        ],
        **exported.manifest,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _plan(onnx_file: str) -> str:
    return onnx_file.removesuffix(".onnx") + ".plan"


def read_manifest(bundle: Path) -> Manifest:
    path = bundle / MANIFEST
    if not path.is_file():
        raise ExportError(f"{bundle}: not a policyd-export bundle (no {MANIFEST})")
    manifest: Manifest = read_json(path, "the bundle's manifest")
    return manifest

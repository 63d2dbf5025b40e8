"""One module per LeRobot policy family: which graphs it splits into and how policyd serves them.

Each family's `export(ckpt, policy, out)` writes its graphs into `out` and returns an
[`Exported`]: the policyd config (as a dict), its TensorRT twin, the trtexec commands, and a
manifest that `policyd-export verify` reads to drive the comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch
from torch import nn

from ..checkpoint import Checkpoint
from ..errors import ExportError
from ..graphs import Graph
from ..remote_code import check_dir, resolve

#: A TOML table as written: the bundle's `policyd.toml` and its sections.
Table = dict[str, Any]


class Noise(TypedDict):
    """The sampler's starting noise: the step graph's input it feeds, and its shape."""

    tensor: str
    shape: list[int]


class Signature(TypedDict):
    """What a family tells `verify` about its graphs: the chunk it returns, the observations
    it stacks, and, for a sampled policy, the noise and the sampler to replay LeRobot's run."""

    family: str
    horizon: int
    action_dim: int
    n_obs_steps: int
    noise: NotRequired[Noise]
    sampler: NotRequired[Table]
    #: The request key of the prompt (a VLA's task).
    prompt_key: NotRequired[str]
    #: openpi: the `norm_stats.json` the export read (verify reads it again).
    norm_stats: NotRequired[str]


@dataclass
class Exported:
    config: Table
    graphs: list[Graph]
    #: What verify needs besides the inputs (see `bundle.Manifest`).
    manifest: Signature
    #: Per graph file: the trtexec precision flags (the script builds `<name>.plan`).
    trt_flags: dict[str, list[str]] = field(default_factory=dict)
    #: Text after the config's tables: `[rtc]` commented out, where the bundle has none.
    config_tail: str = ""

    def with_rtc(self, source: dict[str, Any], ramp_rate: float | None = None) -> Exported:
        """A flow bundle's `[rtc]` from its checkpoint's config (`rtc.table`), else the
        table commented out (`rtc.commented`)."""
        from .. import rtc

        groot = self.config["sampler"].get("flow_time") == "groot"
        rows = int(self.manifest["horizon"])
        table = rtc.table(source, groot, rows)
        if table is not None:
            self.config["rtc"] = table
        else:
            self.config_tail = rtc.commented(groot, rows, ramp_rate)
        return self


def flow_pipeline(
    family: str,
    graphs: list[Graph],
    prefix_out: list[str],
    inputs: list[Table],
    output: Table,
    metadata: Table,
    *,
    steps: int,
    flow_time: str,
    horizon: int,
    max_action: int,
    action_dim: int,
    prompt_key: str,
) -> Exported:
    """A VLA's `prefix.onnx` and `step.onnx` under policyd's flow sampler (pi0, pi0.5, SmolVLA,
    openpi's pi0 and pi0.5): the step graph reads `x_t`, `time` and the prefix's outputs and
    returns `v_t`; a request may ask for up to four times the default steps. TensorRT in BF16:
    Gemma's attention overflows in plain FP16 (pi0.5 above all, docs/export.md)."""
    sampler = {
        "kind": "flow",
        "steps": steps,
        "max_steps": max(steps, 4 * steps),
        "x": "x_t",
        "time": "time",
        "output": "v_t",
        "flow_time": flow_time,
    }
    config: Table = {
        "engine": {"backend": "cpu", "model": "prefix.onnx"},
        "denoise": {"model": "step.onnx", "wire": {n: n for n in prefix_out}},
        "sampler": sampler,
        "inputs": inputs,
        "outputs": [output],
        "metadata": metadata,
    }
    manifest: Signature = {
        "family": family,
        "horizon": horizon,
        "action_dim": action_dim,
        "n_obs_steps": 1,
        "noise": {"tensor": "x_t", "shape": [horizon, max_action]},
        "sampler": sampler,
        "prompt_key": prompt_key,
    }
    flags = {"prefix.onnx": ["--bf16"], "step.onnx": ["--bf16"]}
    return Exported(config, graphs, manifest, flags)


def lerobot_flow(
    family: str,
    cfg: Any,  # a LeRobot PreTrainedConfig (untyped)
    steps: int,
    graphs: list[Graph],
    prefix_out: list[str],
    inputs: list[Table],
    output: Table,
    prompt_key: str,
) -> Exported:
    """`flow_pipeline` for a LeRobot VLA (pi0, pi0.5, SmolVLA): LeRobot's flow time, its
    config's chunk, and the metadata LeRobot's clients read."""
    chunk = int(cfg.chunk_size)
    action_dim = int(output["columns"])
    metadata = {
        "policy_type": family,
        "action_horizon": chunk,
        "action_dim": action_dim,
        "n_action_steps": int(cfg.n_action_steps),
    }
    return flow_pipeline(
        family,
        graphs,
        prefix_out,
        inputs,
        output,
        metadata,
        steps=steps,
        flow_time="lerobot",
        horizon=chunk,
        max_action=int(cfg.max_action_dim),
        action_dim=action_dim,
        prompt_key=prompt_key,
    )


OBS_STATE = "observation.state"
OBS_ENV_STATE = "observation.environment_state"


class FlatInputs(nn.Module):
    """A LeRobot module over flat tensors: the graph's inputs in `keys` order, put back into
    the batch dict LeRobot's code reads, the cameras (`images`) under `observation.images`,
    as a list (ACT) or stacked on dim −4 (Diffusion: `[B, n_obs, n_cam, C, H, W]`)."""

    def __init__(
        self,
        run: Callable[[dict[str, Any]], torch.Tensor],
        keys: list[str],
        images: list[str],
        stack: bool,
    ):
        super().__init__()
        self.run = run  # a bound method of a LeRobot module (registered through its owner)
        self.keys = keys
        self.images = images
        self.stack = stack

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.keys, xs, strict=True))
        batch: dict[str, Any] = {k: v for k, v in named.items() if k not in self.images}
        if self.images:
            cams = [named[k] for k in self.images]
            batch["observation.images"] = torch.stack(cams, dim=-4) if self.stack else cams
        return self.run(batch)


def local_file(name: str, file: str, ckpt_dir: Path) -> Path | None:
    """`file` of a model named `name` by the checkpoint in `ckpt_dir`: in `name` if it is a
    directory (a relative name against `ckpt_dir`, never the current directory), else in the
    local Hugging Face cache (nothing is downloaded); None when it is in neither."""
    directory = resolve(name, ckpt_dir)
    if directory is not None:
        path = directory / file
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, file)
    except Exception:  # an unusual name is just not in the cache
        return None
    return Path(cached) if isinstance(cached, str) and Path(cached).is_file() else None


def load_policy(ckpt: Checkpoint) -> Any:  # a LeRobot PreTrainedPolicy (LeRobot is untyped)
    """The checkpoint's policy through LeRobot's own `from_pretrained`, on the CPU, in eval mode.

    Backbone weights named by the config (ImageNet's ResNet18 for a trained ACT) would be
    downloaded when the model is built, only to be replaced by the checkpoint's: they are not
    asked for."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class

    try:
        cfg = PreTrainedConfig.from_pretrained(str(ckpt.path))
    except Exception as e:
        raise ExportError(f"{ckpt.path / 'config.json'}: LeRobot cannot read it: {e}") from e
    if getattr(cfg, "pretrained_backbone_weights", None):
        cfg.pretrained_backbone_weights = None
    # SmolVLA builds its VLM from this name's config.json (transformers would read a relative
    # name against the current directory): resolved against the checkpoint's, and checked.
    vlm = getattr(cfg, "vlm_model_name", None)
    if isinstance(vlm, str) and (found := resolve(vlm, ckpt.path)) is not None:
        check_dir(found, "the VLM's config")
        cfg.vlm_model_name = str(found)
    cfg.device = "cpu"
    try:
        policy = get_policy_class(ckpt.type).from_pretrained(str(ckpt.path), config=cfg)
    except Exception as e:
        raise ExportError(f"{ckpt.path}: LeRobot cannot load the policy: {e}") from e
    return policy.eval()


@dataclass(frozen=True)
class Request:
    """What an export is given besides the checkpoint: where to write it, and the files a
    family may need from the command line (pi0's tokenizer, GR00T's base and VLM)."""

    out: Path
    verbose: bool = False
    tokenizer: Path | None = None
    base: Path | None = None
    vlm: Path | None = None


#: A family's entry: every family module's `export` has this signature.
ExportFn = Callable[[Checkpoint, Request], Exported]


def export(ckpt: Checkpoint, request: Request) -> Exported:
    """Exports `ckpt` with the family [`registry`](..registry) names for its type."""
    import importlib

    from ..registry import family

    fam = family(ckpt.type)
    if ckpt.relative is not None and not fam.relative_actions:
        raise ExportError(
            f"{ckpt.path}: relative actions (relative_actions_processor) are exported for pi0 "
            f"and pi0.5, whose LeRobot processors apply them; {ckpt.type}'s do not"
        )
    entry: ExportFn = importlib.import_module(f"{__name__}.{fam.name}").export
    return entry(ckpt, request)

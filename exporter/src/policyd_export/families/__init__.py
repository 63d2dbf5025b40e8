"""One module per LeRobot policy family: which graphs it splits into and how policyd serves them.

Each family's `export(ckpt, policy, out)` writes its graphs into `out` and returns an
[`Exported`]: the policyd config (as a dict), its TensorRT twin, the trtexec commands, and a
manifest that `policyd-export verify` reads to drive the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import Checkpoint
from ..errors import ExportError
from ..graphs import Graph


@dataclass
class Exported:
    config: dict
    graphs: list[Graph]
    #: What verify needs: inputs (feature, wire key, type, shape), horizon, sampler, noise.
    manifest: dict
    #: Per graph file: the trtexec precision flags (the script builds `<name>.plan`).
    trt_flags: dict[str, list[str]] = field(default_factory=dict)


def load_policy(ckpt: Checkpoint):  # noqa: ANN201 (a LeRobot PreTrainedPolicy)
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
    cfg.device = "cpu"
    try:
        policy = get_policy_class(ckpt.type).from_pretrained(str(ckpt.path), config=cfg)
    except Exception as e:
        raise ExportError(f"{ckpt.path}: LeRobot cannot load the policy: {e}") from e
    return policy.eval()


def export(
    ckpt: Checkpoint, out: Path, verbose: bool = False, tokenizer: Path | None = None
) -> Exported:
    from . import act, diffusion, pi0

    policy = load_policy(ckpt)
    if ckpt.type in ("pi0", "pi05"):
        return pi0.export(ckpt, policy, out, verbose, tokenizer)
    family = {"act": act, "diffusion": diffusion}[ckpt.type]
    return family.export(ckpt, policy, out, verbose)

"""ACT: one graph, the normalised state and camera images in, the normalised action chunk out.

LeRobot's `ACTPolicy.predict_action_chunk` puts the cameras into a list in the config's order
and runs `ACT.forward`, which in eval mode uses a zero latent (no VAE encoder). The wrapper does
the same with flat tensors; policyd serves the whole chunk (`chunk_size` rows), as LeRobot's
async server sends `predict_action_chunk`'s output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import graphs
from ..bindings import input_binding, output_binding
from ..checkpoint import Checkpoint
from . import OBS_ENV_STATE, OBS_STATE, Exported, FlatInputs, Request, Signature, Table, load_policy


class Act(FlatInputs):
    """`ACT.forward` (eval: zero latent) over flat inputs: state, environment state, cameras."""

    def __init__(self, model: nn.Module, keys: list[str], images: list[str]):
        super().__init__(lambda batch: self.model(batch)[0], keys, images, stack=False)
        self.model: Any = model  # a LeRobot module (untyped)


def _export(ckpt: Checkpoint, policy: Any, out: Path, verbose: bool) -> Exported:
    cfg = policy.config
    images = list(cfg.image_features)
    vectors = [f for f in ckpt.inputs if f.type in ("STATE", "ENV")]
    for f in vectors:
        if f.key not in (OBS_STATE, OBS_ENV_STATE):
            from ..errors import ExportError

            raise ExportError(
                f"config.json: ACT reads {OBS_STATE} and {OBS_ENV_STATE} only; {f.key} would be "
                "ignored by LeRobot too: remove it from input_features"
            )
    by_key = {f.key: f for f in ckpt.inputs}
    keys = [f.key for f in vectors] + images
    gen = torch.Generator().manual_seed(0)
    args = tuple(
        torch.rand((1, *by_key[k].shape), generator=gen)
        if by_key[k].type == "VISUAL"
        else torch.randn((1, *by_key[k].shape), generator=gen)
        for k in keys
    )
    horizon, dim = cfg.chunk_size, ckpt.outputs[0].shape[0]
    graph = graphs.export(
        Act(policy.model, keys, images), args, keys, ["action"], out / "model.onnx", verbose
    )
    config: Table = {
        "engine": {"backend": "cpu", "model": "model.onnx"},
        "inputs": [input_binding(ckpt, by_key[k], k) for k in keys],
        "outputs": [output_binding(ckpt, "action")],
        "metadata": {
            "policy_type": "act",
            "action_horizon": horizon,
            "action_dim": dim,
            "n_action_steps": cfg.n_action_steps,
        },
    }
    manifest: Signature = {
        "family": "act",
        "horizon": horizon,
        "action_dim": dim,
        "n_obs_steps": 1,
    }
    # ACT in FP16 on Orin: 0.077 % RMSE against fp32 (docs/export.md).
    return Exported(config, [graph], manifest, {"model.onnx": ["--fp16"]})


def export(ckpt: Checkpoint, request: Request) -> Exported:
    """The family's entry ([`registry`](..registry)): ACT as one graph."""
    return _export(ckpt, load_policy(ckpt), request.out, request.verbose)

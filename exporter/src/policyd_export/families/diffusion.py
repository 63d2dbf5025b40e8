"""Diffusion Policy: the observation encoder and the U-Net step, served as a policyd pipeline.

LeRobot's `DiffusionModel.generate_actions` encodes `n_obs_steps` frames into one global
condition (`_prepare_global_conditioning`), runs the scheduler's loop over the U-Net
(`conditional_sample`), and keeps rows `[n_obs_steps − 1, n_obs_steps − 1 + n_action_steps)`.
Here the encoder is the pipeline's prefix graph, the U-Net its step graph, the loop policyd's
own DDPM/DDIM with the checkpoint's scheduler settings, and the slice `[[outputs]] rows`. The
frames come from policyd's per-session history (`[[inputs]] history = n_obs_steps`), filled on
a session's first observation as LeRobot's `populate_queues` fills its queues, so a client
sends one frame per request. A camera whose feature is larger than `resize_shape` enters the
encoder at its own size: the encoder's torchvision `Resize` (bilinear, antialiased) is traced
with it, an ONNX `Resize` with `antialias = 1` that tract and onnxruntime both honour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import graphs
from ..bindings import input_binding, output_binding
from ..checkpoint import Checkpoint
from ..errors import ExportError
from . import OBS_ENV_STATE, OBS_STATE, Exported, FlatInputs, Request, Signature, Table, load_policy


class Encoder(FlatInputs):
    """`_prepare_global_conditioning` over flat inputs, each `[1, n_obs_steps, ...]`."""

    def __init__(self, model: nn.Module, keys: list[str], images: list[str]):
        super().__init__(
            lambda batch: self.model._prepare_global_conditioning(batch), keys, images, stack=True
        )
        self.model: Any = model  # a LeRobot module (untyped)


class Step(nn.Module):
    """One U-Net evaluation: the noisy sample, the integer timestep, the global condition."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet: Any = unet  # a LeRobot module (untyped)

    def forward(
        self, x: torch.Tensor, timestep: torch.Tensor, global_cond: torch.Tensor
    ) -> torch.Tensor:
        eps: torch.Tensor = self.unet(x, timestep, global_cond=global_cond)
        return eps


def sampler(cfg: Any) -> dict[str, Any]:  # cfg: a LeRobot DiffusionConfig
    """policyd's `[sampler]` from the checkpoint's scheduler settings (diffusers' defaults for
    the rest: set_alpha_to_one, steps_offset 0, "leading" spacing, fixed_small variance)."""
    kind = {"DDPM": "ddpm", "DDIM": "ddim"}.get(cfg.noise_scheduler_type)
    if kind is None:
        raise ExportError(
            f"config.json: noise_scheduler_type {cfg.noise_scheduler_type!r}; policyd runs DDPM "
            "and DDIM"
        )
    train = int(cfg.num_train_timesteps)
    steps = int(cfg.num_inference_steps or train)
    return {
        "kind": kind,
        "steps": steps,
        "max_steps": min(train, 1000),
        "x": "x",
        "time": "timestep",
        "output": "noise_pred",
        "num_train_timesteps": train,
        "beta_schedule": cfg.beta_schedule,
        "beta_start": float(cfg.beta_start),
        "beta_end": float(cfg.beta_end),
        "prediction_type": cfg.prediction_type,
        "clip_sample": bool(cfg.clip_sample),
        "clip_sample_range": float(cfg.clip_sample_range),
    }


def _export(ckpt: Checkpoint, policy: Any, out: Path, verbose: bool) -> Exported:
    cfg = policy.config
    model = policy.diffusion
    n_obs = int(cfg.n_obs_steps)
    images = list(cfg.image_features)
    by_key = {f.key: f for f in ckpt.inputs}
    vectors = [k for k in (OBS_STATE, OBS_ENV_STATE) if k in by_key]
    for f in ckpt.inputs:
        if f.type != "VISUAL" and f.key not in vectors:
            raise ExportError(
                f"config.json: Diffusion Policy reads {OBS_STATE} and {OBS_ENV_STATE}; {f.key} "
                "would be ignored by LeRobot too: remove it from input_features"
            )
    keys = vectors + images
    gen = torch.Generator().manual_seed(0)
    args = tuple(
        torch.rand((1, n_obs, *by_key[k].shape), generator=gen)
        if by_key[k].type == "VISUAL"
        else torch.randn((1, n_obs, *by_key[k].shape), generator=gen)
        for k in keys
    )
    encoder = graphs.export(
        Encoder(model, keys, images), args, keys, ["global_cond"], out / "encoder.onnx", verbose
    )
    with torch.no_grad():
        cond = Encoder(model, keys, images)(*args)
    horizon, dim = int(cfg.horizon), ckpt.outputs[0].shape[0]
    step_args = (
        torch.randn((1, horizon, dim), generator=gen),
        torch.tensor([int(cfg.num_train_timesteps) - 1], dtype=torch.long),
        cond,
    )
    unet = graphs.export(
        Step(model.unet),
        step_args,
        ["x", "timestep", "global_cond"],
        ["noise_pred"],
        out / "unet.onnx",
        verbose,
    )
    start = n_obs - 1
    rows = (start, start + int(cfg.n_action_steps))
    if rows[1] > horizon:
        raise ExportError(
            f"config.json: n_action_steps {cfg.n_action_steps} with n_obs_steps {n_obs} runs "
            f"past horizon {horizon}"
        )
    config: Table = {
        "engine": {"backend": "cpu", "model": "encoder.onnx"},
        "denoise": {"model": "unet.onnx", "wire": {"global_cond": "global_cond"}},
        "sampler": sampler(cfg),
        "inputs": [input_binding(ckpt, by_key[k], k, history=n_obs) for k in keys],
        "outputs": [output_binding(ckpt, "x", rows=rows)],
        "metadata": {
            "policy_type": "diffusion",
            "action_horizon": rows[1] - rows[0],
            "action_dim": dim,
            "n_obs_steps": n_obs,
        },
    }
    manifest: Signature = {
        "family": "diffusion",
        "horizon": rows[1] - rows[0],
        "action_dim": dim,
        "n_obs_steps": n_obs,
        "noise": {"tensor": "x", "shape": [horizon, dim]},
        "sampler": config["sampler"],
    }
    # The U-Net runs num_inference_steps times and its errors compound: fp32 by default.
    flags = {"encoder.onnx": ["--fp16"], "unet.onnx": []}
    return Exported(config, [encoder, unet], manifest, flags)


def export(ckpt: Checkpoint, request: Request) -> Exported:
    """The family's entry ([`registry`](..registry)): an encoder and a U-Net pipeline."""
    return _export(ckpt, load_policy(ckpt), request.out, request.verbose)

"""LeRobot's own inference on one observation: what a bundle's served actions must equal.

The path is the one LeRobot's async `policy_server` runs (`_predict_action_chunk`): uint8 HWC
camera frames become float [0, 1] CHW with a batch axis (`raw_observation_to_observation`), the
checkpoint's preprocessor runs (renames, batching, normalisation), then
`predict_action_chunk`, then the postprocessor on each action of the chunk. Diffusion's
observation queues are filled as `select_action` fills them (`populate_queues`: a session's
first frame repeated), so a sequence of observations gives LeRobot's history too.

Noise is injected for the sampling families: the initial sample through
`predict_action_chunk(noise=...)`, and DDPM's per-step noise by replacing diffusers'
`randn_tensor` in its DDPM scheduler with the given rows, in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .checkpoint import Checkpoint
from .checkpoint import load as load_checkpoint
from .families import load_policy


class Reference:
    def __init__(self, checkpoint: str | Path | Checkpoint):
        from lerobot.policies.factory import make_pre_post_processors

        self.ckpt = (
            checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
        )
        if self.ckpt.type == "groot":
            from .families import groot

            # Built from its base's config and its own processors (the VLM's tokenizer and
            # image processor from the encode step's directory), as the export does.
            self.policy, self.pre, self.post, _ = groot.load(self.ckpt, None, None)
        else:
            self.policy = load_policy(self.ckpt)
            self.pre, self.post = make_pre_post_processors(
                self.policy.config, pretrained_path=str(self.ckpt.path)
            )
        self.reset()

    def set_steps(self, steps: int) -> None:
        """GR00T's flow steps (`num_inference_timesteps`) for the next chunks."""
        self.policy._groot_model.action_head.num_inference_timesteps = steps

    def reset(self) -> None:
        """A new episode: LeRobot's `policy.reset()` (empties Diffusion's queues)."""
        self.policy.reset()

    def _observation(self, obs: dict[str, Any]) -> dict[str, Any]:
        # The task prompt (a string) goes to the preprocessor's tokenizer as sent.
        task = (self.ckpt.tokenizer or {}).get("task_key", "task")
        # The prompt stays a string; every other value becomes a batched tensor.
        prompted = self.ckpt.tokenizer or self.ckpt.type == "groot"
        out: dict[str, Any] = {task: obs[task]} if prompted and task in obs else {}
        for f in self.ckpt.inputs:
            key = self.ckpt.wire_keys.get(f.key, f.key)
            v = np.asarray(obs[key])
            if f.type == "VISUAL":
                t = torch.from_numpy(np.ascontiguousarray(v)).permute(2, 0, 1)
                out[key] = (t.type(torch.float32) / 255).contiguous().unsqueeze(0)
            else:
                out[key] = torch.from_numpy(v.astype(np.float32)).unsqueeze(0)
        return out

    def use_rtc(self, horizon: int, schedule: str, max_guidance_weight: float) -> None:
        """LeRobot's real-time chunking on for the next chunks (`RTCConfig`, then the
        policy's `init_rtc_processor`, as LeRobot's rollout sets it up); GR00T reads only the
        horizon."""
        from lerobot.configs import RTCAttentionSchedule
        from lerobot.policies.rtc.configuration_rtc import RTCConfig

        self.policy.config.rtc_config = RTCConfig(
            enabled=True,
            execution_horizon=horizon,
            prefix_attention_schedule=RTCAttentionSchedule(schedule.upper()),
            max_guidance_weight=max_guidance_weight,
        )
        if hasattr(self.policy, "init_rtc_processor"):
            self.policy.init_rtc_processor()

    def rtc_off(self) -> None:
        """RTC off again (the policy's config as loaded)."""
        self.policy.config.rtc_config = None
        if hasattr(self.policy, "init_rtc_processor"):
            self.policy.init_rtc_processor()

    @torch.no_grad()
    def chunk(
        self,
        obs: dict[str, NDArray[Any]],
        noise: NDArray[Any] | None = None,
        step_noise: NDArray[Any] | None = None,
        **rtc: Any,
    ) -> torch.Tensor:
        """`predict_action_chunk`'s chunk before the postprocessor, [1, rows, action_dim]: what
        LeRobot's RTC keeps as the previous chunk. `rtc`: `inference_delay` and
        `prev_chunk_left_over`, passed on as LeRobot's rollout passes them."""
        batch = self.pre(self._observation(obs))
        kind = self.ckpt.type
        with _ddpm_noise(step_noise):
            if kind == "diffusion":
                chunk = self._diffusion(batch, noise)
            elif kind == "groot" and noise is not None:
                with _torch_randn(noise):
                    chunk = self.policy.predict_action_chunk(batch, **rtc)
            elif noise is not None:
                x = torch.from_numpy(np.asarray(noise, np.float32))[None]
                chunk = self.policy.predict_action_chunk(batch, noise=x, **rtc)
            else:
                chunk = self.policy.predict_action_chunk(batch, **rtc)
        if chunk.ndim != 3:
            chunk = chunk.unsqueeze(0)
        return chunk

    def postprocess(self, chunk: torch.Tensor) -> NDArray[Any]:
        """The postprocessor on each action of a chunk: [rows, action_dim] float32."""
        rows = [self.post(chunk[:, i, :]) for i in range(chunk.shape[1])]
        return torch.stack(rows, dim=1).squeeze(0).cpu().numpy().astype(np.float32)

    def actions(
        self,
        obs: dict[str, NDArray[Any]],
        noise: NDArray[Any] | None = None,
        step_noise: NDArray[Any] | None = None,
    ) -> NDArray[Any]:
        """The un-normalised action chunk, [rows, action_dim], float32."""
        return self.postprocess(self.chunk(obs, noise, step_noise))

    def _diffusion(self, batch: dict[str, Any], noise: NDArray[Any] | None) -> torch.Tensor:
        from lerobot.policies.utils import populate_queues

        policy = self.policy
        # As `select_action`: no action in the observation (the preprocessor's batch carries
        # an empty one), the cameras stacked, then the queues.
        batch = {k: v for k, v in batch.items() if k != "action" and isinstance(v, torch.Tensor)}
        if policy.config.image_features:
            batch["observation.images"] = torch.stack(
                [batch[k] for k in policy.config.image_features], dim=-4
            )
        policy._queues = populate_queues(policy._queues, batch)
        x = None if noise is None else torch.from_numpy(np.asarray(noise, np.float32))[None]
        chunk: torch.Tensor = policy.predict_action_chunk(batch, noise=x)
        return chunk


@contextlib.contextmanager
def _torch_randn(noise: NDArray[Any]) -> Iterator[None]:
    """GR00T draws its initial sample with `torch.randn` in `get_action_with_features` (no
    noise argument): this one instead, batched."""
    x = torch.from_numpy(np.asarray(noise, np.float32))[None]
    original = torch.randn

    def injected(*args: Any, **kwargs: Any) -> torch.Tensor:
        return x.clone()

    torch.randn = injected
    try:
        yield
    finally:
        torch.randn = original


@contextlib.contextmanager
def _ddpm_noise(rows: NDArray[Any] | None) -> Iterator[None]:
    """diffusers' DDPM draws `randn_tensor` once per step but the last; these rows instead."""
    if rows is None:
        yield
        return
    import diffusers.schedulers.scheduling_ddpm as ddpm

    queue = [torch.from_numpy(np.asarray(r, np.float32)) for r in rows]
    # diffusers' module global, swapped by name (it re-exports torch_utils' function).
    original = getattr(ddpm, "randn_tensor")  # noqa: B009

    def injected(shape: tuple[int, ...], **kwargs: object) -> torch.Tensor:
        return queue.pop(0).reshape(shape)

    setattr(ddpm, "randn_tensor", injected)  # noqa: B010
    try:
        yield
    finally:
        setattr(ddpm, "randn_tensor", original)  # noqa: B010

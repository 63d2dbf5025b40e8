"""openpi's own inference on one observation: what an openpi bundle's served actions must equal.

openpi is not installable (not on PyPI), so its `Policy.infer` is re-implemented here in numpy
from its source (HEAD 15a9616: `transforms.py`, `policies/{libero,droid,aloha}_policy.py`,
`shared/image_tools.py`, `models/tokenizer.py`, `models_pytorch/pi0_pytorch.py`'s sampling
loop), for the training config a `Checkpoint` carries, around LeRobot's `PI0Pytorch` loaded
from the same file by LeRobot's own `from_pretrained` (and checked tensor by tensor, since that
loader keeps random weights where a name does not match). Nothing here shares code with the
bundle's path: that one is graphs and policyd's bindings; this one is numpy and torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .errors import ExportError
from .openpi import EPS, FLIP, GRIPPERS, RESOLUTION, Checkpoint, Stats, lerobot_config

F64 = NDArray[np.float64]


def gripper_to_angular(v: F64) -> F64:
    """`aloha_policy._gripper_to_angular`, as numpy runs it."""
    v = v * (0.05800 - 0.01844) + 0.01844
    v = np.arcsin(np.clip((0.022**2 + v**2 - 0.036**2) / (2 * 0.022 * v), -1.0, 1.0))
    return (v - 0.5476) / (1.6296 - 0.5476)


def gripper_from_angular(v: F64) -> F64:
    """`aloha_policy._gripper_from_angular`."""
    return (v + 0.5476 - -0.6213) / (1.4910 - -0.6213)


def resize_with_pad(img: NDArray[Any], height: int = 224, width: int = 224) -> NDArray[np.uint8]:
    """`openpi_client.image_tools.resize_with_pad` on an HWC uint8 frame: the aspect kept
    (`int(side / ratio)`), resized by Pillow itself with BILINEAR (what openpi's
    `ResizeImages` calls: two passes, each rounded to uint8), pasted on black at
    `int((side − resized) / 2)`."""
    from PIL import Image

    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return np.asarray(img, np.uint8)
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    small = np.asarray(
        Image.fromarray(np.asarray(img, np.uint8)).resize((rw, rh), Image.Resampling.BILINEAR)
    )
    top, left = max(0, int((height - rh) / 2)), max(0, int((width - rw) / 2))
    out = np.zeros((height, width, img.shape[2]), np.uint8)
    out[top : top + rh, left : left + rw] = small
    return out


#: Real-time chunking for a chunk: LeRobot's `RTCProcessor`, the inference delay, the
#: leftover and the execution horizon.
Rtc = tuple[Any, int, torch.Tensor, int]


@contextlib.contextmanager
def openpi_loop(rtc: Rtc | None = None) -> Iterator[None]:
    """LeRobot's Euler loop replaced by openpi's (`PI0Pytorch.sample_actions`): float32 `dt`,
    the time accumulated in float32 while `time >= −dt/2`. With `rtc`, each velocity goes
    through LeRobot's `RTCProcessor.denoise_step` at that time (openpi has no RTC: policyd
    applies LeRobot's formula on openpi's loop, and this is that formula)."""
    import lerobot.policies.pi0.modeling_pi0 as m0
    import lerobot.policies.pi05.modeling_pi05 as m5

    def loop(denoise: Any, noise: torch.Tensor, num_steps: int, **_: Any) -> torch.Tensor:
        dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32)
        x = noise
        time = torch.tensor(1.0, dtype=torch.float32)
        while time >= -dt / 2:
            at = time.expand(noise.shape[0])
            if rtc is None:
                v = denoise(x, at)
            else:
                processor, delay, prev, horizon = rtc
                v = processor.denoise_step(
                    x, prev, delay, float(time), lambda xt, at=at: denoise(xt, at), horizon
                )
            x = x + dt * v
            time = time + dt
        return x

    saved = m0.euler_integrate, m5.euler_integrate
    m0.euler_integrate = m5.euler_integrate = loop
    try:
        yield
    finally:
        m0.euler_integrate, m5.euler_integrate = saved


def _get(obs: dict[str, Any], key: str) -> Any:
    """A request value by policyd's key (openpi's nested `images` map joined with `/`)."""
    head, _, rest = key.partition("/")
    if rest and isinstance(obs.get(head), dict):
        return obs[head].get(rest)
    return obs.get(key)


@dataclass
class _Norm:
    stats: Stats
    quantile: bool

    def normalize(self, x: F64) -> F64:
        n = x.shape[-1]
        s = self.stats
        if self.quantile:
            assert s.q01 is not None and s.q99 is not None
            q01, q99 = s.q01[:n], s.q99[:n]
            return (x - q01) / (q99 - q01 + EPS) * 2.0 - 1.0
        return (x - s.mean[:n]) / (s.std[:n] + EPS)

    def unnormalize(self, x: F64) -> F64:
        """Dimensions past the statistics pass through (openpi pads them: quantile as they
        are, z-score as `x·(1 + 1e-6)`)."""
        s = self.stats
        if self.quantile:
            assert s.q01 is not None and s.q99 is not None
            d = s.q01.shape[-1]
            head = (x[..., :d] + 1.0) / 2.0 * (s.q99 - s.q01 + EPS) + s.q01
            return np.concatenate([head, x[..., d:]], axis=-1)
        pad = x.shape[-1] - s.mean.shape[-1]
        mean = np.pad(s.mean, (0, pad), constant_values=0.0)
        std = np.pad(s.std, (0, pad), constant_values=1.0)
        return x * (std + EPS) + mean


class OpenpiReference:
    """openpi's `Policy.infer` for `ckpt.config` on requests as openpi's clients send them
    (frames of `ckpt.frames`), with the initial noise given."""

    def __init__(self, ckpt: Checkpoint, tokenizer: Path):
        import sentencepiece

        self.ckpt = ckpt
        cfg = ckpt.config
        self.state_norm = _Norm(ckpt.state, cfg.quantile)
        self.action_norm = _Norm(ckpt.actions, cfg.quantile)
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer))
        if cfg.pi05:
            from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy
        else:
            from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy
        policy = Policy.from_pretrained(str(ckpt.path), config=lerobot_config(ckpt))
        self.model = policy.eval().model
        self._check_loaded()
        # Real-time chunking (`use_rtc`), and the last sampled observation's padded state.
        self.rtc: Any = None
        self.horizon = 0
        self._padded: F64 = np.zeros(0)

    def _check_loaded(self) -> None:
        from safetensors.torch import load_file

        saved = load_file(str(self.ckpt.path / "model.safetensors"))
        have = self.model.state_dict()
        wrong = [
            k for k, v in saved.items() if k not in have or not torch.equal(have[k], v.float())
        ]
        if wrong:
            raise ExportError(
                f"{self.ckpt.path}: LeRobot's from_pretrained did not load {len(wrong)} tensors "
                f"as saved (first: {wrong[0]}); the reference would run random weights"
            )

    def tokens(self, prompt: str, state: F64 | None) -> tuple[NDArray[Any], NDArray[Any]]:
        """`TokenizePrompt`: pi0's `cleaned + "\\n"`, or pi0.5's `Task: …, State: …;\\nAction: `
        with the state's 256 bins (`np.digitize`)."""
        n = self.ckpt.config.max_token_len
        cleaned = prompt.strip().replace("_", " ").replace("\n", " ")
        if state is not None:
            bins = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
            text = f"Task: {cleaned}, State: {' '.join(map(str, bins))};\nAction: "
            ids = self.sp.encode(text, add_bos=True)
        else:
            ids = self.sp.encode(cleaned, add_bos=True) + self.sp.encode("\n")
        mask = [True] * min(len(ids), n) + [False] * (n - len(ids))
        ids = (ids + [0] * n)[:n]
        return np.asarray(ids), np.asarray(mask)

    @torch.no_grad()
    def infer(self, obs: dict[str, Any], noise: NDArray[Any]) -> F64:
        return self.decode(self.sample(obs, noise))

    def use_rtc(self, horizon: int, schedule: str, max_guidance_weight: float) -> None:
        """RTC on for the next chunks, LeRobot's `RTCProcessor` with these settings."""
        from lerobot.configs import RTCAttentionSchedule
        from lerobot.policies.rtc.configuration_rtc import RTCConfig
        from lerobot.policies.rtc.modeling_rtc import RTCProcessor

        self.rtc = RTCProcessor(
            RTCConfig(
                enabled=True,
                execution_horizon=horizon,
                prefix_attention_schedule=RTCAttentionSchedule(schedule.upper()),
                max_guidance_weight=max_guidance_weight,
            )
        )
        self.horizon = horizon

    def rtc_off(self) -> None:
        self.rtc = None

    def chunk(
        self,
        obs: dict[str, Any],
        noise: NDArray[Any],
        inference_delay: int | None = None,
        prev_chunk_left_over: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's chunk cut to the robot's columns, [1, rows, columns]: what policyd keeps
        of a chunk for RTC (its padded columns zero)."""
        out = self.sample(obs, noise, inference_delay, prev_chunk_left_over)
        return out[:, :, : self.ckpt.config.robot.columns]

    def postprocess(self, chunk: torch.Tensor) -> F64:
        """The robot's actions from `chunk` (its padded columns are zeros)."""
        width = int(self.ckpt.model["action_dim"])
        padded = torch.zeros((1, chunk.shape[1], width))
        padded[:, :, : chunk.shape[2]] = chunk
        return self.decode(padded)

    def actions(self, obs: dict[str, Any], noise: NDArray[Any]) -> F64:
        return self.infer(obs, noise)

    @torch.no_grad()
    def sample(
        self,
        obs: dict[str, Any],
        noise: NDArray[Any],
        inference_delay: int | None = None,
        prev_chunk_left_over: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's chunk for `obs`, [1, rows, action width], normalised and padded; with a
        leftover (after `use_rtc`), guided towards it."""
        cfg = self.ckpt.config
        robot = cfg.robot
        # Data transforms: the state's parts (DROID's gripper may be a bare number), ALOHA's
        # `_decode_state` (sign flips, the grippers to their angles).
        parts = [np.atleast_1d(np.asarray(_get(obs, k), np.float64)) for k, _ in robot.state]
        state = np.concatenate(parts)
        if robot.adapt_to_pi:
            state = np.asarray(FLIP, np.float64) * state
            state[list(GRIPPERS)] = gripper_to_angular(state[list(GRIPPERS)])
        # Cameras in openpi's slots (ALOHA's sent channels first), HWC; a camera the request
        # leaves out, and the slots past the robot's, a zero image with its mask off.
        sent = [_get(obs, k) for k in robot.cameras]
        frames = [
            None if f is None else np.asarray(f).transpose(1, 2, 0) if robot.chw else np.asarray(f)
            for f in sent
        ]
        # `ResizeImages(224, 224)`: the identity on frames of that size.
        frames = [
            f if f is None or f.shape[:2] == RESOLUTION else resize_with_pad(f, *RESOLUTION)
            for f in frames
        ]
        zero = np.zeros((*RESOLUTION, 3), np.uint8)
        masks = [f is not None for f in frames] + [False] * (3 - len(frames))
        images = [zero if f is None else f for f in frames] + [zero] * (3 - len(frames))
        # Normalize, then the model transforms: the prompt (the config's default for a request
        # without one), the state padded to the model's width.
        state = self.state_norm.normalize(state)
        prompt = obs.get("prompt", cfg.default_prompt)
        if prompt is None:
            raise ExportError("the observation has no prompt and the config no default")
        ids, mask = self.tokens(prompt, state if cfg.state_in_prompt else None)
        width = int(self.ckpt.model["action_dim"])
        padded = np.pad(state, (0, width - state.size))
        # `Observation.from_dict`: uint8 → float32 in [−1, 1], CHW for the PyTorch model.
        tensors = [
            torch.from_numpy(i.astype(np.float32) / 255.0 * 2.0 - 1.0).permute(2, 0, 1)[None]
            for i in images
        ]
        img_masks = [torch.tensor([m]) for m in masks]
        tok, tok_mask = torch.from_numpy(ids)[None], torch.from_numpy(mask)[None]
        x = torch.from_numpy(np.asarray(noise, np.float32))[None]
        rtc = None
        if prev_chunk_left_over is not None and getattr(self, "rtc", None) is not None:
            rtc = (self.rtc, int(inference_delay or 0), prev_chunk_left_over, self.horizon)
        self._padded = padded
        with openpi_loop(rtc):
            if cfg.pi05:
                out: torch.Tensor = self.model.sample_actions(
                    tensors, img_masks, tok, tok_mask, noise=x
                )
            else:
                st = torch.from_numpy(padded.astype(np.float32))[None]
                out = self.model.sample_actions(tensors, img_masks, tok, tok_mask, st, noise=x)
        return out

    def decode(self, out: torch.Tensor) -> F64:
        """openpi's output transforms on a model chunk: un-normalise, `AbsoluteActions` against
        the last sampled observation's state, the robot's columns, ALOHA's encoding."""
        cfg = self.ckpt.config
        robot = cfg.robot
        padded = self._padded
        actions = self.action_norm.unnormalize(out[0].numpy().astype(np.float64))
        # `AbsoluteActions`: the state after its normalise/un-normalise round trip in float32,
        # added to the masked columns.
        if cfg.delta is not None:
            raw_state = self.state_norm.unnormalize(padded.astype(np.float32).astype(np.float64))
            d = len(cfg.delta)
            actions[:, :d] += np.where(cfg.delta, raw_state[:d], 0.0)[None]
        actions = actions[:, : robot.columns]
        if robot.adapt_to_pi:  # `_encode_actions`
            actions = np.asarray(FLIP, np.float64) * actions
            actions[:, list(GRIPPERS)] = gripper_from_angular(actions[:, list(GRIPPERS)])
        return actions


#: Prompts openpi's examples send.
PROMPTS = ["pick up the red cube", "put_the bowl on the stove ", "fold the towel"]


def observations(ckpt: Checkpoint, n: int, seed: int) -> list[dict[str, Any]]:
    """Requests as the config's openpi client sends them: uint8 frames of `ckpt.frames`
    (ALOHA's channels first, in the nested `images` map), the state spread across the
    statistics (ALOHA: raw joints, grippers in [0, 1]), a task (every other one left out where
    the config has a default prompt)."""
    cfg = ckpt.config
    robot = cfg.robot
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs: dict[str, Any] = {}
        for key in robot.cameras:
            shape = (3, *ckpt.frames) if robot.chw else (*ckpt.frames, 3)
            frame = rng.integers(0, 256, shape, np.uint8)
            head, _, rest = key.partition("/")
            if head == "images":
                obs.setdefault("images", {})[rest] = frame
            else:
                obs[key] = frame
        d = robot.state_dim
        s = ckpt.state
        state = s.mean[:d] + 2.0 * s.std[:d] * rng.standard_normal(d)
        if robot.adapt_to_pi:
            state = np.asarray(FLIP, np.float64) * state
            state[list(GRIPPERS)] = rng.random(len(GRIPPERS))
        at = 0
        for key, size in robot.state:
            obs[key] = state[at : at + size]
            at += size
        if cfg.default_prompt is None or i % 2:
            obs["prompt"] = PROMPTS[(seed + i) % len(PROMPTS)]
        out.append(obs)
    return out

"""GR00T N1.7 (LeRobot 0.6.1's `groot`): the Qwen3-VL backbone, GR00T's VL self-attention and
state encoder as a prefix graph, the action encoder, DiT and action decoder as a step graph,
served as a policyd flow pipeline with GR00T's time (`flow_time = "groot"`).

LeRobot runs, per request: `GrootN17PackInputsStep` (cameras in the checkpoint's order, the
task cleaned, the state min-max normalised to [−1, 1], clipped and zero-padded), then
`GrootN17VLMEncodeStep` (per camera a bicubic antialiased resize of the uint8 frame, a centre
crop, a resize back; the Qwen chat template with one image item per camera before the text; the
Qwen image processor's normalisation and patches), then `GR00TN17.get_action` (backbone up to
`select_layer`, pre-norm; `vlln` and `vl_self_attention`; four Euler steps upward in time with
an integer time bucket), then the action decode (clip to [−1, 1], min-max back, cut).

Here:

- `prefix.onnx` takes each camera as uint8 values (float, HWC turned CHW by policyd) at the
  feature's resolution, the token ids and their mask, and the raw state. The resize chain is
  torch's uint8 kernel reproduced bit for bit ([`resize_pass`]); normalisation and patches are
  the image processor's. The vision tower runs with each camera's patch count as a constant,
  the image embeddings are spliced over the fixed image-token ranges (no `masked_scatter`),
  the M-RoPE position ids are a constant computed by LeRobot's own code for the layout, and
  `vl_self_attention`, which has no mask in LeRobot, masks the padding keys (LeRobot, at batch
  1, never pads; a static graph must, and unmasked padding changes the actions).
- `step.onnx` takes `x_t`, the int64 time bucket and the prefix's outputs, returns the velocity.
- policyd's tokenizer (format `groot`) cleans the task as GR00T does and puts it between the
  chat template's fixed token ids (the image block included), read here from the checkpoint's
  own processor.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from numpy.typing import NDArray
from torch import nn

from .. import graphs
from ..checkpoint import Checkpoint
from ..errors import ExportError, read_json
from ..remote_code import check_dir, resolve
from . import OBS_STATE, Exported, Request, flow_pipeline, local_file

TOKENIZER_FILE = "tokenizer.json"
#: Text tokens a prompt may take (the chat template's fixed tokens come on top).
PROMPT_TOKENS = 48
#: The prompt the chat template is rendered with to find where a prompt goes.
SENTINEL = "policyd prompt sentinel"


# --- torch's uint8 bicubic antialiased resize, exactly -------------------------------------


def _cubic(x: float, a: float = -0.5) -> float:
    """The antialiased bicubic filter (a = −0.5, as PIL and torch's `antialias=True`)."""
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


def resize_weights(n_in: int, n_out: int) -> tuple[NDArray[np.float64], int]:
    """The integer weights `[n_out, n_in]` and their precision (bits) of torch's uint8
    antialiased bicubic resize along one axis (`_upsample_bicubic2d_aa` on uint8, the path
    torchvision's `resize` takes for a uint8 tensor on the CPU): the filter's weights
    normalised per output, scaled to int16 at the largest precision that keeps them there."""
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    w = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        size = min(int(center + support + 0.5), n_in) - lo
        taps = [_cubic((j + lo - center + 0.5) * inv) for j in range(size)]
        total = sum(taps)
        for j, t in enumerate(taps):
            w[i, lo + j] = t / total if total != 0.0 else t
    bits = 0
    while bits < 22 and int(0.5 + w.max() * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    q = np.where(w < 0, np.trunc(-0.5 + w * (1 << bits)), np.trunc(0.5 + w * (1 << bits)))
    return q, bits


class ResizePass(nn.Module):
    """One axis of the uint8 resize: `clamp((Σ w·x + 2^(p−1)) >> p, 0, 255)`, exact in float32.

    The sum needs up to 28 bits, more than float32 holds: the weights are split into
    `256·hi + lo` so that each partial sum is an exact integer, and the floor of the scaled
    total is taken piecewise (integer parts, then the sum of the fractions, each exact)."""

    hi: torch.Tensor
    lo: torch.Tensor

    def __init__(self, n_in: int, n_out: int, axis: int, crop: tuple[int, int] | None = None):
        super().__init__()
        q, bits = resize_weights(n_in if crop is None else crop[1], n_out)
        if crop is not None:  # a centre crop before the resize: zero weights outside it
            full = np.zeros((n_out, n_in))
            full[:, crop[0] : crop[0] + crop[1]] = q
            q = full
        hi = np.floor(q / 256.0)
        self.register_buffer("hi", torch.from_numpy(hi.astype(np.float32)))
        self.register_buffer("lo", torch.from_numpy((q - 256.0 * hi).astype(np.float32)))
        self.axis = axis
        self.a_scale = float(2.0 ** (8 - bits))
        self.b_scale = float(2.0**-bits)
        self.rounding = float(2 ** (bits - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis == -1:  # along the width: x [C, H, W] @ wᵀ
            a, b = x @ self.hi.T, x @ self.lo.T
        else:  # along the height: w @ x
            a, b = self.hi @ x, self.lo @ x
        a = a * self.a_scale
        b = (b + self.rounding) * self.b_scale
        fa, fb = torch.floor(a), torch.floor(b)
        return (fa + fb + torch.floor((a - fa) + (b - fb))).clamp(0.0, 255.0)


@dataclass
class ImageChain:
    """GR00T's eval image transform (`_transform_n1_7_image_for_vlm_torch`) for one camera
    size: resize to `edge`², centre crop `crop`, resize to `target`."""

    height: int
    width: int
    edge: int
    crop: int
    target: tuple[int, int]


class Images(nn.Module):
    """One camera (uint8 values as float, `[1, 3, H, W]`) → the Qwen image processor's patches
    `[patches, 3·T·P·P]`: the resize chain, `(x − mean·255)/(std·255)` as the processor's fused
    rescale-and-normalise computes it, the frame repeated over the temporal patch, patches in
    the processor's merge order."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, chain: ImageChain, proc: Any, patch: int, temporal: int, merge: int):
        super().__init__()
        c = chain
        passes: list[nn.Module] = [
            ResizePass(c.width, c.edge, -1),
            ResizePass(c.height, c.edge, -2),
        ]
        top = (c.edge - c.crop) // 2
        passes += [
            ResizePass(c.edge, c.target[1], -1, (top, c.crop)),
            ResizePass(c.edge, c.target[0], -2, (top, c.crop)),
        ]
        self.passes = nn.ModuleList(passes)
        self.grid = (c.target[0] // patch, c.target[1] // patch)
        ip = proc.image_processor
        inv = 1.0 / float(ip.rescale_factor)
        mean = torch.tensor(ip.image_mean, dtype=torch.float32) * inv
        std = torch.tensor(ip.image_std, dtype=torch.float32) * inv
        self.register_buffer("mean", mean.view(3, 1, 1))
        self.register_buffer("std", std.view(3, 1, 1))
        self.patch, self.temporal, self.merge = patch, temporal, merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[0]
        for p in self.passes:
            x = p(x)
        x = (x - self.mean) / self.std
        gh, gw = self.grid
        m, ps, t = self.merge, self.patch, self.temporal
        x = x.unsqueeze(0).expand(t, 3, gh * ps, gw * ps)
        x = x.reshape(t, 3, gh // m, m, ps, gw // m, m, ps).permute(2, 5, 3, 6, 1, 0, 4, 7)
        return x.reshape(gh * gw, 3 * t * ps * ps)


# --- the graphs ------------------------------------------------------------------------------


@dataclass
class Layout:
    """The token layout of one request: the chat template's ids before the prompt (the image
    blocks included), after it, the image-token range of each camera, and the padded length."""

    prefix_ids: list[int]
    suffix_ids: list[int]
    image_ranges: list[tuple[int, int]]
    length: int


class Prefix(nn.Module):
    """Cameras, tokens, token mask, raw state → `vl` (the VL self-attention's output), the
    state features, the backbone's mask and the image-token mask (what the DiT reads)."""

    pos_embeds: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    position_ids: torch.Tensor
    state_lo: torch.Tensor
    state_denom: torch.Tensor
    state_live: torch.Tensor
    embodiment: torch.Tensor

    def __init__(
        self,
        policy: Any,
        images: list[Images],
        layout: Layout,
        position_ids: torch.Tensor,
        state: tuple[NDArray[np.float64], NDArray[np.float64], bool, int],
        embodiment: int,
    ):
        super().__init__()
        model = policy._groot_model
        self.backbone: Any = model.backbone
        self.head: Any = model.action_head
        self.images = nn.ModuleList(images)
        self.layout = layout
        visual = self.backbone.visual
        grid = torch.tensor([[1, *i.grid] for i in images])
        with torch.no_grad():
            self.register_buffer("pos_embeds", visual.fast_pos_embed_interpolate(grid).detach())
            rot = visual.rot_pos_emb(grid).detach()
        emb = torch.cat((rot, rot), dim=-1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())
        self.patches = [i.grid[0] * i.grid[1] for i in images]
        self.register_buffer("position_ids", position_ids)
        lo, hi, clip, pad = state
        denom = hi - lo
        self.register_buffer("state_lo", torch.tensor(lo, dtype=torch.float32))
        self.register_buffer("state_denom", torch.tensor(denom, dtype=torch.float32))
        self.register_buffer("state_live", torch.tensor(denom != 0))
        self.clip, self.pad = clip, pad
        self.register_buffer("embodiment", torch.tensor([embodiment], dtype=torch.long))
        self.image_token = int(self.backbone.model.config.image_token_id)

    def _vision_attention(self, attn: Any, x: torch.Tensor) -> torch.Tensor:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

        n = x.shape[0]
        q, k, v = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, self.cos, self.sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out, start = [], 0
        for count in self.patches:  # each camera attends to itself (LeRobot's cu_seqlens)
            s = slice(start, start + count)
            out.append(
                F.scaled_dot_product_attention(
                    q[:, :, s], k[:, :, s], v[:, :, s], scale=attn.scaling
                )
            )
            start += count
        o = torch.cat(out, dim=2).transpose(1, 2).reshape(n, -1)
        projected: torch.Tensor = attn.proj(o)
        return projected

    def _vision(self, pixels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        visual = self.backbone.visual
        h = visual.patch_embed(pixels) + self.pos_embeds
        deep = []
        for i, blk in enumerate(visual.blocks):
            h = h + self._vision_attention(blk.attn, blk.norm1(h))
            h = h + blk.mlp(blk.norm2(h))
            if i in visual.deepstack_visual_indexes:
                merger = visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(i)]
                deep.append(merger(h))
        return visual.merger(h), deep

    def _splice(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """`text` with the image rows put over the image-token ranges (`masked_scatter` over a
        layout known at export)."""
        parts, prev, used = [], 0, 0
        for start, end in self.layout.image_ranges:
            parts += [text[:, prev:start], image[None, used : used + end - start]]
            used += end - start
            prev = end
        parts.append(text[:, prev:])
        return torch.cat(parts, dim=1)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.images)
        tokens, token_mask, state = xs[n:]
        pixels = torch.cat([img(x) for img, x in zip(self.images, xs[:n], strict=True)])
        image_embeds, deep = self._vision(pixels)
        lm = self.backbone.language_model
        embeds = self._splice(lm.embed_tokens(tokens), image_embeds)
        length = tokens.shape[1]
        keys = token_mask.bool()
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = causal[None, None] & keys[:, None, None, :]
        text_pos, mrope = self.position_ids[0], self.position_ids[1:]
        rope = lm.rotary_emb(embeds, mrope)
        zeros = torch.zeros_like(embeds)
        h = embeds
        last = len(lm.layers) - 1
        for i, layer in enumerate(lm.layers):
            h = layer(h, attention_mask=mask, position_ids=text_pos, position_embeddings=rope)
            # GR00T's features are the last kept layer's own output (a forward hook), taken
            # before Qwen3-VL adds that layer's deepstack features (a backbone cut at or below
            # the deepstack depth).
            if i < len(deep) and i < last:
                h = h + self._splice(zeros, deep[i])
        head = self.head
        vl = head.vlln(h)
        for block in head.vl_self_attention.transformer_blocks:
            vl = block(vl, attention_mask=keys)  # the padding keys masked (see the module doc)
        x = state
        mapped = (
            2
            * (x - self.state_lo)
            / torch.where(self.state_live, self.state_denom, torch.ones_like(self.state_denom))
            - 1
        )
        x = torch.where(self.state_live, mapped, torch.zeros_like(mapped))
        if self.clip:
            x = x.clamp(-1.0, 1.0)
        if self.pad:
            x = torch.cat([x, torch.zeros(1, self.pad)], dim=1)
        state_features = head.state_encoder(x[:, None, :], self.embodiment)
        image_mask = tokens == self.image_token
        return vl, state_features, keys, image_mask


class Step(nn.Module):
    """`x_t`, the time bucket and the prefix's outputs → the velocity (one Euler step of
    `get_action_with_features`, RTC off)."""

    embodiment: torch.Tensor

    def __init__(self, policy: Any, embodiment: int):
        super().__init__()
        self.head: Any = policy._groot_model.action_head
        self.register_buffer("embodiment", torch.tensor([embodiment], dtype=torch.long))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        x, time, vl, state_features, keys, image_mask = xs
        head = self.head
        t = time.reshape(1)
        features = head.action_encoder(x, t, self.embodiment)
        if head.config.add_pos_embed:
            pos = torch.arange(features.shape[1], dtype=torch.long)
            features = features + head.position_embedding(pos).unsqueeze(0)
        out = head.model(
            hidden_states=torch.cat((state_features, features), dim=1),
            encoder_hidden_states=vl,
            timestep=t,
            image_mask=image_mask,
            backbone_attention_mask=keys,
        )
        velocity: torch.Tensor = head.action_decoder(out, self.embodiment)[:, -x.shape[1] :]
        return velocity


# --- loading without the Hub -----------------------------------------------------------------


def _dir_of(name: str, ckpt_dir: Path, what: str, option: str, needs: str) -> Path:
    """A model named by the checkpoint, as a local directory: the name itself (a relative one
    against the checkpoint's directory, never the current one), or its snapshot in the Hugging
    Face cache (nothing is downloaded)."""
    found = resolve(name, ckpt_dir)
    if found is not None:
        return found
    cached = local_file(name, "config.json", ckpt_dir)
    if cached is not None:
        return cached.parent
    raise ExportError(
        f"GR00T needs {what} {name!r} ({needs}), which is neither a directory (a relative name "
        f"is read against {ckpt_dir}) nor in the Hugging Face cache: `huggingface-cli download "
        f"{name} --include '*.json'` (no weights needed), or pass {option} DIR"
    )


def _backbone_dir(base: Path, ckpt_dir: Path, given: Path | None) -> Path | None:
    """The VLM whose config GR00T builds its backbone from (the base config's `model_name`),
    resolved as [`_dir_of`] does (`given`, the `--vlm` directory, where it cannot be) and
    checked for code; None for the name LeRobot builds from a config of its own
    (Cosmos-Reason2-2B, read from no directory)."""
    config = read_json(base / "config.json", "the GR00T base model's config")
    name = config.get("model_name") if isinstance(config, dict) else None
    if not isinstance(name, str) or name.rstrip("/") == "nvidia/Cosmos-Reason2-2B":
        return None
    try:
        found = _dir_of(name, ckpt_dir, "the VLM", "--vlm", "its config.json: the backbone's sizes")
    except ExportError:
        if given is None:
            raise
        found = given
    check_dir(found, "GR00T's backbone config")
    return found


@contextlib.contextmanager
def _from_config(base: Path, backbone: Path | None) -> Iterator[None]:
    """LeRobot's `GrootPolicy.__init__` loads the base model's weights (3B parameters) only for
    the checkpoint's own to replace them: while the policy is built, GR00T is built from the
    base's `config.json` alone (the backbone from its config too, as LeRobot does)."""
    from lerobot.policies.groot import modeling_groot
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config

    class FromConfig:
        @staticmethod
        def from_pretrained(**kwargs: Any) -> Any:
            cfg = GR00TN17Config.from_pretrained(str(base))
            if backbone is not None:
                cfg.model_name = str(backbone)
            for key in ("num_inference_timesteps", "rtc_ramp_rate", "tune_top_llm_layers"):
                if key in kwargs:
                    setattr(cfg, key, kwargs[key])
            cfg.use_flash_attention = False
            return GR00TN17(cfg, load_backbone_weights=False)

    saved = modeling_groot.GR00TN17
    modeling_groot.GR00TN17 = FromConfig
    try:
        yield
    finally:
        modeling_groot.GR00TN17 = saved


def load(ckpt: Checkpoint, base: Path | None, vlm: Path | None) -> tuple[Any, Any, Any, Path]:
    """The policy (fp32, eval), LeRobot's own pre- and postprocessor from the checkpoint, and
    the VLM directory its encode step reads (tokenizer, chat template, image processor)."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.groot.modeling_groot import GrootPolicy
    from lerobot.policies.groot.processor_groot import (
        GrootN17VLMEncodeStep,
        make_groot_pre_post_processors_from_pretrained,
    )

    try:
        cfg = PreTrainedConfig.from_pretrained(str(ckpt.path))
    except Exception as e:
        raise ExportError(f"{ckpt.path / 'config.json'}: LeRobot cannot read it: {e}") from e
    name = str(cfg.base_model_path)
    base_dir = base or _dir_of(
        name, ckpt.path, "its base model", "--base", "config.json: the network's sizes"
    )
    if not (base_dir / "config.json").is_file():
        raise ExportError(f"{base_dir / 'config.json'}: missing (the GR00T base model's sizes)")
    backbone = _backbone_dir(base_dir, ckpt.path, vlm)
    cfg.base_model_path = str(base_dir)
    cfg.device = "cpu"
    cfg.use_bf16 = False
    try:
        with _from_config(base_dir, backbone):
            policy = GrootPolicy.from_pretrained(str(ckpt.path), config=cfg)
        pre, post = make_groot_pre_post_processors_from_pretrained(cfg, str(ckpt.path))
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"{ckpt.path}: LeRobot cannot load the GR00T policy: {e}") from e
    step = next((s for s in pre.steps if isinstance(s, GrootN17VLMEncodeStep)), None)
    if step is None:
        raise ExportError(
            f"{ckpt.path / 'policy_preprocessor.json'}: no groot_n1_7_vlm_encode step"
        )
    vlm_dir = vlm or _dir_of(
        step.model_name,
        ckpt.path,
        "the VLM",
        "--vlm",
        "its tokenizer.json, chat template and image processor config",
    )
    check_dir(vlm_dir, "the VLM's tokenizer and processors")
    step.model_name = str(vlm_dir)
    return policy.eval(), pre, post, vlm_dir


# --- the export --------------------------------------------------------------------------------


def _layout(proc: Any, frames: list[torch.Tensor], prompt_tokens: int) -> Layout:
    """The chat template around the prompt, as token ids, from the checkpoint's own processor:
    rendered with a sentinel prompt, split there, the part before encoded with the images (the
    processor expands each image placeholder), the part after as text; then checked to equal
    the processor's ids for whole prompts."""
    tok = proc.tokenizer

    def conversation(text: str) -> list[dict[str, Any]]:
        items = [{"type": "image", "image": f} for f in frames]
        return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]

    def ids(text: str) -> list[int]:
        rendered = proc.apply_chat_template(
            conversation(text), tokenize=False, add_generation_prompt=False
        )
        out = proc(text=[rendered], images=frames, return_tensors="pt", padding=True)
        return [int(i) for i in out["input_ids"][0]]

    rendered = proc.apply_chat_template(
        conversation(SENTINEL), tokenize=False, add_generation_prompt=False
    )
    if rendered.count(SENTINEL) != 1:
        raise ExportError("the VLM's chat template does not place the task once; not exported")
    before, after = rendered.split(SENTINEL)
    head = proc(text=[before], images=frames, return_tensors="pt")["input_ids"][0].tolist()
    tail = tok(after, add_special_tokens=False)["input_ids"]
    for text in ("pick up the red cube", "fold the towel", "perform the task", "a"):
        body = tok(text, add_special_tokens=False)["input_ids"]
        if ids(text) != [*head, *body, *tail]:
            raise ExportError(
                "the VLM's tokenizer merges the task with the chat template around it (or adds "
                "tokens of its own); policyd puts the template's ids around the encoded task, "
                "which would differ: not exported"
            )
    image_id = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    ranges, i = [], 0
    while i < len(head):
        if head[i] == image_id:
            j = i
            while j < len(head) and head[j] == image_id:
                j += 1
            ranges.append((i, j))
            i = j
        else:
            i += 1
    if len(ranges) != len(frames):
        raise ExportError(
            f"the chat template gives {len(ranges)} image-token runs for {len(frames)} cameras"
        )
    return Layout(head, tail, ranges, len(head) + prompt_tokens + len(tail))


def _position_ids(policy: Any, layout: Layout, pad_id: int, grids: list[tuple[int, int]]) -> Any:
    """Qwen3-VL's M-RoPE ids (4 rows: text, then t/h/w) for the layout with a full-length
    prompt, computed by LeRobot's own backbone code: the prompt's positions run on after the
    images, so a shorter prompt (padded on the right) has the same ids for its real tokens."""
    backbone = policy._groot_model.backbone
    body = layout.length - len(layout.prefix_ids) - len(layout.suffix_ids)
    ids = torch.tensor([[*layout.prefix_ids, *[pad_id] * body, *layout.suffix_ids]])
    model_input: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "image_grid_thw": torch.tensor([[1, h, w] for h, w in grids]),
    }
    backbone._ensure_mm_token_type_ids(model_input)
    backbone._ensure_legacy_qwen3_position_ids(model_input)
    pos = model_input.get("position_ids")
    if pos is None or tuple(pos.shape) != (4, 1, layout.length):
        raise ExportError(
            "transformers' Qwen3-VL no longer computes GR00T's 4-row position ids "
            "(compute_3d_position_ids); the export's patches need updating for this version"
        )
    return pos


def _state(pack: Any, dim: int) -> tuple[NDArray[np.float64], NDArray[np.float64], bool, int]:
    """The pack step's state normalisation: its min/max (zero range → 0), clip, zero pad."""
    stats = (pack.stats or {}).get(OBS_STATE) if pack.normalize_min_max else None
    if stats is None:
        raise ExportError(
            "policy_preprocessor.json: the GR00T pack step has no observation.state statistics; "
            "LeRobot would feed the raw state (not exported: retrain with dataset stats)"
        )
    lo = np.asarray(stats.get("min"), dtype=np.float64).reshape(-1)[:dim]
    hi = np.asarray(stats.get("max"), dtype=np.float64).reshape(-1)[:dim]
    if lo.size != dim or hi.size != dim:
        raise ExportError(f"the GR00T pack step's state statistics do not cover {dim} values")
    return lo, hi, bool(pack.clip_outliers), int(pack.max_state_dim) - dim


def _action(post: Any, action_dim: int) -> tuple[dict[str, Any], int | None]:
    """The decode step as `[[outputs]]` keys (clip, then min-max back), and the valid horizon
    it cuts to (None: all rows)."""
    from lerobot.policies.groot.processor_groot import (
        GrootActionUnpackUnnormalizeStep,
        GrootN17ActionDecodeStep,
        _n1_7_decode_stats_for_action,
    )

    dec = next(
        (
            s
            for s in post.steps
            if isinstance(s, GrootActionUnpackUnnormalizeStep | GrootN17ActionDecodeStep)
        ),
        None,
    )
    if dec is None:
        raise ExportError("policy_postprocessor.json: no GR00T action decode step")
    if isinstance(dec, GrootActionUnpackUnnormalizeStep):
        if dec.libero_gripper_action:
            raise ExportError(
                "policy_postprocessor.json: libero_gripper_action (the gripper mapped to "
                "−sign(2g − 1)) is set; policyd's outputs cannot express it: not exported"
            )
        stats = (dec.stats or {}).get("action") if dec.normalize_min_max else None
        if stats is None:
            return {}, None
        lo = np.asarray(stats.get("min"), dtype=np.float64).reshape(-1)[:action_dim]
        hi = np.asarray(stats.get("max"), dtype=np.float64).reshape(-1)[:action_dim]
        keys: dict[str, Any] = {"min": lo.tolist(), "max": hi.tolist(), "eps": 0.0}
        if dec.clip_normalized_action:
            keys["clip"] = [-1.0, 1.0]
        return keys, None
    if dec.use_relative_action:
        raise ExportError(
            "the checkpoint's processor uses relative actions (use_relative_action); GR00T's "
            "per-group relative decode is not reproduced: not exported"
        )
    if dec.action_decode_transform is not None:
        raise ExportError(
            f"action_decode_transform = {dec.action_decode_transform!r}: the gripper mapped "
            "after decoding, which policyd's outputs cannot express: not exported"
        )
    action_cfg = (dec.modality_config or {}).get("action", {})
    los, his = [], []
    configs = action_cfg.get("action_configs", [])
    for i, key in enumerate(action_cfg.get("modality_keys", [])):
        if key not in (dec.raw_stats or {}).get("action", {}):
            continue
        cfg = configs[i] if i < len(configs) and isinstance(configs[i], dict) else {}
        lo, hi = _n1_7_decode_stats_for_action(
            dec.raw_stats,
            key,
            cfg,
            use_relative_action=False,
            use_percentiles=dec.use_percentiles,
        )
        los.append(lo.reshape(-1))
        his.append(hi.reshape(-1))
    lo_all = np.concatenate(los)[:action_dim].astype(np.float64)
    hi_all = np.concatenate(his)[:action_dim].astype(np.float64)
    rows = len(action_cfg.get("delta_indices") or []) or None
    keys = {"min": lo_all.tolist(), "max": hi_all.tolist(), "eps": 0.0, "clip": [-1.0, 1.0]}
    return keys, rows


def _export(
    ckpt: Checkpoint,
    out: Path,
    verbose: bool,
    base: Path | None = None,
    vlm: Path | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
) -> Exported:
    from lerobot.policies.groot.processor_groot import (
        GrootN17PackInputsStep,
        _transform_n1_7_image_for_vlm_torch,
    )

    policy, pre, post, vlm_dir = load(ckpt, base, vlm)
    cfg = policy.config
    if cfg.use_relative_actions:
        raise ExportError(
            "config.json: use_relative_actions is set; GR00T's relative actions are not "
            "reproduced: not exported"
        )
    pack = next((s for s in pre.steps if isinstance(s, GrootN17PackInputsStep)), None)
    vlm_step = next((s for s in pre.steps if hasattr(s, "image_target_size")), None)
    if pack is None or vlm_step is None:
        raise ExportError("policy_preprocessor.json: GR00T's pack and VLM-encode steps are needed")
    if pack.video_horizon not in (None, 1):
        raise ExportError(
            f"the checkpoint's video horizon is {pack.video_horizon} frames; policyd sends one "
            "frame per camera: not exported"
        )
    for field in ("use_albumentations", "letter_box_transform"):
        if getattr(vlm_step, field):
            raise ExportError(
                f"policy_preprocessor.json: the VLM-encode step's {field} is set (a different "
                "image transform, not reproduced): not exported"
            )
    if vlm_step.image_target_size is None:
        raise ExportError("policy_preprocessor.json: the VLM-encode step has no image_target_size")
    by_key = {f.key: f for f in ckpt.inputs}
    if OBS_STATE not in by_key:
        raise ExportError(f"config.json: GR00T reads {OBS_STATE}")
    cams = [f.key for f in ckpt.inputs if f.type == "VISUAL"]
    extra = [f.key for f in ckpt.inputs if f.type != "VISUAL" and f.key != OBS_STATE]
    if extra:
        raise ExportError(f"config.json: GR00T reads {OBS_STATE} and cameras; not {extra}")
    cams = pack._ordered_image_keys(dict.fromkeys(cams))
    target = tuple(int(v) for v in vlm_step.image_target_size)
    edge = int(vlm_step.shortest_image_edge or target[0])
    fraction = vlm_step.crop_fraction
    if fraction is None and vlm_step.image_crop_size is not None:
        fraction = vlm_step.image_crop_size[0] / float(target[0])
    crop = int(round(edge * fraction)) if fraction is not None and 0.0 < fraction < 1.0 else edge
    proc = vlm_step.proc
    visual = policy._groot_model.backbone.visual
    patch, merge = int(visual.patch_size), int(visual.spatial_merge_size)
    temporal = int(visual.config.temporal_patch_size)
    images = []
    gen = torch.Generator().manual_seed(0)
    frames, samples = [], []
    for k in cams:
        _, h, w = by_key[k].shape
        chain = ImageChain(h, w, edge, crop, (target[0], target[1]))
        images.append(Images(chain, proc, patch, temporal, merge))
        sample = torch.randint(0, 256, (3, h, w), generator=gen, dtype=torch.uint8)
        samples.append(sample)
        frames.append(
            _transform_n1_7_image_for_vlm_torch(
                sample,
                image_crop_size=vlm_step.image_crop_size,
                image_target_size=vlm_step.image_target_size,
                shortest_image_edge=vlm_step.shortest_image_edge,
                crop_fraction=vlm_step.crop_fraction,
            )
        )
    # The graph's image chain against LeRobot's, on these frames, before anything is traced.
    want = proc.image_processor(images=frames, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        got = torch.cat([m(s[None].float()) for m, s in zip(images, samples, strict=True)])
    if tuple(got.shape) != tuple(want.shape) or float((got - want).abs().max()) > 1e-5:
        raise ExportError(
            "the image chain (resize, crop, resize, the image processor's normalisation and "
            "patches) differs from LeRobot's on a test frame "
            f"({list(got.shape)} vs {list(want.shape)}): not exported"
        )
    layout = _layout(proc, frames, prompt_tokens)
    pad_id = int(proc.tokenizer.pad_token_id or 0)
    grids = [m.grid for m in images]
    positions = _position_ids(policy, layout, pad_id, grids)
    state_dim = by_key[OBS_STATE].shape[0]
    emb = int(pack.embodiment_mapping.get(pack.embodiment_tag, 0))
    prefix = Prefix(policy, images, layout, positions, _state(pack, state_dim), emb)
    tokens = torch.tensor(
        [[*layout.prefix_ids, *[7] * prompt_tokens, *layout.suffix_ids]], dtype=torch.long
    )
    token_mask = torch.ones_like(tokens, dtype=torch.bool)
    token_mask[:, -prompt_tokens // 2 :] = False
    state = torch.randn((1, state_dim), generator=gen)
    cam_args = [s[None].float() for s in samples]
    args = (*cam_args, tokens, token_mask, state)
    prefix_in = [*cams, "tokens", "token_mask", OBS_STATE]
    prefix_out = ["vl", "state_features", "backbone_mask", "image_mask"]
    g1 = graphs.export(prefix, args, prefix_in, prefix_out, out / "prefix.onnx", verbose)
    with torch.no_grad():
        cached = prefix(*args)
    head = policy._groot_model.action_head
    horizon, max_action = int(head.action_horizon), int(head.action_dim)
    step = Step(policy, emb)
    x = torch.randn((1, horizon, max_action), generator=gen)
    step_args = (x, torch.tensor([250], dtype=torch.long), *cached)
    step_in = ["x_t", "time", *prefix_out]
    g2 = graphs.export(step, step_args, step_in, ["v_t"], out / "step.onnx", verbose)

    action_dim = ckpt.outputs[0].shape[0]
    norm, valid = _action(post, action_dim)
    rows = min(
        horizon,
        int(cfg.chunk_size),
        int(cfg.n_action_steps),
        valid or horizon,
        policy._resolve_prediction_horizon(torch.zeros(1, horizon, 1)),
    )
    shutil.copy(vlm_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
    inputs: list[dict[str, Any]] = []
    for k in cams:
        c, h, w = by_key[k].shape
        inputs.append(
            {
                "key": ckpt.wire_keys.get(k, k),
                "tensor": k,
                "dtypes": ["uint8"],
                "shape": [h, w, c],
                "layout": "hwc_to_chw",
            }
        )
    inputs.append(
        {
            "key": ckpt.wire_keys.get(OBS_STATE, OBS_STATE),
            "tensor": OBS_STATE,
            "dtypes": ["float32", "float64"],
            "shape": [state_dim],
        }
    )
    inputs.append(
        {
            "key": "task",
            "tensor": "tokens",
            "dtypes": ["text"],
            "tokenizer": {
                "file": TOKENIZER_FILE,
                "format": "groot" if pack.formalize_language else "groot_raw",
                "max_tokens": layout.length,
                "mask_tensor": "token_mask",
                "pad_id": pad_id,
                "overflow": "refuse",
                "prefix_ids": layout.prefix_ids,
                "suffix_ids": layout.suffix_ids,
            },
        }
    )
    output: dict[str, Any] = {"tensor": "x_t", "key": "actions", "dtype": "float32"}
    if rows < horizon:
        output["rows"] = [0, rows]
    output["columns"] = action_dim
    output.update(norm)
    metadata = {
        "policy_type": "groot",
        "action_horizon": rows,
        "action_dim": action_dim,
        "n_action_steps": int(cfg.n_action_steps),
        "embodiment_tag": str(pack.embodiment_tag),
    }
    steps = int(policy._groot_model.action_head.num_inference_timesteps)
    exported = flow_pipeline(
        "groot",
        [g1, g2],
        prefix_out,
        inputs,
        output,
        metadata,
        steps=steps,
        flow_time="groot",
        horizon=rows,
        max_action=max_action,
        action_dim=action_dim,
        prompt_key="task",
    )
    exported.manifest["noise"] = {"tensor": "x_t", "shape": [horizon, max_action]}
    # NVIDIA's deployment: BF16 engines, the vision tower in FP32 (it sits in the prefix here).
    exported.trt_flags = {"prefix.onnx": [], "step.onnx": ["--bf16"]}
    return exported


def export(ckpt: Checkpoint, request: Request) -> Exported:
    """The family's entry ([`registry`](..registry)): built from its base model's config (not
    through `load_policy`), `[rtc]` from the checkpoint's config with its ramp rate."""
    ramp = ckpt.config.get("rtc_ramp_rate")
    exported = _export(ckpt, request.out, request.verbose, request.base, request.vlm)
    return exported.with_rtc(ckpt.config, float(ramp) if ramp is not None else None)

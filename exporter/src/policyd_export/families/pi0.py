"""pi0 and pi0.5: the PaliGemma prefix and the action expert's step, as a policyd flow pipeline.

LeRobot's `sample_actions` (pi0 and pi0.5 alike) embeds the cameras (SigLIP) and the prompt's
tokens, fills the VLM's KV cache over that prefix once, then integrates the action expert from
noise (`euler_integrate`: `t = 1 + i·dt`, `x += dt·v`), the expert attending to the cached
prefix. pi0's expert also embeds the state; pi0.5 writes the state into the prompt instead
(discretised into 256 bins) and conditions the expert on the time through adaRMS. Here:

- `prefix.onnx` (cameras in [−1, 1], token ids, token mask, and for pi0 the normalised state;
  a camera recorded at another size than the model's `image_resolution` enters at its own size,
  normalised, and the graph applies LeRobot's `resize_with_pad_torch` and `·2 − 1` itself, as
  `_preprocess_images` does; see docs/export.md for why it is in the graph)
  → the prefix's pad mask, its keys and values stacked over layers (`[layers, 1, kv_heads, P,
  D]`) and, for pi0, the state padded to `max_state_dim` (passed through for the step);
- `step.onnx` (`x_t`, `time`, and those) → the velocity `v_t`;
- policyd's flow sampler with `flow_time = "lerobot"` runs the loop; its tokenizer makes the
  token ids from the request's `task` as LeRobot's preprocessor does (format `lerobot`:
  the task and a newline; `pi05`: `Task: …, State: …;\nAction: ` from the normalised state);
  `[[outputs]] columns` cuts the padded actions to the robot's dimension.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import graphs as graphs_
from ..bindings import input_binding, output_binding, relative_actions
from ..checkpoint import Checkpoint, Feature
from ..errors import ExportError
from ..remote_code import RemoteCodeRefused, check_dir
from . import Exported, Request, Table, lerobot_flow, load_policy, local_file

OBS_STATE = "observation.state"
TOKENIZER_FILE = "tokenizer.model"


class Prefix(nn.Module):
    """`embed_prefix` and the VLM's pass with `use_cache=True`, over flat inputs."""

    def __init__(
        self,
        model: nn.Module,
        cameras: int,
        empty: int,
        max_state: int | None,
        resize: Sequence[bool | nn.Module] | None = None,
        resolution: tuple[int, int] = (224, 224),
        state_fn: nn.Module | None = None,
        flagged: list[bool] | None = None,
    ):
        super().__init__()
        # Cameras a robot may leave out: each takes a presence flag (a bool [1] input after
        # the others) as its image mask, as openpi's ALOHA inputs mask a missing wrist camera.
        self.flagged = flagged or [False] * cameras
        # A map of the raw state into the model's (openpi ALOHA's adapt_to_pi and its
        # normalisation), before padding; None: the bindings normalised it.
        self.state_fn = state_fn
        self.model: Any = model  # a LeRobot module (untyped)
        self.cameras = cameras
        self.empty = empty
        self.max_state = max_state  # None: pi0.5, no state in the graphs
        self.resize = resize or [False] * cameras
        # Registered, so that their weights are the graph's constants.
        self.resizers = nn.ModuleList([r for r in self.resize if isinstance(r, nn.Module)])
        self.resolution = resolution

    def image(self, x: torch.Tensor, resize: bool | nn.Module) -> torch.Tensor:
        """A camera as `_preprocess_images` makes it: one already in [−1, 1] at the model's
        size passes; one at another size (normalised, [0, 1] for IDENTITY) is resized with
        padding (bilinear, clamped to [0, 1], padded with 0 around the centre), then `·2 − 1`;
        a module (openpi's resize, from 0..255) makes the model's [−1, 1] image itself."""
        if isinstance(resize, nn.Module):
            out: torch.Tensor = resize(x)
            return out
        if not resize:
            return x
        from lerobot.policies.common.vla_utils import resize_with_pad_torch

        img: torch.Tensor = resize_with_pad_torch(x.permute(0, 2, 3, 1), *self.resolution)
        return (img * 2.0 - 1.0).permute(0, 3, 1, 2)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from lerobot.policies.common.vla_utils import (
            make_att_2d_masks,
            pad_vector,
            prepare_attention_masks_4d,
        )

        images = [self.image(x, r) for x, r in zip(xs[: self.cameras], self.resize, strict=True)]
        flags = sum(self.flagged)
        rest = xs[self.cameras : len(xs) - flags]
        present_flags = iter(xs[len(xs) - flags :])
        tokens, token_mask, *states = rest
        # openpi's DROID state arrives as two inputs (joints, gripper), concatenated first.
        state = [torch.cat(states, dim=-1)] if len(states) > 1 else states
        if self.state_fn is not None and state:
            state = [self.state_fn(state[0])]
        present = torch.ones(1, dtype=torch.bool)
        masks = [next(present_flags).bool() if f else present for f in self.flagged]
        # LeRobot's empty cameras: images of −1, masked out.
        for _ in range(self.empty):
            images.append(torch.full_like(images[0], -1.0))
            masks.append(torch.zeros(1, dtype=torch.bool))
        m = self.model
        embs, pad, att = m.embed_prefix(images, masks, tokens, token_mask.bool())
        att4 = prepare_attention_masks_4d(make_att_2d_masks(pad, att))
        positions = torch.cumsum(pad, dim=1) - 1
        vlm = m.paligemma_with_expert
        vlm.paligemma.model.language_model.config._attn_implementation = "eager"
        _, cache = vlm.forward(
            attention_mask=att4,
            position_ids=positions,
            past_key_values=None,
            inputs_embeds=[embs, None],
            use_cache=True,
        )
        keys = torch.stack([layer.keys for layer in cache.layers])
        values = torch.stack([layer.values for layer in cache.layers])
        if self.max_state is None:
            return pad, keys, values
        return pad, keys, values, pad_vector(state[0], self.max_state)


class Step(nn.Module):
    """`denoise_step` with the cache rebuilt from the stacked keys and values."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model: Any = model  # a LeRobot module (untyped)

    def forward(
        self,
        x_t: torch.Tensor,
        time: torch.Tensor,
        prefix_mask: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *state: torch.Tensor,
    ) -> torch.Tensor:
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(keys.shape[0]):
            cache.update(keys[i], values[i], i)
        v: torch.Tensor
        if state:  # pi0
            v = self.model.denoise_step(state[0], prefix_mask, cache, x_t, time)
        else:
            v = self.model.denoise_step(prefix_mask, cache, x_t, time)
        return v


def _tokenizer(ckpt: Checkpoint, out: Path, given: Path | None) -> tuple[dict[str, Any], int]:
    """Copies the SentencePiece model LeRobot's tokenizer step names into the bundle; returns
    the step's config and the pad id."""
    t = ckpt.tokenizer
    if not t:
        raise ExportError(
            f"{ckpt.path / 'policy_preprocessor.json'}: {ckpt.type} needs a tokenizer_processor "
            "step"
        )
    if t.get("padding_side", "right") != "right" or t.get("padding", "max_length") != (
        "max_length"
    ):
        raise ExportError(
            "policy_preprocessor.json: the tokenizer pads "
            f"{t.get('padding')!r} on the {t.get('padding_side')!r}; policyd pads to "
            "max_length on the right"
        )
    name = str(t.get("tokenizer_name") or "")
    candidates: list[Path | None] = []
    if given is not None:
        candidates.append(given / TOKENIZER_FILE if given.is_dir() else given)
    if name:
        candidates.append(local_file(name, TOKENIZER_FILE, ckpt.path))
    found = next((c for c in candidates if c is not None and c.is_file()), None)
    if found is None:
        raise ExportError(
            f"the preprocessor tokenizes with {name!r}, whose {TOKENIZER_FILE} is not here: "
            f"pass --tokenizer DIR (a directory holding {TOKENIZER_FILE}), or fetch it into the "
            f"Hugging Face cache with `huggingface-cli download {name} {TOKENIZER_FILE}` (for "
            "google/paligemma-3b-pt-224, accept its licence on the Hub first)"
        )
    shutil.copy(found, out / TOKENIZER_FILE)
    from transformers import AutoTokenizer

    check_dir(found.parent, "the tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(str(found.parent))
        pad = int(tok.pad_token_id or 0)
    except RemoteCodeRefused:
        raise
    except Exception:  # only the .model: Gemma's pad id
        pad = 0
    return t, pad


def _image_binding(ckpt: Checkpoint, feature: Feature, tensor: str) -> dict[str, Any]:
    """LeRobot's image path for PaliGemma: float [0, 1], the normaliser, then `·2 − 1`."""
    b = input_binding(ckpt, feature, tensor)
    norm = ckpt.input_norm[feature.key]
    if norm.mode == "IDENTITY":
        b.update(scale=2.0 / 255.0, offset=-1.0)
        return b
    if norm.mode == "MEAN_STD":
        # 2·(x/255 − m)/(s + e) − 1 = (x/255 − (m + (s + e)/2)) / ((s + e)/2)
        half = [(s + norm.eps) / 2 for s in b["std"]]
        b["mean"] = [m + h for m, h in zip(b["mean"], half, strict=True)]
        b["std"] = half
        b["eps"] = 0.0
        return b
    raise ExportError(f"image feature {feature.key}: normalisation {norm.mode} is not exported")


def graphs(
    model: nn.Module,
    out: Path,
    verbose: bool,
    images: list[str],
    shapes: list[tuple[int, ...]],
    resize: Sequence[bool | nn.Module],
    states: list[tuple[str, int]],
    length: int,
    empty: int,
    state_fn: nn.Module | None = None,
    flagged: list[bool] | None = None,
) -> tuple[graphs_.Graph, graphs_.Graph, list[str]]:
    """`prefix.onnx` and `step.onnx` of a LeRobot `PI0Pytorch` (pi0 or pi0.5, LeRobot's or
    openpi's weights): camera inputs named `images` at `shapes` (CHW; `resize`: at another
    size than the model's, resized in the graph, LeRobot's way, or by the module given, from
    0..255), `length` prompt tokens, the state inputs
    `states` (name, size; several are concatenated in order, none for pi0.5), `empty` masked
    cameras after the real ones; `state_fn` maps the state first (see `Prefix`); `flagged`
    cameras take a `<camera>_present` bool input, their image mask. Returns the graphs and the
    prefix outputs the step reads."""
    cfg: Any = model.config
    res = tuple(cfg.image_resolution)
    gen = torch.Generator().manual_seed(0)
    # Sample frames in each camera's range: 0..255 for a module, [0, 1] for LeRobot's resize.
    image_args = [
        torch.randint(0, 256, (1, *shape), generator=gen).float()
        if isinstance(r, nn.Module)
        else torch.rand((1, *shape), generator=gen) * (1 if r else 2) - (0 if r else 1)
        for shape, r in zip(shapes, resize, strict=True)
    ]
    tokens = torch.randint(3, 100, (1, length), generator=gen)
    token_mask = torch.ones((1, length), dtype=torch.bool)
    token_mask[:, length // 2 :] = False
    state_args = [torch.randn((1, n), generator=gen) for _, n in states]
    flagged = flagged or [False] * len(images)
    flag_names = [f"{name}_present" for name, f in zip(images, flagged, strict=True) if f]
    flag_args = [torch.ones(1, dtype=torch.bool) for _ in flag_names]
    prefix_in = [*images, "tokens", "token_mask", *[name for name, _ in states], *flag_names]
    prefix_out = ["prefix_mask", "k", "v"] + (["state_padded"] if states else [])
    max_state = int(cfg.max_state_dim) if states else None
    prefix = Prefix(model, len(images), empty, max_state, resize, res, state_fn, flagged)
    args = (*image_args, tokens, token_mask, *state_args, *flag_args)
    g1 = graphs_.export(prefix, args, prefix_in, prefix_out, out / "prefix.onnx", verbose)
    with torch.no_grad():
        cached = prefix(*args)
    chunk, max_action = int(cfg.chunk_size), int(cfg.max_action_dim)
    step_args = (torch.randn((1, chunk, max_action), generator=gen), torch.tensor([0.7]), *cached)
    step_in = ["x_t", "time", *prefix_out]
    g2 = graphs_.export(Step(model), step_args, step_in, ["v_t"], out / "step.onnx", verbose)
    return g1, g2, prefix_out


def _export(
    ckpt: Checkpoint, policy: Any, out: Path, verbose: bool, tokenizer: Path | None = None
) -> Exported:
    cfg = policy.config
    model = policy.model
    pi05 = ckpt.type == "pi05"
    by_key = {f.key: f for f in ckpt.inputs}
    if OBS_STATE not in by_key:
        raise ExportError(f"config.json: {ckpt.type} needs {OBS_STATE}")
    # `empty_cameras` are not inputs: the prefix adds them (−1, masked out), as LeRobot does.
    images = [k for k in cfg.image_features if k in by_key]
    res = tuple(cfg.image_resolution)
    # Cameras recorded at another size are resized with padding inside the prefix graph.
    resize = [tuple(by_key[k].shape[1:]) != res for k in images]
    extra = [f.key for f in ckpt.inputs if f.type != "VISUAL" and f.key != OBS_STATE]
    if extra:
        raise ExportError(f"config.json: {ckpt.type} reads {OBS_STATE} and cameras; not {extra}")
    tok, pad_id = _tokenizer(ckpt, out, tokenizer)
    length = int(tok.get("max_length", cfg.tokenizer_max_length))
    state_dim = by_key[OBS_STATE].shape[0]
    shapes = [by_key[k].shape if r else (3, *res) for k, r in zip(images, resize, strict=True)]
    # pi0.5's state reaches the model only through the prompt.
    states = [] if pi05 else [(OBS_STATE, state_dim)]
    g1, g2, prefix_out = graphs(
        model, out, verbose, images, shapes, resize, states, length, int(cfg.empty_cameras)
    )
    steps = int(cfg.num_inference_steps)
    action_dim = ckpt.outputs[0].shape[0]
    # A resized camera's binding only normalises: the graph resizes, then maps to [−1, 1].
    inputs = [
        input_binding(ckpt, by_key[k], k) if r else _image_binding(ckpt, by_key[k], k)
        for k, r in zip(images, resize, strict=True)
    ]
    state_binding = input_binding(ckpt, by_key[OBS_STATE], OBS_STATE)
    if pi05:
        del state_binding["tensor"]  # discretised into the prompt, never an engine input
    inputs.append(state_binding)
    tokenizer_table: Table = {
        "file": TOKENIZER_FILE,
        "format": "pi05" if pi05 else "lerobot",
        "max_tokens": length,
        "mask_tensor": "token_mask",
        "pad_id": pad_id,
        "overflow": "truncate" if tok.get("truncation", True) else "refuse",
    }
    if pi05:
        tokenizer_table["state_key"] = state_binding["key"]
    inputs.append(
        {
            "key": tok.get("task_key", "task"),
            "tensor": "tokens",
            "dtypes": ["text"],
            "tokenizer": tokenizer_table,
        }
    )
    output = output_binding(ckpt, "x_t")
    output["columns"] = action_dim
    relative_actions(ckpt, output, state_binding["key"], state_dim)
    return lerobot_flow(
        ckpt.type, cfg, steps, [g1, g2], prefix_out, inputs, output, tok.get("task_key", "task")
    )


def export(ckpt: Checkpoint, request: Request) -> Exported:
    """The family's entry ([`registry`](..registry)): pi0 and pi0.5 as flow pipelines,
    `[rtc]` from the checkpoint's config."""
    policy = load_policy(ckpt)
    exported = _export(ckpt, policy, request.out, request.verbose, request.tokenizer)
    return exported.with_rtc(ckpt.config)

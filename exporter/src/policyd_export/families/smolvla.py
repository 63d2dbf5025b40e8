"""SmolVLA: the SmolVLM prefix (cameras, prompt, state) and the action expert's step, served as a
policyd flow pipeline.

LeRobot's `VLAFlowMatching.sample_actions` embeds the cameras (after `prepare_images`: resize
with padding to `resize_imgs_with_padding`, then `·2 − 1`), the prompt's tokens and the padded
state, fills the VLM's KV cache over that prefix once, then integrates the expert, which reads
the cache (cross- and self-attention layers), from noise with `euler_integrate`. Here:

- `prefix.onnx` (each camera as float [0, 1] at its own resolution, token ids, token mask, the
  normalised state) → the prefix's pad mask and its keys and values stacked over layers;
- `step.onnx` (`x_t`, `time`, and those) → the velocity `v_t`;
- policyd's flow sampler (`flow_time = "lerobot"`) runs the loop, its tokenizer the VLM's
  `tokenizer.json` in format `lerobot` (the task ended with a newline, as LeRobot's
  `smolvla_new_line_processor`).

LeRobot pads a prompt to its own length (`pad_language_to = "longest"`); a graph has static
shapes, so policyd pads to `tokenizer_max_length` with a false mask. The padding is masked out
of attention and skipped by the position ids, so the model computes the same thing (checked by
`verify`, which sends prompts of several lengths).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import graphs
from ..bindings import input_binding, output_binding
from ..checkpoint import Checkpoint
from ..errors import ExportError
from ..remote_code import check_dir
from . import OBS_STATE, Exported, Request, lerobot_flow, load_policy, local_file
from .pi0 import Step  # the cache rebuilt from the stacked keys and values, `denoise_step`

TOKENIZER_FILE = "tokenizer.json"


class Prefix(nn.Module):
    """`prepare_images`, `prepare_state`, `embed_prefix` and the VLM's cached pass."""

    def __init__(self, policy: Any, images: list[str]):
        super().__init__()
        self.policy: Any = policy  # a LeRobot module (untyped)
        self.images = images

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from lerobot.policies.common.vla_utils import make_att_2d_masks

        n = len(self.images)
        tokens, token_mask, state = xs[n:]
        batch = dict(zip(self.images, xs[:n], strict=True))
        images, image_masks = self.policy.prepare_images(batch)
        state = self.policy.prepare_state({OBS_STATE: state})
        m = self.policy.model
        embs, pad, att = m.embed_prefix(images, image_masks, tokens, token_mask.bool(), state=state)
        positions = torch.cumsum(pad, dim=1) - 1
        _, cache = m.vlm_with_expert.forward(
            attention_mask=make_att_2d_masks(pad, att),
            position_ids=positions,
            past_key_values=None,
            inputs_embeds=[embs, None],
            use_cache=True,
        )
        keys = torch.stack([layer.keys for layer in cache.layers])
        values = torch.stack([layer.values for layer in cache.layers])
        return pad, keys, values


def _tokenizer(ckpt: Checkpoint, vlm: str, out: Path) -> tuple[dict[str, Any], int, str | None]:
    """Copies the VLM's tokenizer.json into the bundle; returns the tokenizer step's config,
    the pad id and the BOS token the tokenizer adds (if any)."""
    t = ckpt.tokenizer or {}
    name = str(t.get("tokenizer_name") or vlm)
    file = local_file(name, TOKENIZER_FILE, ckpt.path)
    if file is None:
        raise ExportError(
            f"SmolVLA tokenizes with its VLM {name!r}, whose {TOKENIZER_FILE} is neither a local "
            "directory's nor in the Hugging Face cache: `huggingface-cli download "
            f"{name} --include '*.json'` (the VLM's config, processor and tokenizer)"
        )
    shutil.copy(file, out / TOKENIZER_FILE)
    from transformers import AutoTokenizer

    check_dir(file.parent, "the tokenizer")
    tok = AutoTokenizer.from_pretrained(str(file.parent))
    plain = tok("pick", add_special_tokens=False)["input_ids"]
    full = tok("pick")["input_ids"]
    if full == plain:
        bos = None
    elif full[1:] == plain:
        bos = tok.convert_ids_to_tokens(full[0])
    else:
        raise ExportError(
            f"{name}'s tokenizer adds tokens other than a BOS ({full} for {plain}); policyd "
            "adds a BOS only"
        )
    return t, int(tok.pad_token_id or 0), None if bos is None else str(bos)


def _export(ckpt: Checkpoint, policy: Any, out: Path, verbose: bool) -> Exported:
    cfg = policy.config
    model = policy.model
    if cfg.adapt_to_pi_aloha:
        raise ExportError(
            "config.json: adapt_to_pi_aloha is set: SmolVLA then maps the final actions into "
            "pi's ALOHA space after the flow loop (_pi_aloha_encode_actions), a step policyd's "
            "pipeline has no graph for; not exported"
        )
    by_key = {f.key: f for f in ckpt.inputs}
    if OBS_STATE not in by_key:
        raise ExportError(f"config.json: SmolVLA needs {OBS_STATE}")
    # `empty_cameras` are not inputs: `prepare_images` fills them (−1, masked) in the graph.
    images = [k for k in cfg.image_features if k in by_key]
    extra = [f.key for f in ckpt.inputs if f.type != "VISUAL" and f.key != OBS_STATE]
    if extra:
        raise ExportError(f"config.json: SmolVLA reads {OBS_STATE} and cameras; not {extra}")
    tok, pad_id, bos = _tokenizer(ckpt, cfg.vlm_model_name, out)
    length = int(tok.get("max_length", cfg.tokenizer_max_length))
    gen = torch.Generator().manual_seed(0)
    image_args = [torch.rand((1, *by_key[k].shape), generator=gen) for k in images]
    tokens = torch.randint(6, 100, (1, length), generator=gen)
    token_mask = torch.ones((1, length), dtype=torch.bool)
    token_mask[:, length // 2 :] = False
    state = torch.randn((1, by_key[OBS_STATE].shape[0]), generator=gen)
    prefix_in = [*images, "tokens", "token_mask", OBS_STATE]
    prefix_out = ["prefix_mask", "k", "v"]
    prefix = Prefix(policy, images)
    args = (*image_args, tokens, token_mask, state)
    g1 = graphs.export(prefix, args, prefix_in, prefix_out, out / "prefix.onnx", verbose)
    with torch.no_grad():
        cached = prefix(*args)
    chunk, max_action = int(cfg.chunk_size), int(cfg.max_action_dim)
    step_args = (torch.randn((1, chunk, max_action), generator=gen), torch.tensor([0.7]), *cached)
    step_in = ["x_t", "time", *prefix_out]
    g2 = graphs.export(Step(model), step_args, step_in, ["v_t"], out / "step.onnx", verbose)
    steps = int(cfg.num_steps)
    action_dim = ckpt.outputs[0].shape[0]
    inputs = [input_binding(ckpt, by_key[k], k) for k in images]
    inputs.append(input_binding(ckpt, by_key[OBS_STATE], OBS_STATE))
    tokenizer = {
        "file": TOKENIZER_FILE,
        "format": "lerobot",
        "max_tokens": length,
        "mask_tensor": "token_mask",
        "pad_id": pad_id,
        "overflow": "truncate" if tok.get("truncation", True) else "refuse",
    }
    if bos:
        tokenizer["bos"] = bos
    inputs.append(
        {
            "key": tok.get("task_key", "task"),
            "tensor": "tokens",
            "dtypes": ["text"],
            "tokenizer": tokenizer,
        }
    )
    output = output_binding(ckpt, "x_t")
    output["columns"] = action_dim
    return lerobot_flow(
        "smolvla", cfg, steps, [g1, g2], prefix_out, inputs, output, tok.get("task_key", "task")
    )


def export(ckpt: Checkpoint, request: Request) -> Exported:
    """The family's entry ([`registry`](..registry)): a flow pipeline, `[rtc]` from the
    checkpoint's config."""
    exported = _export(ckpt, load_policy(ckpt), request.out, request.verbose)
    return exported.with_rtc(ckpt.config)

"""Every field of a LeRobot 0.6.1 policy config, per family, and what the export does with it.

A field is one of:

- `architecture`: it shapes the network, which is traced into the graphs as it is;
- `exported`: an inference-time option the bundle reproduces (the note says how, and names
  the test that checks it against LeRobot);
- `training`: read only while training (optimiser, schedules, dropout, losses, freezing);
- `no effect`: changes neither the network nor the actions (devices, compilation, Hub metadata);
- `refused`: a value other than the default changes inference in a way the bundle does not
  reproduce; `policyd-export` exits 2 naming the field and why.

`check` enforces the refusals when a checkpoint is read; `tests/test_options.py` checks that the
table covers every field of LeRobot's config classes (so a field LeRobot adds is not silently
ignored), that each refusal exits 2 naming its field, that each `exported` note names a test
that exists, and that docs/export.md shows these tables as `markdown` writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ExportError

ARCH, EXPORTED, TRAINING, NONE, REFUSED = (
    "architecture",
    "exported",
    "training",
    "no effect",
    "refused",
)


@dataclass(frozen=True)
class Option:
    kind: str
    note: str = ""
    #: For `refused`: whether the config's value is one the bundle cannot reproduce.
    refuses: Callable[[object], bool] | None = None


def _set(v: object) -> bool:
    return v is not None


TRAIN = Option(TRAINING)

#: Fields every policy config has (LeRobot's `PreTrainedConfig`).
BASE = {
    "input_features": Option(EXPORTED, "the request keys, shapes and bindings"),
    "output_features": Option(EXPORTED, "the action's dimension and `[[outputs]]`"),
    "n_obs_steps": Option(
        EXPORTED,
        "`[[inputs]] history` (Diffusion; `test_parity.py::test_diffusion_history_changes_…`)",
    ),
    "device": Option(NONE, "the export runs on the CPU"),
    "use_amp": Option(NONE, "autocast in LeRobot's eval loop, not in its inference server"),
    "use_peft": Option(
        REFUSED,
        "the checkpoint holds PEFT adapters: merge them into the weights (peft's "
        "`merge_and_unload`) and save the merged policy, then export that",
        refuses=bool,
    ),
    "pretrained_path": Option(NONE, "Hub metadata"),
    "pretrained_revision": Option(NONE, "Hub metadata"),
    "push_to_hub": Option(NONE, "Hub metadata"),
    "repo_id": Option(NONE, "Hub metadata"),
    "private": Option(NONE, "Hub metadata"),
    "tags": Option(NONE, "Hub metadata"),
    "license": Option(NONE, "Hub metadata"),
}

_NORM = Option(EXPORTED, "the bindings' statistics (`test_parity.py::test_verify_fails_when_…`)")
_OPTIM = {
    k: TRAIN
    for k in (
        "optimizer_lr",
        "optimizer_betas",
        "optimizer_eps",
        "optimizer_weight_decay",
        "optimizer_grad_clip_norm",
        "optimizer_lr_backbone",
        "scheduler_name",
        "scheduler_warmup_steps",
        "scheduler_decay_steps",
        "scheduler_decay_lr",
    )
}
_COMPILE = {
    "compile_model": Option(NONE, "torch.compile computes the same function"),
    "compile_mode": Option(NONE, "torch.compile computes the same function"),
    "gradient_checkpointing": TRAIN,
}
_BACKBONE_WEIGHTS = Option(NONE, "the checkpoint's own weights replace them")

ACT = {
    "chunk_size": Option(ARCH),
    "n_action_steps": Option(EXPORTED, "`[metadata] n_action_steps`; the chunk is served whole"),
    "normalization_mapping": _NORM,
    "vision_backbone": Option(ARCH),
    "pretrained_backbone_weights": _BACKBONE_WEIGHTS,
    "replace_final_stride_with_dilation": Option(ARCH),
    "pre_norm": Option(ARCH),
    "dim_model": Option(ARCH),
    "n_heads": Option(ARCH),
    "dim_feedforward": Option(ARCH),
    "feedforward_activation": Option(ARCH),
    "n_encoder_layers": Option(ARCH),
    "n_decoder_layers": Option(ARCH),
    "use_vae": Option(ARCH, "at inference the latent is zeros, traced"),
    "latent_dim": Option(ARCH),
    "n_vae_encoder_layers": Option(TRAINING, "the VAE encoder runs only in training"),
    "temporal_ensemble_coeff": Option(
        REFUSED,
        "temporal ensembling re-runs the model every step and averages overlapping chunks "
        "inside LeRobot's select_action; policyd serves whole chunks (as LeRobot's async "
        "policy_server, predict_action_chunk): remove it from config.json to serve the "
        "chunks, and aggregate on the client",
        refuses=_set,
    ),
    "dropout": Option(TRAINING, "eval mode"),
    "kl_weight": TRAIN,
    **{
        k: v
        for k, v in _OPTIM.items()
        if k in ("optimizer_lr", "optimizer_weight_decay", "optimizer_lr_backbone")
    },
}

DIFFUSION = {
    "horizon": Option(ARCH),
    "n_action_steps": Option(EXPORTED, "`[[outputs]] rows` (`test_parity.py`)"),
    "normalization_mapping": _NORM,
    "drop_n_last_frames": TRAIN,
    "vision_backbone": Option(ARCH),
    "resize_shape": Option(
        EXPORTED,
        "the antialiased Resize in the encoder graph "
        "(`test_parity.py::test_diffusion_resize_shape_is_served_…`)",
    ),
    "crop_ratio": Option(ARCH, "the centre crop it derives is traced"),
    "crop_shape": Option(ARCH, "the centre crop is traced"),
    "crop_is_random": Option(TRAINING, "evaluation crops at the centre"),
    "pretrained_backbone_weights": _BACKBONE_WEIGHTS,
    "use_group_norm": Option(ARCH),
    "spatial_softmax_num_keypoints": Option(ARCH),
    "use_separate_rgb_encoder_per_camera": Option(ARCH),
    "down_dims": Option(ARCH),
    "kernel_size": Option(ARCH),
    "n_groups": Option(ARCH),
    "diffusion_step_embed_dim": Option(ARCH),
    "use_film_scale_modulation": Option(ARCH),
    **_COMPILE,
    "noise_scheduler_type": Option(EXPORTED, "`[sampler] kind` (`test_parity.py`, DDIM and DDPM)"),
    "num_train_timesteps": Option(EXPORTED, "`[sampler]`, diffusers' meaning"),
    "beta_schedule": Option(EXPORTED, "`[sampler]`, diffusers' meaning"),
    "beta_start": Option(EXPORTED, "`[sampler]`"),
    "beta_end": Option(EXPORTED, "`[sampler]`"),
    "prediction_type": Option(EXPORTED, "`[sampler]`"),
    "clip_sample": Option(EXPORTED, "`[sampler]`"),
    "clip_sample_range": Option(EXPORTED, "`[sampler]`"),
    "num_inference_steps": Option(EXPORTED, "`[sampler] steps`"),
    "do_mask_loss_for_padding": TRAIN,
    **{k: v for k, v in _OPTIM.items() if k in ("optimizer_lr", "optimizer_betas")},
    **{
        k: v
        for k, v in _OPTIM.items()
        if k
        in (
            "optimizer_eps",
            "optimizer_weight_decay",
            "scheduler_name",
            "scheduler_warmup_steps",
        )
    },
}

_PI = {
    "paligemma_variant": Option(ARCH),
    "action_expert_variant": Option(ARCH),
    "dtype": Option(
        REFUSED,
        "dtype = bfloat16 runs LeRobot's model in bfloat16, whose actions float32 graphs do "
        "not reproduce: set it to float32 in config.json to export (the same weights; the "
        "TensorRT plans still build with --bf16 on the board)",
        refuses=lambda v: v not in (None, "float32"),
    ),
    "chunk_size": Option(ARCH),
    "n_action_steps": Option(EXPORTED, "`[metadata] n_action_steps`; the chunk is served whole"),
    "max_state_dim": Option(ARCH),
    "max_action_dim": Option(ARCH, "`[[outputs]] columns` cuts the padding"),
    "num_inference_steps": Option(EXPORTED, "`[sampler] steps` (`test_pi0.py`)"),
    "time_sampling_beta_alpha": TRAIN,
    "time_sampling_beta_beta": TRAIN,
    "time_sampling_scale": TRAIN,
    "time_sampling_offset": TRAIN,
    "min_period": Option(ARCH, "the time embedding is traced"),
    "max_period": Option(ARCH, "the time embedding is traced"),
    "use_relative_actions": Option(
        EXPORTED,
        "`[[outputs]] relative_to` (`test_pi0.py::test_real_camera_sizes_and_relative_…`)",
    ),
    "relative_exclude_joints": Option(
        EXPORTED, "`[[outputs]] relative_mask` (`test_pi0.py::test_real_camera_sizes_and_…`)"
    ),
    "action_feature_names": Option(
        EXPORTED, "`[[outputs]] relative_mask` (`test_pi0.py::test_real_camera_sizes_and_…`)"
    ),
    "rtc_config": Option(
        EXPORTED,
        "`[rtc]`, on or off as the checkpoint has it (`test_pi0.py::test_served_actions_equal_…`, "
        "whose verify checks RTC chunks)",
    ),
    "image_resolution": Option(
        EXPORTED,
        "resize with padding in the prefix graph (`test_pi0.py::test_real_camera_sizes_…`, "
        "`test_lerobot_client.py::test_pi0_with_480x640_cameras_…`)",
    ),
    "empty_cameras": Option(EXPORTED, "filled by the prefix graph, never bound"),
    "normalization_mapping": _NORM,
    **_COMPILE,
    "freeze_vision_encoder": TRAIN,
    "train_expert_only": TRAIN,
    "tokenizer_max_length": Option(
        EXPORTED, "`[inputs.tokenizer] max_tokens` (`test_pi0.py::test_tokens_equal_…`)"
    ),
    **{k: v for k, v in _OPTIM.items() if k not in ("optimizer_lr_backbone", "scheduler_name")},
}

SMOLVLA = {
    "chunk_size": Option(ARCH),
    "n_action_steps": Option(EXPORTED, "`[metadata] n_action_steps`; the chunk is served whole"),
    "normalization_mapping": _NORM,
    "max_state_dim": Option(ARCH),
    "max_action_dim": Option(ARCH, "`[[outputs]] columns` cuts the padding"),
    "resize_imgs_with_padding": Option(
        EXPORTED, "`prepare_images` in the prefix graph (`test_smolvla.py`)"
    ),
    "empty_cameras": Option(
        EXPORTED,
        "filled by the prefix graph, never bound "
        "(`test_smolvla.py::test_empty_cameras_are_filled_…`)",
    ),
    "adapt_to_pi_aloha": Option(
        REFUSED,
        "the final actions are mapped into pi's ALOHA space after the flow loop, a step "
        "policyd's pipeline has no graph for",
        refuses=bool,
    ),
    "use_delta_joint_actions_aloha": Option(
        REFUSED, "not implemented in LeRobot 0.6.1 either (it raises)", refuses=bool
    ),
    "tokenizer_max_length": Option(
        EXPORTED, "`[inputs.tokenizer] max_tokens` (`test_smolvla.py::test_tokens_equal_…`)"
    ),
    "num_steps": Option(EXPORTED, "`[sampler] steps` (`test_smolvla.py`)"),
    "use_cache": Option(
        NONE, "the graphs always cache the prefix; without the cache LeRobot recomputes it"
    ),
    "freeze_vision_encoder": TRAIN,
    "train_expert_only": TRAIN,
    "train_state_proj": TRAIN,
    "vlm_model_name": Option(EXPORTED, "its config, processor and tokenizer.json"),
    "load_vlm_weights": Option(NONE, "the checkpoint's own weights replace them"),
    "add_image_special_tokens": Option(ARCH, "traced in embed_prefix"),
    "attention_mode": Option(ARCH),
    "prefix_length": Option(ARCH, "the prefix padding is traced"),
    "pad_language_to": Option(
        EXPORTED,
        "policyd pads to max_tokens with a false mask, which computes the same "
        "(`test_smolvla.py::test_served_actions_equal_lerobot`)",
    ),
    "num_expert_layers": Option(ARCH),
    "num_vlm_layers": Option(ARCH),
    "self_attn_every_n_layers": Option(ARCH),
    "expert_width_multiplier": Option(ARCH),
    "min_period": Option(ARCH, "the time embedding is traced"),
    "max_period": Option(ARCH, "the time embedding is traced"),
    "rtc_config": _PI["rtc_config"],
    "compile_model": _COMPILE["compile_model"],
    "compile_mode": _COMPILE["compile_mode"],
    **{k: v for k, v in _OPTIM.items() if k not in ("optimizer_lr_backbone", "scheduler_name")},
}

_LEGACY = Option(NONE, "a GR00T N1.5-era or Isaac-GR00T runner field LeRobot 0.6.1 keeps unused")

GROOT = {
    "chunk_size": Option(EXPORTED, "`[[outputs]] rows` with the model's horizon (`test_groot.py`)"),
    "n_action_steps": Option(
        EXPORTED, "`[[outputs]] rows` and `[metadata] n_action_steps` (`test_groot.py`)"
    ),
    "max_state_dim": Option(ARCH, "the prefix graph pads the state to it"),
    "max_action_dim": Option(ARCH, "`[[outputs]] columns` cuts the padding"),
    "normalization_mapping": Option(
        NONE,
        "IDENTITY by design: GR00T's pack and decode steps normalise (the prefix graph, "
        "`[[outputs]]` min/max and clip)",
    ),
    "base_model_path": Option(
        EXPORTED,
        "its config.json sizes the network (`--base`); its weights are not read (`test_groot.py`)",
    ),
    "action_decode_transform": Option(
        REFUSED,
        "LIBERO's gripper map (−sign(2g − 1)) after decoding, which policyd's outputs cannot "
        "express",
        refuses=lambda v: v not in (None, "none", "", "auto"),
    ),
    "embodiment_tag": Option(
        EXPORTED, "its embodiment id is baked into both graphs (`test_groot.py`)"
    ),
    "tune_llm": TRAIN,
    "tune_visual": TRAIN,
    "tune_projector": TRAIN,
    "tune_diffusion_model": TRAIN,
    "tune_vlln": TRAIN,
    "tune_top_llm_layers": TRAIN,
    "num_inference_timesteps": Option(
        EXPORTED,
        "`[sampler] steps`, GR00T's buckets (`test_groot.py::test_served_actions_equal_lerobot`)",
    ),
    "rtc_ramp_rate": Option(
        EXPORTED,
        "`[rtc] rtc_ramp_rate` (`test_groot.py::test_verify_passes`, whose "
        "verify checks RTC chunks)",
    ),
    "use_flash_attention": Option(NONE, "SDPA computes the same"),
    "use_relative_actions": Option(
        REFUSED,
        "GR00T's relative actions (its per-group decode against the cached state) are not "
        "reproduced",
        refuses=bool,
    ),
    "relative_exclude_joints": Option(NONE, "read with use_relative_actions only"),
    "use_bf16": Option(
        NONE,
        "LeRobot's bf16 autocast; the bundle computes in fp32 (TensorRT: BF16 engines, see "
        "docs/export.md)",
    ),
    "model_params_fp32": Option(NONE, "the export loads the weights as float32"),
    "warmup_ratio": TRAIN,
    "tokenizer_assets_repo": Option(
        REFUSED, "an N1.5 field: LeRobot 0.6.1 refuses the checkpoint too", refuses=_set
    ),
    **{
        k: _LEGACY
        for k in (
            "image_size",
            "lora_rank",
            "lora_alpha",
            "lora_dropout",
            "lora_full_model",
            "video_backend",
            "balance_dataset_weights",
            "balance_trajectory_weights",
            "dataset_paths",
            "output_dir",
            "save_steps",
            "max_steps",
            "batch_size",
            "dataloader_num_workers",
            "report_to",
            "resume",
        )
    },
    **{
        k: TRAIN
        for k in ("optimizer_lr", "optimizer_betas", "optimizer_eps", "optimizer_weight_decay")
    },
}

TABLES: dict[str, dict[str, Option]] = {
    "act": {**BASE, **ACT},
    "diffusion": {**BASE, **DIFFUSION},
    "pi0": {**BASE, **_PI},
    "pi05": {**BASE, **_PI},
    "smolvla": {**BASE, **SMOLVLA},
    "groot": {**BASE, **GROOT},
}


def check(kind: str, config: dict[str, Any], where: str) -> None:
    """Exit 2 (an ExportError) for the first refused field whose value the bundle cannot
    reproduce, naming it and why."""
    for name, option in TABLES.get(kind, {}).items():
        if option.kind == REFUSED and option.refuses is not None and name in config:
            value = config[name]
            if option.refuses(value):
                raise ExportError(f"{where}: {name} = {value!r} is not exported: {option.note}")


def markdown(kind: str) -> str:
    """The family's table as docs/export.md shows it."""
    lines = ["| field | what the export does |", "|---|---|"]
    for name, option in sorted(TABLES[kind].items()):
        note = f": {option.note}" if option.note else ""
        lines.append(f"| `{name}` | {option.kind}{note} |")
    return "\n".join(lines)

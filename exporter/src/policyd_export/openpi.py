"""openpi's own pi0 and pi0.5 checkpoints: what openpi does around the model, as a policyd bundle.

openpi's PyTorch checkpoints (its `examples/convert_jax_model_to_pytorch.py` writes
`model.safetensors`, a small `config.json` and, when it finds them, `assets/<asset_id>/
norm_stats.json`) hold the same module tree as LeRobot 0.6.1's `PI0Pytorch`, so the graphs are
`families/pi0.py`'s. Nothing in the checkpoint says which training config made it, and that
config decides everything around the model: the request keys, the normalisation, the prompt,
the delta actions, the columns sent back. So the user names it (`--config pi05_libero`), and
`CONFIGS` holds what openpi's `training/config.py` (HEAD 15a9616) sets for each published one.

openpi's order (`policy_config.create_trained_policy`) and where each step lands:

- data transforms (`LiberoInputs`, `DroidInputs`, `AlohaInputs`): the request keys of the
  bindings; a missing camera slot (the right wrist) is LeRobot's `empty_cameras` (−1, masked
  out), which is what openpi's zero uint8 image becomes after its `/255·2 − 1`; DROID's state
  is two keys, which the prefix graph (pi0) or the prompt (pi0.5) concatenates; ALOHA's
  `adapt_to_pi` state decode runs in the prefix graph (`AdaptToPi`) for pi0, and in the state
  binding for pi0.5 (whose state is discretised into the prompt before any graph runs): the
  flips as a per-joint `scale`, the grippers through policyd's `aloha_gripper_to_angular` map;
- `Normalize`: the bindings' `mean`/`std` with `eps = 1e-6` (z-score), or `min`/`max` with
  `max = q99 + 1e-6` (quantile: `(x − q01)/(q99 − q01 + 1e-6)·2 − 1`);
- model transforms: `ResizeImages(224, 224)` is the identity on the 224×224 frames openpi's
  clients send; a bundle exported for another frame size (`--frame-size`) does it in the prefix
  graph (`ResizeWithPad`: Pillow's BILINEAR, as `openpi_client.image_tools` resizes, padded);
  `TokenizePrompt` is policyd's tokenizer, format `pi0` or, with `discrete_state_input`, `pi05`;
  `PadStatesAndActions` is the graph's `pad_vector`;
- the model: openpi's 10 Euler steps, `flow_time = "openpi"`;
- `Unnormalize`, `AbsoluteActions` (`[[outputs]] relative_to` with the config's mask), and the
  data outputs' columns (ALOHA's encode: `[[outputs]] scale`/`offset`).
"""

from __future__ import annotations

import os
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .bundle import ManifestInput, Source
from .checkpoint import check_sizes, check_statistics
from .errors import ExportError, read_json
from .families import Exported, Table, flow_pipeline

#: The PaliGemma SentencePiece model (openpi's `maybe_download` keeps it in its cache,
#: `$OPENPI_DATA_HOME` or ~/.cache/openpi, under big_vision/).
TOKENIZER_FILE = "paligemma_tokenizer.model"
#: openpi's normalisation epsilon (`transforms.Normalize`/`Unnormalize`).
EPS = 1e-6
#: openpi's camera slots, in the model's order (`model.IMAGE_KEYS`).
SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
#: openpi's image size (`ResizeImages(224, 224)`).
RESOLUTION = (224, 224)
CONVERT = (
    "uv run examples/convert_jax_model_to_pytorch.py --checkpoint_dir {ckpt} "
    "--config_name {config} --output_path {ckpt}_pytorch"
)


@dataclass(frozen=True)
class Robot:
    """openpi's `*Inputs` / `*Outputs` for one robot: the request keys of the cameras (in slot
    order; the slots past them are masked zero images), of the state's parts with their sizes
    (concatenated in order), and how many action columns go back."""

    name: str
    cameras: tuple[str, ...]
    state: tuple[tuple[str, int], ...]
    columns: int
    #: Frames sent channels first (ALOHA's clients), not HWC.
    chw: bool = False
    #: ALOHA's `adapt_to_pi`: joint sign flips and the gripper maps, on the state and actions.
    adapt_to_pi: bool = False
    #: Cameras a request may leave out: openpi gives the slot a zero image with its mask off.
    optional: tuple[str, ...] = ()

    @property
    def state_dim(self) -> int:
        return sum(n for _, n in self.state)


#: `LiberoInputs`/`LiberoOutputs` (examples/libero/main.py sends an 8-value state: end
#: effector position, axis-angle, gripper joints).
LIBERO = Robot(
    "LIBERO", ("observation/image", "observation/wrist_image"), (("observation/state", 8),), 7
)
#: `DroidInputs`/`DroidOutputs`: joints then gripper, the exterior camera and the wrist.
DROID = Robot(
    "DROID",
    ("observation/exterior_image_1_left", "observation/wrist_image_left"),
    (("observation/joint_position", 7), ("observation/gripper_position", 1)),
    8,
)


#: `AlohaInputs`/`AlohaOutputs`: the top camera and the two wrists (`cam_low`, which openpi's
#: clients also send, is not read), channels first; the 14 joint and gripper values.
ALOHA = Robot(
    "ALOHA",
    ("images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist"),
    (("state", 14),),
    14,
    chw=True,
    adapt_to_pi=True,
    # `AlohaInputs`: only `cam_high` is required.
    optional=("images/cam_left_wrist", "images/cam_right_wrist"),
)
#: ALOHA sim (examples/aloha_sim): the top camera only; the wrist slots are masked zero images.
ALOHA_SIM = Robot("ALOHA sim", ("images/cam_high",), (("state", 14),), 14, True, True)
#: openpi's `aloha_policy._joint_flip_mask` and gripper constants.
FLIP = (1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1)
GRIPPERS = (6, 13)


#: Pillow's fixed-point precision for 8-bit resampling (`PRECISION_BITS` in Resample.c).
PIL_BITS = 22


def pil_bilinear_coefficients(n_in: int, n_out: int) -> NDArray[np.int64]:
    """`[n_in, n_out]`: the integer weights Pillow's `Image.resize(..., BILINEAR)` gives each
    input pixel for each output pixel along one axis (Resample.c's `precompute_coeffs` in
    double, then `normalize_coeffs_8bpc`'s rounding to `PRECISION_BITS`): a triangle whose
    support widens by the downscale factor, normalised per output pixel."""
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support = 1.0 * filterscale
    out = np.zeros((n_in, n_out), np.int64)
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        ss = 1.0 / filterscale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in) - xmin
        ws = []
        total = 0.0
        for x in range(xmax):
            d = abs((x + xmin - center + 0.5) * ss)
            w = 1.0 - d if d < 1.0 else 0.0
            ws.append(w)
            total += w
        for x, w in enumerate(ws):
            k = w / total if total != 0.0 else w
            out[xmin + x, xx] = int(0.5 + k * (1 << PIL_BITS))
    return out


class PilPass(torch.nn.Module):
    """One of Pillow's two passes (horizontal, then vertical) on uint8 values held as float:
    `clip8((2^21 + Σ pixel·k) >> 22)`, exactly. Each 22-bit weight is split in two 11-bit
    halves so that every product and partial sum is an integer below 2^24: exact in float32
    (and under TF32, whose inputs keep 11 bits), whatever order a matmul kernel sums in."""

    hi: torch.Tensor
    lo: torch.Tensor

    def __init__(self, coefficients: NDArray[np.int64], axis: int):
        super().__init__()
        taps = int((coefficients > 0).sum(axis=0).max())
        if taps > 32:
            raise ExportError(
                f"a {coefficients.shape[0]}-pixel side is over 15 times the 224-pixel frame; "
                "send frames at most 3360 pixels a side"
            )
        half = 1 << (PIL_BITS // 2)
        hi, lo = np.divmod(coefficients, half)
        if axis == -2:  # rows: [n_out, n_in] @ x
            hi, lo = hi.T, lo.T
        self.axis = axis
        self.register_buffer("hi", torch.from_numpy(hi.astype(np.float32)))
        self.register_buffer("lo", torch.from_numpy(lo.astype(np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = float(1 << (PIL_BITS // 2))
        if self.axis == -1:
            sh, sl = torch.matmul(x, self.hi), torch.matmul(x, self.lo)
        else:
            sh, sl = torch.matmul(self.hi, x), torch.matmul(self.lo, x)
        # (sh·2^11 + sl + 2^21) >> 22, with sh = qh·2^11 + rh: qh + ((rh·2^11 + sl + 2^21) >> 22).
        qh = torch.floor(sh / half)
        rh = sh - qh * half
        rest = torch.floor((rh * half + sl + float(1 << (PIL_BITS - 1))) / float(1 << PIL_BITS))
        return torch.clamp(qh + rest, 0.0, 255.0)


class ResizeWithPad(torch.nn.Module):
    """openpi's `ResizeImages(224, 224)` on a uint8 frame given as its 0..255 values (CHW):
    `openpi_client.image_tools.resize_with_pad` keeps the aspect (`int(side / ratio)`),
    resizes with Pillow's BILINEAR (a horizontal pass rounded to uint8, then a vertical one,
    each [`PilPass`], bit for bit), pads with black around the centre; then
    `Observation.from_dict`'s `/ 255 · 2 − 1`."""

    def __init__(self, height: int, width: int):
        super().__init__()
        th, tw = RESOLUTION
        ratio = max(width / tw, height / th)
        rh, rw = int(height / ratio), int(width / ratio)
        # Pillow skips a pass whose size does not change (it would be the identity).
        self.cols = PilPass(pil_bilinear_coefficients(width, rw), -1) if rw != width else None
        self.rows = PilPass(pil_bilinear_coefficients(height, rh), -2) if rh != height else None
        top, left = (th - rh) // 2, (tw - rw) // 2
        self.pad = (left, tw - rw - left, top, th - rh - top)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cols is not None:
            x = self.cols(x)
        if self.rows is not None:
            x = self.rows(x)
        x = torch.nn.functional.pad(x, self.pad, value=0.0)
        return x * (2.0 / 255.0) - 1.0


class AdaptToPi(torch.nn.Module):
    """`AlohaInputs`' state decode (`_decode_state`: the joint sign flips, each gripper's
    linear position to the pi runtime's angle through an arcsin) and then openpi's z-score
    `Normalize`, in the prefix graph: the arcsin is not an affine map, so the bindings cannot
    do it."""

    def __init__(self, mean: NDArray[np.float64], std: NDArray[np.float64]):
        super().__init__()
        self.flip: torch.Tensor
        self.mean: torch.Tensor
        self.std: torch.Tensor
        self.register_buffer("flip", torch.tensor(FLIP, dtype=torch.float32))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))

    @staticmethod
    def gripper(x: torch.Tensor) -> torch.Tensor:
        # `_gripper_to_angular`: to metres, the horn's angle, normalised to pi's range.
        v = x * (0.05800 - 0.01844) + 0.01844
        v = (0.022**2 + v * v - 0.036**2) / (2 * 0.022 * v)
        v = torch.asin(torch.clamp(v, -1.0, 1.0))
        return (v - 0.5476) / (1.6296 - 0.5476)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        s = state * self.flip
        g = self.gripper
        s = torch.cat([s[..., :6], g(s[..., 6:7]), s[..., 7:13], g(s[..., 13:14])], dim=-1)
        return (s - self.mean) / (self.std + EPS)


def bool_mask(*dims: int) -> tuple[bool, ...]:
    """openpi's `make_bool_mask`: (6, −1) is six trues and a false."""
    return tuple(b for d in dims for b in [d > 0] * abs(d))


@dataclass(frozen=True)
class TrainConfig:
    """One of openpi's training configs, as far as inference sees it."""

    name: str
    pi05: bool
    robot: Robot
    action_horizon: int
    asset_id: str
    #: `DeltaActions`/`AbsoluteActions` mask (None: absolute actions).
    delta: tuple[bool, ...] | None = None
    #: `discrete_state_input` (None: openpi's default, on for pi0.5).
    discrete_state: bool | None = None
    #: What openpi's server sends as metadata (`policy_metadata`, `{}` when unset).
    metadata: dict[str, Any] = field(default_factory=dict)
    #: `InjectDefaultPrompt`: the prompt of a request without one.
    default_prompt: str | None = None

    @property
    def max_token_len(self) -> int:
        return 200 if self.pi05 else 48

    @property
    def state_in_prompt(self) -> bool:
        return self.pi05 if self.discrete_state is None else self.discrete_state

    @property
    def quantile(self) -> bool:
        # `use_quantile_norm=model_config.model_type != ModelType.PI0`
        return self.pi05


CONFIGS = {
    c.name: c
    for c in [
        TrainConfig(
            "pi0_libero", False, LIBERO, 50, "physical-intelligence/libero", bool_mask(6, -1)
        ),
        TrainConfig(
            "pi05_libero", True, LIBERO, 10, "physical-intelligence/libero", discrete_state=False
        ),
        TrainConfig("pi0_droid", False, DROID, 10, "droid"),
        TrainConfig("pi05_droid", True, DROID, 15, "droid"),
        TrainConfig("pi05_droid_finetune", True, DROID, 16, "droid"),
        TrainConfig("pi05_full_droid_finetune", True, DROID, 16, "droid", bool_mask(7, -1)),
        *(
            TrainConfig(
                name,
                name.startswith("pi05"),
                ALOHA,
                50,
                "trossen",
                bool_mask(6, -1, 6, -1),
                metadata={"reset_pose": [0, -1.5, 1.5, 0, 0, 0]} if reset else {},
                default_prompt=prompt,
            )
            for name, prompt, reset in [
                ("pi0_aloha", None, True),
                ("pi0_aloha_towel", "fold the towel", True),
                ("pi0_aloha_tupperware", "open the tupperware and put the food on the plate", True),
                ("pi0_aloha_pen_uncap", "uncap the pen", False),
                ("pi05_aloha", None, True),
                ("pi05_aloha_pen_uncap", "uncap the pen", False),
            ]
        ),
        # `use_delta_joint_actions=False`; the asset id is the dataset's repo id.
        TrainConfig(
            "pi0_aloha_sim",
            False,
            ALOHA_SIM,
            50,
            "lerobot/aloha_sim_transfer_cube_human",
            default_prompt="Transfer cube",
        ),
    ]
}
_FAST = (
    "pi0-FAST: openpi converts only Pi0Config models to PyTorch, and policyd does not serve "
    "FAST's autoregressive decoding yet"
)
#: openpi's other published configs, and why each is refused.
REFUSED = {
    **{
        n: _FAST
        for n in [
            "pi0_fast_droid",
            "pi0_fast_libero",
            "pi0_fast_libero_low_mem_finetune",
            "pi0_fast_full_droid_finetune",
        ]
    },
    "pi0_libero_low_mem_finetune": (
        "a LoRA fine-tune (paligemma_variant gemma_2b_lora): LeRobot's PI0 model, which "
        "policyd-export traces, knows only gemma_2b and gemma_300m"
    ),
}


def config(name: str) -> TrainConfig:
    if name in CONFIGS:
        return CONFIGS[name]
    known = ", ".join(sorted(CONFIGS))
    if name in REFUSED:
        raise ExportError(f"--config {name}: not exported: {REFUSED[name]}; exported: {known}")
    raise ExportError(f"--config {name}: not one of openpi's configs known here; known: {known}")


@dataclass
class Stats:
    """One key of openpi's `norm_stats.json`."""

    mean: NDArray[np.float64]
    std: NDArray[np.float64]
    q01: NDArray[np.float64] | None
    q99: NDArray[np.float64] | None


@dataclass
class Checkpoint:
    path: Path
    config: TrainConfig
    #: openpi's `config.json`: action_dim, action_horizon, the two Gemma variants, precision.
    model: dict[str, Any]
    state: Stats
    actions: Stats
    norm_stats: Path
    #: The frames the robot sends (height, width); openpi resizes them to `RESOLUTION`.
    frames: tuple[int, int] = RESOLUTION


def _refuse_orbax(path: Path, cfg: TrainConfig) -> None:
    if (path / "params").is_dir() or (path / "_CHECKPOINT_METADATA").is_file():
        raise ExportError(
            f"{path}: an openpi JAX (Orbax) checkpoint; policyd-export reads openpi's PyTorch "
            "checkpoints. Convert it in a clone of openpi with "
            f"`{CONVERT.format(ckpt=path, config=cfg.name)}`, then export "
            f"{path}_pytorch with --norm-stats {path / 'assets' / cfg.asset_id}"
        )


def _stats(raw: Any, key: str, where: Path, quantile: bool) -> Stats:
    try:
        s = raw["norm_stats"][key]
        mean, std = np.asarray(s["mean"], np.float64), np.asarray(s["std"], np.float64)
        q01 = np.asarray(s["q01"], np.float64) if s.get("q01") is not None else None
        q99 = np.asarray(s["q99"], np.float64) if s.get("q99") is not None else None
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(
            f"{where}: no usable norm_stats.{key} (mean, std, q01, q99 lists): {e}"
        ) from None
    if quantile and (q01 is None or q99 is None):
        raise ExportError(
            f"{where}: norm_stats.{key} lacks q01/q99, which this config's quantile "
            "normalisation reads (openpi's compute_norm_stats writes them)"
        )
    found = {"mean": mean, "std": std}
    if q01 is not None and q99 is not None:
        found.update(q01=q01, q99=q99)
    check_statistics({f"norm_stats.{key}": found}, str(where))
    return Stats(mean.reshape(-1), std.reshape(-1), q01, q99)


def _norm_stats_file(path: Path, cfg: TrainConfig, given: Path | None) -> Path:
    looked = []
    if given is not None:
        for c in (given, given / "norm_stats.json", given / cfg.asset_id / "norm_stats.json"):
            looked.append(c)
            if c.is_file():
                return c
    else:
        c = path / "assets" / cfg.asset_id / "norm_stats.json"
        looked.append(c)
        if c.is_file():
            return c
    raise ExportError(
        f"no norm_stats.json for asset {cfg.asset_id!r} (looked at {', '.join(map(str, looked))}); "
        "openpi's converter copies the assets/ beside the JAX checkpoint's directory, not its "
        "own, so pass --norm-stats JAX_CHECKPOINT/assets/" + cfg.asset_id
    )


def load(
    path: str | Path,
    name: str,
    norm_stats: Path | None = None,
    frames: tuple[int, int] = RESOLUTION,
) -> Checkpoint:
    """Reads and checks an openpi PyTorch checkpoint directory for the training config `name`
    (`frames`: the size the robot's cameras send)."""
    path = Path(path)
    if min(frames) < 1 or max(frames) > 4096:
        raise ExportError(f"--frame-size {frames[0]}x{frames[1]}: each side must be 1 to 4096")
    cfg = config(name)
    if not path.is_dir():
        raise ExportError(f"{path}: not a directory (give the converter's --output_path)")
    _refuse_orbax(path, cfg)
    if not (path / "model.safetensors").is_file():
        raise ExportError(
            f"{path}: no model.safetensors; give the directory openpi's "
            "convert_jax_model_to_pytorch.py wrote"
        )
    model = read_json(path / "config.json", "openpi's converter's config")
    if not isinstance(model, dict):
        raise ExportError(f"{path / 'config.json'}: not a JSON object")
    for key in ("action_dim", "action_horizon", "paligemma_variant", "action_expert_variant"):
        if key not in model:
            raise ExportError(f"{path / 'config.json'}: no {key} (not openpi's converter's config)")
    check_sizes(model, str(path / "config.json"))
    stats_file = _norm_stats_file(path, cfg, norm_stats)
    raw = read_json(stats_file, "openpi's norm_stats.json")
    state = _stats(raw, "state", stats_file, cfg.quantile)
    actions = _stats(raw, "actions", stats_file, cfg.quantile)
    if state.mean.size < cfg.robot.state_dim:
        raise ExportError(
            f"{stats_file}: the state's statistics have {state.mean.size} values; {cfg.name}'s "
            f"{cfg.robot.name} state has {cfg.robot.state_dim} (openpi would fail too)"
        )
    if int(model["action_dim"]) < max(cfg.robot.state_dim, cfg.robot.columns):
        raise ExportError(
            f"{path / 'config.json'}: action_dim {model['action_dim']} is smaller than the "
            f"{cfg.robot.name} state or actions"
        )
    return Checkpoint(path, cfg, model, state, actions, stats_file, frames)


def lerobot_config(ckpt: Checkpoint) -> Any:  # a LeRobot PI0Config / PI05Config
    """LeRobot's config for the same network: openpi's sizes, the robot's cameras in openpi's
    slot order with the missing ones as LeRobot's empty (masked) cameras, fp32."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    cfg = ckpt.config
    if cfg.pi05:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
    else:
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
    cams = len(cfg.robot.cameras)
    inputs = {
        f"observation.images.{slot}": PolicyFeature(FeatureType.VISUAL, (3, *RESOLUTION))
        for slot in SLOTS[:cams]
    }
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (cfg.robot.state_dim,))
    dim, horizon = int(ckpt.model["action_dim"]), int(ckpt.model["action_horizon"])
    try:
        return Config(
            input_features=inputs,
            output_features={"action": PolicyFeature(FeatureType.ACTION, (cfg.robot.columns,))},
            paligemma_variant=str(ckpt.model["paligemma_variant"]),
            action_expert_variant=str(ckpt.model["action_expert_variant"]),
            chunk_size=horizon,
            n_action_steps=horizon,
            max_state_dim=dim,
            max_action_dim=dim,
            tokenizer_max_length=cfg.max_token_len,
            num_inference_steps=10,
            empty_cameras=len(SLOTS) - cams,
            image_resolution=RESOLUTION,
            dtype="float32",
            device="cpu",
        )
    except ValueError as e:
        raise ExportError(f"{ckpt.path / 'config.json'}: {e}") from None


#: Where openpi's converter's `save_model` keeps the tied embedding (the alphabetically first
#: name of the two), and where LeRobot's module reads it.
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"


def load_weights(ckpt: Checkpoint, policy: Any) -> None:
    """openpi's tensors into LeRobot's module, every one accounted for: LeRobot's own loader
    warns and keeps random weights when names do not match, so this checks it itself."""
    from safetensors.torch import load_file

    file = ckpt.path / "model.safetensors"
    try:
        tensors = load_file(str(file))
    except Exception as e:
        raise ExportError(f"{file}: not a safetensors file ({e})") from None
    if LM_HEAD in tensors and EMBED not in tensors:
        tensors[EMBED] = tensors[LM_HEAD]
    module = policy.model
    want = module.state_dict()
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    shapes = sorted(
        f"{k} {list(tensors[k].shape)} (the model has {list(want[k].shape)})"
        for k in set(want) & set(tensors)
        if tuple(tensors[k].shape) != tuple(want[k].shape)
    )
    if missing or unexpected or shapes:

        def some(keys: list[str]) -> str:
            more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
            return ", ".join(keys[:8]) + more

        problems = [
            f"missing {len(missing)}: {some(missing)}" if missing else "",
            f"unexpected {len(unexpected)}: {some(unexpected)}" if unexpected else "",
            f"other shapes: {some(shapes)}" if shapes else "",
        ]
        kind = "pi0.5" if ckpt.config.pi05 else "pi0"
        raise ExportError(
            f"{file}: its tensors do not match a {kind} model with config.json's sizes "
            f"({ckpt.config.name}): {'; '.join(p for p in problems if p)}. Check --config (pi0 "
            "and pi0.5 differ in the time MLP and the expert's norms) and config.json"
        )
    with torch.no_grad():
        module.load_state_dict(
            {k: v.to(want[k].dtype) for k, v in tensors.items()}, strict=True, assign=False
        )


def _tokenizer(out: Path, given: Path | None) -> None:
    candidates = []
    if given is not None:
        candidates += (
            [given / TOKENIZER_FILE, given / "tokenizer.model"] if given.is_dir() else [given]
        )
    cache = Path(os.environ.get("OPENPI_DATA_HOME", "~/.cache/openpi")).expanduser()
    candidates.append(cache / "big_vision" / TOKENIZER_FILE)
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ExportError(
            f"no PaliGemma tokenizer (looked at {', '.join(map(str, candidates))}): pass "
            f"--tokenizer PATH to {TOKENIZER_FILE} (openpi downloads it from "
            f"gs://big_vision/{TOKENIZER_FILE} into $OPENPI_DATA_HOME/big_vision/, by default "
            "~/.cache/openpi/big_vision/)"
        )
    shutil.copy(found, out / TOKENIZER_FILE)


def _state_bindings(ckpt: Checkpoint, tensors: bool) -> list[Table]:
    """The state's parts, each normalised with its slice of openpi's statistics."""
    cfg, s = ckpt.config, ckpt.state
    out = []
    at = 0
    for key, n in cfg.robot.state:
        b: Table = {"key": key, "dtypes": ["float32", "float64"], "shape": [n]}
        if tensors:
            b["tensor"] = key.rsplit("/", 1)[-1]
        out.append(b)
        start, at = at, at + n
        part = slice(start, at)
        if cfg.robot.adapt_to_pi and not cfg.pi05:
            continue  # raw: the prefix graph decodes and normalises it (`AdaptToPi`)
        if cfg.robot.adapt_to_pi:
            # pi0.5 discretises the state into the prompt, on the CPU: `_decode_state` as the
            # binding's per-joint sign (`scale`) and policyd's `aloha_gripper_to_angular`, then
            # openpi's quantile `Normalize` on the decoded values.
            b["scale"] = [float(f) for f in FLIP[start:at]]
            b["map"] = {
                "function": "aloha_gripper_to_angular",
                "columns": [j - start for j in GRIPPERS if start <= j < at],
            }
        if cfg.quantile:
            assert s.q01 is not None and s.q99 is not None
            b.update(
                min=[float(v) for v in s.q01[part]],
                max=[float(v) + EPS for v in s.q99[part]],
            )
        else:
            b.update(mean=[float(v) for v in s.mean[part]], std=[float(v) for v in s.std[part]])
            b["eps"] = EPS
    return out


def _output(ckpt: Checkpoint) -> Table:
    """`Unnormalize`, `AbsoluteActions`, the data outputs' columns. Statistics shorter than the
    columns pass the rest through, as openpi pads them (mean 0 and std 1; quantile columns
    as they are)."""
    cfg, a = ckpt.config, ckpt.actions
    n = cfg.robot.columns
    o: Table = {"tensor": "x_t", "key": "actions", "dtype": "float32", "columns": n}

    def padded(v: NDArray[np.float64], fill: float) -> list[float]:
        return [float(x) for x in v[:n]] + [fill] * max(0, n - v.size)

    if cfg.quantile:
        assert a.q01 is not None and a.q99 is not None
        lo = padded(a.q01, -1.0)
        hi = [h + EPS if i < a.q99.size else 1.0 for i, h in enumerate(padded(a.q99, 1.0))]
        o.update(min=lo, max=hi)
    else:
        o.update(mean=padded(a.mean, 0.0), std=padded(a.std, 1.0), eps=EPS)
    if cfg.robot.adapt_to_pi:
        # `AlohaOutputs`' encode after `AbsoluteActions`: the joints' sign flips, each gripper's
        # `_gripper_from_angular` (affine: (y + 0.5476 + 0.6213)/(1.4910 + 0.6213)). A flipped
        # relative joint is flip·(y + flip·state) = flip·y + state: the state as sent is added
        # after the scale, as policyd does.
        span = 1.4910 + 0.6213
        o["scale"] = [1.0 / span if j in GRIPPERS else float(FLIP[j]) for j in range(n)]
        o["offset"] = [(0.5476 + 0.6213) / span if j in GRIPPERS else 0.0 for j in range(n)]
    if cfg.delta is not None:
        # openpi adds the state (un-normalised back) to the masked columns; the mask covers
        # the first state part (LIBERO's state, DROID's joints).
        key, size = cfg.robot.state[0]
        mask = list(cfg.delta[:n])
        # openpi's `AbsoluteActions` adds the state only where the mask is true: trailing
        # false entries change nothing (pi05_full_droid_finetune's 8th, DROID's gripper,
        # past its 7-value joint part).
        while mask and not mask[-1]:
            mask.pop()
        if len(mask) > size:
            raise ExportError(
                f"{cfg.name}: a delta mask of {len(mask)} over a state part of {size}"
            )
        if mask:
            o.update(relative_to=key, relative_mask=mask)
    return o


def source(ckpt: Checkpoint) -> Source:
    """The checkpoint as a bundle's source: openpi's request keys, no LeRobot client."""
    cfg = ckpt.config
    keys = [*cfg.robot.cameras, *(k for k, _ in cfg.robot.state), "prompt"]
    h, w = ckpt.frames
    resized = "" if ckpt.frames == RESOLUTION else " (resized to 224×224 as openpi does)"
    return Source(
        path=ckpt.path,
        policy_type=f"openpi/{cfg.name}",
        describe=f"openpi's {cfg.name} checkpoint",
        serving="\n".join(
            textwrap.wrap(
                f"Request keys are openpi's {cfg.robot.name} client's: {', '.join(keys)}; "
                f"images uint8 {'CHW' if cfg.robot.chw else 'HWC'} {h}×{w}{resized}. "
                f"Normalisation is openpi's, from {ckpt.norm_stats}.",
                90,
            )
        )
        + "\n",
        inputs=[
            ManifestInput(feature=k, key=k, type="VISUAL", shape=[3, *ckpt.frames])
            for k in cfg.robot.cameras
        ]
        + [ManifestInput(feature=k, key=k, type="STATE", shape=[n]) for k, n in cfg.robot.state],
        lerobot=None,
    )


def export(
    ckpt: Checkpoint, out: Path, verbose: bool = False, tokenizer: Path | None = None
) -> Exported:
    from lerobot.policies.factory import get_policy_class

    from .families import pi0

    cfg = ckpt.config
    _tokenizer(out, tokenizer)
    lcfg = lerobot_config(ckpt)
    policy = get_policy_class("pi05" if cfg.pi05 else "pi0")(lcfg).eval()
    load_weights(ckpt, policy)
    cams = list(SLOTS[: len(cfg.robot.cameras)])
    # pi0's expert reads the state (DROID's two parts concatenated in the graph); pi0.5's
    # reaches the model only through the prompt, or not at all (pi05_libero).
    states = [] if cfg.pi05 else [(key.rsplit("/", 1)[-1], n) for key, n in cfg.robot.state]
    # Frames of another size: openpi's ResizeImages in the graph, on the raw 0..255 values.
    resize: list[bool | torch.nn.Module] = [False] * len(cams)
    if ckpt.frames != RESOLUTION:
        resize = [ResizeWithPad(*ckpt.frames) for _ in cams]
    state_fn = None
    if cfg.robot.adapt_to_pi and not cfg.pi05:
        d = cfg.robot.state_dim
        state_fn = AdaptToPi(ckpt.state.mean[:d], ckpt.state.std[:d])
    g1, g2, prefix_out = pi0.graphs(
        policy.model,
        out,
        verbose,
        cams,
        [(3, *ckpt.frames)] * len(cams),
        resize,
        states,
        cfg.max_token_len,
        len(SLOTS) - len(cams),
        state_fn,
        [key in cfg.robot.optional for key in cfg.robot.cameras],
    )
    chw = cfg.robot.chw
    # openpi's `Observation.from_dict`: uint8 / 255 · 2 − 1 (in the graph after a resize).
    resized = ckpt.frames != RESOLUTION
    to_model = {} if resized else {"scale": 2.0 / 255.0, "offset": -1.0}
    # A camera left out: openpi's zero uint8 image (0 before the graph's resize, −1 after the
    # binding's map), its mask from the presence flag.
    black = 0.0 if resized else -1.0
    inputs: list[Table] = [
        {
            "key": key,
            "tensor": slot,
            "dtypes": ["uint8"],
            "shape": [3, *ckpt.frames] if chw else [*ckpt.frames, 3],
            **({} if chw else {"layout": "hwc_to_chw"}),
            **to_model,
            **(
                {"optional": True, "fill": black, "present_tensor": f"{slot}_present"}
                if key in cfg.robot.optional
                else {}
            ),
        }
        for key, slot in zip(cfg.robot.cameras, cams, strict=True)
    ]
    if not cfg.pi05 or cfg.state_in_prompt or cfg.delta is not None:
        inputs += _state_bindings(ckpt, tensors=not cfg.pi05)
    tokenizer_table: Table = {
        "file": TOKENIZER_FILE,
        "format": "pi05" if cfg.state_in_prompt else "pi0",
        "max_tokens": cfg.max_token_len,
        "mask_tensor": "token_mask",
        "pad_id": 0,
        "overflow": "truncate",
    }
    if cfg.default_prompt is not None:
        tokenizer_table["default_prompt"] = cfg.default_prompt
    if cfg.state_in_prompt:
        keys = [k for k, _ in cfg.robot.state]
        tokenizer_table["state_key"] = keys[0] if len(keys) == 1 else keys
    inputs.append(
        {"key": "prompt", "tensor": "tokens", "dtypes": ["text"], "tokenizer": tokenizer_table}
    )
    exported = flow_pipeline(
        "pi05" if cfg.pi05 else "pi0",
        [g1, g2],
        prefix_out,
        inputs,
        _output(ckpt),
        dict(cfg.metadata),
        steps=10,
        flow_time="openpi",
        horizon=int(lcfg.chunk_size),
        max_action=int(lcfg.max_action_dim),
        action_dim=cfg.robot.columns,
        prompt_key="prompt",
    )
    exported.manifest["norm_stats"] = str(ckpt.norm_stats.resolve())
    exported.with_rtc({})
    return exported

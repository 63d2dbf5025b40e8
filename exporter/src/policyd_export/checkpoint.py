"""What is in a LeRobot checkpoint directory, read without running any of it.

`save_pretrained` writes `config.json` (the policy's type, features and hyper-parameters),
`model.safetensors`, and the processor pipelines `policy_preprocessor.json` /
`policy_postprocessor.json`, whose normaliser steps keep their statistics in safetensors files
beside them. Everything the bundle needs to normalise as LeRobot does comes from those files;
nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from . import options
from .errors import ExportError, read_json
from .registry import SUPPORTED

#: Policy types this exporter turns into bundles (config.json's "type").
#: Types LeRobot has that are planned but not exported yet, with what stands in the way.
PLANNED = {
    "pi0_fast": "autoregressive decoding, no prefix + step split (not exported yet)",
}

PREPROCESSOR = "policy_preprocessor.json"
POSTPROCESSOR = "policy_postprocessor.json"
#: Processor steps whose effect the bundle reproduces (batching and devices are no-ops there;
#: pi0's newline and tokenizer steps are policyd's `lerobot` tokenizer format; relative
#: actions are `[[outputs]] relative_to`, for the families that apply them).
KNOWN_STEPS = {
    PREPROCESSOR: {
        "rename_observations_processor",
        "to_batch_processor",
        "device_processor",
        "normalizer_processor",
        "pi0_new_line_processor",
        "smolvla_new_line_processor",
        "pi05_prepare_state_tokenizer_processor_step",
        "tokenizer_processor",
        "relative_actions_processor",
        # GR00T N1.7's own steps: packing, normalising and encoding are its prefix graph and
        # policyd's `groot` tokenizer format (families/groot.py).
        "groot_n1_7_pack_inputs_v1",
        "groot_n1_7_vlm_encode_v1",
    },
    POSTPROCESSOR: {
        "unnormalizer_processor",
        "device_processor",
        "absolute_actions_processor",
        "groot_action_unpack_unnormalize_v2",
        "groot_n1_7_action_decode_v1",
    },
}
RELATIVE, ABSOLUTE = "relative_actions_processor", "absolute_actions_processor"


@dataclass
class Feature:
    """One input or output feature: its LeRobot key, type and shape (images: C, H, W)."""

    key: str
    type: str
    shape: tuple[int, ...]


#: LeRobot's normalisation modes (`NormalizationMode`), as config.json's `norm_map` names them.
NormMode = Literal["IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"]

#: The statistics each mode but IDENTITY reads.
NORM_STATS: dict[NormMode, tuple[str, str]] = {
    "MEAN_STD": ("mean", "std"),
    "MIN_MAX": ("min", "max"),
    "QUANTILES": ("q01", "q99"),
    "QUANTILE10": ("q10", "q90"),
}


@dataclass
class Norm:
    """How LeRobot (un)normalises one feature: the mode and the statistics it reads."""

    mode: NormMode
    stats: dict[str, NDArray[Any]] = field(default_factory=dict)
    eps: float = 1e-8


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    type: str
    inputs: list[Feature]
    outputs: list[Feature]
    #: Per feature key: its normalisation on the way in (observations) or out (actions).
    input_norm: dict[str, Norm]
    output_norm: dict[str, Norm]
    #: Per feature key: the observation key a client sends (the preprocessor's rename_map
    #: renames client keys to feature keys).
    wire_keys: dict[str, str] = field(default_factory=dict)
    #: The preprocessor's tokenizer step config (a language-conditioned policy), if any.
    tokenizer: dict[str, Any] | None = None
    #: The preprocessor's `relative_actions_processor` config when relative actions are on
    #: (`use_relative_actions`): the model predicts actions relative to the raw state.
    relative: dict[str, Any] | None = None

    def features(self, kind: str) -> list[Feature]:
        return [f for f in self.inputs if f.type == kind]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise ExportError(f"{path}: not a JSON object ({what})")
    return data


def _features(raw: dict[str, Any], where: str) -> list[Feature]:
    out = []
    for key, f in (raw or {}).items():
        try:
            out.append(Feature(key, str(f["type"]), tuple(int(d) for d in f["shape"])))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ExportError(f"config.json: {where}.{key} needs a type and a shape") from None
        if any(not 1 <= d <= 16384 for d in out[-1].shape):
            raise ExportError(
                f"config.json: {where}.{key} has shape {list(out[-1].shape)}; each dimension "
                "from 1 to 16384"
            )
    return out


def _normaliser(
    path: Path, pipeline_file: str, registry_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The normaliser step of a processor pipeline: its config and its statistics."""
    pipeline = _read_json(
        path / pipeline_file,
        "LeRobot's processor pipeline; checkpoints from lerobot < 0.4 need "
        "`python -m lerobot.processor.migrate_policy_normalization` first",
    )
    for s in pipeline.get("steps", []):
        name = s.get("registry_name")
        if name not in KNOWN_STEPS[pipeline_file]:
            raise ExportError(
                f"{path / pipeline_file}: processor step {name!r} is not "
                f"reproduced by policyd; supported steps: "
                f"{', '.join(sorted(KNOWN_STEPS[pipeline_file]))}"
            )
    steps = [s for s in pipeline.get("steps", []) if s.get("registry_name") == registry_name]
    if not steps:
        return {}, {}
    step = steps[0]
    stats: dict[str, dict[str, NDArray[Any]]] = {}
    state_file = step.get("state_file")
    if state_file:
        from safetensors.numpy import load_file

        # A name inside the checkpoint directory, never a path out of it (`/etc/passwd`,
        # `../`): symlinks are followed as they are (a Hugging Face snapshot's files are links).
        rel = Path(str(state_file))
        if rel.is_absolute() or ".." in rel.parts:
            raise ExportError(
                f"{path / pipeline_file}: the {registry_name} step's state_file {state_file!r} "
                "points outside the checkpoint directory; it names a file beside the pipeline"
            )
        file = path / rel
        if not file.is_file():
            raise ExportError(
                f"{file}: missing (the statistics of {pipeline_file}'s {registry_name} step); "
                "copy it from the training run's pretrained_model directory"
            )
        try:
            tensors = load_file(str(file))
        except Exception as e:  # safetensors' own errors: a pickle, a truncated file, ...
            raise ExportError(
                f"{file}: not a safetensors file ({e}); the {registry_name} step's statistics "
                "are read from safetensors only (a pickle is never loaded)"
            ) from None
        for name, value in tensors.items():
            key, _, stat = name.rpartition(".")
            if value.dtype.kind not in "fiu":
                raise ExportError(f"{file}: {name} is {value.dtype}, not numbers")
            stats.setdefault(key, {})[stat] = value.astype(np.float64)
        check_statistics(stats, str(file))
    return step.get("config", {}), stats


def check_statistics(stats: dict[str, dict[str, NDArray[Any]]], where: str) -> None:
    """Refuses statistics policyd would refuse (or serve wrongly), naming the file and the key:
    non-finite values, a negative standard deviation, a minimum above its maximum, a low
    quantile above its high one."""
    for key, s in stats.items():
        for stat, v in s.items():
            if stat != "count" and not np.all(np.isfinite(v)):
                raise ExportError(f"{where}: {key}.{stat} holds NaN or infinity")
        if "std" in s and np.any(s["std"] < 0):
            raise ExportError(f"{where}: {key}.std is negative")
        for lo, hi in (("min", "max"), ("q01", "q99"), ("q10", "q90")):
            if lo in s and hi in s and s[lo].shape == s[hi].shape and np.any(s[lo] > s[hi]):
                at = int(np.argmax(s[lo] > s[hi]))
                raise ExportError(
                    f"{where}: {key}.{lo} is above {key}.{hi} (at index {at}); the statistics "
                    "are inverted"
                )


#: The largest chunk, horizon or padded width a config may ask for: far past any policy
#: (GR00T's 132-wide actions, ACT's 100-step chunks), small enough that nothing allocates
#: gigabytes building the network before a later check refuses it.
MAX_SIZE = 4096
#: Config fields that size the network.
SIZE_FIELDS = (
    "chunk_size",
    "n_action_steps",
    "horizon",
    "n_obs_steps",
    "max_state_dim",
    "max_action_dim",
    "action_dim",
    "action_horizon",
    "num_steps",
    "num_inference_steps",
)


def check_sizes(config: dict[str, Any], where: str) -> None:
    """Each size field a whole number from 1 to [`MAX_SIZE`], checked before anything is built."""
    for name in SIZE_FIELDS:
        if name not in config or config[name] is None:
            continue
        v = config[name]
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or v != int(v)
            or not (1 <= v <= MAX_SIZE)
        ):
            raise ExportError(f"{where}: {name} = {v!r}; give a whole number from 1 to {MAX_SIZE}")


def _norms(
    config: dict[str, Any], stats: dict[str, Any], features: list[Feature], side: str
) -> dict[str, Norm]:
    norm_map = config.get("norm_map", {})
    eps = float(config.get("eps", 1e-8))
    out = {}
    for f in features:
        written = str(norm_map.get(f.type, "IDENTITY"))
        if written == "IDENTITY" or f.key not in stats:
            # LeRobot passes a feature through when it has no statistics.
            out[f.key] = Norm("IDENTITY", {}, eps)
            continue
        mode = next((m for m in NORM_STATS if m == written), None)
        if mode is None:
            raise ExportError(f"{side}: feature {f.key} uses normalisation {written}, unknown here")
        need = NORM_STATS[mode]
        missing = [n for n in need if n not in stats[f.key]]
        if missing:
            raise ExportError(
                f"{side}: feature {f.key} is normalised with {mode} but its statistics lack "
                f"{', '.join(missing)}; recompute the dataset's stats"
            )
        out[f.key] = Norm(mode, {n: stats[f.key][n] for n in need}, eps)
    return out


def _refuse_groot_n15(path: Path, config: dict[str, Any]) -> None:
    """A GR00T N1.5 checkpoint, told apart as LeRobot 0.6.1 tells it (its `model_version`, an
    N1.5 base model path, N1.5-only fields), gets LeRobot's own advice."""
    from lerobot.policies.groot.configuration_groot import (
        GROOT_N1_5,
        GROOT_N1_5_REMOVAL_GUIDANCE,
        infer_groot_model_version,
        normalize_groot_model_version,
    )

    where = path / "config.json"
    try:
        normalize_groot_model_version(str(config.get("model_version") or "n1.7"))
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from e
    backbone = config.get("backbone_cfg")
    n15 = (
        config.get("tokenizer_assets_repo") is not None
        or (isinstance(backbone, dict) and "eagle_path" in backbone)
        or infer_groot_model_version(config.get("base_model_path")) == GROOT_N1_5
    )
    if n15:
        raise ExportError(f"{where}: a GR00T N1.5 checkpoint. {GROOT_N1_5_REMOVAL_GUIDANCE}")


def load(path: str | Path) -> Checkpoint:
    """Reads and checks a checkpoint directory; every problem is an ExportError naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: not a directory (give a LeRobot pretrained_model directory)")
    if not (path / "config.json").is_file():
        raise ExportError(
            f"{path}: not a LeRobot checkpoint (no config.json; give the pretrained_model "
            "directory that save_pretrained wrote)"
        )
    config = _read_json(path / "config.json", "the policy's config")
    kind = config.get("type")
    if kind == "groot":
        _refuse_groot_n15(path, config)
    if kind not in SUPPORTED:
        extra = f" ({kind}: {PLANNED[kind]})" if kind in PLANNED else ""
        raise ExportError(
            f"{path / 'config.json'}: policy type {kind!r} is not supported{extra}; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    check_sizes(config, str(path / "config.json"))
    options.check(kind, config, str(path / "config.json"))
    if not (path / "model.safetensors").is_file():
        raise ExportError(f"{path / 'model.safetensors'}: missing (the policy's weights)")
    inputs = _features(config.get("input_features") or {}, "input_features")
    # pi0's and SmolVLA's `empty_cameras` add features no robot sends: the model fills them
    # (−1, masked out) when they are missing, so they are neither bound nor sent.
    empty = {
        f"observation.images.empty_camera_{i}" for i in range(int(config.get("empty_cameras") or 0))
    }
    inputs = [f for f in inputs if f.key not in empty]
    outputs = _features(config.get("output_features") or {}, "output_features")
    bindable = {"STATE", "VISUAL", "ENV"}
    for f in inputs:
        if f.type not in bindable:
            raise ExportError(
                f"config.json: input feature {f.key} has type {f.type}; policyd binds "
                f"{', '.join(sorted(bindable))} inputs for {kind}"
            )
        if f.type == "VISUAL" and (len(f.shape) != 3 or f.shape[0] != 3):
            raise ExportError(
                f"config.json: image feature {f.key} has shape {list(f.shape)}; policyd binds "
                "RGB images [3, H, W]"
            )
        if f.type != "VISUAL" and len(f.shape) != 1:
            raise ExportError(
                f"config.json: feature {f.key} has shape {list(f.shape)}; vectors only"
            )
    actions = [f for f in outputs if f.type == "ACTION"]
    if len(actions) != 1 or len(outputs) != 1 or len(actions[0].shape) != 1:
        raise ExportError("config.json: output_features must be one ACTION vector")
    pre_cfg, pre_stats = _normaliser(path, PREPROCESSOR, "normalizer_processor")
    renames = {}
    tokenizer = None
    for s in _read_json(path / PREPROCESSOR, "").get("steps", []):
        if s.get("registry_name") == "rename_observations_processor":
            renames = {v: k for k, v in s.get("config", {}).get("rename_map", {}).items()}
        if s.get("registry_name") == "tokenizer_processor":
            tokenizer = s.get("config", {})
    post_cfg, post_stats = _normaliser(path, POSTPROCESSOR, "unnormalizer_processor")
    relative = _relative(path)
    return Checkpoint(
        path=path,
        config=config,
        type=kind,
        inputs=inputs,
        outputs=outputs,
        input_norm=_norms(pre_cfg, pre_stats, inputs, PREPROCESSOR),
        output_norm=_norms(post_cfg, post_stats, outputs, POSTPROCESSOR),
        wire_keys={f.key: renames.get(f.key, f.key) for f in inputs},
        tokenizer=tokenizer,
        relative=relative,
    )


def _relative(path: Path) -> dict[str, Any] | None:
    """The relative-actions step pair, if enabled: the preprocessor's step (before the
    normaliser, so that it caches the raw state) and the postprocessor's (after the
    un-normaliser). Anything else is refused naming the step."""

    def steps(file: str) -> list[tuple[str, dict[str, Any]]]:
        return [
            (s.get("registry_name"), s.get("config", {}))
            for s in _read_json(path / file, "").get("steps", [])
        ]

    pre, post = steps(PREPROCESSOR), steps(POSTPROCESSOR)
    rel = [(i, c) for i, (n, c) in enumerate(pre) if n == RELATIVE]
    ab = [(i, c) for i, (n, c) in enumerate(post) if n == ABSOLUTE]
    on_pre = bool(rel and rel[0][1].get("enabled"))
    on_post = bool(ab and ab[0][1].get("enabled"))
    if not on_pre and not on_post:
        return None
    if on_pre != on_post:
        raise ExportError(
            f"{path}: {RELATIVE} is {'en' if on_pre else 'dis'}abled in {PREPROCESSOR} but "
            f"{ABSOLUTE} is {'en' if on_post else 'dis'}abled in {POSTPROCESSOR}; LeRobot "
            "enables both together (use_relative_actions)"
        )
    names = [n for n, _ in pre]
    if "normalizer_processor" in names and names.index("normalizer_processor") < rel[0][0]:
        raise ExportError(
            f"{path / PREPROCESSOR}: {RELATIVE} runs after the normaliser, so it would offset "
            "by the normalised state; policyd reproduces LeRobot's order (relative, then "
            "normalise)"
        )
    post_names = [n for n, _ in post]
    if (
        "unnormalizer_processor" in post_names
        and post_names.index("unnormalizer_processor") > ab[0][0]
    ):
        raise ExportError(
            f"{path / POSTPROCESSOR}: {ABSOLUTE} runs before the un-normaliser; policyd "
            "reproduces LeRobot's order (un-normalise, then absolute)"
        )
    return rel[0][1]

"""policyd's `[[inputs]]` and `[[outputs]]` for a checkpoint's features, normalised as LeRobot does.

LeRobot's normaliser (lerobot/processor/normalize_processor.py) works per feature type:
MEAN_STD is `(x − mean)/(std + eps)` in and `x·std + mean` out; MIN_MAX (and QUANTILES with
q01/q99, QUANTILE10 with q10/q90) is `2(x − lo)/(hi − lo) − 1` in and `(x + 1)/2·(hi − lo) + lo`
out, `eps` standing in for a zero range. policyd's bindings say exactly that: `mean`/`std`/`eps`
and `min`/`max`/`eps`. Images arrive as uint8 HWC and become float [0, 1] CHW first, as
LeRobot's server converts a robot's frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from .checkpoint import Checkpoint, Feature, Norm
from .errors import ExportError

RANGE_STATS = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}


def _values(stat: NDArray[Any], feature: Feature) -> list[float]:
    """A statistic as policyd indexes it: one per vector entry; for an image one per channel
    (LeRobot keeps [3, 1, 1]) or, if it varies over pixels, one per element in HWC order."""
    stat = np.asarray(stat, dtype=np.float64)
    if feature.type != "VISUAL":
        if stat.size != feature.shape[0]:
            raise ExportError(
                f"statistics of {feature.key} have {stat.size} values for a feature of "
                f"{feature.shape[0]}"
            )
        return [float(v) for v in stat.reshape(-1)]
    c, h, w = feature.shape
    try:
        full = np.broadcast_to(
            stat.reshape(stat.shape[-3:] if stat.ndim >= 3 else (-1, 1, 1)), (c, h, w)
        )
    except ValueError:
        raise ExportError(
            f"statistics of {feature.key} have shape {list(stat.shape)}, which does not "
            f"broadcast to the image's {[c, h, w]}"
        ) from None
    per_channel = full.reshape(c, -1)
    if np.all(per_channel == per_channel[:, :1]):
        return [float(v) for v in per_channel[:, 0]]
    return [float(v) for v in full.transpose(1, 2, 0).reshape(-1)]


def norm_keys(norm: Norm, feature: Feature, output: bool) -> dict[str, Any]:
    """The binding keys of one feature's normalisation (none for IDENTITY)."""
    if norm.mode == "IDENTITY":
        return {}
    if norm.mode == "MEAN_STD":
        return {
            "mean": _values(norm.stats["mean"], feature),
            "std": _values(norm.stats["std"], feature),
            # LeRobot un-normalises with `x·std + mean`: no epsilon on the way out.
            "eps": 0.0 if output else norm.eps,
        }
    lo, hi = RANGE_STATS[norm.mode]
    return {
        "min": _values(norm.stats[lo], feature),
        "max": _values(norm.stats[hi], feature),
        "eps": norm.eps,
    }


def input_binding(
    ckpt: Checkpoint, feature: Feature, tensor: str, history: int = 1
) -> dict[str, Any]:
    """One `[[inputs]]` table: the client's key, the graph input, wire dtype/shape, transforms."""
    b: dict[str, Any] = {"key": ckpt.wire_keys.get(feature.key, feature.key), "tensor": tensor}
    if feature.type == "VISUAL":
        c, h, w = feature.shape
        b.update(dtypes=["uint8"], shape=[h, w, c], layout="hwc_to_chw", scale=1.0 / 255.0)
    else:
        b.update(dtypes=["float32", "float64"], shape=[feature.shape[0]])
    b.update(norm_keys(ckpt.input_norm[feature.key], feature, output=False))
    if history > 1:
        b["history"] = history
    return b


def output_binding(
    ckpt: Checkpoint, tensor: str, rows: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The `[[outputs]]` table of the action: un-normalised as LeRobot's postprocessor does."""
    action = ckpt.outputs[0]
    b: dict[str, Any] = {"tensor": tensor, "key": "actions", "dtype": "float32"}
    if rows is not None:
        b["rows"] = list(rows)
    b.update(norm_keys(ckpt.output_norm[action.key], action, output=True))
    return b


def relative_actions(
    ckpt: Checkpoint, output: dict[str, Any], state_key: str, state_dim: int
) -> None:
    """With LeRobot's relative actions on (`use_relative_actions`), the `[[outputs]]` table gets
    `relative_to` the state binding and the mask LeRobot's own step builds (its
    `exclude_joints` matched against the action names; the gripper stays absolute by default),
    so policyd adds the raw state to those columns after un-normalising, as
    `AbsoluteActionsProcessorStep` does."""
    if ckpt.relative is None:
        return
    from lerobot.processor.relative_action_processor import RelativeActionsProcessorStep

    action_dim = ckpt.outputs[0].shape[0]
    cfg = ckpt.relative
    step = RelativeActionsProcessorStep(
        enabled=True,
        exclude_joints=list(cfg.get("exclude_joints") or []),
        action_names=cfg.get("action_names"),
    )
    mask = [bool(m) for m in step._build_mask(action_dim)]
    if len(mask) > state_dim:
        raise ExportError(
            f"relative actions: {len(mask)} action dimensions are relative to a state of "
            f"{state_dim}; LeRobot's to_absolute_actions needs the state at least as long"
        )
    output["relative_to"] = state_key
    output["relative_mask"] = mask

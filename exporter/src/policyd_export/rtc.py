"""`[rtc]` in a flow bundle's config: real-time chunking as the checkpoint has it.

LeRobot's flow families carry an `rtc_config` (`RTCConfig`: `enabled`, `execution_horizon`,
`prefix_attention_schedule`, `max_guidance_weight`); where a checkpoint has one, the bundle's
`[rtc]` says the same (turned on or off as LeRobot has it). Where it has none, the table is
written commented out with LeRobot's defaults, for the operator to turn on. GR00T N1.7 has
no `rtc_config`: its RTC is native inpainting, keyed by `rtc_ramp_rate` (its model config's,
6.0 by default), and its horizon is the rollout's.
"""

from __future__ import annotations

from typing import Any

#: LeRobot's `RTCConfig` defaults (0.6.1).
EXECUTION_HORIZON = 10
SCHEDULE = "linear"
MAX_GUIDANCE_WEIGHT = 10.0
#: GR00T N1.7's `rtc_ramp_rate` default.
RAMP_RATE = 6.0


def table(config: dict[str, Any], groot: bool, rows: int) -> dict[str, Any] | None:
    """`[rtc]` from a checkpoint's config (its `rtc_config`), or None when it has none. The
    horizon is cut to the chunk's `rows` (LeRobot's flow families fail on a longer one)."""
    rtc = config.get("rtc_config")
    if not isinstance(rtc, dict) or groot:
        return None
    out: dict[str, Any] = {
        "enabled": bool(rtc.get("enabled", True)),
        "execution_horizon": min(int(rtc.get("execution_horizon", EXECUTION_HORIZON)), rows),
        "prefix_attention_schedule": str(rtc.get("prefix_attention_schedule", SCHEDULE)).lower(),
        "max_guidance_weight": float(rtc.get("max_guidance_weight", MAX_GUIDANCE_WEIGHT)),
    }
    return out


def commented(groot: bool, rows: int, ramp_rate: float | None = None) -> str:
    """The `[rtc]` table commented out, with LeRobot's defaults (GR00T: its own keys)."""
    horizon = min(EXECUTION_HORIZON, rows)
    lines = [
        "",
        "# Real-time chunking (docs/pacing.md): a new chunk continues the one the robot is",
        "# executing, for LeRobot's robot_client and the `observe` route. Uncomment to turn it on;",
        "# inference_delay (control steps) defaults to the session's measured delay.",
        "# [rtc]",
        f"# execution_horizon = {horizon}",
    ]
    if groot:
        lines.append(f"# rtc_ramp_rate = {ramp_rate if ramp_rate is not None else RAMP_RATE}")
    else:
        lines += [
            f'# prefix_attention_schedule = "{SCHEDULE}"',
            f"# max_guidance_weight = {MAX_GUIDANCE_WEIGHT}",
        ]
    lines.append("# inference_delay = 2")
    return "\n".join(lines) + "\n"

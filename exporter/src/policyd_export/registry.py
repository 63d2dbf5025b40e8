"""Which LeRobot policies policyd-export exports: each family (a module under
`policyd_export.families`), the policy types it exports and their LeRobot config classes.

The one list: the checkpoint check, the CLI's help, `families.export`'s dispatch and the
options tables' coverage (`test_options.py`) derive from it. Importing it imports no torch,
so that `--help` and a checkpoint's refusal stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    #: Its module under `policyd_export.families`, whose `export(ckpt, request)` writes it.
    name: str
    #: LeRobot policy type (config.json's `type`) -> its config class, `module:Class`.
    types: dict[str, str]
    #: LeRobot's `relative_actions_processor` applies to its checkpoints (exported as such).
    relative_actions: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("act", {"act": "lerobot.policies.act.configuration_act:ACTConfig"}),
    Family(
        "diffusion",
        {"diffusion": "lerobot.policies.diffusion.configuration_diffusion:DiffusionConfig"},
    ),
    Family("groot", {"groot": "lerobot.policies.groot.configuration_groot:GrootConfig"}),
    Family(
        "pi0",
        {
            "pi0": "lerobot.policies.pi0.configuration_pi0:PI0Config",
            "pi05": "lerobot.policies.pi05.configuration_pi05:PI05Config",
        },
        relative_actions=True,
    ),
    Family("smolvla", {"smolvla": "lerobot.policies.smolvla.configuration_smolvla:SmolVLAConfig"}),
)

#: Every exported policy type, sorted.
SUPPORTED: tuple[str, ...] = tuple(sorted(t for f in FAMILIES for t in f.types))


def family(policy_type: str) -> Family:
    """The family that exports `policy_type` (one of [`SUPPORTED`])."""
    return next(f for f in FAMILIES if policy_type in f.types)


def config_class(policy_type: str) -> str:
    """LeRobot's config class of `policy_type`, `module:Class`."""
    return family(policy_type).types[policy_type]

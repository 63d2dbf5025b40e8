"""A robot for LeRobot's own `robot_client`, registered through LeRobot's robot registry: it
reads like an SO-101 follower (six `<motor>.pos` joints in degrees, uint8 RGB cameras) from a
seeded generator, and records every observation it gave and every action it was sent."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from lerobot.robots.config import RobotConfig
from lerobot.robots.robot import Robot

MOTORS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]


@RobotConfig.register_subclass("policyd_test_robot")
@dataclass
class PolicydTestRobotConfig(RobotConfig):
    # Camera name -> (height, width) (not `cameras`: RobotConfig reads that as camera configs).
    frames: dict[str, tuple[int, int]] = field(default_factory=lambda: {"cam0": (48, 64)})
    seed: int = 0
    # Every observation the same (the first): chunks then differ only by their timesteps.
    constant: bool = False


class PolicydTestRobot(Robot):
    config_class = PolicydTestRobotConfig
    name = "policyd_test_robot"

    def __init__(self, config: PolicydTestRobotConfig) -> None:
        super().__init__(config)
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        self.lock = threading.Lock()
        self.observations: list[dict[str, Any]] = []
        self.actions: list[dict[str, float]] = []
        self._connected = False

    @cached_property
    def observation_features(self) -> dict[str, type | tuple]:
        f: dict[str, type | tuple] = {f"{m}.pos": float for m in MOTORS}
        for cam, (h, w) in self.config.frames.items():
            f[cam] = (h, w, 3)
        return f

    @cached_property
    def action_features(self) -> dict[str, type]:
        return {f"{m}.pos": float for m in MOTORS}

    @property
    def is_connected(self) -> bool:
        return self._connected

    def connect(self, calibrate: bool = True) -> None:
        self._connected = True

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        pass

    def configure(self) -> None:
        pass

    def get_observation(self) -> dict[str, Any]:
        with self.lock:
            if self.config.constant and self.observations:
                return dict(self.observations[0])
            obs: dict[str, Any] = {f"{m}.pos": float(self.rng.uniform(-90.0, 90.0)) for m in MOTORS}
            for cam, (h, w) in self.config.frames.items():
                obs[cam] = self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            self.observations.append(obs)
            return dict(obs)

    def send_action(self, action: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.actions.append({k: float(v) for k, v in action.items()})
        return action

    def disconnect(self) -> None:
        self._connected = False

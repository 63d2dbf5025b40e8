"""policyd-export: LeRobot checkpoints → policyd bundles, with parity checks against LeRobot."""

__version__ = "0.1.0"

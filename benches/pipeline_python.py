#!/usr/bin/env python3
"""The pipeline loop of benches/python_server.py without its networks, timed as
benches/pipeline.rs times policyd's: the step is a function returning a fixed array, so the time
per step is the loop's own work (numpy's update, the step's call). Flow at 50 x 32 and DDIM at
16 x 2, 1 and 10 steps. Run with the interop venv: .venv-test/bin/python benches/pipeline_python.py"""

import pathlib
import sys
import timeit

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from python_server import Sampler

for name, cfg, shape in [
    (
        "flow 50x32",
        {"kind": "flow", "steps": 10, "x": "x", "time": "t", "output": "v"},
        (1, 50, 32),
    ),
    (
        "ddim 16x2",
        {
            "kind": "ddim",
            "steps": 10,
            "x": "x",
            "time": "t",
            "output": "eps",
            "num_train_timesteps": 100,
            "beta_schedule": "squaredcos_cap_v2",
        },
        (1, 16, 2),
    ),
]:
    sampler = Sampler(cfg)
    out = np.full(shape, 0.01, np.float32)

    def step(x, t, out=out):
        return out

    for steps in (1, 10):
        n = 2000
        best = min(
            timeit.repeat(
                lambda sampler=sampler, step=step, shape=shape, steps=steps: (
                    sampler.run(step, shape, 1, steps)
                ),
                number=n,
                repeat=5,
            )
        )
        print(
            f"python {name}, {steps} steps, no-op step: {best / n * 1e6:.1f} us per request"
        )

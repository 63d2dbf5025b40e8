"""Observations for the demo profiles (configs/*.toml), as the openpi examples send them. Needs
only numpy, so the on-device scripts (benches/compare_backends.py) can use it on a Jetson."""

import numpy as np

# configs/flow.toml's cameras (pi0's).
CAMS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]


def flow_obs(rng, prompt="pick up the red block"):
    return {
        "images": {
            c: rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for c in CAMS
        },
        "state": rng.standard_normal(32).astype(np.float32),
        "prompt": prompt,
    }


def diffusion_obs(rng):
    return {
        "observation/state": rng.standard_normal((2, 2)).astype(np.float32),
        "observation/image": rng.integers(0, 256, (2, 96, 96, 3), dtype=np.uint8),
    }


def observation(profile, rng):
    img = lambda shape: rng.integers(0, 256, shape, dtype=np.uint8)
    if profile == "flow":
        return flow_obs(rng)
    if profile == "diffusion":
        return diffusion_obs(rng)
    if profile == "aloha":
        return {
            "state": rng.random(14),
            "images": {
                c: img((3, 224, 224))
                for c in ["cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"]
            },
            "prompt": "fold",
        }
    if profile == "droid":
        return {
            "observation/exterior_image_1_left": img((224, 224, 3)),
            "observation/wrist_image_left": img((224, 224, 3)),
            "observation/joint_position": rng.random(7),
            "observation/gripper_position": rng.random(1),
            "prompt": "pick",
        }
    if profile == "tiny":
        return {"observation/state": rng.random(8).astype(np.float32), "prompt": "pick"}
    return {
        "observation/image": img((224, 224, 3)),
        "observation/wrist_image": img((224, 224, 3)),
        "observation/state": rng.random(8).astype(np.float32),
        "prompt": "pick",
    }

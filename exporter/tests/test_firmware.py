"""A bundle baked into a firmware image (`POLICYD_EMBED_CONFIG=BUNDLE/policyd.toml cargo build`)
serves from an empty directory exactly what the bundle's files serve: the Diffusion bundle,
whose step graph (`[denoise] model`) must be built in beside the encoder, here with the U-Net's
weights as ONNX external data (`unet.onnx.data`, as a graph past 2 GB is written)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
from conftest import ROOT
from openpi_client import websocket_client_policy

from policyd_export import rewrite
from policyd_export.checkpoint import load
from policyd_export.verify import observations, serve


def _cargo_build(env: dict) -> None:
    r = subprocess.run(
        ["cargo", "build", "--bin", "policyd"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]


def _actions(port: int, obs: list[dict]) -> list[np.ndarray]:
    client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
    return [np.asarray(client.infer(dict(o, seed=7))["actions"]) for o in obs]


def test_a_baked_diffusion_bundle_serves_the_same_actions(
    ddim_bundle: object, policyd: str, tmp_path: Path
) -> None:
    # The bundle, its U-Net's weights moved to external data.
    bundle = tmp_path / "bundle"
    shutil.copytree(ddim_bundle.bundle, bundle)
    unet = onnx.load(str(bundle / "unet.onnx"))
    (bundle / "unet.onnx").unlink()
    rewrite.save(unet, bundle / "unet.onnx", external_over=0)
    assert (bundle / "unet.onnx.data").stat().st_size > 100_000
    baked = tmp_path / "policyd-baked"
    try:
        _cargo_build({"POLICYD_EMBED_CONFIG": str(bundle / "policyd.toml")})
        shutil.copy(ROOT / "target/debug/policyd", baked)
    finally:
        # Put the plain binary back for everything after this test.
        _cargo_build({"POLICYD_EMBED_CONFIG": ""})
    shown = subprocess.run([str(baked), "print-default-config"], capture_output=True, text=True)
    assert "from the LeRobot diffusion checkpoint" in shown.stdout
    obs = observations(load(ddim_bundle.checkpoint), 3, seed=5)
    with serve(policyd, ddim_bundle.bundle / "policyd.toml") as port:
        want = _actions(port, obs)
    with serve(policyd, bundle / "policyd.toml") as port:  # external data from files
        np.testing.assert_array_equal(_actions(port, obs)[0], want[0])
    empty = tmp_path / "empty"
    empty.mkdir()
    # No --config: the binary serves what it was built with, from a directory with no files.
    proc_cwd = os.getcwd()
    os.chdir(empty)
    try:
        with serve(str(baked), None) as port:
            got = _actions(port, obs)
    finally:
        os.chdir(proc_cwd)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (8, 6)
        np.testing.assert_array_equal(g, w)

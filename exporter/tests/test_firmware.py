"""A bundle baked into a firmware image (`POLICYD_EMBED_CONFIG=BUNDLE/policyd.toml cargo build`)
serves from an empty directory exactly what the bundle's files serve: the Diffusion bundle,
whose step graph (`[denoise] model`) must be built in beside the encoder, here with the U-Net's
weights as ONNX external data (`unet.onnx.data`, as a graph past 2 GB is written); and it holds
those weights once, in its engine, not also as resident pages of the binary."""

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
from policyd_export.verify import observations, serve, served


def _rss_mb(pid: int) -> dict[str, float]:
    """Resident anonymous and file-backed memory (MB) of a process."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


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
    built = ROOT / "target/debug/policyd"
    plain = tmp_path / "policyd-plain"
    shutil.copy2(built, plain)
    try:
        _cargo_build({"POLICYD_EMBED_CONFIG": str(bundle / "policyd.toml")})
        shutil.copy(built, baked)
    finally:
        # The plain binary back for everything after this test, copied rather than rebuilt
        # (~40 s); cargo rebuilds it anyway at the next build, whose POLICYD_EMBED_CONFIG
        # differs from this one's (build.rs reruns when it changes).
        built.unlink()
        shutil.copy2(plain, built)
    shown = subprocess.run([str(baked), "print-default-config"], capture_output=True, text=True)
    assert "from the LeRobot diffusion checkpoint" in shown.stdout
    obs = observations(load(ddim_bundle.checkpoint), 3, seed=5)
    with serve(policyd, ddim_bundle.bundle / "policyd.toml") as port:
        want = _actions(port, obs)
    with served(policyd, bundle / "policyd.toml") as (port, pid):  # external data from files
        np.testing.assert_array_equal(_actions(port, obs)[0], want[0])
        from_files = _rss_mb(pid)
    empty = tmp_path / "empty"
    empty.mkdir()
    # No --config: the binary serves what it was built with, from a directory with no files.
    proc_cwd = os.getcwd()
    os.chdir(empty)
    try:
        with served(str(baked), None) as (port, pid):
            got = _actions(port, obs)
            built_in = _rss_mb(pid)
    finally:
        os.chdir(proc_cwd)
    # The graphs and the external data built in (~50 MB) are copied into the engines; their
    # pages of the binary are released after (before: all of them stayed resident, RssFile
    # 50 MB above the same binary serving files). The code is the same binary's.
    embedded = sum(f.stat().st_size for f in bundle.glob("*.onnx*")) / 2**20
    extra = built_in["RssFile"] - from_files["RssFile"]
    assert extra < 0.4 * embedded, (built_in, from_files, embedded)
    assert built_in["RssAnon"] < from_files["RssAnon"] + 0.4 * embedded, (built_in, from_files)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (8, 6)
        np.testing.assert_array_equal(g, w)

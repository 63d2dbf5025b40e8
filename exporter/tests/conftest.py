"""Shared fixtures: the policyd binary, and each tiny checkpoint exported once per run."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def policyd() -> str:
    path = os.environ.get("POLICYD_BIN", str(ROOT / "target/debug/policyd"))
    if not Path(path).is_file():
        pytest.fail(f"no policyd binary at {path}: run `cargo build` or set POLICYD_BIN")
    return path


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`policyd-export ARGS`, run in this process: its exit status and what it printed.

    In-process because each console-script run spent 10-20 s importing torch, LeRobot and
    transformers before doing anything (about a fifth of the suite's time in CI).
    `test_cli.py::test_the_console_script_runs_as_a_user_runs_it` keeps one real run."""
    from policyd_export.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_console_script(*args: str) -> subprocess.CompletedProcess:
    """`policyd-export ARGS` as a user runs it: the installed console script, in a process."""
    exe = Path(sys.executable).parent / "policyd-export"
    return subprocess.run([str(exe), *args], capture_output=True, text=True)


def check_config(policyd: str, config: Path) -> subprocess.CompletedProcess:
    """`policyd check-config CONFIG`, its output captured."""
    return subprocess.run([policyd, "check-config", str(config)], capture_output=True, text=True)


class Exported:
    def __init__(self, checkpoint: Path, bundle: Path, log: str):
        self.checkpoint = checkpoint
        self.bundle = bundle
        self.log = log


def _export(root: Path, name: str, make: object, **kw: object) -> Exported:
    ckpt = make(root / f"{name}-checkpoint", **kw)
    bundle = root / f"{name}-bundle"
    r = run_cli("lerobot", str(ckpt), "--out", str(bundle))
    assert r.returncode == 0, r.stderr
    return Exported(ckpt, bundle, r.stdout)


@pytest.fixture(scope="session")
def act_bundle(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _export(tmp_path_factory.mktemp("act"), "act", checkpoints.act, cameras=2)


@pytest.fixture(scope="session")
def ddim_bundle(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _export(tmp_path_factory.mktemp("ddim"), "ddim", checkpoints.diffusion)


@pytest.fixture(scope="session")
def ddpm_bundle(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return _export(
        tmp_path_factory.mktemp("ddpm"),
        "ddpm",
        checkpoints.diffusion,
        scheduler="DDPM",
        steps=None,
    )

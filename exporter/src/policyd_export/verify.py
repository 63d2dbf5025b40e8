"""`policyd-export verify`: the bundle served by policyd against its framework (LeRobot, or
openpi's pipeline for an openpi bundle), on the same observations.

policyd serves the bundle's own config; the official openpi-client sends a sequence of
observations (LeRobot key names, uint8 HWC images) on one connection, as a robot would, and
each reply's actions are compared with `Reference.actions` on the same observation, after the
same earlier ones (Diffusion's frame history). For a sampling policy the noise is injected on
both sides: policyd takes its initial sample (and DDPM's per-step noise) from the request
through the test-only `sampler.inject_noise`, in a copy of the config written to a temporary
directory; the bundle itself is not touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
from numpy.typing import NDArray

from .bundle import CONFIG, Manifest, read_manifest
from .checkpoint import Checkpoint
from .checkpoint import load as load_checkpoint
from .errors import ExportError


@dataclass
class Row:
    what: str
    diff: float
    tol: float

    @property
    def ok(self) -> bool:
        return bool(self.diff <= self.tol)


def find_policyd(given: str | None) -> str:
    """The policyd binary: --policyd, $POLICYD_BIN, or `policyd` on PATH."""
    path = given or os.environ.get("POLICYD_BIN") or shutil.which("policyd")
    if not path or not Path(path).is_file():
        raise ExportError(
            "no policyd binary: pass --policyd PATH or set POLICYD_BIN (build it with "
            "`cargo build --release`: target/release/policyd)"
        )
    return path


#: Prompts for language-conditioned policies (openpi's and LeRobot's example tasks).
PROMPTS = [
    "pick up the red cube",
    "put the bowl on the stove",
    "open the top drawer and put the bowl inside",
    "fold the towel",
]


def observations(
    ckpt: Checkpoint, n: int, seed: int, prompt_key: str | None = None
) -> list[dict[str, Any]]:
    """Observations in the range of the checkpoint's statistics (so normalisation matters),
    with a task prompt under `prompt_key` for a language-conditioned policy."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs: dict[str, Any] = {}
        if prompt_key:
            obs[prompt_key] = PROMPTS[(seed + i) % len(PROMPTS)]
        for f in ckpt.inputs:
            key = ckpt.wire_keys.get(f.key, f.key)
            if f.type == "VISUAL":
                c, h, w = f.shape
                obs[key] = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
                continue
            norm = ckpt.input_norm[f.key]
            d = f.shape[0]
            if norm.mode == "MEAN_STD":
                v = norm.stats["mean"].reshape(-1) + norm.stats["std"].reshape(-1) * (
                    rng.standard_normal(d)
                )
            elif norm.mode != "IDENTITY":
                lo, hi = (norm.stats[k].reshape(-1) for k in list(norm.stats)[:2])
                v = lo + (hi - lo) * rng.random(d)
            else:
                v = rng.standard_normal(d)
            obs[key] = v.astype(np.float32)
        out.append(obs)
    return out


def injected_config(
    bundle: Path, manifest: Manifest, tmp: Path, rtc: dict[str, Any] | None = None
) -> tuple[Path, bool]:
    """A copy of the bundle's config that takes its noise from the request (and `[rtc]` as
    given); True when DDPM's per-step noise is an input too."""
    config = tomllib.loads((bundle / CONFIG).read_text())
    config["engine"]["model"] = str((bundle / config["engine"]["model"]).resolve())
    for binding in config["inputs"]:
        if "tokenizer" in binding:
            binding["tokenizer"]["file"] = str((bundle / binding["tokenizer"]["file"]).resolve())
    step_noise = False
    if "denoise" in config:
        config["denoise"]["model"] = str((bundle / config["denoise"]["model"]).resolve())
        sampler = config["sampler"]
        sampler["inject_noise"] = True
        noise = manifest["noise"]
        config["inputs"].append(
            {
                "key": "noise",
                "tensor": noise["tensor"],
                "dtypes": ["float32"],
                "shape": noise["shape"],
            }
        )
        step_noise = sampler["kind"] == "ddpm" or float(sampler.get("eta", 0.0)) > 0.0
        if step_noise:
            n = int(np.prod(noise["shape"]))
            config["inputs"].append(
                {
                    "key": "step_noise",
                    "tensor": f"{noise['tensor']}_step_noise",
                    "dtypes": ["float32"],
                    "shape": [sampler.get("max_steps", sampler["steps"]), n],
                }
            )
    config.setdefault("server", {})["host"] = "127.0.0.1"
    # verify speaks openpi-client only; LeRobot's port may be taken (by LeRobot's own server).
    config.pop("lerobot", None)
    if rtc is not None:
        config["rtc"] = rtc
    path = tmp / "policyd.toml"
    path.write_text(tomli_w.dumps(config))
    return path, step_noise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def serve(binary: str, config: Path | None, timeout: float = 120.0) -> Iterator[int]:
    """policyd serving `config` (None: the config built into a firmware image) on a free
    loopback port, ready (/healthz 200) when yielded."""
    with served(binary, config, timeout) as (port, _):
        yield port


@contextlib.contextmanager
def served(binary: str, config: Path | None, timeout: float = 120.0) -> Iterator[tuple[int, int]]:
    """`serve`, yielding the process id too (for benchmarks that read its memory)."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    args = [binary, "--port", str(port)] + (["--config", str(config)] if config else [])
    proc = subprocess.Popen(args, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise ExportError(f"policyd exited ({proc.returncode}):\n{log.read().decode()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ExportError(f"policyd did not become ready within {timeout:.0f} s")
            time.sleep(0.05)
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


#: One observation's reference actions, given the request's noise (initial, per step).
Want = Callable[[dict[str, Any], NDArray[Any] | None, NDArray[Any] | None], NDArray[Any]]


def verify(
    bundle: Path,
    checkpoint: Path,
    policyd: str | None = None,
    n: int = 4,
    rtol: float = 1e-4,
    seed: int = 0,
    norm_stats: Path | None = None,
    rtc: bool = True,
) -> list[Row]:
    """Every check as a row: the export's graph checks, then one per served observation,
    against LeRobot's own inference (a LeRobot bundle) or openpi's pipeline (an openpi one;
    `norm_stats`: its statistics, where the export was given them with --norm-stats), then
    (`rtc`, where the bundle can take it) the real-time chunking cases."""
    manifest = read_manifest(bundle)
    rtc = rtc and rtc_applies(bundle, manifest) and n >= 2
    if manifest["policy_type"].startswith("openpi/"):
        return _verify_openpi(bundle, checkpoint, manifest, policyd, n, rtol, seed, norm_stats, rtc)
    from .reference import Reference

    ckpt = load_checkpoint(checkpoint)
    if ckpt.type != manifest["policy_type"]:
        raise ExportError(
            f"{checkpoint} is a {ckpt.type} checkpoint; the bundle was exported from a "
            f"{manifest['policy_type']} one"
        )
    binary = find_policyd(policyd)
    reference = Reference(ckpt)
    requests = observations(ckpt, n, seed, manifest.get("prompt_key"))
    rows = _compare(binary, bundle, manifest, requests, reference.actions, rtol, seed, "LeRobot")
    if rtc:
        rows += _verify_rtc(binary, bundle, manifest, requests[:2], reference, rtol, seed)
    return rows


def rtc_applies(bundle: Path, manifest: Manifest) -> bool:
    """Whether the bundle can take `[rtc]`: a flow pipeline whose actions are not relative
    (policyd refuses RTC with relative actions, whose leftover LeRobot re-anchors)."""
    config = tomllib.loads((bundle / CONFIG).read_text())
    relative = any("relative_to" in o for o in config.get("outputs", []))
    return manifest.get("sampler", {}).get("kind") == "flow" and not relative


def _verify_openpi(
    bundle: Path,
    checkpoint: Path,
    manifest: Manifest,
    policyd: str | None,
    n: int,
    rtol: float,
    seed: int,
    norm_stats: Path | None,
    rtc: bool,
) -> list[Row]:
    """An openpi bundle against openpi's pipeline (`openpi_reference`) on requests as the
    config's openpi client sends them, with the statistics the export read."""
    from . import openpi
    from .openpi_reference import OpenpiReference
    from .openpi_reference import observations as openpi_observations

    name = manifest["policy_type"].removeprefix("openpi/")
    stats = norm_stats
    if stats is None and manifest.get("norm_stats"):
        recorded = Path(manifest["norm_stats"])
        if not recorded.is_file():
            raise ExportError(
                f"{recorded}: the statistics this bundle was exported with are gone; pass "
                "--norm-stats (the norm_stats.json given to the export)"
            )
        stats = recorded
    cameras = [i for i in manifest["inputs"] if i["type"] == "VISUAL"]
    h, w = cameras[0]["shape"][1:]
    ckpt = openpi.load(checkpoint, name, stats, (h, w))
    binary = find_policyd(policyd)
    reference = OpenpiReference(ckpt, bundle / openpi.TOKENIZER_FILE)
    requests = openpi_observations(ckpt, n, seed)

    def want(obs: dict[str, Any], noise: NDArray[Any] | None, _: Any) -> NDArray[Any]:
        assert noise is not None
        return reference.infer(obs, noise)

    rows = _compare(binary, bundle, manifest, requests, want, rtol, seed, "openpi")
    if rtc:
        rows += _verify_rtc(binary, bundle, manifest, requests[:2], reference, rtol, seed)
    return rows


def _compare(
    binary: str,
    bundle: Path,
    manifest: Manifest,
    requests: list[dict[str, Any]],
    want: Want,
    rtol: float,
    seed: int,
    framework: str,
) -> list[Row]:
    """Serves the bundle (noise injected), sends `requests` in order with openpi-client on one
    connection, and compares each reply's actions with `want`'s."""
    try:
        from openpi_client import websocket_client_policy
    except ImportError:
        raise ExportError(
            "openpi-client is not installed: `pip install --no-deps openpi-client==0.1.2 "
            "msgpack websockets dm-tree` (it pins numpy<2, which lerobot 0.6.1 does not allow)"
        ) from None
    rows = [
        Row(f"{g['file']}: onnxruntime vs torch (at export)", g["max_abs_diff"], 1e-4)
        for g in manifest["graphs"]
    ]
    rng = np.random.default_rng(seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        config, step_noise = injected_config(bundle, manifest, Path(tmp))
        with serve(binary, config) as port:
            client = websocket_client_policy.WebsocketClientPolicy("127.0.0.1", port)
            for i, obs in enumerate(requests):
                request = dict(obs)
                noise = steps = None
                if "noise" in manifest:
                    noise = rng.standard_normal(manifest["noise"]["shape"]).astype(np.float32)
                    request["noise"] = noise
                    if step_noise:
                        sampler = manifest["sampler"]
                        count = int(sampler.get("max_steps") or sampler["steps"])
                        steps = rng.standard_normal((count, noise.size)).astype(np.float32)
                        request["step_noise"] = steps
                served = np.asarray(client.infer(request)["actions"], dtype=np.float64)
                expected = np.asarray(want(obs, noise, steps), dtype=np.float64)
                if served.shape != expected.shape:
                    raise ExportError(
                        f"policyd answered actions of shape {list(served.shape)}, {framework} "
                        f"{list(expected.shape)}"
                    )
                scale = float(np.abs(expected).max()) or 1.0
                what = f"observation {i + 1}: policyd vs {framework} actions {list(expected.shape)}"
                rows.append(Row(what, float(np.abs(served - expected).max()), rtol * scale))
    return rows


#: The RTC chunks `verify` checks, as (inference_delay, execution_horizon, schedule, the
#: second observation's timestep less the first's, less the chunk's rows when negative):
#: LeRobot's default schedule with a leftover longer than the horizon, no delay, a delay past
#: the horizon, and a leftover shorter than the horizon (zero-padded, as LeRobot's rollout
#: pads it). Horizons are cut to the chunk.
RTC_CASES = [(2, 6, "linear", 2), (0, 4, "exp", 1), (5, 4, "ones", 1), (1, 6, "zeros", -3)]
RTC_MAX_GUIDANCE = 10.0


def observe(ws: Any, obs: dict[str, Any], timestep: int) -> dict[str, Any]:
    """One `observe` on policyd's WebSocket (openpi's msgpack), and the chunk it pushes."""
    from openpi_client import msgpack_numpy

    frame = {"endpoint": "observe", "timestep": timestep, "timestamp": timestep / 30.0, **obs}
    ws.send(msgpack_numpy.packb(frame))
    reply: dict[str, Any] = msgpack_numpy.unpackb(ws.recv(timeout=120))
    if reply.get("type") != "actions":
        raise ExportError(f"policyd answered an observation with {reply!r}")
    return reply


def _verify_rtc(
    binary: str,
    bundle: Path,
    manifest: Manifest,
    requests: list[dict[str, Any]],
    reference: Any,
    rtol: float,
    seed: int,
) -> list[Row]:
    """Real-time chunking: policyd's chunk for a second observation on the `observe` route,
    continuing its first, against LeRobot's `predict_action_chunk(inference_delay=d,
    prev_chunk_left_over=prev)` (an openpi bundle: openpi's loop with LeRobot's
    `RTCProcessor`) with the same noise, `prev` being the first chunk (LeRobot's,
    equal to policyd's within the tolerance above) from the second observation's timestep on,
    cut or zero-padded to the horizon as LeRobot's rollout does (`RTC_CASES`)."""
    import torch
    from websockets.sync.client import connect

    rng = np.random.default_rng(seed + 2)
    shape = manifest["noise"]["shape"]
    noises = [rng.standard_normal(shape).astype(np.float32) for _ in requests]
    groot = manifest.get("family") == "groot"
    framework = "openpi" if manifest["policy_type"].startswith("openpi/") else "LeRobot"
    first = reference.chunk(requests[0], noises[0])
    plain = reference.actions(requests[1], noises[1]).astype(np.float64)
    rows_sent = first.shape[1]
    out = []
    for delay, horizon, schedule, step in RTC_CASES:
        horizon = min(horizon, rows_sent)
        k = step if step > 0 else rows_sent + step
        rtc: dict[str, Any] = {"execution_horizon": horizon, "inference_delay": delay}
        if not groot:
            rtc |= {"prefix_attention_schedule": schedule, "max_guidance_weight": RTC_MAX_GUIDANCE}
        prev = first[0, k:].clone()[:horizon]
        if prev.shape[0] < horizon:
            pad = torch.zeros((horizon - prev.shape[0], prev.shape[1]), dtype=prev.dtype)
            prev = torch.cat([prev, pad])
        reference.use_rtc(horizon, schedule, RTC_MAX_GUIDANCE)
        try:
            second = reference.chunk(
                requests[1], noises[1], inference_delay=delay, prev_chunk_left_over=prev
            )
        finally:
            reference.rtc_off()
        expected = reference.postprocess(second).astype(np.float64)
        scale = float(np.abs(expected).max()) or 1.0
        if np.abs(expected - plain).max() <= 10 * rtol * scale:
            raise ExportError(
                f"LeRobot's RTC chunk (d={delay}, h={horizon}) equals its plain one: comparing "
                "them with policyd's would prove nothing"
            )
        with tempfile.TemporaryDirectory() as tmp:
            config, _ = injected_config(bundle, manifest, Path(tmp), rtc)
            with serve(binary, config) as port:
                with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
                    ws.recv(timeout=120)  # the metadata
                    observe(ws, {**requests[0], "noise": noises[0]}, 100)
                    reply = observe(ws, {**requests[1], "noise": noises[1]}, 100 + k)
        served = np.asarray(reply["actions"], dtype=np.float64)
        steps = np.asarray(reply["timesteps"], dtype=np.int64) - (100 + k)
        if served.shape[1:] != expected.shape[1:] or steps.min() < 0:
            raise ExportError(
                f"policyd pushed actions of shape {list(served.shape)} at chunk rows "
                f"{steps.tolist()}; LeRobot's chunk is {list(expected.shape)}"
            )
        want = expected[steps]
        what = (
            f"rtc d={delay} h={horizon} {'groot' if groot else schedule} leftover "
            f"{min(rows_sent - k, horizon)}: policyd vs {framework} {list(served.shape)}"
        )
        out.append(Row(what, float(np.abs(served - want).max()), rtol * scale))
    return out


def table(rows: list[Row]) -> str:
    width = max(len(r.what) for r in rows)
    lines = [f"{'check':<{width}}  {'max abs diff':>12}  {'tolerance':>10}  result"]
    for r in rows:
        lines.append(
            f"{r.what:<{width}}  {r.diff:>12.3e}  {r.tol:>10.3e}  {'pass' if r.ok else 'FAIL'}"
        )
    return "\n".join(lines)

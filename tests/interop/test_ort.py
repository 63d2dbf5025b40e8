"""The `ort` backend (onnxruntime, from the PyPI wheel this venv installed) against the `cpu`
backend (tract): every demo config and both pipelines' samplers, served twice, through the
unchanged openpi-client, must give the same actions.

Tolerance: both engines compute in float32 with different kernels (MLAS vs tract's), so actions
agree to rounding, not bit for bit: |ort - cpu| <= 1e-4 + 1e-4 * |cpu| (the demo models' actions
are O(1); the measured worst is printed). Pipelines draw their noise from the request's `seed`,
so both servers start from the same sample.
"""

import pathlib

import numpy as np
import onnxruntime
import pytest
from openpi_client import websocket_client_policy as wcp
from profiles import observation
from test_openpi import BIN, free_port, start_policyd

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIB_DIR = pathlib.Path(onnxruntime.__file__).parent / "capi"


def as_ort(text, extra=""):
    """A demo config's text on the ort backend, its relative paths made absolute."""
    text = text.replace('"../', f'"{ROOT}/')
    out, done = [], False
    for line in text.splitlines():
        if line.startswith("backend = ") and not done:
            line = f'backend = "ort"\nort_library = "{LIB_DIR}"{extra}'
            done = True
        out.append(line)
    assert done, "the config has no engine.backend line"
    return "\n".join(out) + "\n"


def as_cpu(text):
    return text.replace('"../', f'"{ROOT}/')


# (config, profile its observations follow, how to vary it)
CASES = [
    ("aloha", "aloha", None),
    ("droid", "droid", None),
    ("libero", "libero", None),
    ("tiny", "tiny", None),
    ("prompted", "tiny", None),
    ("flow", "flow", None),
    ("diffusion", "diffusion", None),
    # The other diffusion sampler, and DDIM with eta (its noise drawn per step).
    ("diffusion", "diffusion", ('kind = "ddim"', 'kind = "ddpm"\nsteps = 100')),
    ("diffusion", "diffusion", ("clip_sample = true", "clip_sample = true\neta = 1.0")),
]


def vary(text, change):
    if change is None:
        return text
    old, new = change
    assert old in text
    text = text.replace(old, new, 1)
    # `ddpm` takes every training step; the shipped `steps = 10` goes.
    if "ddpm" in new:
        text = text.replace("steps = 10\n", "", 1)
    return text


def serve(tmp_path, name, text):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    port = free_port()
    return start_policyd(path, port), port


@pytest.mark.parametrize(("config", "profile", "change"), CASES)
def test_ort_gives_the_cpu_backends_actions(tmp_path, config, profile, change):
    text = vary((ROOT / f"configs/{config}.toml").read_text(), change)
    procs = []
    try:
        cpu, cpu_port = serve(tmp_path, "cpu", as_cpu(text))
        procs.append(cpu)
        ort, ort_port = serve(tmp_path, "ort", as_ort(text))
        procs.append(ort)
        clients = [
            wcp.WebsocketClientPolicy("127.0.0.1", p) for p in (cpu_port, ort_port)
        ]
        meta = clients[1].get_server_metadata()
        rng = np.random.default_rng(7)
        worst = 0.0
        for i in range(4):
            obs = observation(profile, rng)
            if config == "prompted":
                obs["prompt"] = ["pick up the cup", "stack the blocks", "", "fold"][i]
            obs["seed"] = 1000 + i
            a, b = (np.asarray(c.infer(obs)["actions"], np.float64) for c in clients)
            assert a.shape == b.shape and a.size > 0
            assert np.isfinite(b).all()
            err = np.abs(a - b) - 1e-4 * np.abs(a)
            worst = max(worst, float(np.abs(a - b).max()))
            assert err.max() <= 1e-4, (
                f"request {i}: max |ort - cpu| {np.abs(a - b).max()}"
            )
        print(
            f"{config} {change}: max |ort - cpu| = {worst:.2e}; metadata {sorted(meta)}"
        )
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)


def check(tmp_path, text):
    import subprocess

    path = tmp_path / "c.toml"
    path.write_text(text)
    return subprocess.run(
        [BIN, "check-config", str(path)], check=False, capture_output=True, text=True
    )


def test_check_config_on_ort_reports_the_library_and_measured_memory(tmp_path):
    r = check(tmp_path, as_ort((ROOT / "configs/flow.toml").read_text()))
    assert r.returncode == 0, r.stderr
    assert "OK (ort backend" in r.stdout
    assert "onnxruntime  session, weights and arena" in r.stdout
    assert f"onnxruntime {onnxruntime.__version__}" in r.stderr


def test_unknown_and_missing_provider_and_library_errors_name_the_key(tmp_path):
    base = (ROOT / "configs/tiny.toml").read_text()
    r = check(tmp_path, as_ort(base, '\nproviders = ["cuda"]'))
    assert r.returncode != 0
    assert 'engine.providers names "cuda"' in r.stderr
    assert "CPUExecutionProvider" in r.stderr and "onnxruntime-gpu" in r.stderr
    r = check(tmp_path, as_ort(base, '\nproviders = ["npu"]'))
    assert r.returncode != 0 and "engine.providers" in r.stderr and '"npu"' in r.stderr
    text = as_ort(base).replace(str(LIB_DIR), str(tmp_path / "nowhere"))
    r = check(tmp_path, text)
    assert r.returncode != 0
    assert "engine.ort_library" in r.stderr and "pip install onnxruntime" in r.stderr


def metrics(port):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def wait_for(port, needle):
    import time

    for _ in range(200):
        text = metrics(port)
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} never appeared in /metrics:\n{text}")


def test_a_reload_moves_a_running_policy_from_cpu_to_ort(tmp_path):
    import signal

    text = (ROOT / "configs/libero.toml").read_text()
    path = tmp_path / "live.toml"
    path.write_text(as_cpu(text))
    port = free_port()
    proc = start_policyd(path, port)
    try:
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        obs = observation("libero", np.random.default_rng(3))
        on_cpu = np.asarray(client.infer(obs)["actions"], np.float64)
        # A library that is not there: the reload is refused, naming the key; cpu keeps serving.
        path.write_text(as_ort(text).replace(str(LIB_DIR), str(tmp_path / "missing")))
        proc.send_signal(signal.SIGHUP)
        wait_for(port, 'policyd_config_reloads_total{result="refused"} 1')
        assert "engine.ort_library" in metrics(port)
        np.testing.assert_array_equal(client.infer(obs)["actions"], on_cpu)
        path.write_text(as_ort(text))
        proc.send_signal(signal.SIGHUP)
        wait_for(port, 'policyd_config_reloads_total{result="ok"} 1')
        on_ort = np.asarray(client.infer(obs)["actions"], np.float64)
        assert np.abs(on_ort - on_cpu).max() <= 1e-4
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    # onnxruntime was loaded by the reload, in the running process.
    assert f"onnxruntime {onnxruntime.__version__} from" in err.decode()

"""Interop tests: the real openpi-client (PyPI) against the policyd binary.

Actions are checked against the same ONNX model run by onnxruntime, with the binding
transforms of the profile's config applied in numpy.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import tomllib

import msgpack
import msgpack_numpy
import numpy as np
import onnxruntime as ort
import pytest
import websockets.exceptions
import websockets.sync.client as wsc
from openpi_client import msgpack_numpy as openpi_mn
from openpi_client import websocket_client_policy as wcp
from profiles import observation

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("POLICYD_BIN", str(ROOT / "target/debug/policyd"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_policyd(config, port, cafile=None):
    """Starts policyd and waits until /healthz says it is ready (it answers 503 while the
    engine loads)."""
    proc = subprocess.Popen(
        [BIN, "--config", str(config), "--port", str(port)], stderr=subprocess.PIPE
    )
    return wait_healthy(proc, port, "policyd", cafile)


def wait_healthy(proc, port, name, cafile=None):
    """Waits until the server `proc` started answers 200 on /healthz; returns `proc`."""
    import ssl
    import urllib.request

    scheme = "https" if cafile else "http"
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    host = "localhost" if cafile else "127.0.0.1"
    for _ in range(400):
        try:
            with urllib.request.urlopen(
                f"{scheme}://{host}:{port}/healthz", timeout=1, context=ctx
            ) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    err = proc.stderr.read().decode() if proc.stderr else ""
    raise RuntimeError(f"{name} on port {port} never became ready: {err}")


@pytest.fixture(scope="module", params=["aloha", "droid", "libero", "tiny"])
def server(request):
    port = free_port()
    proc = start_policyd(ROOT / f"configs/{request.param}.toml", port)
    yield request.param, port
    proc.terminate()
    proc.wait(timeout=15)


def lookup(obs, key):
    for part in key.split("/") if key not in obs else [key]:
        if not isinstance(obs, dict) or part not in obs:
            return None
        obs = obs[part]
    return obs


def expected(profile, obs):
    cfg = tomllib.loads((ROOT / f"configs/{profile}.toml").read_text())
    sess = ort.InferenceSession(str(ROOT / f"models/{profile}.onnx"))
    feed = {}
    for b in cfg["inputs"]:
        x = lookup(obs, b["key"])
        meta = {i.name: i for i in sess.get_inputs()}[b["tensor"]]
        if x is None:
            feed[b["tensor"]] = np.full(meta.shape, b.get("fill", 0.0), np.float32)
            continue
        x = x.astype(np.float64) * b.get("scale", 1.0) + b.get("offset", 0.0)
        if "mean" in b:
            x = (x - np.array(b["mean"])) / (np.array(b["std"]) + 1e-6)
        if b.get("layout") == "hwc_to_chw":
            x = x.transpose(2, 0, 1)
        feed[b["tensor"]] = x.astype(np.float32).reshape(meta.shape)
    out = sess.run(None, feed)[0][0].astype(np.float64)
    o = cfg["outputs"][0]
    if "mean" in o:
        out = out * (np.array(o["std"]) + 1e-6) + np.array(o["mean"])
    return out, o.get("dtype", "float32")


def test_infer_matches_onnxruntime(server):
    profile, port = server
    client = wcp.WebsocketClientPolicy("127.0.0.1", port)
    meta = client.get_server_metadata()
    if profile == "aloha":
        assert meta == {"reset_pose": [0, -1.5, 1.5, 0, 0, 0]}
    rng = np.random.default_rng(0)
    for i in range(3):
        obs = observation(profile, rng)
        reply = client.infer(obs)
        want, dtype = expected(profile, obs)
        assert reply["actions"].dtype == np.dtype(dtype)
        assert reply["actions"].shape == want.shape
        assert np.max(np.abs(reply["actions"] - want)) <= 1e-4
        # openpi's keys, plus policyd's delay_steps (pacing.reply_delay_steps, on by default).
        assert set(reply) == {
            "actions",
            "policy_timing",
            "server_timing",
            "delay_steps",
        }
        assert isinstance(reply["delay_steps"], int) and reply["delay_steps"] >= 0
        assert reply["policy_timing"]["infer_ms"] > 0
        assert reply["server_timing"]["infer_ms"] >= reply["policy_timing"]["infer_ms"]
        assert ("prev_total_ms" in reply["server_timing"]) == (i > 0)
        if profile == "droid":
            # openpi's examples/droid/main.py asserts this shape.
            assert reply["actions"].shape == (10, 8)


BAKED = os.environ.get("POLICYD_BAKED_BIN")


def test_firmware_image_serves_its_baked_config_from_an_empty_directory(tmp_path):
    """A binary built with POLICYD_EMBED_CONFIG=configs/libero.toml (scripts/test builds it)
    serves LIBERO with no arguments and no files, exactly as the same config from files."""
    if not BAKED:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must set POLICYD_BAKED_BIN (scripts/test builds the baked binary)"
            )
        pytest.skip(
            "set POLICYD_BAKED_BIN to a binary built with POLICYD_EMBED_CONFIG=configs/libero.toml"
        )
    text = subprocess.run(
        [BAKED, "print-default-config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert text == (ROOT / "configs/libero.toml").read_text()
    port_b, port_f = free_port(), free_port()
    baked = wait_healthy(
        subprocess.Popen(
            [BAKED, "--port", str(port_b)], cwd=tmp_path, stderr=subprocess.PIPE
        ),
        port_b,
        "the baked policyd",
    )
    files = start_policyd(ROOT / "configs/libero.toml", port_f)
    try:
        rng = np.random.default_rng(7)
        a = wcp.WebsocketClientPolicy("127.0.0.1", port_b)
        b = wcp.WebsocketClientPolicy("127.0.0.1", port_f)
        assert a.get_server_metadata() == b.get_server_metadata()
        for _ in range(3):
            obs = observation("libero", rng)
            got, want = a.infer(obs)["actions"], b.infer(obs)["actions"]
            assert got.shape == (10, 7)
            np.testing.assert_array_equal(got, want)
        assert list(tmp_path.iterdir()) == [], (
            "nothing is read from or written to the directory"
        )
    finally:
        for p in (baked, files):
            p.terminate()
            p.wait(timeout=15)
    assert b"serving <embedded libero.onnx>" in baked.stderr.read()


def as_policy(profile, default=False):
    """A demo profile's config rewritten as one `[[policies]]` entry."""
    text = (ROOT / f"configs/{profile}.toml").read_text()
    text = text[text.index("[engine]") :]  # drop the comments and [server]
    for table in ["engine", "metadata", "pacing"]:
        text = text.replace(f"[{table}]", f"[policies.{table}]")
    for array in ["inputs", "outputs"]:
        text = text.replace(f"[[{array}]]", f"[[policies.{array}]]")
    text = text.replace('"../models/', f'"{ROOT}/models/')
    head = f'[[policies]]\nname = "{profile}"\ndefault = {"true" if default else "false"}\n'
    return head + text


@pytest.fixture(scope="module")
def two_policies(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("policies") / "policyd.toml"
    cfg.write_text(
        '[server]\nhost = "127.0.0.1"\n'
        + as_policy("tiny", default=True)
        + as_policy("libero")
    )
    port = free_port()
    proc = start_policyd(cfg, port)
    yield port
    proc.terminate()
    proc.wait(timeout=15)


def test_openpi_client_chooses_a_policy_by_url_or_field(two_policies):
    port = two_policies
    rng = np.random.default_rng(1)
    # By URL: openpi-client takes a ws:// URL as its host.
    libero = wcp.WebsocketClientPolicy(f"ws://127.0.0.1:{port}/policies/libero")
    obs = observation("libero", rng)
    want, _ = expected("libero", obs)
    assert np.max(np.abs(libero.infer(obs)["actions"] - want)) <= 1e-4
    # The default policy.
    tiny = wcp.WebsocketClientPolicy("127.0.0.1", port)
    obs = observation("tiny", rng)
    want, _ = expected("tiny", obs)
    assert np.max(np.abs(tiny.infer(obs)["actions"] - want)) <= 1e-4
    # By field: the same connection moves to libero.
    obs = observation("libero", rng)
    want, _ = expected("libero", obs)
    reply = tiny.infer({**obs, "policy": "libero"})
    assert np.max(np.abs(reply["actions"] - want)) <= 1e-4
    # An unknown policy is refused with the names served.
    with pytest.raises(Exception) as err:
        wcp.WebsocketClientPolicy(f"ws://127.0.0.1:{port}/policies/nope")
    assert "404" in str(err.value) or "nope" in str(err.value)


def test_aloha_sim_sends_only_cam_high(server):
    profile, port = server
    if profile != "aloha":
        pytest.skip("aloha only")
    client = wcp.WebsocketClientPolicy("127.0.0.1", port)
    rng = np.random.default_rng(1)
    obs = {
        "state": rng.random(14),
        "images": {"cam_high": rng.integers(0, 256, (3, 224, 224), dtype=np.uint8)},
    }
    want, _ = expected(profile, obs)
    assert np.max(np.abs(client.infer(obs)["actions"] - want)) <= 1e-4


def bad_inputs(profile, rng):
    good = observation(profile, rng)
    key = next(k for k in good if k != "prompt" and not isinstance(good[k], dict))
    wrong_shape = dict(good, **{key: np.zeros(3)})
    wrong_dtype = dict(good, **{key: good[key].astype(np.int32)})
    missing = {k: v for k, v in good.items() if k != key}
    packed = openpi_mn.packb(good)
    # A float input (the state): non-finite values are refused by default (issue 21).
    fkey = next(
        k for k, v in good.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f"
    )
    state = good[fkey]

    def with_state(value):
        bad = state.copy()
        bad.flat[0] = value
        return openpi_mn.packb(dict(good, **{fkey: bad}))

    non_finite = {f"state {v}": with_state(v) for v in [np.nan, np.inf, -np.inf]}
    # 1e308 fits float64 but not the engine's float32; float32-max overflows once normalised
    # (the profiles' state std is below 1) or is at the engine's limit.
    non_finite["state 1e308"] = openpi_mn.packb(
        dict(good, **{fkey: np.full(state.shape, 1e308, np.float64)})
    )
    return {
        **non_finite,
        # msgpack str where numpy data must be bin (both reference servers fail on it).
        "str data": msgpack.packb(
            {
                **{k: v for k, v in good.items() if k != fkey},
                fkey: {
                    b"__ndarray__": True,
                    b"data": "0" * state.nbytes,
                    b"dtype": state.dtype.str,
                    b"shape": list(state.shape),
                },
            },
            default=openpi_mn.pack_array,
        ),
        "not msgpack": b"\xc1\xc1\xc1",
        "truncated": packed[: min(1000, len(packed) // 2)],
        "non-map": openpi_mn.packb([1, 2, 3]),
        "wrong shape": openpi_mn.packb(wrong_shape),
        "wrong dtype": openpi_mn.packb(wrong_dtype),
        "missing key": openpi_mn.packb(missing),
        "complex": openpi_mn.packb(dict(good, z=0)).replace(b"", b"")
        and msgpack.packb(
            {
                key: {
                    "nd": True,
                    "type": "<c8",
                    "kind": b"",
                    "shape": [1],
                    "data": b"\0" * 8,
                }
            }
        ),
        "object": msgpack.packb(
            {key: np.array([1, "a"], dtype=object)}, default=msgpack_numpy.encode
        ),
        "length mismatch": msgpack.packb(
            {
                key: {
                    b"__ndarray__": True,
                    b"data": b"\0" * 7,
                    b"dtype": "<f8",
                    b"shape": [1],
                }
            }
        ),
        "absurd shape": msgpack.packb(
            {
                key: {
                    b"__ndarray__": True,
                    b"data": b"",
                    b"dtype": "<f8",
                    b"shape": [2**40, 2**40, 2**40],
                }
            }
        ),
        "deep": b"\x81\xa1x" + b"\x91" * 5000 + b"\x00",
        "text": "hello",
    }


def test_bad_inputs_openpi_route(server):
    profile, port = server
    rng = np.random.default_rng(2)
    for name, payload in bad_inputs(profile, rng).items():
        with wsc.connect(
            f"ws://127.0.0.1:{port}/", compression=None, max_size=None
        ) as ws:
            ws.recv()  # metadata
            ws.send(payload)
            err = ws.recv()
            assert isinstance(err, str) and err.startswith(
                "policyd: invalid request"
            ), (name, err)
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                ws.recv()
            assert ws.close_code == 1011, name
    # the server still serves
    client = wcp.WebsocketClientPolicy("127.0.0.1", port)
    assert client.infer(observation(profile, rng))["actions"].ndim == 2


def test_oversized_frame_rejected(server):
    """A frame over max_message_bytes (4 MiB) is discarded unread: openpi gets its error text
    and close 1011, and the server keeps serving."""
    profile, port = server
    with wsc.connect(f"ws://127.0.0.1:{port}/", compression=None, max_size=None) as ws:
        ws.recv()
        ws.send(b"\x80" + b"\0" * (5 << 20))
        err = ws.recv(timeout=10)
        assert isinstance(err, str) and "max_message_bytes" in err, err
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv()
        assert ws.close_code == 1011
    client = wcp.WebsocketClientPolicy("127.0.0.1", port)
    assert (
        client.infer(observation(profile, np.random.default_rng(4)))["actions"].ndim
        == 2
    )


def test_vllm_route_oversized_frame_keeps_socket(server):
    profile, port = server
    rng = np.random.default_rng(5)
    with wsc.connect(
        f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi",
        compression=None,
        max_size=None,
    ) as ws:
        msgpack.unpackb(ws.recv())
        obs = observation(profile, rng)
        big = dict(obs, padding=b"\0" * (5 << 20))
        ws.send(msgpack.packb(big, default=msgpack_numpy.encode))
        err = msgpack.unpackb(ws.recv(timeout=10))
        assert err["type"] == "error" and err["message"] == "Invalid request payload", (
            err
        )
        assert "max_message_bytes" in err["detail"]
        ws.send(msgpack.packb(obs, default=msgpack_numpy.encode))
        arr = openpi_mn.unpackb(ws.recv(timeout=10))
        want, _ = expected(profile, obs)
        assert np.max(np.abs(arr - want)) <= 1e-4


def test_vllm_route_errors_keep_socket_and_sessions(server):
    profile, port = server
    rng = np.random.default_rng(3)
    with wsc.connect(
        f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi",
        compression=None,
        max_size=None,
    ) as ws:
        msgpack.unpackb(ws.recv())
        for name, payload in bad_inputs(profile, rng).items():
            ws.send(payload)
            err = msgpack.unpackb(ws.recv())
            assert (
                err["type"] == "error" and err["message"] == "Invalid request payload"
            ), (name, err)
            assert err["detail"]
        obs = observation(profile, rng)
        for sid in ["a", "b", "a"]:
            ws.send(
                msgpack.packb(dict(obs, session_id=sid), default=msgpack_numpy.encode)
            )
            arr = openpi_mn.unpackb(ws.recv())
            want, _ = expected(profile, obs)
            assert arr.dtype == np.float32 and np.max(np.abs(arr - want)) <= 1e-4
        ws.send(msgpack.packb({"endpoint": "reset"}))
        assert msgpack.unpackb(ws.recv()) == {"status": "reset successful"}


def test_healthz(server):
    _, port = server
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as r:
        assert r.status == 200 and r.read() == b"OK\n"
        assert r.headers["Content-Type"] == "text/plain; charset=utf-8"


API_KEY = "interop-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """The LIBERO demo with an API key from a key file ([auth] key_file)."""
    d = tmp_path_factory.mktemp("keyed")
    (d / "keys").write_text(f"# robots on the lab network\n{API_KEY}\n")
    text = (ROOT / "configs/libero.toml").read_text()
    text = text.replace(
        'model = "../models/libero.onnx"', f'model = "{ROOT}/models/libero.onnx"'
    )
    (d / "policyd.toml").write_text(text + '\n[auth]\nkey_file = "keys"\n')
    port = free_port()
    proc = start_policyd(d / "policyd.toml", port)
    yield port
    proc.terminate()
    proc.wait(timeout=15)


def test_api_key_right_wrong_and_missing(keyed_server):
    import urllib.error
    import urllib.request

    port = keyed_server
    client = wcp.WebsocketClientPolicy("127.0.0.1", port, api_key=API_KEY)
    reply = client.infer(observation("libero", np.random.default_rng(1)))
    assert reply["actions"].shape == (10, 7)
    for key in ["wrong-key-0123456789abcdef", None]:
        with pytest.raises(Exception, match="401"):
            wcp.WebsocketClientPolicy("127.0.0.1", port, api_key=key)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics")
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Authorization": f"Api-Key {API_KEY}"},
    )
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    assert "policyd_auth_failures_total 3" in text
    assert 'policyd_requests_total{route="openpi",endpoint="infer"} 1' in text


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """The LIBERO demo over wss://, with a self-signed certificate made here for localhost."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    text = (ROOT / "configs/libero.toml").read_text()
    text = text.replace(
        'model = "../models/libero.onnx"', f'model = "{ROOT}/models/libero.onnx"'
    )
    (d / "policyd.toml").write_text(
        text + '\n[tls]\ncert = "cert.pem"\nkey = "key.pem"\n'
    )
    port = free_port()
    proc = start_policyd(d / "policyd.toml", port, cafile=d / "cert.pem")
    yield port, d / "cert.pem"
    proc.terminate()
    proc.wait(timeout=15)


def test_openpi_client_over_wss(tls_server, monkeypatch):
    import ssl
    import urllib.request

    port, cert = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test certificate
    client = wcp.WebsocketClientPolicy("wss://localhost", port)
    obs = observation("libero", np.random.default_rng(2))
    reply = client.infer(obs)
    want, _ = expected("libero", obs)
    assert np.max(np.abs(reply["actions"] - want)) <= 1e-4
    ctx = ssl.create_default_context(cafile=str(cert))
    with urllib.request.urlopen(f"https://localhost:{port}/healthz", context=ctx) as r:
        assert r.status == 200 and r.read() == b"OK\n"
    # A plain ws:// client gets no WebSocket from a TLS port.
    with pytest.raises(Exception):  # noqa: B017 (any failure to connect is the point)
        wcp.WebsocketClientPolicy("127.0.0.1", port)


def test_policyd_bench_drives_openpis_own_python_server():
    """`policyd bench` against openpi's server code (PyPI openpi-server) over onnxruntime
    (benches/python_server.py), compared in turn with policyd on the same config."""
    cfg = ROOT / "configs/tiny.toml"
    py_port, pd_port = free_port(), free_port()
    py = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "benches/python_server.py"),
            "--config",
            str(cfg),
            "--port",
            str(py_port),
        ]
    )
    pd = start_policyd(cfg, pd_port)
    try:
        wait_healthy(py, py_port, "openpi-server")  # it has /healthz too
        out = subprocess.run(
            [
                BIN,
                "bench",
                f"ws://127.0.0.1:{pd_port}",
                "--profile",
                "tiny",
                "--name",
                "policyd",
                "--compare",
                f"ws://127.0.0.1:{py_port}",
                "--compare-name",
                "python",
                "--duration",
                "1",
                "--warmup",
                "0.3",
                "--rounds",
                "2",
                "--json",
            ],
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr.decode()
        rep = json.loads(out.stdout)
        names = [t["name"] for t in rep["targets"]]
        assert names == ["policyd", "python"]
        for t in rep["targets"]:
            assert t["requests"] > 20 and t["errors"] == 0, t
            # Both replies carry policy_timing.infer_ms; both processes are found by port.
            assert t["engine_ms_per_request"] > 0, t
            assert t["cpu_ms_per_request"] is not None, t
        assert rep["ratios"][0]["pair"] == "policyd / python"
    finally:
        py.kill()
        py.wait(timeout=15)
        pd.terminate()
        pd.wait(timeout=15)

"""LeRobot's own async inference against policyd's `[lerobot]` gRPC service: the unmodified
`RobotClient` of lerobot 0.6.1 (real torch, real grpcio) drives an exported bundle, the actions
equal those LeRobot's own `policy_server` gives for the same observation, a Diffusion Policy
(which LeRobot 0.6.1's server cannot serve) runs, and hostile payloads are refused with the
server still serving and nothing executed."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import policyd_test_robot as test_robot
import pytest
import tomli_w
from conftest import Exported, check_config
from lerobot.async_inference.configs import RobotClientConfig
from lerobot.async_inference.helpers import (
    RemotePolicyConfig,
    TimedAction,
    TimedObservation,
    map_robot_keys_to_lerobot_features,
)
from lerobot.transport import services_pb2, services_pb2_grpc
from lerobot.transport.utils import grpc_channel_options, send_bytes_in_chunks

MARKER = Path("/tmp/policyd-pwned")
ATTACKS = Path(__file__).resolve().parents[2] / "tests/fixtures/lerobot"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"policyd exited: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "policyd did not become ready"
        time.sleep(0.05)


class Served:
    def __init__(
        self, port: int, grpc_port: int, log: Path, config: Path, proc: subprocess.Popen
    ) -> None:
        self.port, self.grpc_port, self.log = port, grpc_port, log
        self.config, self.proc = config, proc
        self.address = f"127.0.0.1:{grpc_port}"

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
            return r.status == 200

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
            return r.read().decode()


@contextlib.contextmanager
def served(policyd: str, b: Exported, tmp: Path, **lerobot: object) -> Iterator[Served]:
    """The bundle's own config, as exported, with free ports and `lerobot` overrides."""
    config = tomllib.loads((b.bundle / "policyd.toml").read_text())
    for section in ("engine", "denoise"):
        if section in config:
            config[section]["model"] = str(b.bundle / config[section]["model"])
    for binding in config["inputs"]:
        if "tokenizer" in binding:
            binding["tokenizer"]["file"] = str(b.bundle / binding["tokenizer"]["file"])
    grpc_port = free_port()
    config["lerobot"]["listen"] = f"127.0.0.1:{grpc_port}"
    config["lerobot"].update(lerobot)
    path = tmp / f"policyd-{grpc_port}.toml"
    path.write_text(tomli_w.dumps(config))
    port = free_port()
    log = tmp / f"policyd-{grpc_port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [policyd, "--config", str(path), "--port", str(port)], stdout=out, stderr=out
        )
    try:
        wait_ready(port, proc, log)
        yield Served(port, grpc_port, log, path, proc)
    finally:
        proc.terminate()
        proc.wait(10)


def robot_config(**kw: object) -> test_robot.PolicydTestRobotConfig:
    return test_robot.PolicydTestRobotConfig(**kw)


def remote_config(
    b: Exported, robot: test_robot.PolicydTestRobot, chunk: int
) -> RemotePolicyConfig:
    """What RobotClient sends: its robot's features, positionally, as it builds them."""
    features = map_robot_keys_to_lerobot_features(robot)
    return RemotePolicyConfig("act", str(b.checkpoint.resolve()), features, chunk, "cpu")


class Stub:
    """LeRobot's own stub, channel options and chunking, one call at a time (what RobotClient's
    threads do, without its loop)."""

    def __init__(self, address: str, own_connection: bool = False) -> None:
        options = list(grpc_channel_options())
        if own_connection:
            # gRPC shares one connection between channels of a process with the same target
            # and options; another client is another connection.
            options.append(("grpc.use_local_subchannel_pool", 1))
        self.channel = grpc.insecure_channel(address, options)
        self.stub = services_pb2_grpc.AsyncInferenceStub(self.channel)

    def setup(self, config: RemotePolicyConfig | bytes) -> None:
        data = config if isinstance(config, bytes) else pickle.dumps(config)
        self.stub.Ready(services_pb2.Empty())
        self.stub.SendPolicyInstructions(services_pb2.PolicySetup(data=data))

    def observe(self, obs: TimedObservation | bytes) -> None:
        data = obs if isinstance(obs, bytes) else pickle.dumps(obs)
        self.stub.SendObservations(send_bytes_in_chunks(data, services_pb2.Observation))

    def actions(self, timeout: float = 30.0) -> list[TimedAction]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self.stub.GetActions(services_pb2.Empty()).data
            if data:
                return pickle.loads(data)  # noqa: S301 (the server under test wrote it)
        raise AssertionError("no actions within the timeout")

    def close(self) -> None:
        self.channel.close()


def drive(client: Any, task: str, seconds: float) -> tuple[Any, test_robot.PolicydTestRobot]:
    """LeRobot's `RobotClient` run as its `main` runs it (the action receiver and the control
    loop on their threads) for `seconds`, then stopped: the client and the robot it drove."""
    assert client.start()
    receiver = threading.Thread(target=client.receive_actions, daemon=True)
    receiver.start()
    loop = threading.Thread(target=client.control_loop, args=(task,), daemon=True)
    loop.start()
    time.sleep(seconds)
    client.shutdown_event.set()
    loop.join(5)
    robot = client.robot
    client.stop()
    receiver.join(5)
    return client, robot


def observation(robot: test_robot.PolicydTestRobot, step: int) -> TimedObservation:
    raw = robot.get_observation()
    raw["task"] = "pick the cube"
    return TimedObservation(time.time(), step, raw, must_go=True)


@pytest.fixture(scope="module")
def act(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    import checkpoints
    from conftest import _export

    return _export(tmp_path_factory.mktemp("lerobot-act"), "act", checkpoints.act, cameras=1)


def test_the_bundle_maps_the_checkpoint_for_lerobot_clients(act: Exported) -> None:
    config = tomllib.loads((act.bundle / "policyd.toml").read_text())
    assert config["lerobot"]["listen"] == "127.0.0.1:8080"
    assert config["lerobot"]["serve"] == [
        {"pretrained": str(act.checkpoint.resolve()), "policy_type": "act"}
    ]


def test_robot_client_runs_against_policyd(
    act: Exported, policyd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # robot_client's logger writes logs/ into the working directory when it is imported.
    monkeypatch.chdir(tmp_path)
    from lerobot.async_inference.robot_client import RobotClient

    with served(policyd, act, tmp_path) as s:
        cfg = RobotClientConfig(
            policy_type="act",
            pretrained_name_or_path=str(act.checkpoint.resolve()),
            robot=robot_config(),
            actions_per_chunk=10,
            server_address=s.address,
            task="pick the cube",
            fps=30,
        )
        client, robot = drive(RobotClient(cfg), cfg.task, 4.0)
        # 4 s at 30 Hz: actions flow from the first chunk on, one per tick.
        assert len(robot.actions) >= 80, len(robot.actions)
        assert client.latest_action >= 80
        assert client.action_chunk_size == 10
        assert len(robot.observations) >= 4
        for a in robot.actions:
            assert list(a) == [f"{m}.pos" for m in test_robot.MOTORS]
            assert all(math.isfinite(v) for v in a.values())
        # The client sends an observation when its queue runs half empty: chunks aggregate.
        assert max(client.action_queue_size) <= 10
        assert s.healthy()
        m = s.metrics()
        assert 'policyd_lerobot_rpcs_total{rpc="SendObservations"}' in m
        assert 'policyd_requests_total{route="lerobot",endpoint="observe"}' in m


#: LeRobot's policy_server with pi0 at the tests' tiny sizes and its noise all zeros (policyd's
#: side takes the same zeros as injected noise), so that the two servers' actions compare.
TINY_PI0_SERVER = """
import runpy, sys, torch
sys.path.insert(0, {tests!r})
import checkpoints
from lerobot.policies.pi0.modeling_pi0 import PI0Pytorch
PI0Pytorch.sample_noise = lambda self, shape, device: torch.zeros(shape, device=device)
sys.argv = ["policy_server"] + sys.argv[1:]
with checkpoints.tiny_pi0():
    runpy.run_module("lerobot.async_inference.policy_server", run_name="__main__")
"""


@contextlib.contextmanager
def lerobot_server(tmp: Path, tiny_pi0: bool = False) -> Iterator[str]:
    """LeRobot 0.6.1's own policy_server, as its users start it (`tiny_pi0`: see
    `TINY_PI0_SERVER`)."""
    port = free_port()
    log = tmp / "lerobot-server.log"
    if tiny_pi0:
        start = ["-c", TINY_PI0_SERVER.format(tests=str(Path(__file__).parent))]
    else:
        start = ["-m", "lerobot.async_inference.policy_server"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                *start,
                "--host=127.0.0.1",
                f"--port={port}",
                "--fps=30",
                "--inference_latency=0",
            ],
            stdout=out,
            stderr=out,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            cwd=tmp,  # its logs/
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            assert time.monotonic() < deadline, "LeRobot's server did not start"
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_actions_equal_lerobots_own_policy_server(
    act: Exported, policyd: str, tmp_path: Path
) -> None:
    robot = test_robot.PolicydTestRobot(robot_config(seed=3))
    config = remote_config(act, robot, chunk=8)
    observations = [observation(robot, step) for step in (0, 5, 12)]
    replies: dict[str, list[list[TimedAction]]] = {}
    with served(policyd, act, tmp_path) as s, lerobot_server(tmp_path) as upstream:
        for name, address in (("policyd", s.address), ("lerobot", upstream)):
            stub = Stub(address)
            stub.setup(config)
            replies[name] = []
            for obs in observations:
                stub.observe(obs)
                replies[name].append(stub.actions())
            stub.close()
    worst = 0.0
    for ours, theirs, obs in zip(replies["policyd"], replies["lerobot"], observations, strict=True):
        assert len(ours) == len(theirs) == 8
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert a.get_timestep() == b.get_timestep() == obs.get_timestep() + i
            assert abs(a.get_timestamp() - b.get_timestamp()) < 1e-6
            ta, tb = a.get_action(), b.get_action()
            assert ta.dtype == tb.dtype and ta.shape == tb.shape and ta.device.type == "cpu"
            scale = max(float(tb.abs().max()), 1.0)
            diff = float((ta - tb).abs().max())
            worst = max(worst, diff / scale)
    assert worst <= 1e-4, worst
    print(f"policyd vs LeRobot's policy_server: max relative difference {worst:.2e}")


def test_frames_of_another_size_are_resized_like_lerobots_server(
    act: Exported, policyd: str, tmp_path: Path
) -> None:
    """A 60x80 camera for a 48x64 policy: both servers resize (torch's uint8 bilinear kernel,
    which policyd reproduces pixel for pixel), so the actions agree as closely as at 48x64."""
    robot = test_robot.PolicydTestRobot(robot_config(seed=4, frames={"cam0": (60, 80)}))
    config = remote_config(act, robot, chunk=4)
    obs = observation(robot, 0)
    got = {}
    with served(policyd, act, tmp_path) as s, lerobot_server(tmp_path) as upstream:
        for name, address in (("policyd", s.address), ("lerobot", upstream)):
            stub = Stub(address)
            stub.setup(config)
            stub.observe(obs)
            got[name] = np.stack([a.get_action().numpy() for a in stub.actions()])
            stub.close()
    scale = max(float(np.abs(got["lerobot"]).max()), 1.0)
    assert float(np.abs(got["policyd"] - got["lerobot"]).max()) / scale <= 1e-4
    with served(policyd, act, tmp_path, resize="refuse") as s:
        stub = Stub(s.address)
        with pytest.raises(grpc.RpcError) as e:
            stub.setup(config)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "lerobot.resize" in e.value.details() and "80x60" in e.value.details()


def test_diffusion_policy_is_served_with_its_observation_history(
    ddim_bundle: Exported, policyd: str, tmp_path: Path
) -> None:
    """LeRobot 0.6.1's own server cannot serve Diffusion Policy (lerobot#3861); policyd keeps
    its n_obs_steps history per session in fixed buffers."""
    robot = test_robot.PolicydTestRobot(robot_config(frames={"cam0": (96, 96)}))
    features = map_robot_keys_to_lerobot_features(robot)
    ckpt = str(ddim_bundle.checkpoint.resolve())
    with served(policyd, ddim_bundle, tmp_path) as s:
        stub = Stub(s.address)
        stub.setup(RemotePolicyConfig("diffusion", ckpt, features, 8, "cpu"))
        for step in (0, 3, 6):
            stub.observe(observation(robot, step))
            actions = stub.actions()
            assert len(actions) == 8
            assert [a.get_timestep() for a in actions] == list(range(step, step + 8))
            assert all(bool(a.get_action().isfinite().all()) for a in actions)
        stub.close()
        assert "history" in check_config(policyd, ddim_bundle.bundle / "policyd.toml").stdout


def pr3048(meta: dict, tensors: dict | None = None) -> bytes:
    """lerobot PR #3048's payload: a big-endian u32 JSON length, the JSON, safetensors."""
    import json
    import struct

    from safetensors.torch import save

    body = json.dumps(meta).encode()
    return struct.pack(">I", len(body)) + body + (save(tensors) if tensors else b"")


def from_pr3048(data: bytes) -> tuple[dict, dict]:
    import json
    import struct

    from safetensors.torch import load

    (n,) = struct.unpack(">I", data[:4])
    rest = data[4 + n :]
    return json.loads(data[4 : 4 + n]), (load(rest) if rest else {})


def json_setup(config: RemotePolicyConfig, chunk: int) -> bytes:
    """`config` as a PR #3048 client sends it."""
    return pr3048(
        {
            "type": "RemotePolicyConfig",
            "policy_type": config.policy_type,
            "pretrained_name_or_path": config.pretrained_name_or_path,
            "lerobot_features": config.lerobot_features,
            "actions_per_chunk": chunk,
            "device": "cpu",
            "rename_map": {},
        }
    )


def json_observation(obs: TimedObservation) -> bytes:
    """`obs` as a PR #3048 client sends it: scalars in the JSON, arrays as safetensors."""
    import torch

    raw = obs.get_observation()
    arrays = {k: torch.from_numpy(v) for k, v in raw.items() if isinstance(v, np.ndarray)}
    meta = {
        "type": "TimedObservation",
        "timestamp": obs.get_timestamp(),
        "timestep": obs.get_timestep(),
        "must_go": True,
        "scalar_data": {k: v for k, v in raw.items() if k not in arrays},
        "numpy_keys": list(arrays),
    }
    return pr3048(meta, arrays)


def json_actions(stub: Stub, timeout: float = 30.0) -> tuple[dict, dict]:
    """The next chunk, which must come in PR #3048's format."""
    deadline = time.monotonic() + timeout
    while not (data := stub.stub.GetActions(services_pb2.Empty()).data):
        assert time.monotonic() < deadline, "no actions within the timeout"
    assert data[0] != 0x80, "answered in the client's format, not pickle"
    return from_pr3048(data)


def test_pr_3048_json_safetensors_clients_get_answers_in_their_format(
    act: Exported, policyd: str, tmp_path: Path
) -> None:
    """A client on lerobot PR #3048's branch (JSON + safetensors, no pickle) gets the same
    actions as a pickle client, answered in its own format."""
    import torch

    robot = test_robot.PolicydTestRobot(robot_config(seed=6))
    config = remote_config(act, robot, chunk=6)
    obs = observation(robot, 4)
    with served(policyd, act, tmp_path) as s:
        stub = Stub(s.address)
        stub.setup(config)
        stub.observe(obs)
        pickled = stub.actions()
        stub.setup(json_setup(config, 6))
        stub.observe(json_observation(obs))
        reply, tensors = json_actions(stub)
        assert reply["type"] == "TimedActions" and len(reply["actions"]) == 6
        for i, (a, p) in enumerate(zip(reply["actions"], pickled, strict=True)):
            assert a["timestep"] == p.get_timestep() == 4 + i
            assert a["timestamp"] == p.get_timestamp()
            assert torch.equal(tensors[f"action_{i}"], p.get_action())
        # A pickle observation on a JSON session is refused by name.
        e = status_of(lambda: stub.observe(obs))
        assert "set up with JSON + safetensors" in e.details()
        stub.close()


def status_of(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_hostile_payloads_are_refused_and_the_server_keeps_serving(
    act: Exported, policyd: str, tmp_path: Path
) -> None:
    MARKER.unlink(missing_ok=True)
    robot = test_robot.PolicydTestRobot(robot_config(seed=5))
    config = remote_config(act, robot, chunk=10)
    with served(policyd, act, tmp_path, max_payload_bytes=1 << 20) as s:
        stub = Stub(s.address)
        # Code in the config or an observation: refused by name, never run.
        for f in sorted(ATTACKS.glob("attack_*.pkl")):
            e = status_of(lambda f=f: stub.setup(f.read_bytes()))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "allow-list" in e.details()
        stub.setup(config)
        for f in sorted(ATTACKS.glob("attack_*.pkl")):
            e = status_of(lambda f=f: stub.observe(f.read_bytes()))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "allow-list" in e.details()
        assert not MARKER.exists()
        good = pickle.dumps(observation(robot, 0))
        # Truncated, and a payload past lerobot.max_payload_bytes (sent in LeRobot's chunks).
        e = status_of(lambda: stub.observe(good[: len(good) // 2]))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in e.details()
        big = good + b"\0" * (1 << 21)
        e = status_of(lambda: stub.observe(big))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "lerobot.max_payload_bytes" in e.details()
        # A chunk stream without END, and one that starts UNKNOWN.
        begin = services_pb2.Observation(transfer_state=services_pb2.TRANSFER_BEGIN, data=good)
        e = status_of(lambda: stub.stub.SendObservations(iter([begin])))
        assert "TRANSFER_END" in e.details()
        unknown = services_pb2.Observation(data=good)
        e = status_of(lambda: stub.stub.SendObservations(iter([unknown])))
        assert "TRANSFER_UNKNOWN" in e.details()
        # Observations held open mid-stream: one per address is received at once (the other
        # held one is refused as busy), and so is a third.
        release = threading.Event()

        def held() -> Iterator[services_pb2.Observation]:
            yield begin
            release.wait(10)

        open_streams = [stub.stub.SendObservations.future(held()) for _ in range(2)]
        time.sleep(0.5)
        e = status_of(lambda: stub.stub.SendObservations(iter([begin]), timeout=5))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        assert "one at a time" in e.details()
        release.set()
        for f in open_streams:
            with contextlib.suppress(grpc.RpcError):
                f.result(10)
        # An array whose bytes do not match its shape, and deep nesting.
        lying = bytearray(good)
        at = lying.find(b"K0K@K\x03\x87")  # the shape (48, 64, 3)
        assert at > 0
        lying[at + 3] = 65
        e = status_of(lambda: stub.observe(bytes(lying)))
        assert "needs" in e.details() and "cam0" in e.details()
        e = status_of(lambda: stub.observe(b"\x80\x04" + b"(" * 100_000))
        assert "stack depth" in e.details()
        # A policy it does not serve, and a chunk longer than the policy's.
        unknown_policy = RemotePolicyConfig("act", "user/other", config.lerobot_features, 10)
        e = status_of(lambda: stub.setup(unknown_policy))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert '"user/other" is not served here' in e.details()
        too_long = RemotePolicyConfig(
            "act", config.pretrained_name_or_path, config.lerobot_features, 11
        )
        e = status_of(lambda: stub.setup(too_long))
        assert "actions_per_chunk = 11" in e.details()
        wrong_type = RemotePolicyConfig(
            "pi0", config.pretrained_name_or_path, config.lerobot_features, 10
        )
        e = status_of(lambda: stub.setup(wrong_type))
        assert 'policy_type "pi0"' in e.details()
        # A second client's Ready and setup mid-stream are refused (the session is the first
        # client's while it is connected and active); the first goes on.
        stub.setup(config)
        stub.observe(observation(robot, 1))
        assert len(stub.actions()) == 10
        other = Stub(s.address, own_connection=True)
        e = status_of(lambda: other.stub.Ready(services_pb2.Empty()))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
        e = status_of(lambda: other.setup(config))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
        stub.observe(observation(robot, 2))
        assert [a.get_timestep() for a in stub.actions()][0] == 2
        other.close()
        stub.close()
        assert s.healthy()
        m = s.metrics()
        for reason in ("pickle", "oversize", "busy", "chunking", "observation", "setup", "owner"):
            line = next(
                x
                for x in m.splitlines()
                if f'policyd_lerobot_refused_total{{reason="{reason}"}}' in x
            )
            assert float(line.split()[-1]) >= 1, line
    assert not MARKER.exists()


def test_a_peer_off_the_allow_list_is_refused(act: Exported, policyd: str, tmp_path: Path) -> None:
    with served(policyd, act, tmp_path, allow=["10.0.0.0/8"]) as s:
        stub = Stub(s.address)
        e = status_of(lambda: stub.stub.Ready(services_pb2.Empty(), timeout=5))
        assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        stub.close()
        assert 'policyd_lerobot_refused_total{reason="peer"}' in s.metrics()
        assert "not in lerobot.allow" in s.log.read_text()


def reload_at_10_hz(s: Served, stub: Stub) -> None:
    """Changes the served policy (its control rate, to 10 Hz), SIGHUPs policyd and waits until
    the session has moved to the new engine."""
    import signal

    text = tomllib.loads(s.config.read_text())
    text.setdefault("pacing", {})["fps"] = 10.0
    s.config.write_text(tomli_w.dumps(text))
    s.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while "session starts afresh" not in s.log.read_text():
        # The session moves once it is idle and sees the new generation: poke it.
        with contextlib.suppress(grpc.RpcError):
            stub.stub.GetActions(services_pb2.Empty(), timeout=0.5)
        assert time.monotonic() < deadline, s.log.read_text()
        time.sleep(0.2)


def test_a_reload_moves_the_session_to_the_new_engine(
    act: Exported, policyd: str, tmp_path: Path
) -> None:
    """SIGHUP with a changed policy (here its control rate): the session carries on with the
    new engine, without a new setup; its timestamps follow the new rate."""

    robot = test_robot.PolicydTestRobot(robot_config(seed=9))
    config = remote_config(act, robot, chunk=4)
    with served(policyd, act, tmp_path) as s:
        stub = Stub(s.address)
        stub.setup(config)
        stub.observe(observation(robot, 0))
        before = stub.actions()
        assert abs(before[1].get_timestamp() - before[0].get_timestamp() - 1 / 30) < 1e-6
        reload_at_10_hz(s, stub)
        stub.observe(observation(robot, 5))
        after = stub.actions()
        assert after[0].get_timestep() == 5
        assert abs(after[1].get_timestamp() - after[0].get_timestamp() - 0.1) < 1e-6
        stub.close()


def test_a_json_client_keeps_its_format_across_a_reload(
    act: Exported, policyd: str, tmp_path: Path
) -> None:
    """Issue 51's bug: after a reload that replaced the policy, a PR #3048 (JSON +
    safetensors) client had every observation refused as "set up with pickle payloads" until
    it set up again. Its format is part of its setup, which the session carries across the
    reload: the next observation is answered, in JSON."""

    robot = test_robot.PolicydTestRobot(robot_config(seed=10))
    config = remote_config(act, robot, chunk=4)
    with served(policyd, act, tmp_path) as s:
        stub = Stub(s.address)
        stub.setup(json_setup(config, 4))
        stub.observe(json_observation(observation(robot, 0)))
        reply, _ = json_actions(stub)
        assert [a["timestep"] for a in reply["actions"]] == [0, 1, 2, 3]
        reload_at_10_hz(s, stub)
        stub.observe(json_observation(observation(robot, 5)))
        reply, tensors = json_actions(stub)
        assert [a["timestep"] for a in reply["actions"]] == [5, 6, 7, 8]
        assert abs(reply["actions"][1]["timestamp"] - reply["actions"][0]["timestamp"] - 0.1) < 1e-6
        assert len(tensors) == 4
        stub.close()


def test_pi0_with_480x640_cameras_for_256x256_features_equals_lerobots_server(
    policyd: str, tmp_path: Path
) -> None:
    """A pi0 fine-tuned on 256×256 frames (LIBERO's size; the model takes 224×224) behind a robot
    whose camera gives 480×640: both servers resize the frame to the feature's 256×256 (uint8
    bilinear), then the model resizes with padding to 224×224. With the same (zero) noise on both
    sides, the actions agree."""
    import checkpoints

    from policyd_export.cli import main

    with checkpoints.tiny_pi0():
        tokenizer = checkpoints.gemma_tokenizer(tmp_path / "tokenizer")
        ckpt = checkpoints.pi0(tmp_path / "checkpoint", tokenizer, image=(256, 256), seed=4)
        bundle = tmp_path / "bundle"
        assert main(["lerobot", str(ckpt), "--out", str(bundle)]) == 0
    # policyd's initial sample from a binding no robot sends: zeros, as LeRobot's patched noise.
    config = tomllib.loads((bundle / "policyd.toml").read_text())
    config["sampler"]["inject_noise"] = True
    config["inputs"].append(
        {
            "key": "noise",
            "tensor": "x_t",
            "dtypes": ["float32"],
            "shape": [10, 32],
            "optional": True,
            "fill": 0.0,
        }
    )
    (bundle / "policyd.toml").write_text(tomli_w.dumps(config))
    exported = Exported(ckpt, bundle, "")
    robot = test_robot.PolicydTestRobot(robot_config(seed=6, frames={"cam0": (480, 640)}))
    features = map_robot_keys_to_lerobot_features(robot)
    remote = RemotePolicyConfig("pi0", str(ckpt.resolve()), features, 10, "cpu")
    observations = [observation(robot, step) for step in (0, 4)]
    got: dict[str, list[np.ndarray]] = {}
    with served(policyd, exported, tmp_path) as s, lerobot_server(tmp_path, tiny_pi0=True) as up:
        for name, address in (("policyd", s.address), ("lerobot", up)):
            stub = Stub(address)
            stub.setup(remote)
            got[name] = []
            for obs in observations:
                stub.observe(obs)
                got[name].append(np.stack([a.get_action().numpy() for a in stub.actions(60)]))
            stub.close()
    for ours, theirs in zip(got["policyd"], got["lerobot"], strict=True):
        assert ours.shape == theirs.shape == (10, 6)
        scale = max(float(np.abs(theirs).max()), 1.0)
        assert float(np.abs(ours - theirs).max()) / scale <= 1e-4, (ours, theirs)

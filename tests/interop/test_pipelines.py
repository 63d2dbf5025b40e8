"""The demo pipelines (configs/flow.toml, configs/diffusion.toml) through the unchanged
openpi-client and the vllm-omni route, against a reference written here from openpi's
`sample_actions` (flow matching) and diffusers' `DDIMScheduler` (as LeRobot's Diffusion Policy
uses it), running the same ONNX parts with onnxruntime. For the exact comparison the initial
noise is injected (`sampler.inject_noise`, a test-only key: the request's `noise` is the
initial sample); the seed tests use the configs as shipped.
"""

import math
import pathlib

import msgpack
import msgpack_numpy
import numpy as np
import onnxruntime as ort
import pytest
import websockets.sync.client as wsc
from openpi_client import msgpack_numpy as openpi_mn
from openpi_client import websocket_client_policy as wcp
from profiles import CAMS, diffusion_obs, flow_obs
from test_openpi import free_port, start_policyd
from test_tokenizer import PaligemmaReference

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"


def session(name):
    return ort.InferenceSession(str(MODELS / f"{name}.onnx"))


FLOW_PREFIX, FLOW_EXPERT = session("flow_prefix"), session("flow_expert")
DIFF_ENCODER, DIFF_UNET = session("diffusion_encoder"), session("diffusion_unet")
TOKENIZER = PaligemmaReference(MODELS / "tokenizer" / "bpe.model", 48)


def flow_reference(obs, noise, num_steps=10):
    """openpi `Pi0.sample_actions`: x_t = noise, dt = -1/num_steps, time = 1; while
    time >= -dt/2: v_t = expert(prefix, x_t, time); x_t += dt * v_t; time += dt."""
    ids, mask, _ = TOKENIZER.tokenize(obs["prompt"])
    feed = {
        c: (obs["images"][c].astype(np.float32) * (2 / 255) - 1).transpose(2, 0, 1)[
            None
        ]
        for c in CAMS
    }
    feed.update(
        state=obs["state"][None],
        tokenized_prompt=np.array([ids], np.int32),
        tokenized_prompt_mask=np.array([mask], bool),
    )
    prefix, state = FLOW_PREFIX.run(None, feed)
    dt = np.float32(-1.0 / num_steps)
    x_t, time = noise[None].astype(np.float32), np.float32(1.0)
    while time >= -dt / 2:
        v_t = FLOW_EXPERT.run(
            None,
            {
                "prefix_features": prefix,
                "state": state,
                "x_t": x_t,
                "time": np.array([time], np.float32),
            },
        )[0]
        x_t = x_t + dt * v_t
        time = np.float32(time + dt)
    return x_t[0]


def alphas_cumprod(T=100):
    """diffusers `betas_for_alpha_bar(T, alpha_transform_type="cosine")`, max_beta 0.999."""

    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = np.array(
        [min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), 0.999) for i in range(T)],
        dtype=np.float32,
    )
    return np.cumprod(1.0 - betas, dtype=np.float32)


def ddim_reference(obs, noise, num_steps=10, T=100):
    """diffusers `DDIMScheduler` (eta 0, epsilon, clip_sample to [-1, 1], set_alpha_to_one,
    timestep_spacing "leading") driving the denoiser, as LeRobot's `conditional_sample`."""
    feed = {
        "state": obs["observation/state"][None],
        "image": (obs["observation/image"].astype(np.float32) / 255).transpose(
            0, 3, 1, 2
        )[None],
    }
    cond = DIFF_ENCODER.run(None, feed)[0]
    ac = alphas_cumprod(T)
    ratio = T // num_steps
    timesteps = (np.arange(0, num_steps) * ratio).round()[::-1].astype(np.int64)
    x = noise[None].astype(np.float32)
    for t in timesteps:
        eps = DIFF_UNET.run(
            None, {"x": x, "timestep": np.array([t], np.int64), "global_cond": cond}
        )[0]
        prev = t - ratio
        a_t, a_prev = ac[t], (ac[prev] if prev >= 0 else np.float32(1.0))
        x0 = np.clip((x - np.sqrt(1 - a_t) * eps) / np.sqrt(a_t), -1, 1)
        x = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps
    return x[0]


def ddpm_reference(obs, noise, num_steps, step_noise, T=100):
    """diffusers `DDPMScheduler.step` (epsilon, clip_sample to [-1, 1], variance_type
    "fixed_small", timestep_spacing "leading"): the posterior mean plus std * noise on every
    step but t = 0, the noise of step i being `step_noise[i]`."""
    feed = {
        "state": obs["observation/state"][None],
        "image": (obs["observation/image"].astype(np.float32) / 255).transpose(
            0, 3, 1, 2
        )[None],
    }
    cond = DIFF_ENCODER.run(None, feed)[0]
    ac = alphas_cumprod(T)
    ratio = T // num_steps
    timesteps = (np.arange(0, num_steps) * ratio).round()[::-1].astype(np.int64)
    x = noise[None].astype(np.float32)
    for i, t in enumerate(timesteps):
        eps = DIFF_UNET.run(
            None, {"x": x, "timestep": np.array([t], np.int64), "global_cond": cond}
        )[0]
        prev = t - ratio
        a_t, a_prev = ac[t], (ac[prev] if prev >= 0 else np.float32(1.0))
        b_t, b_prev = 1 - a_t, 1 - a_prev
        cur_alpha = a_t / a_prev
        cur_beta = 1 - cur_alpha
        x0 = np.clip((x - np.sqrt(b_t) * eps) / np.sqrt(a_t), -1, 1)
        mean = (np.sqrt(a_prev) * cur_beta / b_t) * x0 + (
            np.sqrt(cur_alpha) * b_prev / b_t
        ) * x
        if t > 0:
            std = np.sqrt(max(b_prev / b_t * cur_beta, 1e-20))
            mean = mean + std * step_noise[i].reshape(x.shape)
        x = mean.astype(np.float32)
    return x[0]


def injected(config, tmp_path, shape, ddpm=False):
    """`config` with the initial sample taken from the request's `noise` (and with `ddpm`, the
    diffusion demo as DDPM, every step's noise from `step_noise`)."""
    text = (ROOT / "configs" / config).read_text().replace('"../models/', f'"{MODELS}/')
    x = "x_t" if "flow" in config else "x"
    step_noise = (
        f"""[[inputs]]
key = "step_noise"
tensor = "{x}_step_noise"
dtypes = ["float32"]
shape = [100, {int(np.prod(shape))}]

"""
        if ddpm
        else ""
    )
    text = text.replace(
        "[[outputs]]",
        f"""[[inputs]]
key = "noise"
tensor = "{x}"
dtypes = ["float32"]
shape = {list(shape)}

{step_noise}[[outputs]]""",
        1,
    )
    text = text.replace("[sampler]\n", "[sampler]\ninject_noise = true\n", 1)
    if ddpm:
        text = text.replace('kind = "ddim"', 'kind = "ddpm"', 1)
    path = tmp_path / config
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "config,make,shape,reference",
    [
        ("flow.toml", flow_obs, (50, 32), flow_reference),
        ("diffusion.toml", lambda rng: diffusion_obs(rng), (16, 2), ddim_reference),
    ],
)
def test_actions_match_the_reference_for_the_same_noise(
    tmp_path, config, make, shape, reference
):
    port = free_port()
    proc = start_policyd(injected(config, tmp_path, shape), port)
    try:
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        rng = np.random.default_rng(11)
        for steps in [10, 3, 1]:
            obs = make(rng)
            noise = rng.standard_normal(shape).astype(np.float32)
            reply = client.infer(
                dict(obs, noise=noise, sampling_params={"num_inference_steps": steps})
            )
            want = reference(obs, noise, steps)
            assert np.max(np.abs(reply["actions"] - want)) <= 1e-4, (config, steps)
            timing = reply["policy_timing"]
            assert (
                timing["steps"] == steps
                and timing["prefix_ms"] > 0
                and timing["denoise_ms"] > 0
            )
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_ddpm_matches_the_reference_with_injected_step_noise(tmp_path):
    """DDPM draws fresh noise every step but the last: with all of it injected, policyd's
    actions equal diffusers' formulas over onnxruntime, at 10, 4 and 1 steps."""
    port = free_port()
    proc = start_policyd(injected("diffusion.toml", tmp_path, (16, 2), ddpm=True), port)
    try:
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        rng = np.random.default_rng(13)
        results = []
        for steps in [10, 4, 1]:
            obs = diffusion_obs(rng)
            noise = rng.standard_normal((16, 2)).astype(np.float32)
            step_noise = rng.standard_normal((100, 32)).astype(np.float32)
            reply = client.infer(
                dict(
                    obs,
                    noise=noise,
                    step_noise=step_noise,
                    sampling_params={"num_inference_steps": steps},
                )
            )
            want = ddpm_reference(obs, noise, steps, step_noise)
            assert np.max(np.abs(reply["actions"] - want)) <= 1e-4, steps
            results.append((obs, noise, step_noise, reply["actions"]))
        # The step noise matters: the same request with other step noise, other actions.
        obs, noise, step_noise, actions = results[0]
        other = client.infer(
            dict(
                obs,
                noise=noise,
                step_noise=step_noise[::-1].copy(),
                sampling_params={"num_inference_steps": 10},
            )
        )["actions"]
        assert np.max(np.abs(other - actions)) > 1e-3
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="module", params=["flow", "diffusion"])
def pipeline(request):
    port = free_port()
    proc = start_policyd(ROOT / f"configs/{request.param}.toml", port)
    yield request.param, port
    proc.terminate()
    proc.wait(timeout=15)


def test_seeds_and_steps(pipeline):
    name, port = pipeline
    rng = np.random.default_rng(5)
    obs = flow_obs(rng) if name == "flow" else diffusion_obs(rng)
    a, b = (
        wcp.WebsocketClientPolicy("127.0.0.1", port),
        wcp.WebsocketClientPolicy("127.0.0.1", port),
    )
    act = lambda c, **kw: c.infer(dict(obs, **kw))["actions"]
    seeded = act(a, seed=42)
    assert np.array_equal(seeded, act(b, seed=42)), (
        "same seed, another connection: identical"
    )
    assert np.array_equal(seeded, act(a, seed=42)), "same seed again: identical"
    assert not np.array_equal(seeded, act(a, seed=43)), "another seed: different"
    assert not np.array_equal(act(a), act(a)), "no seed: fresh noise each request"
    one = act(a, seed=42, sampling_params={"num_inference_steps": 1})
    assert not np.array_equal(seeded, one), "1 step differs from the default 10"
    assert np.array_equal(
        seeded, act(a, seed=42, sampling_params={"num_inference_steps": 10})
    )
    assert np.all(np.isfinite(seeded))


def test_vllm_route_honours_seed_and_sampling_params(pipeline):
    name, port = pipeline
    rng = np.random.default_rng(6)
    obs = flow_obs(rng) if name == "flow" else diffusion_obs(rng)
    client = wcp.WebsocketClientPolicy("127.0.0.1", port)
    want = client.infer(dict(obs, seed=7, sampling_params={"num_inference_steps": 4}))[
        "actions"
    ]
    with wsc.connect(
        f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi",
        compression=None,
        max_size=None,
    ) as ws:
        msgpack.unpackb(ws.recv())
        send = lambda **kw: ws.send(
            msgpack.packb(dict(obs, **kw), default=msgpack_numpy.encode)
        )
        send(seed=7, sampling_params={"num_inference_steps": 4})
        got = openpi_mn.unpackb(ws.recv(timeout=10))
        assert np.array_equal(got, want.astype(np.float32))
        # Steps out of range, a seed that is not an integer: error maps naming the key; the
        # socket keeps serving.
        for bad, key in [
            ({"sampling_params": {"num_inference_steps": 0}}, "num_inference_steps"),
            (
                {"sampling_params": {"num_inference_steps": 10_000}},
                "num_inference_steps",
            ),
            ({"seed": 1.5}, "seed"),
            ({"seed": "x"}, "seed"),
        ]:
            send(**bad)
            err = msgpack.unpackb(ws.recv(timeout=10))
            assert err["type"] == "error" and key in err["detail"], (bad, err)
        send(seed=7, sampling_params={"num_inference_steps": 4})
        assert np.array_equal(
            openpi_mn.unpackb(ws.recv(timeout=10)), want.astype(np.float32)
        )


def test_observe_streaming_and_metrics_work_with_pipelines(pipeline):
    """`observe` (timed actions, pacing) over a pipeline, and its steps in /metrics."""
    import urllib.request

    name, port = pipeline
    rng = np.random.default_rng(8)
    obs = flow_obs(rng) if name == "flow" else diffusion_obs(rng)
    client = wcp.WebsocketClientPolicy("127.0.0.1", port)
    for step in range(3):
        reply = client.infer(
            dict(
                obs,
                endpoint="observe",
                timestep=step,
                timestamp=step / 10,
                must_go=True,
                seed=3,
                sampling_params={"num_inference_steps": 2},
            )
        )
        assert reply["actions"].ndim == 2 and np.all(np.isfinite(reply["actions"]))
        assert len(reply["timesteps"]) == len(reply["actions"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    count = next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("policyd_sampler_steps_count")
    )
    assert count >= 3, text

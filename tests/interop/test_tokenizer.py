"""Token for token: policyd's tokenizer (`policyd tokenize`, the code a `[inputs.tokenizer]`
binding runs) against a Python reference written from openpi's
`PaligemmaTokenizer.tokenize` over the PyPI `sentencepiece` package, and against the PyPI
`tokenizers` package for a tokenizer.json. The tokenizers are the committed ones of
models/tokenizer/ (scripts/gen_tokenizers.py); the prompts are openpi's own examples and 1,000
generated ones.
"""

import json
import os
import pathlib
import random
import subprocess

import numpy as np
import pytest
import sentencepiece
import tokenizers

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("POLICYD_BIN", str(ROOT / "target/debug/policyd"))
TOK = ROOT / "models" / "tokenizer"

# openpi's example prompts: LIBERO task names (examples/libero), DROID instructions
# (examples/droid), ALOHA (examples/aloha_real).
OPENPI_PROMPTS = [
    "put both the alphabet soup and the tomato sauce in the basket",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "turn on the stove and put the moka pot on it",
    "pick up the book and place it in the back compartment of the caddy",
    "LIVING_ROOM_SCENE2_put_both_the_alphabet_soup_and_the_cream_cheese_box_in_the_basket",
    "KITCHEN_SCENE3_turn_on_the_stove_and_put_the_moka_pot_on_it",
    "open the top drawer and put the bowl inside",
    "push the plate to the front of the stove",
    "Put the marker in the cup",
    "pick up the red block and place it on the plate",
    "take the toast out of the toaster",
    "fold the towel",
    "",
]

PIECES = [
    "pick up",
    "the",
    "red",
    "block",
    "_",
    "\n",
    " ",
    "  ",
    "\t",
    "🤖",
    "👍🏽",
    "日本語",
    "café",
    "naïve",
    "Ω",
    "ﬁ",
    "ＡＢＣ",
    "١٢٣",
    "עברית",
    "e\u0301",
    "\u200b",
    "\u3000",
    "\x1c",
    "\u0085",
    "\u00a0",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "12345",
    "3.14",
    "-7",
    "Task:",
    "State:",
    "Action:",
    ";",
    ",",
    ".",
    "!?",
    "\\",
    '"',
    "'",
    "xyzq",
    "QQQ",
    "\U0001f9ea",
    "\U00010348",
    "ǅ",
    "ß",
    "İ",
    "ꙮ",
    "\x00",
]


def generated_prompts(n=1000, seed=7):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.randint(0, 24)
        s = "".join(
            rnd.choice(PIECES) + (" " if rnd.random() < 0.5 else "") for _ in range(k)
        )
        if i % 10 == 0:
            s = "  " + s + "\n "
        if i % 25 == 0:
            # Past max_tokens: openpi truncates.
            s = " ".join(rnd.choice(PIECES) for _ in range(300))
        out.append(s)
    return out


PROMPTS = OPENPI_PROMPTS + generated_prompts()


def bin_edge_states(n, seed=3):
    """States whose values sit at, just below and just above pi0.5's bin edges (float32, as
    openpi's normalised state is), and outside [-1, 1]."""
    rnd = random.Random(seed)
    edges = np.linspace(-1, 1, 257).astype(np.float32)
    values = []
    for e in edges:
        values += [e, np.nextafter(e, np.float32(-2)), np.nextafter(e, np.float32(2))]
    values += [np.float32(v) for v in (-1.5, 1.5, -1e6, 1e6, 0.0, -0.0)]
    states = []
    for _ in range(n):
        dim = rnd.choice([8, 14, 32])
        states.append(
            np.array([rnd.choice(values) for _ in range(dim)], dtype=np.float32)
        )
    return states


class PaligemmaReference:
    """openpi's `PaligemmaTokenizer.tokenize` (src/openpi/models/tokenizer.py)."""

    def __init__(self, path, max_len):
        self._max_len = max_len
        self._tokenizer = sentencepiece.SentencePieceProcessor(
            model_proto=path.read_bytes()
        )

    def tokenize(self, prompt, state=None, fmt="pi0"):
        cleaned_text = prompt.strip().replace("_", " ").replace("\n", " ")
        if fmt == "plain":
            tokens = self._tokenizer.encode(prompt, add_bos=True)
        elif state is not None:
            discretized_state = (
                np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
            )
            state_str = " ".join(map(str, discretized_state))
            full_prompt = f"Task: {cleaned_text}, State: {state_str};\nAction: "
            tokens = self._tokenizer.encode(full_prompt, add_bos=True)
        else:
            tokens = self._tokenizer.encode(
                cleaned_text, add_bos=True
            ) + self._tokenizer.encode("\n")
        return pad(tokens, self._max_len)


class HfReference:
    """The same layout over a tokenizer.json, with `tokenizers` (BOS by name, as LeRobot
    prepends it)."""

    def __init__(self, path, max_len, bos):
        self._max_len = max_len
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self._bos = [self._tok.token_to_id(bos)] if bos else []

    def tokenize(self, prompt, state=None, fmt="plain"):
        encode = lambda t: self._tok.encode(t, add_special_tokens=False).ids
        cleaned_text = prompt.strip().replace("_", " ").replace("\n", " ")
        if fmt == "plain":
            tokens = self._bos + encode(prompt)
        else:
            tokens = self._bos + encode(cleaned_text) + encode("\n")
        return pad(tokens, self._max_len)


def pad(tokens, max_len):
    if len(tokens) < max_len:
        return (
            tokens + [0] * (max_len - len(tokens)),
            [True] * len(tokens) + [False] * (max_len - len(tokens)),
            len(tokens),
        )
    return tokens[:max_len], [True] * max_len, len(tokens)


def policyd_tokenize(tokenizer, fmt, max_tokens, items, bos=None):
    args = [
        BIN,
        "tokenize",
        "--tokenizer",
        str(tokenizer),
        "--format",
        fmt,
        "--max-tokens",
        str(max_tokens),
    ]
    if bos:
        args += ["--bos", bos]
    lines = "".join(json.dumps(item) + "\n" for item in items)
    out = subprocess.run(args, input=lines.encode(), capture_output=True, check=True)
    return [json.loads(line) for line in out.stdout.decode().splitlines()]


def compare(ref, got, items, fmt):
    assert len(got) == len(items)
    bad = []
    for item, g in zip(items, got):
        state = np.array(item["state"], dtype=np.float32) if "state" in item else None
        ids, mask, n = ref.tokenize(item["prompt"], state, fmt)
        if g["ids"] != [int(i) for i in ids] or g["mask"] != mask or g["tokens"] != n:
            bad.append((item, g, ids))
    assert not bad, f"{len(bad)} of {len(items)} differ; first: {bad[0]}"


@pytest.mark.parametrize(
    "model,fmt,max_len",
    [
        ("bpe.model", "pi0", 48),
        ("bpe.model", "plain", 48),
        ("unigram.model", "pi0", 48),
        ("unigram.model", "plain", 64),
    ],
)
def test_sentencepiece_prompts_match_openpi(model, fmt, max_len):
    items = [{"prompt": p} for p in PROMPTS]
    got = policyd_tokenize(TOK / model, fmt, max_len, items)
    compare(PaligemmaReference(TOK / model, max_len), got, items, fmt)
    # The corpus reaches what it is meant to: truncation, and (unigram) unknown pieces.
    assert any(g["tokens"] > max_len for g in got)
    if model == "unigram.model":
        sp = sentencepiece.SentencePieceProcessor(
            model_proto=(TOK / model).read_bytes()
        )
        assert any(sp.unk_id() in g["ids"] for g in got)


@pytest.mark.parametrize("model", ["bpe.model", "unigram.model"])
def test_pi05_state_bins_match_openpi(model):
    states = bin_edge_states(len(PROMPTS))
    items = [
        {"prompt": p, "state": [float(v) for v in s]} for p, s in zip(PROMPTS, states)
    ]
    got = policyd_tokenize(TOK / model, "pi05", 200, items)
    compare(PaligemmaReference(TOK / model, 200), got, items, "pi05")


@pytest.mark.parametrize("fmt", ["plain", "pi0"])
def test_tokenizer_json_matches_tokenizers(fmt):
    items = [{"prompt": p} for p in PROMPTS]
    got = policyd_tokenize(TOK / "bytelevel.json", fmt, 64, items, bos="<s>")
    compare(HfReference(TOK / "bytelevel.json", 64, "<s>"), got, items, fmt)


# End to end: the prompted demo (configs/prompted.toml) through the unchanged openpi-client,
# its actions checked against onnxruntime fed the reference's ids and mask.

import urllib.request

import msgpack
import msgpack_numpy
import onnxruntime as ort
import websockets.sync.client as wsc
from openpi_client import msgpack_numpy as openpi_mn
from openpi_client import websocket_client_policy as wcp
from test_openpi import free_port, start_policyd


@pytest.fixture(scope="module")
def prompted():
    port = free_port()
    proc = start_policyd(ROOT / "configs/prompted.toml", port)
    yield port
    proc.terminate()
    proc.wait(timeout=15)


SESSION = ort.InferenceSession(str(ROOT / "models/prompted.onnx"))
REF = PaligemmaReference(TOK / "bpe.model", 48)


def reference_actions(state, prompt):
    ids, mask, _ = REF.tokenize(prompt)
    return SESSION.run(
        None,
        {
            "state": state[None].astype(np.float32),
            "tokenized_prompt": np.array([ids], dtype=np.int32),
            "tokenized_prompt_mask": np.array([mask], dtype=bool),
        },
    )[0][0]


def test_prompts_are_tokenized_as_openpi_does(prompted):
    client = wcp.WebsocketClientPolicy("127.0.0.1", prompted)
    state = np.linspace(-1, 1, 8).astype(np.float32)
    seen = {}
    for prompt in OPENPI_PROMPTS[:6] + ["  pick_up the\nred block  ", "日本語 🤖 café"]:
        got = client.infer({"observation/state": state, "prompt": prompt})["actions"]
        assert np.max(np.abs(got - reference_actions(state, prompt))) <= 1e-5, prompt
        seen[prompt] = got
        again = client.infer({"observation/state": state, "prompt": prompt})["actions"]
        assert np.array_equal(got, again), "the same prompt gives the same actions"
    values = list(seen.values())
    assert all(
        not np.array_equal(a, b) for i, a in enumerate(values) for b in values[i + 1 :]
    ), "different prompts give different actions"
    # openpi-client sends np.str_ prompts too (as numpy "<U" arrays).
    got = client.infer(
        {"observation/state": state, "prompt": np.array("fold the towel")}
    )["actions"]
    assert np.max(np.abs(got - reference_actions(state, "fold the towel"))) <= 1e-5


def metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name}")


def test_long_and_empty_prompts_match_openpi_on_the_vllm_route(prompted):
    """Past max_tokens a prompt is truncated as openpi truncates it (a 1 MiB prompt too: the
    server reads only its first max_prompt_bytes), counted; an empty one is BOS + "\\n"."""
    state = np.zeros(8, dtype=np.float32)
    long = " ".join(["pick up the red block and put it in the basket"] * 20)
    huge = ("put the bowl on the plate " * 40400)[: 1 << 20]
    before = metric(prompted, "policyd_prompts_truncated_total")
    with wsc.connect(
        f"ws://127.0.0.1:{prompted}/v1/realtime/robot/openpi",
        compression=None,
        max_size=None,
    ) as ws:
        msgpack.unpackb(ws.recv())
        for prompt in [long, huge, "", "   "]:
            obs = {"observation/state": state, "prompt": prompt}
            ws.send(msgpack.packb(obs, default=msgpack_numpy.encode))
            arr = openpi_mn.unpackb(ws.recv(timeout=10))
            assert np.max(np.abs(arr - reference_actions(state, prompt))) <= 1e-5, (
                prompt[:40]
            )
        # Not text, not UTF-8: an error map naming the key; the socket still serves.
        for bad in [np.arange(4, dtype=np.float32), b"\xff\xfe"]:
            ws.send(
                msgpack.packb(
                    {"observation/state": state, "prompt": bad},
                    default=msgpack_numpy.encode,
                )
            )
            err = msgpack.unpackb(ws.recv(timeout=10))
            assert err["type"] == "error" and "'prompt'" in err["detail"], err
        ws.send(
            msgpack.packb(
                {"observation/state": state, "prompt": "fold the towel"},
                default=msgpack_numpy.encode,
            )
        )
        arr = openpi_mn.unpackb(ws.recv(timeout=10))
        assert np.max(np.abs(arr - reference_actions(state, "fold the towel"))) <= 1e-5
    assert metric(prompted, "policyd_prompts_truncated_total") >= before + 2

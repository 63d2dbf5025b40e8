#!/usr/bin/env python3
"""Trains the small tokenizers the prompt tests and the prompted demo use, from a generated
corpus of robot instructions, and writes them under models/tokenizer/:

- `bpe.model`: SentencePiece BPE set up like PaliGemma's tokenizer (openpi's
  `paligemma_tokenizer.model`): byte fallback, split digits, identity normalisation, no dummy
  prefix and no whitespace folding, 4,000 pieces.
- `unigram.model`: SentencePiece's defaults (unigram, NFKC, dummy prefix, whitespace folded),
  no byte fallback, so characters it never saw become `<unk>`; 2,000 pieces.
- `bytelevel.json`: a Hugging Face tokenizer.json, byte-level BPE as SmolLM2 (SmolVLA) uses,
  with `<s>` and `<|im_start|>` added as special tokens; 3,000 tokens.

Needs `pip install sentencepiece tokenizers`. The files are committed; rerun only to change them.
"""

import io
import json
import pathlib
import random

import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parent.parent / "models" / "tokenizer"

VERBS = [
    "pick up",
    "put",
    "place",
    "open",
    "close",
    "push",
    "pull",
    "turn on",
    "turn off",
    "move",
    "stack",
    "wipe",
    "fold",
    "pour",
    "insert",
    "lift",
    "slide",
    "rotate",
]
OBJECTS = [
    "the red block",
    "the blue cup",
    "the black bowl",
    "the plate",
    "the drawer",
    "the microwave",
    "the stove",
    "the ketchup",
    "the alphabet soup",
    "the cream cheese",
    "the butter",
    "the tomato sauce",
    "the wine bottle",
    "the towel",
    "the marker",
    "the top drawer of the cabinet",
    "the basket",
    "the mug",
    "the sponge",
    "the lid",
]
PLACES = [
    "on the plate",
    "in the basket",
    "into the drawer",
    "on the stove",
    "on the shelf",
    "next to the cup",
    "to the left",
    "to the right",
    "on top of the cabinet",
    "in the sink",
    "onto the tray",
    "between the two bowls",
]
EXTRA = [
    "Task: ",
    ", State: ",
    ";\nAction: ",
    "carefully",
    "then",
    "and",
    "slowly",
    "please",
    "LIVING_ROOM_SCENE",
    "KITCHEN_SCENE3",
    "pick_up_the_book",
    "日本語",
    "café",
    "naïve",
]


SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "ta",
    "vo",
    "shi",
    "pra",
    "gel",
    "dun",
    "or",
    "ix",
    "bel",
    "qua",
    "zor",
    "fe",
    "nu",
    "trel",
    "ost",
    "wy",
    "han",
    "jo",
    "cre",
    "sta",
    "pli",
]


def corpus(n=30000, seed=0):
    rnd = random.Random(seed)
    # Made-up object names, so the trainer has a few thousand pieces to find.
    words = [
        "".join(rnd.choice(SYLLABLES) for _ in range(rnd.randint(2, 4)))
        for _ in range(6000)
    ]
    lines = []
    for _ in range(n):
        s = f"{rnd.choice(VERBS)} {rnd.choice(OBJECTS)} {rnd.choice(PLACES)}"
        s += " " + " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 4)))
        if rnd.random() < 0.3:
            s += f" {rnd.choice(EXTRA)} {rnd.choice(VERBS)} {rnd.choice(OBJECTS)}"
        if rnd.random() < 0.3:
            s = (
                "Task: "
                + s
                + ", State: "
                + " ".join(str(rnd.randrange(256)) for _ in range(8))
            )
        if rnd.random() < 0.2:
            s = s.replace(" ", "_")
        lines.append(s)
    return lines


def train_sentencepiece(lines, name, **kw):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        num_threads=1,
        minloglevel=2,
        **kw,
    )
    (OUT / name).write_bytes(model.getvalue())


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    lines = corpus()
    train_sentencepiece(
        lines,
        "bpe.model",
        model_type="bpe",
        vocab_size=4000,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
    )
    train_sentencepiece(
        lines,
        "unigram.model",
        model_type="unigram",
        vocab_size=2000,
        character_coverage=0.9995,
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|endoftext|>", "<s>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    text = json.dumps(json.loads(tok.to_str()), indent=1, ensure_ascii=False)
    (OUT / "bytelevel.json").write_text(text + "\n", encoding="utf-8")
    for f in sorted(OUT.iterdir()):
        print(f"{f.relative_to(OUT.parent.parent)}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""openpi's prompt tokenization in Python, timed on the prompts benches/tokenize.rs times:
`PaligemmaTokenizer.tokenize` (src/openpi/models/tokenizer.py) over the PyPI sentencepiece
package and models/tokenizer/bpe.model. Needs numpy and sentencepiece (the interop venv has
both): .venv-test/bin/python benches/tokenize_python.py"""

import pathlib
import sys
import timeit

import numpy as np

sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "interop")
)
from test_tokenizer import TOK, PaligemmaReference

PROMPT = "put both the alphabet soup and the tomato sauce in the basket"
STATE = np.arange(32, dtype=np.float32) / 40.0 - 0.4

for name, max_len, state in [("pi0", 48, None), ("pi05 + 32-value state", 200, STATE)]:
    ref = PaligemmaReference(TOK / "bpe.model", max_len)
    n = 20000
    best = min(
        timeit.repeat(
            lambda ref=ref, state=state: ref.tokenize(PROMPT, state), number=n, repeat=5
        )
    )
    print(f"python openpi tokenize, {name}: {best / n * 1e6:.2f} us per prompt")

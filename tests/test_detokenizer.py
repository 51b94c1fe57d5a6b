"""Incremental detokenization against a full decode, on the real SmolLM2 tokenizer."""
from __future__ import annotations

import random

import pytest

from sparsex.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Plain ASCII, with punctuation: commas, (parens) and 'quotes'.",
    "Multi-byte: naïve café, Zürich, 東京タワー, 🙂🚀 emoji split over byte tokens.",
    "Code:\n    def f(x):\n        return {'a': x}  # ok\n",
]


@pytest.mark.parametrize("skip_special", [True, False])
def test_matches_full_decode_at_every_step(smollm2, skip_special):
    tok = smollm2.tokenizer
    rng = random.Random(0)
    streams = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    # random tokens too, with special tokens mixed in (they must vanish under skip_special_tokens)
    streams.append([rng.randrange(tok.vocab_size) for _ in range(200)] + [tok.eos_token_id, 42])
    for ids in streams:
        detok = IncrementalDetokenizer(tok, skip_special)
        for n in range(1, len(ids) + 1):
            text = detok.update(ids[:n])
            full = tok.decode(ids[:n], skip_special_tokens=skip_special)
            # text may only lag behind by an incomplete character held back; never differ otherwise
            assert full.startswith(text), (n, text[-20:], full[-20:])
            if not full.endswith("\ufffd"):
                assert text == full, (n, text[-20:], full[-20:])


def test_engine_output_text_equals_decode_of_its_tokens(llm_prefix):
    from sparsex import SamplingParams
    out = llm_prefix.generate(["Write the Japanese word for Tokyo Tower and two emoji."],
                              SamplingParams(temperature=0.8, seed=3, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert out.text == llm_prefix.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)

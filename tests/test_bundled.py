"""The same losslessness checks on the real bundled model (SmolLM2-135M-Instruct, CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from engine.compare import compare
from engine.models import MODELS
from engine.runtime import TextStream, encode_prompt
from engine.settings import BUNDLED, Settings

pytestmark = pytest.mark.bundled

REWRITE = (
    "Fix the spelling and repeat the text: The quick brown fox jumpd over the lazzy dog. "
    "It was a sunny day and the fox was verry happy."
)


@pytest.fixture(scope="module")
def bundled():
    return MODELS.get(BUNDLED)


def hf_generate(loaded, ids, n):
    model = loaded.model
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "drafter, gamma",
    [("prompt-lookup", 3), ("prompt-lookup", 6), ("draft-model", 4), ("synthetic", 5)],
)
def test_bundled_greedy_is_lossless(bundled, drafter, gamma):
    s = Settings(drafter=drafter, draft=BUNDLED if drafter == "draft-model" else "", gamma=gamma, max_new_tokens=24,
                 alpha=0.6, warmup=False)  # fmt: skip
    result = compare(s, REWRITE)
    ids = encode_prompt(bundled.tokenizer, REWRITE, chat=True)
    assert result.identical is True
    assert result.speculative.token_ids == result.baseline.token_ids == hf_generate(bundled, ids, 24)
    assert result.speculative.metrics.acceptance_rate > 0
    if drafter == "draft-model":  # the target drafting for itself agrees with itself
        assert result.speculative.metrics.acceptance_rate == 1.0


def test_bundled_text_stream_reassembles_unicode(bundled):
    tok = bundled.tokenizer
    text = "Ünïcödé: 日本語のテキスト, emoji 🚀🙂, accents café."
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) + stream.flush() == text

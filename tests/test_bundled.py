"""The same losslessness checks on the real bundled model (SmolLM2-135M-Instruct, CPU, float32)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.compare import compare
from engine.decoding.metrics import position_counts
from engine.decoding.runtime import TextStream, encode_prompt
from engine.models.loading import MODELS
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


def test_drafts_through_text_round_trip_on_a_real_tokenizer(bundled):
    """The target drafting for itself through its text (the path of a draft with another tokenizer): every
    re-encoded draft is the target's own next tokens, so nearly all hold; ids equal the baseline's."""
    from engine.decoding.crosstok import CrossTokenizerDraft
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.speculative import speculative_decode

    tok, model = bundled.tokenizer, bundled.model
    ids = encode_prompt(tok, REWRITE, chat=True)
    drafter = CrossTokenizerDraft(model, tok, tok, gamma=4)
    with torch.inference_mode():
        steps = list(speculative_decode(model, tok, ids, drafter, SamplingConfig(), 32, {tok.eos_token_id}))
    emitted = [t for s in steps for t in s.tokens]
    assert emitted == hf_generate(bundled, ids, 32)[: len(emitted)]
    accepted, drafted = sum(s.accepted for s in steps), sum(len(s.drafted) for s in steps)
    assert drafted > 0 and accepted / drafted > 0.8


def test_a_draft_whose_text_merges_with_the_last_tokens_proposes_nothing(bundled):
    from engine.decoding.crosstok import CrossTokenizerDraft
    from engine.decoding.drafters import Draft
    from engine.decoding.sampling import SamplingConfig

    tok = bundled.tokenizer
    drafter = CrossTokenizerDraft(bundled.model, tok, tok, gamma=4)
    drafter.reset()
    ids = tok.encode("Hello wor", add_special_tokens=False)
    drafter.inner.propose = lambda ids, limit, cfg, gen: Draft(tok.encode("ld and more", add_special_tokens=False), 2)
    merged = drafter.propose(ids, 8, SamplingConfig(), None)
    assert merged.tokens == [] and "merged with the last target tokens" in merged.note
    drafter.inner.propose = lambda ids, limit, cfg, gen: Draft(tok.encode(" and more", add_special_tokens=False), 2)
    clean = drafter.propose(ids, 8, SamplingConfig(), None)
    assert tok.decode(clean.tokens) == " and more" and "the draft's own tokens" in clean.note


def suite_prompts(categories: list[str], per_category: int) -> list[str]:
    from engine import presets

    return [p for ps in presets.suite(categories, per_category).values() for p in ps]


def test_strict_mode_makes_bfloat16_greedy_identical_on_the_bundled_model():
    """bfloat16, the dtype of every GPU: prompt lookup gives the baseline's ids on rewriting, summarisation and code
    prompts, and the model drafting for itself accepts every draft token (in the model's own layers without strict
    mode it accepted 0.91-0.94 and parted by rounding). Where our fused kernels run every pass, each row already
    rounds as a one-token pass does and strict mode needs no width (a run that parts would be a bug); elsewhere
    every target pass runs at one width over a cache of one size."""
    for prompt in suite_prompts(["rewriting", "summarisation", "code"], 2):
        c = compare(Settings(dtype="bfloat16", strict="on", gamma=4, max_new_tokens=48, warmup=False), prompt)
        strict = c.environment["strict"]
        assert c.verdict.kind == "identical" and (strict.get("exact") or strict["width"] == 5), prompt
        if os.environ.get("CI"):  # CI has a compiler, so our kernels run every pass there
            assert strict == {"setting": "on", "width": 0, "cost": None, "exact": True}
    c = compare(Settings(dtype="bfloat16", strict="on", drafter="draft-model", draft=BUNDLED, gamma=4,
                         max_new_tokens=48, warmup=False), REWRITE)  # fmt: skip
    assert c.verdict.kind == "identical" and c.speculative.metrics.acceptance_rate == 1.0


def test_the_synthetic_drafter_measures_the_alpha_it_was_asked_for_in_bfloat16():
    """Strict mode off, so runs may part from the baseline by rounding: the drafter follows the run's own text, and
    over 256+ drafted tokens the measured alpha is the one asked for (it collapsed to 0.63 here, 0.02 on a GPU)."""
    kept = tested = 0
    for prompt in suite_prompts(["open_qa", "creative_writing"], 2):
        c = compare(Settings(dtype="bfloat16", strict="off", drafter="synthetic", alpha=0.8, gamma=5,
                             max_new_tokens=80, warmup=False, seed=0), prompt)  # fmt: skip
        assert c.verdict.kind in ("identical", "rounding"), c.verdict.message
        counts = position_counts(c.speculative.steps[1:])  # per draft position: (tested, kept)
        tested, kept = tested + sum(r for r, _ in counts), kept + sum(k for _, k in counts)
    assert tested >= 256 and abs(kept / tested - 0.8) <= 0.05, (kept, tested)

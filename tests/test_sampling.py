"""The rejection rule reproduces the target distribution: Monte Carlo with statistical bounds.

All draws are seeded, so a pass is reproducible; the bounds (4.5 standard errors) would almost never
fail by chance for a correct rule, while a wrong one (e.g. forgetting the residual) misses by far more.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.decoding.baseline import baseline_decode
from engine.decoding.drafters import DraftModel, PromptLookup
from engine.decoding.runtime import forward, new_cache
from engine.decoding.sampling import SamplingConfig, logits_to_probs, verify
from engine.decoding.speculative import speculative_decode
from tests.conftest import LetterTokenizer, noisy_copy, tiny_llama

V = 6


def assert_matches(counts: torch.Tensor, expected: torch.Tensor, slack: float = 0.004):
    n = int(counts.sum())
    freq = counts.double() / n
    for f, p in zip(freq.tolist(), expected.double().tolist()):
        bound = 4.5 * math.sqrt(max(p * (1 - p), 1e-12) / n) + slack
        assert abs(f - p) <= bound, (freq.tolist(), expected.tolist())


@pytest.fixture
def p_q():
    torch.manual_seed(0)
    p = torch.distributions.Dirichlet(torch.ones(V) * 0.7).sample((2,))  # (2, V): position 1 and bonus position
    q = torch.distributions.Dirichlet(torch.ones(V) * 0.7).sample()  # (V,)
    return p, q


def test_rejection_sampling_gives_the_target_distribution(p_q):
    p, q = p_q
    cfg = SamplingConfig(temperature=1.0, seed=0)
    gen = cfg.generator(torch.device("cpu"))
    first, bonus = torch.zeros(V), torch.zeros(V)
    for _ in range(20000):
        x = torch.multinomial(q, 1, generator=gen)  # (1,)
        verdict = verify(x, p.log(), q[None], cfg, gen)
        if verdict.accepted:
            first[x] += 1
            bonus[verdict.token] += 1
        else:
            first[verdict.token] += 1
    assert_matches(first, p[0])
    assert_matches(bonus, p[1])  # the bonus token after an accepted draft follows p at the next position


def test_one_hot_drafts_are_accepted_with_probability_p(p_q):
    p, _ = p_q
    cfg = SamplingConfig(temperature=1.0, seed=1)
    gen = cfg.generator(torch.device("cpu"))
    draft = torch.tensor([int(p[0].argmin())])  # even the least likely proposal must not bias the output
    out, accepted = torch.zeros(V), 0
    for _ in range(20000):
        verdict = verify(draft, p.log(), None, cfg, gen)
        out[draft if verdict.accepted else verdict.token] += 1
        accepted += verdict.accepted
    assert_matches(out, p[0])
    assert abs(accepted / 20000 - float(p[0, draft])) < 0.01


def test_greedy_verify_is_argmax_matching():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    gen = torch.Generator()
    assert verify(torch.tensor([1, 0]), logits, None, SamplingConfig(), gen).accepted == 2
    verdict = verify(torch.tensor([1, 2]), logits, None, SamplingConfig(), gen)
    assert (verdict.accepted, verdict.token) == (1, 0)  # corrected to the target's argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_argmax_picks_what_torch_picks_ties_to_the_first(dtype):
    """sampling.argmax (numpy's, over a float32 view on CPU: torch's ran 6-40x slower over a real vocabulary) gives
    torch's argmax for one row and for a verify pass's rows, in every dtype, ties to the first of the maxima (a bfloat16
    vocabulary holds many equal logits), as a long tensor of the rows' shape."""
    from engine.decoding.sampling import argmax

    torch.manual_seed(0)
    logits = torch.randn(6, 49152).to(dtype)
    logits[1, [7, 100, 40000]] = 9.0  # ties: the first wins
    logits[2] = 0.5  # every logit equal
    logits[3, -1] = 20.0
    logits[4, 0] = 20.0
    for x in (logits, logits[1], logits[3], logits[4], logits[:, :5]):
        got = argmax(x)
        assert got.dtype == torch.long and got.shape == x.shape[:-1] and torch.equal(got, x.argmax(-1))
    assert argmax(logits).tolist()[1:5] == [7, 0, 49151, 0]


def test_logits_to_probs_applies_temperature_top_k_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(logits_to_probs(logits, SamplingConfig(temperature=1.0)), full)
    cooler = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(cooler, torch.softmax(logits / 0.5, -1))
    top2 = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    # top-p keeps the smallest set of most likely tokens whose mass reaches p
    mass = float(full[0] + full[1])
    kept = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=mass - 1e-3))
    assert (kept[:2] > 0).all() and (kept[2:] == 0).all()
    assert (logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.01))[1:] == 0).all()


def exact_marginals(model, prompt, cfg, length):
    """P(token at position i) for i < length, by enumerating every prefix (tiny vocabulary)."""
    marginals = []
    frontier = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            dist = torch.zeros(model.config.vocab_size, dtype=torch.float64)
            nxt = {}
            for prefix, weight in frontier.items():
                probs = logits_to_probs(forward(model, prompt + list(prefix), new_cache(model))[-1], cfg).double()
                dist += weight * probs
                for t, pt in enumerate(probs.tolist()):
                    if pt > 0:
                        nxt[prefix + (t,)] = weight * pt
            marginals.append(dist)
            frontier = nxt
    return marginals


def assert_both_exact(spec, base, exact) -> None:
    """Speculative and baseline token counts both follow the exact marginals, position by position."""
    for i in range(len(exact)):
        assert_matches(spec[i], exact[i], slack=0.01)
        assert_matches(base[i], exact[i], slack=0.01)


def sampled_exactly(target, make_drafter, gamma, cfg, prompt, length) -> tuple[int, int]:
    """Sample speculative and baseline runs, hold both to the exact marginals; return (accepted, drafted)."""
    exact = exact_marginals(target, prompt, cfg, length)
    spec, base, accepted, drafted = sampled_counts(target, make_drafter, gamma, cfg, prompt, length)
    assert_both_exact(spec, base, exact)
    return accepted, drafted


def sampled_counts(target, make_drafter, gamma, cfg, prompt, length, runs=1500):
    """Token counts per position over `runs` seeds, speculative and baseline, and (accepted, drafted)."""
    tok, vocab = LetterTokenizer(), target.config.vocab_size
    spec, base = torch.zeros(length, vocab), torch.zeros(length, vocab)
    accepted = drafted = 0
    with torch.inference_mode():
        for seed in range(runs):
            c = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed)
            drafter = make_drafter()
            drafter.start = gamma  # its draft length: the run's reset() applies it
            steps = list(speculative_decode(target, tok, prompt, drafter, c, length, set()))
            for i, t in enumerate(t for s in steps for t in s.tokens):
                spec[i, t] += 1
            accepted += sum(s.accepted for s in steps)
            drafted += sum(len(s.drafted) for s in steps)
            for i, t in enumerate(t for s in baseline_decode(target, tok, prompt, c, length, set()) for t in s.tokens):
                base[i, t] += 1
    return spec, base, accepted, drafted


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampled_speculative_run_matches_target_distribution(cfg):
    target = tiny_llama(vocab_size=8, layers=1, seed=5)
    draft = noisy_copy(target, scale=0.8, seed=6)
    accepted, drafted = sampled_exactly(target, lambda: DraftModel(draft, 8), 2, cfg, [1, 2, 3], 3)
    assert 0.2 < accepted / drafted < 0.95  # both branches of the rule were exercised


def test_prompt_lookup_sizing_its_own_drafts_keeps_the_target_distribution():
    """Draft lengths chosen from what held so far depend on the past only, so sampling stays exact."""
    target = tiny_llama(vocab_size=8, layers=1, seed=5)
    cfg, prompt, length = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2, 4, 1, 2], 4
    costs = [1.0] + [1.3] * 4
    accepted, drafted = sampled_exactly(target, lambda: PromptLookup(2, costs=costs), 4, cfg, prompt, length)
    assert 0 < accepted < drafted


def test_confidence_stopped_drafts_keep_the_target_distribution():
    """Where a draft stops depends on the draft's own probabilities only, so sampling stays exact."""
    target = tiny_llama(vocab_size=8, layers=1, seed=5)
    draft = noisy_copy(target, scale=0.8, seed=6)
    cfg, prompt, length = SamplingConfig(temperature=1.0), [1, 2, 3], 3
    full = sampled_counts(target, lambda: DraftModel(draft, 8), 3, cfg, prompt, length, runs=300)
    accepted, drafted = sampled_exactly(target, lambda: DraftModel(draft, 8, p_min=0.4), 3, cfg, prompt, length)
    assert 0 < accepted < drafted
    assert drafted / 1500 < full[3] / 300  # the stop drafted fewer tokens per run


def test_suffix_drafts_from_session_memory_keep_the_target_distribution():
    from engine.decoding.suffix import SuffixDrafter, SuffixMemory

    target = tiny_llama(vocab_size=8, layers=1, seed=5)
    memory = SuffixMemory()
    memory.begin((7,), [4, 1, 2, 3, 5, 6, 7, 5, 6, 4, 3, 5, 6, 7])  # another prompt's text

    def drafter():
        memory.begin((0,), [0])  # a run starts: nothing of earlier runs of this prompt may be used
        return SuffixDrafter(memory, 3)

    accepted, drafted = sampled_exactly(target, drafter, 3, SamplingConfig(temperature=1.0), [1, 2, 3], 4)
    assert 0 < accepted < drafted


def test_drafts_from_another_tokenizer_keep_the_target_distribution():
    """The draft's argmax, re-encoded into the target's ids, is a one-hot proposal: sampling stays exact."""
    from engine.decoding.crosstok import CrossTokenizerDraft

    target = tiny_llama(vocab_size=8, layers=1, seed=5)
    draft = noisy_copy(target, scale=0.8, seed=6)
    # the draft reads the same letters under other ids: its weights are the copy's, rows reversed to match
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(draft.model.embed_tokens.weight.flip(0))
        draft.lm_head.weight.copy_(draft.lm_head.weight.flip(0))
    make = lambda: CrossTokenizerDraft(draft, LetterTokenizer(reverse=True), LetterTokenizer(), gamma=2)  # noqa: E731
    accepted, drafted = sampled_exactly(target, make, 2, SamplingConfig(temperature=1.0), [1, 2, 3], 3)
    assert 0.05 < accepted / drafted < 0.95  # argmax drafts against a sampled target: both branches exercised

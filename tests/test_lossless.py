"""The lossless verdict (engine.decoding.lossless) and strict mode, on tiny random models: rounding is told from a
bug by the scores of the passes, and strict mode makes 16-bit greedy runs bit-identical."""

from __future__ import annotations

import pytest
import torch

import engine.decoding.speculative
from engine.decoding.baseline import baseline_decode
from engine.decoding.drafters import DraftModel, PromptLookup, Synthetic
from engine.decoding.lossless import judge, tops
from engine.decoding.metrics import StepEvent, summarise
from engine.decoding.speculative import speculative_decode
from tests.test_engine import GREEDY, PROMPTS, prompt_ids


def step(tokens: list[int], top: list[list]) -> StepEvent:
    return StepEvent(1, "target", tokens, [""] * len(tokens), top=top)


def pair_of_runs(flip_base: list, flip_spec: list, shared: int = 3, moved: float = 0.0625):
    """Two runs that agree on `shared` tokens (their scores moved by `moved` between the passes), then part."""
    base = [step([7], [[7, 20.0, 8, 19.0]]) for _ in range(shared)] + [step([flip_base[0]], [flip_base])]
    spec = [step([7], [[7, 20.0 + moved, 8, 19.0]]) for _ in range(shared)] + [step([flip_spec[0]], [flip_spec])]
    ids = lambda steps: [t for s in steps for t in s.tokens]  # noqa: E731
    return base, spec, ids(base), ids(spec)


def test_a_flip_within_the_rounding_the_runs_showed_is_rounding():
    base, spec, b, s = pair_of_runs([5, 16.0, 6, 16.0 - 0.0625], [6, 16.0 + 0.0625, 5, 16.0])
    verdict = judge(base, spec, b, s, "bfloat16", decode=lambda ids: f"t{ids[0]}")
    assert verdict.kind == "rounding" and verdict.lossless is True and verdict.position == 3
    assert verdict.message.startswith("identical for the first 3 tokens; at token 4 the baseline chose 't5' and "
                                      "speculation 't6': the two passes' logits for them differ by less than "
                                      "bfloat16 rounding")  # fmt: skip
    assert verdict.evidence["baseline_gap"] == 0.0625 and verdict.evidence["speculative_gap"] == 0.0625


def test_where_every_pass_rounds_rows_alike_a_flip_within_rounding_is_a_bug():
    """Our fused kernels round each row of any pass as a one-token pass does (engine.decoding.lean.rounds_alike): a
    run over them that parts from its baseline cannot have parted by rounding, however near the two tokens were."""
    base, spec, b, s = pair_of_runs([5, 16.0, 6, 16.0 - 0.0625], [6, 16.0 + 0.0625, 5, 16.0])
    verdict = judge(base, spec, b, s, "bfloat16", exact=True)
    assert verdict.kind == "differs" and verdict.lossless is False and verdict.position == 3
    assert "rounding cannot part them: this is a bug" in verdict.message
    assert judge(base[:3], spec[:3], b[:3], s[:3], "bfloat16", exact=True).kind == "identical"


def test_exact_ties_listed_in_either_order_are_read_as_ties():
    base, spec, b, s = pair_of_runs([5, 16.0, 6, 16.0], [6, 16.0, 5, 16.0])
    base[-1].top = [[6, 16.0, 5, 16.0]]  # topk listed the tie the other way round than argmax chose
    assert judge(base, spec, b, s, "bfloat16").kind == "rounding"


def test_a_flip_far_beyond_rounding_is_a_bug():
    base, spec, b, s = pair_of_runs([5, 18.0, 6, 14.0], [6, 16.0, 5, 15.9])
    verdict = judge(base, spec, b, s, "bfloat16")
    assert verdict.kind == "differs" and verdict.lossless is False
    assert "baseline's pass preferred its token by 4, beyond bfloat16 rounding" in verdict.message
    assert "this is a bug" in verdict.message
    # in float32 the same flip with a tiny gap is still beyond what float32 rounds
    base, spec, b, s = pair_of_runs([5, 16.0, 6, 15.99], [6, 16.0, 5, 15.99], moved=0.0)
    assert judge(base, spec, b, s, "float32").kind == "differs"


def test_no_scores_or_a_three_way_tie_cannot_be_judged():
    base, spec, b, s = pair_of_runs([5, 16.0, 6, 16.0], [6, 16.0, 9, 16.0])
    spec[-1].top = []
    assert judge(base, spec, b, s, "bfloat16").kind == "unjudged"
    base, spec, b, s = pair_of_runs([5, 16.0, 9, 16.0], [6, 16.0, 9, 16.0])  # 6 not among the baseline's two best
    verdict = judge(base, spec, b, s, "bfloat16")
    assert verdict.kind == "unjudged" and "three or more tokens" in verdict.message


def test_an_injected_difference_in_the_real_loop_is_judged_a_bug(llama_pair, monkeypatch):
    """A verify pass that puts another token far ahead (as a broken cache roll-back would) is not rounding."""
    target, _, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    with torch.inference_mode():
        base = list(baseline_decode(target, tok, ids, GREEDY, 30, set()))
        real, calls = engine.decoding.speculative.forward, {"n": 0}

        def broken(model, token_ids, cache, keep=0, width=0, layers=(), tree=None):
            logits = real(model, token_ids, cache, keep, width)
            calls["n"] += 1
            if calls["n"] == 4:
                logits = logits.clone()
                logits[0, (int(logits[0].argmax()) + 1) % logits.shape[-1]] += 50.0
            return logits

        monkeypatch.setattr(engine.decoding.speculative, "forward", broken)
        spec = list(speculative_decode(target, tok, ids, PromptLookup(), GREEDY, 30, set()))
    b, s = summarise("b", base, "").token_ids, summarise("s", spec, "").token_ids
    verdict = judge(base, spec, b, s, "float32")
    assert b != s and verdict.kind == "differs" and verdict.evidence["speculative_gap"] > 40


def test_every_emitted_token_keeps_the_two_best_of_its_pass(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[1])
    with torch.inference_mode():
        steps = list(speculative_decode(target, tok, ids, DraftModel(draft, 384), GREEDY, 20, set()))
    records = tops(steps)
    tokens = [t for s in steps for t in s.tokens]
    assert len(records) == len(tokens) and all(r[0] == t and r[1] >= r[3] for r, t in zip(records, tokens))


@pytest.fixture(scope="module")
def wide_bf16():
    """A random Llama wide enough (576, the bundled model's width) for bfloat16 passes of different shapes to round
    differently, as real models do; the tiny fixture's 64-wide passes happen to round alike."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0, initializer_range=0.02)  # fmt: skip
    return LlamaForCausalLM(config).eval().to(torch.bfloat16)


TEXTS = PROMPTS + ["Once upon a time, once upon a time there", "a b c a b c a b"]


def greedy_runs(model, tok, text: str, width: int, gamma: int = 4) -> tuple[list[int], list]:
    """The baseline's ids, and (drafter name, ids, acceptance) for prompt lookup and the model drafting for
    itself, all at `width` (0: strict mode off)."""
    ids = prompt_ids(tok, text)
    with torch.inference_mode():
        base = summarise("b", list(baseline_decode(model, tok, ids, GREEDY, 40, set(), width=width)), "").token_ids
        runs = []
        for drafter in (PromptLookup(gamma=gamma), DraftModel(model, 384, gamma=gamma)):
            steps = list(speculative_decode(model, tok, ids, drafter, GREEDY, 40, set(), width=width))
            spec = summarise("s", steps, "")
            assert not width or max(len(s.drafted) for s in steps[1:]) <= width - 1  # drafts fit the width
            runs.append((drafter.name, spec.token_ids, spec.metrics.acceptance_rate))
    return base, runs


def test_strict_mode_gives_identical_greedy_ids_in_bfloat16(wide_bf16, llama_pair):
    """Every target pass of both runs at one width over a cache of one size: the baseline's one-token passes and
    the verify passes run the same kernels over as many keys, so their ids are equal, and the model drafting
    for itself (its passes at that width too) agrees with itself every time. Without strict mode the same
    runs part somewhere: what strict mode fixes is real on this model."""
    tok = llama_pair[2]
    parted = 0
    for text in TEXTS:
        base, runs = greedy_runs(wide_bf16, tok, text, width=5)
        for name, ids, acceptance in runs:
            assert ids == base, (name, text)
        assert runs[1][2] == 1.0, text  # the self-draft
        loose_base, loose = greedy_runs(wide_bf16, tok, text, width=0)
        parted += sum(ids != loose_base or (name == "draft-model" and acceptance < 1.0)
                      for name, ids, acceptance in loose)  # fmt: skip
    assert parted > 0


def test_the_synthetic_drafter_follows_the_run_where_it_leaves_the_reference(llama_pair):
    """A reference the run does not follow (as after a 16-bit rounding flip) is made again from the run's own
    text, so the asked alpha is what the run measures, and the time that takes is kept out of the clocks."""
    target, _, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[2])
    with torch.inference_mode():
        truth = summarise("b", list(baseline_decode(target, tok, ids, GREEDY, 60, set())), "").token_ids
        stale = truth[:5] + [(t + 7) % 384 for t in truth[5:]]  # a reference that parts from the run at token 6

        def regenerate(at, n):
            steps = baseline_decode(target, tok, at, GREEDY, n, set())
            return [t for s in steps for t in s.tokens]

        blind = Synthetic(len(ids), stale, 1.0, 384, gamma=4)
        following = Synthetic(len(ids), stale, 1.0, 384, gamma=4, regenerate=regenerate)
        runs = [summarise("s", list(speculative_decode(target, tok, ids, d, GREEDY, 60, set())), "")
                for d in (blind, following)]  # fmt: skip
    assert all(r.token_ids == truth for r in runs)  # lossless either way
    assert runs[0].metrics.alpha < 0.2 and runs[1].metrics.alpha == 1.0 and following.regenerated == 1

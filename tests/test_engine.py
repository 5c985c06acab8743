"""Losslessness of the engine on tiny random models: greedy ids, caches, EOS and length limits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.decoding.baseline import baseline_decode
from engine.decoding.drafters import DraftModel, PromptLookup, Synthetic
from engine.decoding.metrics import summarise
from engine.decoding.runtime import TextStream, forward, measure_verify_costs, new_cache
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import speculative_decode
from tests.conftest import EOS

GREEDY = SamplingConfig()
PROMPTS = ["The cat sat on the mat. The cat", "def add(a, b):\n    return", "1, 2, 3, 4,"]


def prompt_ids(tokenizer, text):
    return tokenizer(text)["input_ids"][:-1]  # drop ByT5's trailing </s>


def run_baseline(model, tok, ids, n, eos=frozenset({EOS}), cfg=GREEDY):
    with torch.inference_mode():
        steps = list(baseline_decode(model, tok, ids, cfg, n, set(eos)))
    return summarise("baseline", steps, "")


def run_spec(model, tok, ids, drafter, gamma, n, eos=frozenset({EOS}), cfg=GREEDY):
    drafter.start = gamma  # its draft length: the run's reset() applies it
    with torch.inference_mode():
        steps = list(speculative_decode(model, tok, ids, drafter, cfg, n, set(eos)))
    return summarise("speculative", steps, "")


def hf_generate(model, ids, n, eos=EOS):
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("pair", ["llama_pair", "gpt2_pair"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_baseline_and_hf_generate(pair, gamma, request):
    target, draft, tok = request.getfixturevalue(pair)
    for text in PROMPTS:
        ids = prompt_ids(tok, text)
        expected = hf_generate(target, ids, 40)
        assert run_baseline(target, tok, ids, 40).token_ids == expected
        for drafter in (DraftModel(draft, target.config.vocab_size), PromptLookup(max_ngram=3)):
            result = run_spec(target, tok, ids, drafter, gamma, 40)
            assert result.token_ids == expected, (drafter.name, text)


def test_draft_model_is_right_sometimes_and_wrong_sometimes(llama_pair):
    """Guards the fixture: a pair with alpha of exactly 0 or 1 would test only half the loop."""
    target, draft, tok = llama_pair
    result = run_spec(target, tok, prompt_ids(tok, PROMPTS[0]), DraftModel(draft, 384), 4, 60, eos=())
    assert 0.1 < result.metrics.acceptance_rate < 0.99
    kinds = {s.kind for s in result.steps}
    assert {"correction", "bonus"} <= kinds


def test_oracle_accepts_everything_adversary_nothing(llama_pair):
    target, _, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[1])
    reference = run_baseline(target, tok, ids, 50, eos=()).token_ids
    oracle = run_spec(target, tok, ids, Synthetic(len(ids), reference, 1.0, 384), 4, 50, eos=())
    adversary = run_spec(target, tok, ids, Synthetic(len(ids), reference, 0.0, 384), 4, 50, eos=())
    assert oracle.metrics.acceptance_rate == 1.0
    assert adversary.metrics.acceptance_rate == 0.0
    assert oracle.token_ids == adversary.token_ids == reference
    assert oracle.metrics.target_passes < adversary.metrics.target_passes == 50
    assert oracle.metrics.per_position_acceptance == [1.0] * 4
    m = adversary.metrics  # every draft rejected at once; the last step has no room to draft
    assert m.accepted_length_hist[1:] == [0] * 4 and m.no_draft_steps == 1
    assert m.accepted_length_hist[0] + m.no_draft_steps == m.target_passes - 1


def test_eos_inside_an_accepted_draft_ends_the_run(llama_pair):
    target, _, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    free = run_baseline(target, tok, ids, 60, eos=()).token_ids
    # pick as EOS a token that first appears mid-sequence
    cut = next(i for i in range(6, 60) if free[i] not in free[:i])
    eos = {free[cut]}
    expected = free[: cut + 1]
    assert hf_generate(target, ids, 60, eos=free[cut]) == expected
    oracle = Synthetic(len(ids), free, 1.0, 384)
    inside = 0
    for gamma in (2, 3, 4, 5, 7):
        result = run_spec(target, tok, ids, oracle, gamma, 60, eos=eos)
        assert result.token_ids == expected
        assert result.metrics.finish_reason == "eos"
        last = result.steps[-1]
        assert last.tokens[-1] in eos
        inside += last.token is None  # EOS was an accepted draft token: the target's own token is dropped
    assert inside > 0


def test_max_new_tokens_cuts_the_draft(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[2])
    reference = run_baseline(target, tok, ids, 30, eos=()).token_ids
    for n in (1, 2, 5, 7, 13):
        for drafter in (Synthetic(len(ids), reference, 1.0, 384), DraftModel(draft, 384), PromptLookup()):
            result = run_spec(target, tok, ids, drafter, 4, n, eos=())
            assert result.token_ids == reference[:n]
            assert result.metrics.finish_reason == "length"
            assert all(len(s.drafted) <= 4 for s in result.steps)


def test_rolled_back_target_cache_matches_a_fresh_pass(llama_pair):
    target, _, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    with torch.inference_mode():
        cache = new_cache(target)
        forward(target, ids[:-1], cache)
        forward(target, [ids[-1], 7, 8, 9, 10], cache)  # a verify pass over four draft tokens
        cache.crop(-3)  # two rejected... keep [last, 7]
        after = forward(target, [11], cache)[-1]
        fresh = forward(target, ids + [7, 11], new_cache(target))[-1]
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)


def test_draft_model_resynchronises_its_cache(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[1])
    gen = torch.Generator()
    with torch.inference_mode():
        reused = DraftModel(draft, 384)
        reused.propose(ids + [5, 6, 7], 4, GREEDY, gen)  # fill its cache with a future that is then rejected
        again = reused.propose(ids + [5, 9], 4, GREEDY, gen)
        fresh = DraftModel(draft, 384).propose(ids + [5, 9], 4, GREEDY, gen)
    assert again.tokens == fresh.tokens
    torch.testing.assert_close(again.probs, fresh.probs, rtol=1e-4, atol=1e-5)


def test_prompt_lookup_follows_what_most_occurrences_agree_on():
    lookup = PromptLookup(max_ngram=2)
    gen = torch.Generator()
    assert lookup.propose([1, 2, 3], 3, GREEDY, gen).tokens == []
    assert lookup.propose([4, 4, 4], 3, GREEDY, gen).tokens == [4]
    # a tie goes to the earliest occurrence: in an edit or a summary, the source text
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2], 3, GREEDY, gen).tokens == [3, 4, 9]
    # two of three occurrences go on with 5; after 1 2 5 they part ways (6 vs 7), and the earlier wins
    assert lookup.propose([1, 2, 5, 6, 1, 2, 8, 1, 2, 5, 7, 1, 2], 3, GREEDY, gen).tokens == [5, 6, 1]
    # an occurrence cut short by the end of the text drops out; the others carry the draft on
    assert lookup.propose([1, 2, 5, 6, 8, 3, 1, 2, 1, 2], 3, GREEDY, gen).tokens == [5, 6, 8]
    # the longest matching n-gram decides before any shorter one
    assert lookup.propose([7, 2, 9, 9, 1, 2, 3, 3, 1, 2], 2, GREEDY, gen).tokens == [3, 3]


def test_prompt_lookup_sizes_drafts_from_costs_and_what_held():
    gen = torch.Generator()
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    free = PromptLookup(max_ngram=1, costs=[1.0] * 9)  # verifying costs nothing: draft all there is
    assert free.propose(text + [10], 8, GREEDY, gen).tokens == text[1:9]
    dear = [1.0] + [2.0] * 8  # any draft costs one more step
    assert PromptLookup(3, costs=dear).propose(text + [10], 8, GREEDY, gen).tokens == []  # a bare match: no
    assert PromptLookup(3, costs=dear).propose(text + [10, 11, 12], 8, GREEDY, gen).tokens == text[3:] + [10]

    lookup = PromptLookup(3, costs=[1.0] + [3.5] * 8)
    drafted = lookup.propose(text + [10, 11, 12], 8, GREEDY, gen).tokens
    assert drafted  # a 3-gram match is worth it
    lookup.observe(len(drafted), 0)  # the target kept none of it
    seen = text + [10, 11, 12, 99, 10, 11, 12]  # the same 3-gram comes again
    assert lookup.propose(seen, 8, GREEDY, gen).tokens == []  # after that miss, not worth a pass
    # while it drafts nothing its evidence fades, until the match is worth a try again
    quiet = 1
    while True:
        lookup.observe(0, 0)  # a step without a draft
        if lookup.propose(seen, 8, GREEDY, gen).tokens:
            break
        quiet += 1
    assert 10 < quiet < 60

    # drafts that held in full make it draft where the prior alone would not
    learnt = PromptLookup(max_ngram=1, costs=[1.0] * 9)
    seen = text + [10]
    for _ in range(3):
        # all held, the target added 19, and the text goes back to the start of the copy
        drafted = learnt.propose(seen, 8, GREEDY, gen).tokens
        learnt.observe(len(drafted), len(drafted))
        seen += drafted + [19, 10]
    memory = learnt.MEMORY
    assert learnt.first[1] == [pytest.approx(1 + memory + memory**2), 0.0]  # three scored, the older faded
    learnt.costs = [1.0] + [2.5] * 8
    assert learnt.propose(seen, 8, GREEDY, gen).tokens == text[1:9]


def test_events_carry_pieces_that_add_up_to_the_text(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    result = run_spec(target, tok, ids, DraftModel(draft, 384), 3, 40, eos=())
    for step in result.steps:
        assert len(step.pieces) == len(step.tokens)
        assert step.tokens[: step.accepted] == step.drafted[: step.accepted]
        assert len(step.p) == len(step.q) == len(step.drafted)
        assert step.elapsed_s >= 0 and step.draft_s >= 0 and step.verify_s > 0
    assert "".join(p for s in result.steps for p in s.pieces) == tok.decode(result.token_ids, skip_special_tokens=True)
    m = result.metrics
    assert m.new_tokens == sum(s.accepted for s in result.steps) + m.target_passes
    assert m.accepted_tokens == sum(i * n for i, n in enumerate(m.accepted_length_hist))


def test_stop_flag_ends_the_run_between_steps(llama_pair):
    import threading

    target, draft, tok = llama_pair
    stop = threading.Event()
    events = []
    with torch.inference_mode():
        ids = prompt_ids(tok, PROMPTS[0])
        for event in speculative_decode(target, tok, ids, DraftModel(draft, 384, gamma=3), GREEDY, 100, set(), stop):
            events.append(event)
            if event.step == 2:
                stop.set()
    assert events[-1].finished == "stopped" and events[-1].step == 3
    result = summarise("speculative", events, "")
    assert result.metrics.finish_reason == "stopped" and result.metrics.target_passes == 3


def test_text_stream_handles_multibyte_characters(llama_pair):
    tok = llama_pair[2]
    text = "naïve café — 世界 🙂 done"
    ids = tok(text)["input_ids"][:-1]
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) + stream.flush() == text
    assert "" in pieces  # a byte that completes no character yet


def test_adaptive_gamma_changes_draft_length_and_stays_lossless(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    expected = run_baseline(target, tok, ids, 60, eos=()).token_ids
    oracle = Synthetic(len(ids), expected, 1.0, 384, gamma=2, adaptive=True)
    with torch.inference_mode():
        steps = list(speculative_decode(target, tok, ids, oracle, GREEDY, 60, set()))
    lengths = [len(s.drafted) for s in steps[1:]]
    assert lengths[:4] == [2, 4, 6, 8]  # always fully accepted: +2 each step
    with torch.inference_mode():
        costs = measure_verify_costs(target, 16)
    assert len(costs) == 17 and costs[0] == 1.0 and costs == sorted(costs)
    # prompt lookup sizes drafts from given costs (measured ones move with the machine's load: a test on them
    # would time the machine, not test the sizing)
    cheap = [1.0 + 0.02 * k for k in range(17)]
    for drafter in (DraftModel(draft, 384, adaptive=True), PromptLookup(costs=cheap)):
        with torch.inference_mode():
            steps = list(speculative_decode(target, tok, ids, drafter, GREEDY, 60, set()))
        assert summarise("s", steps, "").token_ids == expected
        assert len({len(s.drafted) for s in steps[1:] if s.drafted}) > 1


def test_verify_costs_fit_a_short_context():
    """Costs are timed after a prompt-sized prefix; a model with learned positions and a short context gets
    a shorter one instead of an index error."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=384, n_embd=32, n_layer=1, n_head=2, n_positions=40)).eval()
    with torch.inference_mode():
        costs = measure_verify_costs(model, 16)
    assert len(costs) == 17 and costs[0] == 1.0 and costs == sorted(costs)


def test_cpu_linear_forms_match_stock_layers(model_dirs, llama_pair, monkeypatch):
    from engine.models.cpu import CpuLinear
    from engine.models.loading import ModelCache

    monkeypatch.setenv("SPECARENA_CPU_PACK", "1")  # packed for every pass, whatever this CPU would choose
    cache = ModelCache(max_models=2)
    packed, plain = cache.get(model_dirs["target"]), cache.get(model_dirs["target"], pack=False)
    assert packed.reformed_linears > 0 and plain.reformed_linears == 0
    assert isinstance(packed.model.lm_head, CpuLinear) and packed.vocab_size == plain.vocab_size == 384
    assert set(packed.model.lm_head.weights) == {"packed"}  # the stock copy no pass uses is not kept
    ids = prompt_ids(llama_pair[2], PROMPTS[1])
    with torch.inference_mode():
        a = forward(packed.model, ids, new_cache(packed.model))
        b = forward(plain.model, ids, new_cache(plain.model))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    tok = packed.tokenizer
    expected = run_baseline(plain.model, tok, ids, 30).token_ids
    assert run_spec(packed.model, tok, ids, PromptLookup(), 4, 30).token_ids == expected


TABLES = [("packed",), ("transposed",), ("blas",), ("own",), ("stock", "stock", "stock", "transposed", "transposed",
          "packed"), ("stock", "packed", "stock", "transposed"), ("stock", "blas", "stock", "packed", "blas"),
          ("stock", "own", "stock", "packed", "own")]  # fmt: skip


def own_kernel():
    """Our own kernel, compiled here (engine.models.native); CI has a compiler, so there its absence fails."""
    from engine.models import native
    from engine.models.cpu import available

    if "own" not in available():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"our own kernel: {native.status()}")


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_linear_matches_in_every_form_and_row_count(table, bias):
    """Each layout computes what nn.Linear does, for any row count, padded or not; the table picks the form
    by the rows a pass runs as (its last entry serves longer passes) and only the forms it names are kept."""
    from engine.models.cpu import CpuLinear, measurable

    if "own" in table:
        own_kernel()
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    wrapped = CpuLinear(layer, measurable())
    wrapped.keep_only(table)
    assert set(wrapped.weights) == set(table)
    with torch.inference_mode():
        for pad in ((), (0, 3, 5, 3, 5, 5)):  # padded: 1 and 2 rows run as 3, 4 as 5; the extra rows dropped
            wrapped.pad = pad
            for rows in (1, 2, 3, 4, 5, 17, 64):
                x = torch.randn(1, rows, 48)
                torch.testing.assert_close(wrapped(x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(80, 48), (5, 3), (200, 576), (576, 1536), (1000, 37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_our_kernel_rounds_a_verify_pass_exactly_like_one_token_passes(shape, dtype):
    """Every output's sum runs over the inputs in one order, whatever the rows of the pass: a verify pass of k rows
    gives the bits of k one-token passes (where oneDNN, MKL and OpenBLAS change kernels with the row count), and
    matches nn.Linear to float32 rounding. Shapes with partial tiles and partial vectors included. Bfloat16 weights
    are summed in float32 and each output rounded once: the float32 product of the same numbers, rounded."""
    from engine.models.cpu import CpuLinear

    own_kernel()
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0]).to(dtype)
    wrapped = CpuLinear(layer, ("stock", "own"))
    wrapped.keep_only(("own",))
    with torch.inference_mode():
        for rows in (2, 3, 4, 5, 6, 7, 8, 9, 13, 17):
            x = torch.randn(rows, shape[1], dtype=dtype)
            together = wrapped(x)
            alone = torch.cat([wrapped(x[i : i + 1]) for i in range(rows)])
            assert together.dtype == dtype and torch.equal(together, alone), rows
            if dtype == torch.float32:
                torch.testing.assert_close(together, layer(x), rtol=1e-4, atol=1e-4)
            else:  # against the float32 product: at most one rounding step of bfloat16 apart
                exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
                assert ((together.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all(), rows


@pytest.mark.parametrize("build", ["widening", "pairs", "amx"])
def test_every_build_of_the_bfloat16_kernel_rounds_verify_passes_like_one_token_passes(build, monkeypatch):
    """Bfloat16 weights are widened to float32 lane by lane; or, where the CPU has AVX512_BF16 and native.flags
    asks for it (AMD), summed in pairs by vdpbf16ps from weights packed in pairs along k; or, where it has AMX, by
    AMX tiles from the same pairs, k padded to steps of 32. Whichever build runs here, the others are tested too: k
    rows give the bits of k one-token passes (more than a tile's 16 rows included), odd k and partial tiles
    included, within a bfloat16 rounding of the float32 product, and a packed weight unpacks to itself."""
    from engine.models import native
    from engine.models.cpu import cpu_flags, cpu_id

    own_kernel()
    monkeypatch.setenv("SPECARENA_BF16_PAIRS", "1" if build == "pairs" else "0")
    monkeypatch.setenv("SPECARENA_AMX", "1" if build == "amx" else "0")
    monkeypatch.setattr(native, "_loaded", {})  # build (or recall) this variant; the process's own stays as it was
    lib = native.library(cpu_id())
    assert lib is not None, native.status()
    flags, own_compiler = cpu_flags(), bool(os.environ.get("CXX"))  # one's own compiler may leave AVX512 out
    wanted = {"widening": 0, "pairs": "avx512_bf16" in flags, "amx": "amx_bf16" in flags}[build]
    assert lib.rows_pairs() <= wanted and lib.rows_tiles() <= (build == "amx")
    if wanted and not own_compiler:
        assert lib.rows_pairs() == 1 and lib.rows_depth() == (32 if build == "amx" else 2)
    said = {"widening": "widened to float32", "pairs": "summed in pairs by vdpbf16ps", "amx": "on AMX tiles"}
    if build == "widening" or (wanted and not own_compiler):  # the words the page's "measured with" line shows
        refused = build == "amx" and not lib.rows_tiles()  # Linux may refuse a process the tiles: pairs then
        assert native.sixteen() == said["pairs" if refused else build]
    torch.manual_seed(0)
    for out_features, in_features in ((80, 48), (1000, 37), (576, 1536)):
        weight = torch.randn(out_features, in_features).bfloat16()
        bias = torch.randn(out_features)
        rows = native.Rows(weight, bias, lib)
        assert rows.pairs == bool(lib.rows_pairs())
        unpacked, kept_bias = rows.unpacked()
        assert torch.equal(unpacked, weight) and torch.equal(kept_bias, bias)
        for count in (2, 5, 6, 9, 17):
            x = torch.randn(count, in_features).bfloat16()
            together = rows(x, count)
            alone = torch.cat([rows(x[i : i + 1], 1) for i in range(count)])
            assert torch.equal(together, alone), (in_features, count)
            exact = x.float() @ weight.float().T + bias
            assert ((together.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all(), (in_features, count)


def test_a_machine_whose_amx_tiles_fail_builds_the_kernel_without_them(tmp_path, monkeypatch):
    """llama.cpp's AMX kernels died on Xeons with AMX seen here: before the kernel is built to use the tiles, a probe
    runs them in a process of its own, once per CPU (its answer kept in the cache folder). A probe that dies leaves
    the tiles out of the build (-DNO_AMX); one that passes keeps them; a CPU without AMX runs no probe."""
    from engine.models import cpuinfo, native

    own_kernel()
    real = cpuinfo.field
    monkeypatch.setenv("SPECARENA_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECARENA_AMX", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(cpuinfo, "field", lambda name: real(name).replace("amx_bf16", "") if name == "flags" else
                        real(name))  # fmt: skip
    assert not native.amx_works() and not (tmp_path / "kernels").exists()  # no AMX: nothing probed
    monkeypatch.setattr(cpuinfo, "field", lambda name: real(name) + " amx_bf16" if name == "flags" else real(name))
    for source, works in (("int main() { __builtin_trap(); }", False), ("int main() { return 0; }", True)):
        probe = tmp_path / f"probe-{works}.cpp"
        probe.write_text(source + "\n")
        monkeypatch.setattr(native, "PROBE", probe)
        monkeypatch.setattr(native, "_loaded", {})
        assert native.amx_works() is works and ("-DNO_AMX" in native.flags()) is not works
        monkeypatch.setattr(native, "_loaded", {})  # recalled from the cache folder, not probed again
        with monkeypatch.context() as no_probe:
            no_probe.setattr(native.subprocess, "run", lambda *args, **kwargs: pytest.fail("probed again"))
            assert native.amx_works() is works


def avx2_build(tmp_path, monkeypatch):
    """Our kernel as a CPU with AVX2 and no AVX512 builds it (8 lanes, 16 vector registers): built here with
    -mno-avx512f, into a cache of the test's own, and the library this process uses for the rest of the test."""
    from engine.models import native
    from engine.models.cpu import cpu_flags, cpu_id

    own_kernel()
    if "avx2" not in cpu_flags():
        pytest.skip("the CPU has no AVX2")
    wrapper = tmp_path / "c++"
    wrapper.write_text(f'#!/bin/sh\nexec {native.compiler()} "$@" -mno-avx512f\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("SPECARENA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    lib = native.library(cpu_id())
    assert lib is not None and lib.rows_lanes() == 8, native.status()
    return lib


def test_the_kernel_built_for_avx2_rounds_verify_passes_like_one_token_passes(tmp_path, monkeypatch):
    """The kernel as a CPU with AVX2 and no AVX512 builds it (8 lanes, 16 vector registers), built here with
    -mno-avx512f: k rows give the bits of k one-token passes, in float32 and bfloat16. Left to -ffp-contract, GCC fused
    the multiply-add for some row counts and not others in this build, so every verify row differed there."""
    from engine.models import native

    lib = avx2_build(tmp_path, monkeypatch)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for out_features, in_features in ((80, 48), (5, 3), (200, 576)):
            rows = native.Rows(torch.randn(out_features, in_features).to(dtype), torch.randn(out_features), lib)
            x = torch.randn(9, in_features).to(dtype)
            alone = torch.cat([rows(x[i : i + 1], 1) for i in range(9)])
            for count in range(2, 10):
                assert torch.equal(rows(x[:count], count), alone[:count]), (dtype, in_features, count)
            lib.rows_prefetch(0, 0)  # the same products on the hardware prefetchers alone: the same bits
            for count in range(1, 10):
                assert torch.equal(rows(x[:count], count), alone[:count]), (dtype, in_features, count)
            lib.rows_prefetch(native.prefetch_bits(native.prefetching()["float32"]),
                              native.prefetch_bits(native.prefetching()["bfloat16"]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_products_prefetched_or_not_give_the_same_bits(dtype):
    """Whether a product prefetches its weight's lines (chosen per CPU and row count at the kernel's first load:
    native.choose_prefetch) changes what memory is asked for ahead, not the sums: every row count, each choice, and one
    that differs between a one-token pass and a verify pass (as on the AVX2 EPYC in float32), gives the same bits."""
    from engine.models import native
    from engine.models.cpu import cpu_id

    own_kernel()
    lib = native.library(cpu_id())
    chosen = native.prefetching()
    assert set(chosen) == {"float32", "bfloat16"}
    assert all(len(on) == len(native.PREFETCH_ROWS) for on in chosen.values())
    torch.manual_seed(0)
    try:
        for out_features, in_features in ((80, 48), (1000, 37), (576, 1536)):
            rows = native.Rows(torch.randn(out_features, in_features).to(dtype), torch.randn(out_features), lib)
            x = torch.randn(17, in_features).to(dtype)
            outputs = []
            for bits in ((1 << 32) - 1, 0, native.prefetch_bits([False] + [True] * 7), 0b1010101):
                lib.rows_prefetch(bits, bits)
                outputs.append([rows(x[:count], count) for count in range(1, 18)])
                alone = torch.cat([rows(x[i : i + 1], 1) for i in range(17)])
                assert all(torch.equal(out, alone[: len(out)]) for out in outputs[-1]), bits
            assert all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other))
    finally:
        lib.rows_prefetch(native.prefetch_bits(chosen["float32"]), native.prefetch_bits(chosen["bfloat16"]))


def test_the_prefetch_choice_is_measured_once_per_cpu_recalled_and_can_be_forced(tmp_path, monkeypatch):
    """Software prefetches speed one product and slow another, by CPU and row count (on the AVX2 EPYC a float32
    one-token pass ran 10-14% faster without them, its verify passes and every bfloat16 pass slower): each size is
    timed with and without in turns, prefetching is left out only where that saved PREFETCH_GAIN in the timing and in
    a second look at those sizes, the choice is kept in the cache folder per CPU, thread count and build and recalled,
    and SPECARENA_PREFETCH_ROWS=0/1 forces it. The words say where the hardware prefetches alone (the page's
    "measured with" line)."""
    from engine.models import native

    monkeypatch.setenv("SPECARENA_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECARENA_PREFETCH_ROWS", raising=False)
    sizes = native.PREFETCH_ROWS
    timed = []

    def fake_times(lib, asked=sizes):  # float32: 1 row 20% faster without, 2 rows 1% (noise), 4 rows 10% in the first
        # look only (a fluke), the rest slower; bfloat16 slower
        timed.append((lib, asked))
        off = {1: 0.8, 2: 0.99, 4: 0.9 if len(timed) % 2 else 1.0} | {n: 1.1 for n in sizes if n not in (1, 2, 4)}
        return {"float32": {True: dict.fromkeys(asked, 1.0), False: {n: off[n] for n in asked}},
                "bfloat16": {True: dict.fromkeys(asked, 1.0), False: dict.fromkeys(asked, 1.2)}}  # fmt: skip

    monkeypatch.setattr(native, "time_prefetch", fake_times)
    first = native.choose_prefetch("lib", "cpu A|2 threads|rows-1")
    assert first["float32"] == [False] + [True] * (len(sizes) - 1) and first["bfloat16"] == [True] * len(sizes)
    assert first["measured"]["float32"][False][1] == 0.8 and timed == [("lib", sizes), ("lib", (1, 4))]
    assert first["measured"]["again"]["float32"][False] == {1: 0.8, 4: 1.0}
    again = native.choose_prefetch("lib", "cpu A|2 threads|rows-1")  # recalled from the cache folder: not timed
    assert again == {name: first[name] for name in ("float32", "bfloat16")} and len(timed) == 2
    assert (tmp_path / "prefetch.json").is_file()
    native.choose_prefetch("lib", "cpu A|1 threads|rows-1")  # another thread count (or CPU, or build): timed
    assert len(timed) == 4
    for forced in ("0", "1"):
        monkeypatch.setenv("SPECARENA_PREFETCH_ROWS", forced)
        assert native.choose_prefetch("lib", "cpu B") == {"float32": [forced == "1"] * len(sizes),
                                                          "bfloat16": [forced == "1"] * len(sizes)}  # fmt: skip
    assert len(timed) == 4
    # the kernel's bits: bit r - 1 for r rows, the last size's answer for every larger one
    assert native.prefetch_bits([False] + [True] * 7) == (1 << 32) - 2
    assert native.prefetch_bits([True] * 7 + [False]) == 0x7F and native.prefetch_bits([False] * 8) == 0
    words = {(False,) + (True,) * 7: "float32 products of 1 row leave prefetching to the hardware",
             (False, False) + (True,) * 5 + (False,): "float32 products of 1-2, 8 or more rows leave prefetching to "
             "the hardware", (False,) * 8: "every float32 product leaves prefetching to the hardware", (True,) * 8: ""}
    for on, said in words.items():
        monkeypatch.setitem(native._loaded, "prefetch", {"float32": list(on), "bfloat16": [True] * 8})
        assert native.prefetch_words(torch.float32) == said and native.prefetch_words(torch.bfloat16) == ""


def test_tiles_are_as_wide_as_the_registers_hold_a_verify_pass_and_share_out_evenly():
    """native.tile_blocks: tiles of 4 vectors where a layer has many outputs on AVX512 (32 registers hold 6 rows' sums
    of one), at most 2 on AVX2 (16 registers hold 3 rows' sums of a 4-vector tile, 5 of a 2-vector one: a 5-row
    verify pass read each weight twice), and narrower where the tiles would not share out evenly among the threads."""
    from engine.models.native import tile_blocks

    assert [tile_blocks(n, 16, 2) for n in (49152, 1536, 960, 576, 192, 64)] == [4, 4, 2, 2, 1, 1]
    assert [tile_blocks(n, 16, 1) for n in (49152, 960, 576, 192)] == [4, 4, 4, 1]  # one thread: nothing to share
    assert [tile_blocks(n, 8, 2) for n in (49152, 1536, 960, 576, 192, 64)] == [2, 2, 2, 2, 2, 1]
    assert all(tile_blocks(n, 8, threads) <= 2 for n in range(8, 60000, 97) for threads in (1, 2, 4))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_layers_joined_in_one_call_of_our_kernel_give_each_layers_own_bits(bias, dtype):
    """q/k/v (and gate/up) made one call by the lean pass: each member's output equal to the bit to the member run
    alone, at every row count, with no second copy of the weights; a pass size that runs another form is not joined."""
    from engine.models.cpu import CpuLinear, join

    own_kernel()
    torch.manual_seed(0)
    # whole tiles but the last; joined, wide enough for bfloat16's tiles read in pairs (engine.models.native)
    linears = [torch.nn.Linear(96, n, bias=bias).to(dtype) for n in (256, 128, 100)]
    layers = [CpuLinear(linear, ("stock", "own")) for linear in linears]
    for layer in layers:
        layer.keep_only(("own",))
    alone_first = [layer(torch.ones(1, 96, dtype=dtype)) for layer in layers]
    joined = join(layers)
    assert joined is not None
    base = layers[0].weights["own"].untyped_storage().data_ptr()
    assert all(layer.weights["own"].untyped_storage().data_ptr() == base for layer in layers)  # views of one weight
    with torch.inference_mode():
        for rows in (1, 2, 5, 9):
            x = torch.randn(1, rows, 96, dtype=dtype)
            together = joined(x)
            for layer, linear, out in zip(layers, linears, together):
                assert torch.equal(out, layer(x))
                exact = torch.nn.functional.linear(x.float(), linear.weight.float(), None if not bias else
                                                   linear.bias.float())  # fmt: skip
                torch.testing.assert_close(out.float(), exact, rtol=2**-7 if dtype == torch.bfloat16 else 1e-4,
                                           atol=1e-4)  # fmt: skip
    assert all(torch.equal(layer(torch.ones(1, 96, dtype=dtype)), first) for layer, first in zip(layers, alone_first))
    for layer in layers:
        layer.use(("stock", "own", "stock"))  # 2 rows and more in another form: the joined call stands aside
    assert joined(torch.randn(1, 1, 96, dtype=dtype)) is not None and joined(torch.randn(1, 3, 96, dtype=dtype)) is None
    assert join([layers[0], torch.nn.Linear(96, 8)]) is None


def test_passes_run_padded_only_where_a_larger_pass_is_clearly_cheaper():
    """Measured on an AMD EPYC (AVX512): two rows 45 ms, three to five 40 ms; 1-row at 38.7 against 37.6
    for three rows is within the noise, so it stays."""
    from engine.models.cpu import PAD_GAIN, _confirmed, _pad_table, describe

    times = {1: 38.7, 2: 45.0, 3: 40.0, 4: 42.0, 5: 39.5, 6: 42.0, 7: 44.0}
    assert _pad_table(times) == (0, 1, 5, 3, 5, 5, 6, 7)
    assert _pad_table({n: 40.0 + n for n in range(1, 8)}) == ()  # rising costs: nothing padded
    assert _pad_table({1: 40.0, 2: 40.0 * (1 - PAD_GAIN / 2), 3: 41.0}) == ()  # within the noise margin
    # a second timing keeps the padding it agrees with, and only that
    assert _confirmed((0, 1, 5, 3, 5, 5, 6, 7), {2: 45.0, 4: 41.0, 5: 39.5}) == (0, 1, 5, 3, 4, 5, 6, 7)
    assert _confirmed((0, 1, 5, 3, 5, 5), {2: 40.0, 4: 40.0, 5: 39.5}) == ()
    assert describe(("packed",), (0, 1, 5, 3, 5, 5)) == (
        "oneDNN-packed for every pass; passes of 2 as 5, 4 as 5 rows (cheaper)"
    )
    assert describe(("stock",) * 4 + ("transposed",) * 5 + ("packed",) * 9) == (
        "stock nn.Linear for 1-3 rows, transposed weights for 4-8 rows, oneDNN-packed from 9"
    )
    assert describe(("stock", "packed", "stock")) == "oneDNN-packed for 1 row, stock nn.Linear from 2"


def test_linear_forms_follow_the_measurements_and_are_measured_once(llama_pair, tmp_path, monkeypatch):
    from engine.models import cpu

    monkeypatch.setenv("SPECARENA_CPU_PACK", "auto")
    # as measured on the AMX Xeon (ms, best of 5): stock best for 1-3 rows, transposed from 4, packed close
    stock = {1: 34.8, 2: 38.3, 3: 41.0, 4: 53.4, 5: 55.4, 6: 56.5}
    transposed = {1: 33.9, 2: 41.8, 3: 43.6, 4: 47.8, 5: 49.0, 6: 50.4}
    packed = {1: 44.0, 2: 47.9, 3: 49.9, 4: 51.4, 5: 52.5, 6: 53.0}
    times = {"stock": stock, "transposed": transposed, "packed": packed}
    assert cpu._choose(times) == ("stock",) * 4 + ("transposed",) * 3  # 1 row: 2.6% faster is inside the noise
    # the fastest form serves a size, where it clears the margin; a win inside the margin is no win
    assert cpu._choose(times | {"packed": dict.fromkeys(stock, 1.0)}) == ("stock",) + ("packed",) * 6
    margin = {n: t * (1 - cpu.FORM_GAIN / 2) for n, t in stock.items()}
    assert cpu._choose({"stock": stock, "transposed": margin, "packed": margin}) == ("stock",) * 7
    import copy

    model = copy.deepcopy(llama_pair[0])
    file, said = tmp_path / "forms.json", []
    assert cpu.fitting_forms(model) == cpu.available()
    # OpenBLAS's own spinning thread pool is never timed in turns with our kernel, only in its stead (or in roofline)
    assert ("blas" in cpu.available()) != ("own" in cpu.available()) and "blas" in cpu.measurable()
    first = cpu.choose_forms(model, "tiny|float32", file, said.append)
    assert said and "timing" in said[0]
    measured = first["measured"]
    assert measured is not None and set(measured) == {f"{form}_s" for form in cpu.available()} | {"shapes_s"}
    assert all(set(measured[f"{form}_s"]) == set(range(1, cpu.PAD_ROWS + 1)) for form in cpu.available())
    shapes = {layer.shape for layer in first["layers"]}
    assert set(measured["shapes_s"]) == shapes and "384x64" in shapes  # each weight shape timed alone, the LM head's
    assert len(first["table"]) == cpu.PAD_ROWS + 1 and set(first["groups"]) <= shapes
    assert first["linear_forms"] == cpu.describe(first["table"], first["pad"], first["groups"])

    def own_table(layer, chosen):
        return chosen["groups"].get(layer.shape, chosen["table"])

    assert first["layers"] and all(layer.table == own_table(layer, first) for layer in first["layers"])
    assert all(set(layer.weights) == cpu.used(layer.table) for layer in first["layers"])  # forms no pass uses: freed
    # recalled, with a shape that runs its own forms: its layers take them, the others the table
    entry = json.loads(file.read_text())
    [key] = entry
    entry[key]["groups"] = {"384x64": ["stock"] + ["packed"] * cpu.PAD_ROWS}
    file.write_text(json.dumps(entry))
    again, said = copy.deepcopy(llama_pair[0]), []
    second = cpu.choose_forms(again, "tiny|float32", file, said.append)
    assert second["measured"] is None and second["table"] == first["table"] and not said  # recalled, not re-measured
    assert second["pad"] == first["pad"] and set(second["groups"]) == {"384x64"}
    layers = second["layers"]
    assert layers and all(layer.table == own_table(layer, second) and layer.pad == first["pad"] for layer in layers)
    assert again.lm_head.table[1:] == ("packed",) * cpu.PAD_ROWS and set(again.lm_head.weights) == {"packed"}
    assert all(set(layer.weights) == cpu.used(layer.table) for layer in layers)  # only the forms used were made
    monkeypatch.setenv("SPECARENA_CPU_PACK", "0")
    plain = copy.deepcopy(llama_pair[0])
    assert cpu.choose_forms(plain, "tiny|float32", file)["layers"] == [] and cpu.fitting_forms(plain) == ()
    assert type(plain.lm_head) is torch.nn.Linear


def test_weight_shapes_take_their_own_form_only_where_whole_passes_agree():
    """As measured on the AMX Xeon (ms, the 30 layers' or the LM head's products alone): stock layers serve every
    pass of 1-6 rows, yet from 4 rows the LM head runs far faster packed, and 576x576 transposed; 1536x576 packed
    at 4 rows saves less than the margin. Whole passes then keep the shapes' forms only where they beat the table."""
    from engine.models import cpu

    table = ("stock",) * 7
    times = {
        "49152x576": {"stock": {1: 4.0, 3: 4.4, 4: 7.8, 5: 8.4}, "transposed": {1: 3.9, 3: 6.3, 4: 6.9, 5: 7.6},
                      "packed": {1: 4.3, 3: 4.9, 4: 5.0, 5: 5.1}},
        "576x576": {"stock": {1: 3.6, 3: 3.8, 4: 5.7, 5: 5.9}, "transposed": {1: 3.6, 3: 4.8, 4: 5.1, 5: 5.7},
                    "packed": {1: 6.0, 3: 5.4, 4: 5.7, 5: 6.1}},
        "1536x576": {"stock": {1: 8.1, 3: 10.8, 4: 12.2, 5: 12.9}, "transposed": {1: 8.0, 3: 13.5, 4: 15.0, 5: 16.4},
                     "packed": {1: 10.7, 3: 11.2, 4: 12.4, 5: 12.6}},
    }  # fmt: skip
    groups = cpu._choose_shapes(times, table)
    assert groups == {"49152x576": ("stock",) * 4 + ("packed",) * 2 + ("stock",),
                      "576x576": ("stock",) * 4 + ("transposed",) + ("stock",) * 2}  # fmt: skip
    # whole passes: the shapes' forms save 7% at 4 rows, 1% at 5 (inside GROUP_GAIN): only 4 keeps them
    whole = {"table": {4: 40.0, 5: 41.0}, "own": {4: 37.2, 5: 40.6}}
    kept = cpu._kept_shapes(groups, table, whole)
    assert kept == {"49152x576": ("stock",) * 4 + ("packed",) + ("stock",) * 2,
                    "576x576": ("stock",) * 4 + ("transposed",) + ("stock",) * 2}  # fmt: skip
    assert cpu._kept_shapes(groups, table, {"table": {4: 40.0, 5: 41.0}, "own": {4: 39.9, 5: 41.5}}) == {}
    assert cpu.describe(table, (), kept) == (
        "stock nn.Linear for every pass; 2 weight shapes run a form of their own at 4 rows"
    )


def test_cpu_key_tells_apart_machines_of_one_name(monkeypatch):
    """Two machines here were both "AMD EPYC": one AVX2, one AVX512. What is measured or compiled for one
    (linear forms, a -march=native llama-server) must not be reused on the other."""
    from engine.backends import llamacpp
    from engine.models import cpu, cpuinfo

    info = {"model name": "AMD EPYC", "flags": "fpu sse2 avx2 fma"}
    monkeypatch.setattr(cpuinfo, "field", lambda name: info[name])
    avx2_key, avx2_binary, avx2_name = cpu.cpu_id(), llamacpp.cached_binary(), cpu.cpu_name()
    info["flags"] += " avx512f avx512_bf16"
    assert cpu.cpu_id() != avx2_key and llamacpp.cached_binary() != avx2_binary
    assert (avx2_name, cpu.cpu_name()) == ("AMD EPYC (AVX2)", "AMD EPYC (AVX512, BF16)")


def test_compiled_decoding_is_lossless(llama_pair):
    """The compiled path (static KV cache, passes padded up to a bucket, the padding cropped) gives the plain
    model's ids, for prefills short and long, the baseline, a draft model and self-sized prompt lookup drafts
    of many lengths. Dynamo traces it with the eager backend: inductor and CUDA graphs need a GPU."""
    import copy

    from transformers import StaticCache

    from engine.decoding.runtime import compile_decoding

    plain, _, tok = llama_pair
    target, draft = copy.deepcopy(plain), copy.deepcopy(llama_pair[1])
    for model in (target, draft):
        compile_decoding(model, backend="eager", mode=None)
    assert isinstance(new_cache(target, 8), StaticCache)
    target.static_caches.clear()  # start the runs below from no cache
    costs = [1.0 + 0.01 * k for k in range(17)]  # cheap passes: drafts of many lengths
    for text in (PROMPTS[0], PROMPTS[0] * 3):  # prefill inside the largest bucket, and beyond it (eager)
        ids = prompt_ids(tok, text)
        expected = run_baseline(plain, tok, ids, 40).token_ids
        assert run_baseline(target, tok, ids, 40).token_ids == expected
        assert run_spec(target, tok, ids, DraftModel(draft, 384, len(ids) + 40 + 16), 5, 40).token_ids == expected
        sized = run_spec(target, tok, ids, PromptLookup(costs=costs), 16, 40)
        assert sized.token_ids == expected
    assert len({len(s.drafted) for s in sized.steps if s.drafted}) > 1
    # one static cache per role, reset between runs, allocated by an eager pass so CUDA graphs may keep it
    assert set(target.static_caches) == {"run"} and set(draft.static_caches) == {"draft"}
    size, cache = target.static_caches["run"]
    assert size >= len(prompt_ids(tok, PROMPTS[0] * 3)) + 40 and size & (size - 1) == 0
    assert all(layer.keys._dynamo_static_input_type for layer in cache.layers)
    assert new_cache(target, 8) is cache and cache.get_seq_length() == 0
    assert new_cache(target, 8, role="measure") is not cache
    assert new_cache(target, 4 * size) is not cache


def test_confidence_stop_and_shortest_draft_stay_lossless_and_say_why(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    expected = run_baseline(target, tok, ids, 40).token_ids
    with torch.inference_mode():
        steps = list(speculative_decode(target, tok, ids, DraftModel(draft, 384, gamma=6, p_min=0.06), GREEDY, 40,
                                        {EOS}))  # fmt: skip
    assert summarise("s", steps, "").token_ids == expected
    stopped = [s for s in steps[1:] if s.draft_note]
    assert stopped and all("confidence stop" in s.draft_note for s in stopped)
    assert all(len(s.drafted) < 6 for s in stopped)  # the note is on the steps whose draft it cut
    assert any(len(s.drafted) == 6 for s in steps[1:] if not s.draft_note)  # confident drafts run to gamma
    lookup = PromptLookup(max_ngram=3, gamma=4)
    lookup.min_tokens = 3
    with torch.inference_mode():
        steps = list(speculative_decode(target, tok, ids, lookup, GREEDY, 40, {EOS}))
    assert summarise("s", steps, "").token_ids == expected
    assert all(len(s.drafted) in (0, 3, 4) for s in steps[1:])
    assert any("dropped" in s.draft_note for s in steps[1:])


def _trie(node) -> dict:
    return {t: (c.count, _trie(c)) for t, c in node.children.items()}


def test_suffix_memory_counts_windows_forgets_the_same_prompt_and_drops_the_oldest():
    from engine.decoding.suffix import DEPTH, SuffixMemory

    memory = SuffixMemory(cap=1000)
    first = memory.begin((1,), [1, 5, 6, 7, 8])
    assert memory.continuation([9, 5, 6], 8) == ([7, 8], 2)  # the longest known suffix, then what followed it
    assert memory.continuation([9, 6], 8) == ([7], 1)  # at most as long as the match
    assert memory.continuation([9, 6], 8, by_match=False) == ([7, 8], 1)
    assert memory.continuation([2, 3], 8) == ([], 0)
    memory.extend(first, [5, 6, 9])
    memory.begin((2,), [2, 5, 6, 9])  # "5 6" went on with 9 twice and with 7 once
    assert memory.continuation([4, 5, 6], 8) == ([9], 2)
    clean = SuffixMemory(cap=1000)
    clean.begin((2,), [2, 5, 6, 9])
    memory.begin((1,), [1, 3])  # a new run of prompt 1: its earlier text is forgotten, prompt 2's is kept
    clean.begin((1,), [1, 3])
    assert _trie(memory.root) == _trie(clean.root) and len(memory) == len(clean) == 6
    small = SuffixMemory(cap=10)
    for key in range(4):
        small.begin((key,), [key] * 4)
    assert [k for k, _ in small.texts.values()] == [(2,), (3,)] and len(small) == 8  # oldest dropped
    long = SuffixMemory()
    long.begin((0,), list(range(100)))
    assert max(_depth(long.root), 0) == DEPTH


def _depth(node) -> int:
    return 1 + max((_depth(c) for c in node.children.values()), default=-1) if node.children else 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_suffix_drafts_from_earlier_runs_and_stays_lossless(llama_pair, adaptive):
    from engine.decoding.suffix import SuffixDrafter, SuffixMemory

    target, _, tok = llama_pair
    memory = SuffixMemory()
    costs = [1.0 + 0.1 * k for k in range(17)] if adaptive else None
    accepted, first = [], prompt_ids(tok, PROMPTS[0])
    # the last prompt is the first one with the start of its answer: the rest of that answer is in memory
    for ids in [prompt_ids(tok, text) for text in PROMPTS] + [first + run_baseline(target, tok, first, 5).token_ids]:
        expected = run_baseline(target, tok, ids, 40, eos=()).token_ids
        result = run_spec(target, tok, ids, SuffixDrafter(memory, 6, costs), 6, 40, eos=())
        assert result.token_ids == expected
        accepted.append(result.metrics.accepted_tokens)
    assert accepted[-1] > 2 * accepted[0] and len(memory.texts) == 4


def test_a_draft_with_another_tokenizer_drafts_through_text_and_stays_lossless(model_dirs):
    """The pair of the fixtures with different tokenizers (bytes vs words): no longer refused."""
    from engine.compare import compare
    from engine.settings import Settings

    s = Settings(target=model_dirs["target"], drafter="draft-model", draft=model_dirs["other-vocab"], gamma=3,
                 max_new_tokens=24, seed=0, warmup=False)  # fmt: skip
    c = compare(s, "w1 w2 w3 w1 w2")
    assert c.identical is True and c.speculative.metrics.drafted_tokens > 0
    notes = [x.draft_note for x in c.speculative.steps[1:]]
    assert all(n.startswith("the draft's own tokens: ") for n in notes[:-1]), notes  # shown on hover
    assert any(x.accepted == 0 < len(x.drafted) for x in c.speculative.steps[1:])  # drafts that missed


def test_every_torch_pass_of_a_comparison_runs_on_the_engine_thread(model_dirs):
    """Loading (with its timed passes), warm-up, both runs and the drafter's passes, asked for from other threads
    as a web server does: one OpenMP team for all of it (engine.worker)."""
    import threading

    from engine.compare import stream_compare
    from engine.models.loading import MODELS
    from engine.settings import Settings
    from engine.worker import ENGINE

    MODELS.clear()
    seen: set[str] = set()
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.add(threading.current_thread().name)
    )
    s = Settings(target=model_dirs["target"], drafter="draft-model", draft=model_dirs["draft"], max_new_tokens=12,
                 seed=0, adaptive=True)  # fmt: skip
    events = stream_compare(s, "the same prompt twice: the same prompt")
    try:
        while True:  # each event asked for from a new thread, as a server's worker pool may
            box = {}
            worker = threading.Thread(target=lambda: box.setdefault("event", next(events, None)))
            worker.start()
            worker.join()
            if box["event"] is None:
                break
    finally:
        hook.remove()
    assert seen == {ENGINE.name}


def test_a_compiled_pair_compiles_what_its_runs_need_in_the_warm_up_and_says_so(model_dirs):
    """Every pass size the timed runs make is compiled (and on a GPU recorded) before they start, on the caches
    they use, each step reported with its time; the timed runs then compile nothing. The eager backend stands in
    for inductor and CUDA graphs, which need a GPU."""
    from engine.backends.transformers import Pair, Transformers
    from engine.compare import result_of, run, warm_up
    from engine.decoding.runtime import compile_decoding
    from engine.events import Status
    from engine.models.loading import MODELS
    from engine.settings import Settings

    for strict, expected in (("off", {1, 2, 4, 8}), ("on", {8})):
        MODELS.clear()
        s = Settings(target=model_dirs["target"], drafter="draft-model", draft=model_dirs["draft"], gamma=4,
                     max_new_tokens=24, strict=strict, seed=0)  # fmt: skip
        backend = Transformers()
        target, draft = MODELS.get(s.target), MODELS.get(s.draft)
        for loaded in (target, draft):
            compile_decoding(loaded.model, backend="eager", mode=None)
        backend.pair = Pair(target, draft)
        ids = backend.encode("a prompt, a prompt", s)
        said = [e.message for e in warm_up(backend, ids, s) if isinstance(e, Status)]
        assert any("compiling the target's passes" in m for m in said)
        compiled = {m.split("'s ")[1].split("-token")[0] for m in said if m.startswith("compiled the target")}
        assert {int(n) for n in compiled} == expected  # strict: one width, one graph (gamma 4: 5 rows, bucket 8)
        before = {name: dict(m.model.compiled_step.first) for name, m in (("t", target), ("d", draft))}
        base = result_of(run("baseline", backend.baseline(ids, s), backend.decode))
        spec = result_of(run("speculative", backend.speculative(ids, s, []), backend.decode))
        assert base.token_ids == spec.token_ids
        assert {name: dict(m.model.compiled_step.first) for name, m in (("t", target), ("d", draft))} == before
    MODELS.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_weight_of_2_mb_or_more_lies_on_huge_pages_and_gives_the_same_bits(monkeypatch, dtype):
    """Our kernel streams each packed weight once a pass, and the hardware prefetchers stop at every 4 KB page: a
    weight of one 2 MB page or more is copied to 2 MB-aligned memory that Linux is asked to back with huge pages
    (native.on_huge_pages; SPECARENA_HUGE_PAGES=0 leaves it where torch put it). The values and the products' bits are
    the same either way; a smaller weight stays where it was."""
    import mmap

    from engine.models import native
    from engine.models.cpu import cpu_id

    own_kernel()
    lib = native.library(cpu_id())
    weight, x = torch.randn(2048, 576).to(dtype), torch.randn(5, 576).to(dtype)  # 4.5 / 2.25 MB
    moved = native.Rows(weight, None, lib)
    monkeypatch.setenv("SPECARENA_HUGE_PAGES", "0")
    kept = native.Rows(weight, None, lib)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        assert moved.weight.data_ptr() % native.HUGE == 0
    assert torch.equal(moved.weight, kept.weight) and moved.weight.is_contiguous()
    assert torch.equal(moved(x, 5), kept(x, 5)) and torch.equal(moved(x[:1], 1), kept(x[:1], 1))
    assert torch.equal(torch.cat([moved(x[i : i + 1], 1) for i in range(5)]), moved(x, 5))  # rows round alike
    monkeypatch.delenv("SPECARENA_HUGE_PAGES")
    small = torch.randn(64, 576).to(dtype)
    assert native.on_huge_pages(small) is small


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_settle_lays_small_packed_weights_one_after_another_on_huge_pages_with_the_same_bits(monkeypatch, dtype):
    """A weight under 2 MB gets no huge page of its own: native.settle copies a model's packed weights one after
    another into 2 MB-aligned stretches and points each tensor at its copy in place, so a joined weight's members
    (views of it, which a Stack is not given) and the CpuLinear forms holding the same tensor follow. Values and
    products' bits are unchanged; with SPECARENA_HUGE_PAGES=0, or under 2 MB in all, nothing moves."""
    import mmap

    from engine.models import native
    from engine.models.cpu import cpu_id

    own_kernel()
    lib = native.library(cpu_id())
    torch.manual_seed(0)
    weights = [torch.randn(out, 576).to(dtype) for out in (576, 192, 192, 576, 1536, 1536)]  # q, k, v, o, gate, up
    packed = [native.Rows(w, None, lib) for w in weights]
    qkv, gate_up = native.join(packed[:3]), native.join(packed[4:])
    x = torch.randn(5, 576).to(dtype)
    before = [rows(x, 5) for rows in (*packed, qkv, gate_up)] + [qkv(x[:1], 1)]
    member = packed[1].weight  # a view of the joined q/k/v weight, as a CpuLinear's "own" form holds it

    monkeypatch.setenv("SPECARENA_HUGE_PAGES", "0")
    ptrs = [rows.weight.data_ptr() for rows in (*packed, qkv, gate_up)]
    assert native.settle([*packed, qkv, gate_up]) == 0
    assert [rows.weight.data_ptr() for rows in (*packed, qkv, gate_up)] == ptrs
    monkeypatch.delenv("SPECARENA_HUGE_PAGES")
    tiny = [native.Rows(torch.randn(64, 576).to(dtype), None, lib) for _ in range(2)]  # under 2 MB in all: no page
    ptrs = [rows.weight.data_ptr() for rows in tiny]
    assert native.settle(tiny) == 0 and [rows.weight.data_ptr() for rows in tiny] == ptrs

    moved = native.settle([qkv, packed[3], gate_up])  # as a Stack passes them: the joined weights, not their members
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # off Linux: nothing to lay out
        return
    sizes = [t.numel() * t.element_size() for t in (qkv.weight, packed[3].weight, gate_up.weight)]
    assert moved == sum(sizes)  # each storage once: the members moved with their joined weight
    assert qkv.weight.data_ptr() % native.HUGE == 0  # the first weight opens the stretch, the rest follow it
    assert packed[3].weight.data_ptr() == qkv.weight.data_ptr() + -(-sizes[0] // 64) * 64
    assert member.data_ptr() == qkv.weight.data_ptr() + 576 * 576 * member.element_size()  # still the joined's view
    assert packed[1].weight is member and packed[4].weight.data_ptr() == gate_up.weight.data_ptr()
    after = [rows(x, 5) for rows in (*packed, qkv, gate_up)] + [qkv(x[:1], 1)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(rows.unpacked()[0], w) for rows, w in zip(packed, weights))

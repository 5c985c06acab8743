"""The lean forward pass (engine.decoding.lean) computes what the model's own forward does, to the bit."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.decoding.baseline import baseline_decode
from engine.decoding.drafters import DraftModel, PromptLookup
from engine.decoding.lean import LeanCache, attach, supported
from engine.decoding.metrics import summarise
from engine.decoding.runtime import forward, new_cache
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import speculative_decode
from tests.conftest import EOS, tiny_gpt2, tiny_llama


def tiny_qwen2(seed: int = 0, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, eos_token_id=EOS, pad_token_id=0,
        initializer_range=0.2, **extra,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def lean_copy(model, dtype=torch.float32):
    lean = copy.deepcopy(model).to(dtype)
    assert attach(lean)
    return lean


# prefill, a decode step, a verify pass, a rollback, more passes, and a pass that outgrows the cache
PASSES = [(list(range(40, 104)), 0), ([5], 1), ([6, 7, 8, 9, 10], 0), (-3, 0), ([11], 1), ([12, 13], 0),
          (list(range(200, 260)), 2)]  # fmt: skip


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama-gqa", "qwen2-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lean_logits_equal_the_models_own_to_the_bit(build, dtype):
    own = build().to(dtype)
    lean = lean_copy(own, dtype)
    with torch.inference_mode():
        theirs, ours = new_cache(own), new_cache(lean, 60)
        assert type(ours) is LeanCache and ours.capacity < 100  # the last pass makes it grow
        for ids, keep in PASSES:
            if isinstance(ids, int):
                theirs.crop(ids)
                ours.crop(ids)
                continue
            expected, got = forward(own, ids, theirs, keep=keep), forward(lean, ids, ours, keep=keep)
            assert got.shape == expected.shape and torch.equal(got, expected), (len(ids), dtype)
        assert ours.get_seq_length() == theirs.get_seq_length()


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama-gqa", "qwen2-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_projections_joined_in_one_call_give_the_same_logits_to_the_bit(build, dtype):
    """Where a layer's linears run our kernel (engine.models.native) and the layers run in torch operations (the fused
    pass off: tests/test_fused.py has it), the lean pass calls q/k/v and gate/up as one each: every pass's logits
    equal those of the same layers called one by one."""
    from engine.models.cpu import join, wrap_linears
    from tests.test_engine import own_kernel

    own_kernel()
    lean = lean_copy(build(), dtype)
    for layer in wrap_linears(lean, ("stock", "own")):
        layer.keep_only(("own",))
    assert lean.lean.join(join) == lean.config.num_hidden_layers
    lean.lean.stack = None
    with torch.inference_mode():
        joined, apart = new_cache(lean, 60), new_cache(lean, 60)
        for ids, keep in PASSES:
            if isinstance(ids, int):
                joined.crop(ids)
                apart.crop(ids)
                continue
            together = forward(lean, ids, joined, keep=keep)
            calls, lean.lean.joined = lean.lean.joined, []
            one_by_one = forward(lean, ids, apart, keep=keep)
            lean.lean.joined = calls
            assert torch.equal(together, one_by_one), len(ids)


@pytest.mark.parametrize("gamma", [1, 4])
def test_lean_speculative_equals_lean_baseline_and_hf_generate(llama_pair, gamma):
    target, draft, tok = llama_pair
    lean_target, lean_draft = lean_copy(target), lean_copy(draft)
    greedy = SamplingConfig()
    for text in ("The quick brown fox jumps over the lazy dog. The quick brown", "abcabcabcabc"):
        ids = tok(text)["input_ids"][:-1]
        expected = target.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=EOS,
                                   pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        expected = expected[0, len(ids) :].tolist()
        with torch.inference_mode():
            base = summarise("baseline", list(baseline_decode(lean_target, tok, ids, greedy, 40, {EOS})), "")
            assert base.token_ids == expected
            for drafter in (DraftModel(lean_draft, 384), PromptLookup(max_ngram=3)):
                drafter.start = gamma
                steps = list(speculative_decode(lean_target, tok, ids, drafter, greedy, 40, {EOS}))
                assert summarise("speculative", steps, "").token_ids == expected, drafter.name


def test_lean_forward_only_where_it_computes_the_same(monkeypatch):
    assert supported(tiny_llama()) and supported(tiny_qwen2())
    assert not supported(tiny_gpt2())  # another architecture
    sliding = tiny_qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert not supported(sliding)  # its mask is not a causal one
    from transformers import LlamaConfig, LlamaForCausalLM

    dynamic = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert not supported(dynamic)  # its rotary frequencies change per pass
    remote = type("LlamaForCausalLM", (type(tiny_llama()),), {"__module__": "transformers_modules.someone.model"})
    assert not supported(remote(tiny_llama().config))  # remote code that only shares the name
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    assert not supported(eager)
    monkeypatch.setenv("SPECARENA_LEAN", "0")
    model = tiny_llama()
    assert not attach(model) and type(new_cache(model)) is not LeanCache


def test_lean_cache_rolls_back_as_dynamic_cache_does():
    cache = LeanCache(tiny_llama(), 8)
    cache.length = 6
    cache.crop(-2)
    assert cache.length == 4
    cache.crop(10)  # longer than it holds: nothing to drop
    assert cache.length == 4
    cache.crop(1)
    assert cache.length == 1
    cache.reset()
    assert cache.get_seq_length() == 0


def test_loaded_models_run_lean_on_cpu_and_say_so(model_dirs):
    from engine.models.loading import ModelCache

    models = ModelCache()
    ours, reference = models.get(model_dirs["target"]), models.get(model_dirs["target"], pack=False)
    assert ours.lean and "lean forward" in ours.describe()
    assert not reference.lean and getattr(reference.model, "lean", None) is None  # what HF users run

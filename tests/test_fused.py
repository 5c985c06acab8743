"""The fused pass (engine.decoding.lean with kernels/layers.cpp): every layer as one call of our kernels. Each row of a
prompt, verify or tree pass rounds exactly like the one-token passes of the baseline (float32 and bfloat16), the
logits are the model's own to float32 rounding (bfloat16: as near float32 as transformers' bfloat16 pass is), and
greedy speculative runs give the baseline's ids and HF generate()'s."""

from __future__ import annotations

import pytest
import torch

from engine.decoding.drafters import DraftModel, PromptLookup
from engine.decoding.runtime import forward, new_cache
from tests.conftest import tiny_llama
from tests.test_engine import PROMPTS, avx2_build, hf_generate, own_kernel, prompt_ids, run_baseline, run_spec
from tests.test_lean import PASSES, lean_copy, tiny_qwen2
from tests.test_tree import PARENTS, TOKENS


def wide_groups():
    """Six query heads to a key/value head: an attention task takes at most 4 heads of a group (kernels/layers.cpp),
    so each group runs as two tasks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=384, hidden_size=384, intermediate_size=128, num_hidden_layers=2, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=1, pad_token_id=0,
        initializer_range=0.08,  # tiny_llama's 0.2 scaled to the wider hidden size: activations of the same size
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


BUILDS = pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2, wide_groups],
                                 ids=["llama-gqa", "qwen2-bias", "llama-6-heads-a-group"])  # fmt: skip
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def fused_copy(model, dtype=torch.float32):
    """A lean copy of `model` whose linears run our kernel only, joined, its layers one call."""
    from engine.models.cpu import join, wrap_linears
    from engine.models.native import Stack

    own_kernel()
    lean = lean_copy(model, dtype)
    for layer in wrap_linears(lean, ("stock", "own")):
        layer.keep_only(("own",))
    assert lean.lean.join(join, Stack) == lean.config.num_hidden_layers and lean.lean.stack is not None
    return lean


def one_by_one(model, context, tokens, layers=()):
    """The logits (and asked-for states) of each token fed alone after `context`: what a baseline computes."""
    cache = new_cache(model, 64)
    forward(model, context, cache)
    outs = [forward(model, [token], cache, layers=layers) for token in tokens]
    if layers:
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    return torch.cat(outs)


@BUILDS
@DTYPES
def test_every_row_of_a_fused_pass_rounds_like_one_token_passes(build, dtype):
    model = fused_copy(build(), dtype)
    context, tokens, layers = list(range(40, 70)), [5, 6, 7, 8, 9, 10], (0, 1, 2)
    with torch.inference_mode():
        alone, alone_states = one_by_one(model, context, tokens, layers)
        # a verify pass of all six rows
        cache = new_cache(model, 64)
        forward(model, context, cache)
        logits, states = forward(model, tokens, cache, layers=layers)
        assert torch.equal(logits, alone) and torch.equal(states, alone_states)
        # a prompt pass: its last rows are those tokens after the context, computed in the same pass
        logits = forward(model, context + tokens, new_cache(model, 64))
        assert torch.equal(logits[len(context) :], alone)
        # a tree pass: each node's row is the last row of its branch fed alone
        cache = new_cache(model, 64)
        forward(model, context, cache)
        tree = forward(model, [5] + TOKENS, cache, tree=PARENTS)
        for node, parent in enumerate(PARENTS):
            path, at = [node], parent
            while at >= 0:
                path.insert(0, at)
                at = PARENTS[at]
            branch = one_by_one(model, context, [5] + [TOKENS[i] for i in path])
            assert torch.equal(tree[node + 1], branch[-1]), node


@DTYPES
def test_the_fused_pass_built_for_avx2_rounds_like_one_token_passes(dtype, tmp_path, monkeypatch):
    """The same on the kernel as an AVX2 CPU (no AVX512) builds it, built here with -mno-avx512f."""
    avx2_build(tmp_path, monkeypatch)
    test_every_row_of_a_fused_pass_rounds_like_one_token_passes(tiny_llama, dtype)


@BUILDS
@DTYPES
def test_a_fused_pass_computes_the_models_own_forward(build, dtype):
    """float32: the model's own logits to float32 rounding. bfloat16: rounding there is coarse, so the fused pass must
    sit as near the float32 model as transformers' own bfloat16 forward does."""
    models = {"float32": build(), "own": build().to(dtype), "fused": fused_copy(build(), dtype)}
    off = {"own": [], "fused": []}  # each pass's mean distance from the float32 model's logits
    with torch.inference_mode():
        caches = {name: new_cache(model, 60) for name, model in models.items()}
        for ids, keep in PASSES:
            if isinstance(ids, int):
                for cache in caches.values():
                    cache.crop(ids)
                continue
            out = {name: forward(model, ids, caches[name], keep=keep).float() for name, model in models.items()}
            if dtype == torch.float32:
                torch.testing.assert_close(out["fused"], out["own"], rtol=1e-4, atol=1e-4)
            for name, distances in off.items():
                distances.append((out[name] - out["float32"]).abs().mean())
    if dtype != torch.float32:
        assert torch.stack(off["fused"]).mean() <= 1.5 * torch.stack(off["own"]).mean()


@DTYPES
@pytest.mark.parametrize("gamma", [1, 4])
def test_fused_speculative_equals_fused_baseline(llama_pair, dtype, gamma):
    """Greedy speculative runs over fused passes give the baseline's ids in both dtypes, and HF generate()'s in
    float32."""
    target, draft, tok = llama_pair
    fused_target, fused_draft = fused_copy(target, dtype), fused_copy(draft, dtype)
    assert fused_target.lean.rounds_alike(17)  # no strict mode needed: every row rounds as a one-token pass
    fused_target.lm_head.use(("own", "own", "stock"))  # the LM head in stock layers from 2 rows: no longer alike
    assert fused_target.lean.rounds_alike(1) and not fused_target.lean.rounds_alike(2)
    fused_target.lm_head.use(("own",))
    for ids in (prompt_ids(tok, text) for text in PROMPTS[:2]):
        base = run_baseline(fused_target, tok, ids, 40).token_ids
        if dtype == torch.float32:
            assert base == hf_generate(target, ids, 40)
        for drafter in (DraftModel(fused_draft, 384), PromptLookup(max_ngram=3)):
            assert run_spec(fused_target, tok, ids, drafter, gamma, 40).token_ids == base, drafter.name


def test_the_fused_pass_runs_only_where_every_product_runs_our_kernel(monkeypatch):
    from engine.models.cpu import join, wrap_linears
    from engine.models.native import Stack

    own_kernel()
    lean = lean_copy(tiny_llama())
    for layer in wrap_linears(lean, ("stock", "own")):
        layer.keep_only(("stock", "own"))
        layer.use(("own", "own", "stock"))  # one row our kernel, two and more stock layers
    lean.lean.join(join, Stack)
    assert lean.lean._fused(1) and not lean.lean._fused(2) and not lean.lean._fused(9)
    assert lean.lean.fused_sizes(4) == [1] and lean.lean.fused_words(17).endswith("for passes of 1 row")
    # strict mode's padding is needed from 2 rows: those passes run stock layers, which round by the rows
    assert lean.lean.rounds_alike(1) and not lean.lean.rounds_alike(2)
    monkeypatch.setenv("SPECARENA_FUSED", "0")
    lean.lean.join(join, Stack)
    assert lean.lean.stack is None and not lean.lean._fused(1)


def fused_head(dtype, kind="eagle3", **flags):
    """A random head of a kind whose layers run fused (EAGLE-3, P-EAGLE, DFlash, DSpark; norm weights random too) of a
    tiny Llama whose linears run our kernel only, given the target's forms: its layers one call of our kernels. The
    same weights, rounded, in either dtype."""
    from engine.models import cpu
    from engine.models.heads import in_target_kernels, random_head

    own_kernel()
    target = tiny_llama()
    head = random_head(target, kind, draft_vocab=200, seed=3, mask_token_id=0 if kind == "eagle3" else 3,
                       block_size=5, **flags)  # fmt: skip
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
    target, head = target.to(dtype), head.to(dtype)
    for layer in cpu.wrap_linears(target, ("stock", "own")):
        layer.keep_only(("own",))
    assert in_target_kernels(head, target) and head.stack is not None and head.fused(1) and head.fused(40)
    return target, head


MANY_FLAGS = {"norm_before_residual": True, "attention_bias": True, "windows": (6,)}
HEAD_FLAGS = pytest.mark.parametrize("flags", [{}, MANY_FLAGS], ids=["plain", "normed-residual-bias-window"])


def head_passes(head, features, tokens, fused: bool = True):
    """An EAGLE-3 head's logits over 24 rows in one pass, then row by row: the first 20 in one pass and the last 4 one
    at a time (features: (24, hidden), already fused by fc)."""
    from engine.decoding.heads import HeadCache

    c, p = head.config, next(head.parameters())
    stack, head.stack = head.stack, head.stack if fused else None
    try:
        with torch.inference_mode():
            whole = head.eagle3(tokens, features, HeadCache(1, c.num_kv_heads, c.head_dim, p.dtype, p.device, 8))[1]
            cache = HeadCache(1, c.num_kv_heads, c.head_dim, p.dtype, p.device, 8)  # grows as the rows come
            parts = [head.eagle3(tokens[:20], features[:20], cache)[1]]
            parts += [head.eagle3(tokens[i : i + 1], features[i : i + 1], cache)[1] for i in range(20, 24)]
    finally:
        head.stack = stack
    return whole, torch.cat(parts)


@DTYPES
@HEAD_FLAGS
def test_a_heads_fused_pass_rounds_every_row_like_a_one_row_pass(dtype, flags):
    """An EAGLE-3 head's layers as one call (Head.join): each row of a pass is the same bits whatever the pass's
    rows, with a sliding window's mask too, so a chain step and the pass over the target's kept rows agree."""
    _, head = fused_head(dtype, **flags)
    torch.manual_seed(5)
    features = torch.randn(24, head.config.hidden_size).to(dtype)
    whole, parts = head_passes(head, features, torch.randint(0, 200, (24,)))
    assert torch.equal(whole, parts)


BLOCKS = pytest.mark.parametrize("flags", [{}, {"causal": (True, False), "windows": (0, 7), "num_layers": 2}],
                                 ids=["non-causal", "causal-then-windowed"])  # fmt: skip


def block_passes(head, features, fused: bool = True):
    """A DFlash head's final states of two blocks: after 20 context rows, then after 4 more (features unfused)."""
    from engine.decoding.heads import HeadCache

    c, p = head.config, next(head.parameters())
    block = torch.tensor([7, 3, 3, 3])
    stack, head.stack = head.stack, head.stack if fused else None
    try:
        with torch.inference_mode():
            cache = HeadCache(c.num_layers, c.num_kv_heads, c.head_dim, p.dtype, p.device, 8)
            return torch.cat([head.dflash(features[:20], block, cache), head.dflash(features[20:], block, cache)])
    finally:
        head.stack = stack


@DTYPES
@BLOCKS
def test_a_dflash_heads_fused_block_computes_its_torch_layers(dtype, flags):
    """A DFlash head's layers as one call: the context rows' keys and values unnormed, Qwen3's per-head q/k norms, a
    block causal or not, windowed or not. float32: its torch layers' states to float32 rounding; bfloat16: as near
    the float32 head as its torch layers in bfloat16 are."""
    flags = dict(flags)  # the parametrized dict is shared between the runs
    layers = flags.pop("num_layers", 1)
    _, head = fused_head(dtype, "dflash", layers=layers, **flags)
    assert head.config.qk_norm and head.config.num_layers == layers
    torch.manual_seed(6)
    features = torch.randn(24, head.config.feature_size)
    ours, theirs = (block_passes(head, features.to(dtype), fused).float() for fused in (True, False))
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    else:
        exact = block_passes(fused_head(torch.float32, "dflash", layers=layers, **flags)[1], features, fused=False)
        assert (ours - exact).abs().mean() <= 1.5 * (theirs - exact).abs().mean()


@DTYPES
@HEAD_FLAGS
def test_a_heads_fused_pass_computes_its_torch_layers(dtype, flags):
    """float32: the head's own layers' logits to float32 rounding. bfloat16: as near the float32 head as its torch
    layers in bfloat16 are."""
    _, head = fused_head(dtype, **flags)
    torch.manual_seed(5)
    features, tokens = torch.randn(24, head.config.hidden_size), torch.randint(0, 200, (24,))
    ours, theirs = (head_passes(head, features.to(dtype), tokens, fused)[0].float() for fused in (True, False))
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    else:
        exact = head_passes(fused_head(torch.float32, **flags)[1], features, tokens, fused=False)[0]
        assert (ours - exact).abs().mean() <= 1.5 * (theirs - exact).abs().mean()


@pytest.mark.parametrize("kind, topk", [("eagle3", 1), ("eagle3", 3), ("peagle", 1), ("dflash", 1), ("dspark", 1)],
                         ids=["eagle3-chain", "eagle3-tree", "peagle", "dflash", "dspark"])  # fmt: skip
def test_a_fused_head_drafts_what_its_torch_layers_draft(llama_pair, kind, topk):
    """EAGLE-3's chain and tree drafts (EAGLE-2's tree: rows at their depth's positions, each seeing its branch),
    P-EAGLE's (every draft in one pass) and DFlash's and DSpark's blocks over the target's features are the same in
    float32 with the layers as one call and in torch operations."""
    from engine.decoding.sampling import SamplingConfig
    from engine.models.heads import drafter_for

    target, head = fused_head(torch.float32, kind)
    ids = prompt_ids(llama_pair[2], PROMPTS[0])
    drafts = {}
    for fused in (True, False):
        stack, head.stack = head.stack, head.stack if fused else None
        drafter = drafter_for(head, target.config.vocab_size, 4, topk=topk)
        with torch.inference_mode():
            _, features = forward(target, ids[:-1], new_cache(target), layers=drafter.layers)
            drafter.see(features)
            draft = drafter.propose(ids, 4, SamplingConfig(temperature=0.0), torch.Generator())
        head.stack = stack
        drafts[fused] = (draft.tokens, getattr(draft, "parents", None))
    assert drafts[True] == drafts[False] and len(drafts[True][0]) >= 4


@DTYPES
def test_a_heads_one_call_reads_rotary_and_its_final_norm_as_its_torch_layers_compute_them(dtype):
    """The one call's cos and sin come from a table of the first positions (grown by doubling, read by slice or by a
    tree's positions): the values `rotary` gives, rotate_half's sign on sin, also past the first table. Its final norm,
    our kernel's, is the head's RMSNorm to float32 rounding, each value of the model's dtype."""
    _, head = fused_head(dtype)
    half = head.config.head_dim // 2
    for start, rows, positions in [(0, 1, None), (37, 5, None), (0, 0, torch.tensor([40, 41, 41, 42, 40])),
                                   (300, 3, None), (0, 0, torch.tensor([700, 3, 511]))]:  # fmt: skip
        cos, sin = head._kernel_rotary(start, rows, dtype, positions)
        want_cos, want_sin = (t[0, 0].float() for t in head.rotary(start, rows, dtype, positions))
        assert torch.equal(cos, want_cos) and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(sin, torch.cat((-want_sin[:, :half], want_sin[:, half:]), -1))
    assert head._table.cos.shape[0] == 1024  # grown twice, by doubling
    x = torch.randn(3, head.config.hidden_size).to(dtype)
    ours = head.stack.norm(x.float().contiguous(), head._final_norm, head.config.rms_norm_eps)
    assert torch.equal(ours, ours.to(dtype).float())  # values of the model's dtype
    torch.testing.assert_close(ours.to(dtype), head.norm(x), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@DTYPES
@pytest.mark.parametrize("flags", [{}, {"norm_output": True, "logit_scale": 0.5, **MANY_FLAGS}],
                         ids=["plain", "normed-output-scaled-window"])  # fmt: skip
def test_a_heads_final_norm_and_lm_head_in_its_layers_call_give_the_bits_of_their_own_calls(dtype, flags):
    """Where the head's LM head runs our kernel, its final norm and LM head run at the end of the layers' one call
    (native.Final): the state fed back and the logits are the bits the norm's and the LM head's own calls give, for a
    pass over many rows and for chain steps; where the LM head runs another form, they are called apart."""
    from engine.decoding.heads import HeadCache

    _, head = fused_head(dtype, **flags)
    c = head.config
    assert head._final(1) is not None and head._final(24) is not None
    torch.manual_seed(5)
    features, tokens = torch.randn(24, c.hidden_size).to(dtype), torch.randint(0, 200, (24,))

    def passes():
        cache = HeadCache(1, c.num_kv_heads, c.head_dim, dtype, torch.device("cpu"), 8)
        with torch.inference_mode():
            out = [head.eagle3(tokens[:20], features[:20], cache)]
            for i in range(20, 24):  # chain steps, each fed the state before it
                out.append(head.eagle3(tokens[i : i + 1], out[-1][0][-1:], cache))
        return out

    together = passes()
    head._final = lambda rows: None  # the norm and the LM head called apart, as before
    try:
        apart = passes()
    finally:
        del head._final
    for (state, logits), (state_apart, logits_apart) in zip(together, apart):
        assert state.dtype == logits.dtype == dtype and logits.shape[-1] == 200
        assert torch.equal(state, state_apart) and torch.equal(logits, logits_apart)
    head.lm_head.form = lambda rows: "stock"  # as if the LM head ran another form here: no final steps in the call
    try:
        assert head._final(1) is None
    finally:
        del head.lm_head.form

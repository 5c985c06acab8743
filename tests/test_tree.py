"""Draft trees (engine.decoding.tree): a tree pass scores every node as a chain along its branch would, the cache keeps
the branch taken as if it had come alone, greedy tree runs give the baseline's and HF generate()'s ids, sampled ones
the target's exact marginals, and the head grows each node's children from the state a chain would give it."""

from __future__ import annotations

import pytest
import torch

from engine.decoding.heads import Eagle3
from engine.decoding.lean import attach
from engine.decoding.runtime import forward, keep_rows, new_cache
from engine.decoding.sampling import SamplingConfig, logits_to_probs, verify_tree
from engine.decoding.tree import ancestry, branch, depths, reindex, select
from engine.errors import UserError
from engine.models.heads import random_head
from engine.settings import Settings
from tests.conftest import tiny_llama
from tests.test_engine import GREEDY, PROMPTS, hf_generate, prompt_ids, run_baseline, run_spec
from tests.test_sampling import sampled_exactly

# a tree of 7 nodes: two children of the root, a chain under the first, a fork under the second
PARENTS = [-1, -1, 0, 2, 1, 1, 4]
TOKENS = [11, 12, 13, 14, 15, 16, 17]


CONTEXT = list(range(20, 40))


def _primed(model, context=CONTEXT):
    """A cache holding `context`, the pass that verifies a draft next."""
    cache = new_cache(model, 64)
    forward(model, context, cache, keep=1)
    return cache


def _target(lean: bool):
    model = tiny_llama(layers=3, seed=2)
    if lean:
        model.config._attn_implementation = "sdpa"
        assert attach(model)
    return model


def test_tree_shape_helpers():
    assert depths(PARENTS) == [1, 1, 2, 3, 2, 2, 3]
    assert branch(PARENTS, 6) == [1, 4, 6]
    seen = ancestry(PARENTS)
    assert seen[7].nonzero().flatten().tolist() == [0, 2, 5, 7]  # node 6: root, nodes 1, 4, itself
    assert seen[0].nonzero().flatten().tolist() == [0]
    # ranked by confidence, ancestors first; a node without its parent is never kept
    scores = [-0.1, -1.0, -0.3, -0.5, -1.2, -3.0, -1.5]
    kept = select(scores, PARENTS, None, 4)
    assert kept == [0, 1, 2, 3] and reindex(kept, PARENTS) == [-1, -1, 0, 2]
    # with costs: a node is kept while the tokens it may bring pay for its row
    flat = [1.0] * 8
    assert len(select(scores, PARENTS, flat, 16)) == 7
    steep = [1.0, 1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5]
    assert select(scores, PARENTS, steep, 16) == [0]  # the first node (p 0.90) pays for a 1.5x pass, no more


@pytest.mark.parametrize("lean", [False, True])
def test_a_tree_pass_scores_each_node_as_its_branch_alone(lean):
    model = _target(lean)
    with torch.inference_mode():
        logits, features = forward(model, [5] + TOKENS, _primed(model), layers=(1, 3), tree=PARENTS)
        for node in range(-1, len(TOKENS)):
            path = [TOKENS[i] for i in branch(PARENTS, node)] if node >= 0 else []
            ref_logits, ref_features = forward(model, [5] + path, _primed(model), layers=(1, 3))
            torch.testing.assert_close(logits[node + 1], ref_logits[-1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(features[node + 1], ref_features[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lean", [False, True])
def test_the_cache_keeps_the_branch_taken_as_if_it_came_alone(lean):
    model = _target(lean)
    with torch.inference_mode():
        cache = _primed(model)
        forward(model, [5] + TOKENS, cache, tree=PARENTS)
        kept = [0] + [i + 1 for i in branch(PARENTS, 6)]  # root, nodes 1, 4, 6
        keep_rows(cache, len(CONTEXT), kept)
        assert cache.get_seq_length() == len(CONTEXT) + 4
        after = forward(model, [3], cache)
        alone = _primed(model, CONTEXT + [5, 12, 15, 17])
        torch.testing.assert_close(after, forward(model, [3], alone), rtol=1e-5, atol=1e-5)


def test_the_walk_follows_the_targets_own_tokens():
    logits = torch.full((8, 20), -5.0)
    argmax = {0: 12, 2: 15, 5: 3}  # the root wants 12 (node 1), node 1 wants 15 (node 4), node 4 wants 3: no child
    for row, token in argmax.items():
        logits[row, token] = 5.0
    verdict = verify_tree(TOKENS, PARENTS, logits, GREEDY, torch.Generator())
    assert verdict.path == [1, 4] and verdict.accepted == 2 and verdict.token == 3
    assert verdict.tried == [6] and len(verdict.p) == 3  # the walked tokens 12, 15 and the turned-down 17


def test_acceptance_per_draft_position_counts_a_trees_depths():
    """A tree step's `drafted` is the branch taken, then the candidates turned down below it: position i is depth i,
    reached once per step, not once per candidate (a side-by-side table once showed columns no step reached)."""
    from engine.decoding.metrics import StepEvent, position_counts

    def step(drafted, accepted, tree):
        return StepEvent(1, "correction", [0], [""], drafted=drafted, accepted=accepted, tree=tree)

    steps = [step([4, 5, 6], 0, 3),  # three candidates at depth 1, none taken
             step([4, 7, 8, 9], 1, 6),  # depth 1 taken, its three children turned down
             step([4, 7], 2, 6),  # a branch to a leaf at depth 2: all kept
             step([4, 5], 2, 0)]  # a chain, both kept  # fmt: skip
    assert position_counts(steps) == [(4, 3), (3, 2)]


def test_the_walk_emits_draws_from_the_target_at_every_position():
    """Monte Carlo over a fixed tree: the first token follows the root's p whatever the candidates, and the next
    follows the row of the candidate it landed on (SpecInfer's rule for deterministic candidates)."""
    parents, tokens = [-1, -1, -1, 0, 0], [0, 1, 2, 3, 1]  # root candidates 0, 1, 2; under 0: 3 and 1
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((6, 5), generator=g) * 1.5
    logits[0] = torch.tensor([1.0, 0.5, 0.2, 0.0, -0.5])  # the root: every token drawn, its candidate 0 often
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    p = logits_to_probs(logits, cfg)
    runs, first, second = 20000, torch.zeros(5), torch.zeros(5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(runs):
        v = verify_tree(tokens, parents, logits, cfg, gen)
        emitted = [tokens[i] for i in v.path] + [v.token]
        first[emitted[0]] += 1
        if v.path[:1] == [0]:
            second[emitted[1]] += 1
    torch.testing.assert_close(first / runs, p[0], atol=0.012, rtol=0)
    torch.testing.assert_close(second / second.sum(), p[1], atol=0.02, rtol=0)  # node 0's row


def _heads(model):
    return [random_head(model, "eagle3"), random_head(model, "eagle3", draft_vocab=200, norm_before_residual=True,
                                                      seed=1)]  # fmt: skip


@pytest.mark.parametrize("lean", [False, True])
def test_greedy_tree_runs_give_the_baseline_and_hf_generate_ids(lean, llama_pair):
    model, tok = _target(lean), llama_pair[2]
    trees = 0
    for text in PROMPTS:
        ids = prompt_ids(tok, text)
        expected = hf_generate(model, ids, 24)
        assert run_baseline(model, tok, ids, 24).token_ids == expected
        for head in _heads(model):
            for topk, gamma, costs in ((2, 3, None), (3, 2, [1.0] * 17), (4, 4, [1.0, 1.0, 1.1, 1.2] + [1.3] * 13)):
                result = run_spec(model, tok, ids, Eagle3(head, 384, gamma, topk=topk, costs=costs), gamma, 24)
                assert result.token_ids == expected, (text, topk, gamma)
                trees += sum(s.tree > 0 for s in result.steps)
    assert trees > 20


def test_sampled_tree_runs_keep_the_target_distribution():
    """A head's trees through the whole loop (candidates, several per position, walked by the target's own draws, the
    cache kept along the branch): the target's exact marginals."""
    model = tiny_llama(vocab_size=8, layers=3, seed=5)
    head = random_head(model, "eagle3", draft_vocab=6, seed=7)
    for cfg in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)):
        accepted, drafted = sampled_exactly(model, lambda: Eagle3(head, 8, 3, topk=3), 3, cfg, [1, 2, 3], 3)
        assert 0.05 < accepted / drafted < 0.95


def test_a_node_has_the_children_its_branch_would_give_a_chain():
    """Every node the tree grew from carries the head's top-k after its branch, fed one row at a time as a chain."""
    model = tiny_llama(layers=3, seed=2)
    head = random_head(model, "eagle3", draft_vocab=200, seed=1)
    ids = list(range(30, 52))
    with torch.inference_mode():
        drafter = Eagle3(head, 384, 3, topk=3)
        drafter.reset()
        _, features = forward(model, ids[:-1], new_cache(model, 64), layers=drafter.layers)
        drafter.see(features)
        draft = drafter.propose(ids, 3, GREEDY, torch.Generator())
        assert draft.parents is not None and max(depths(draft.parents)) == 3
        for node in range(-1, len(draft.tokens)):
            children = {draft.tokens[i] for i, p in enumerate(draft.parents) if p == node}
            if not children:
                continue
            path = [draft.tokens[i] for i in branch(draft.parents, node)] if node >= 0 else []
            chain = Eagle3(head, 384, 1)
            chain.reset()
            chain.see(features)
            state, logits = chain._real_rows(ids)
            for token in path:
                state, logits = head.eagle3(torch.tensor([token]), state[-1:], chain.cache)
            top = logits[-1].topk(3).indices
            assert children <= set(head.d2t[top].tolist()), node


def test_a_tree_is_refused_where_it_cannot_run():
    for values, match in (({"drafter": "dflash", "draft": "h"}, "EAGLE-3"), ({"backend": "vllm"}, "transformers"),
                          ({"strict": "on"}, "strict"), ({"compile": True}, "compile")):  # fmt: skip
        s = Settings(**({"drafter": "eagle3", "draft": "h", "topk": 2} | values))
        with pytest.raises(UserError, match=match) as err:
            s.validate()
        assert err.value.field == "topk"
    with pytest.raises(UserError, match="1 \\(a chain\\) to 8"):
        Settings(drafter="eagle3", draft="h", topk=9).validate()

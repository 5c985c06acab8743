"""Speculative decoding: the draft proposes, the target verifies gamma tokens in one forward pass.

Leviathan, Kalman & Matias (2023) and Chen et al. (2023). Names follow the paper: target p,
draft q, gamma (draft length), alpha (acceptance rate). Each step:

  1. draft:    the drafter proposes up to gamma tokens x_1..x_gamma after the sequence so far;
  2. verify:   the target scores [last, x_1..x_gamma] in ONE pass -> gamma+1 next-token distributions;
  3. accept:   keep the longest prefix that passes the rejection rule (engine.decoding.sampling.verify), then add
               the target's own token: the correction at the first rejection, or a bonus if all passed;
  4. roll back: crop the rejected tokens' keys/values from the target cache (the drafter crops its own).

The output has exactly the target's distribution (with temperature 0: the target's greedy tokens), so
the only thing speculation changes is how many target passes, and hence how much time, it takes.

The target cache always holds every token except the last emitted one, which is fed at the next step.
"""

from __future__ import annotations

import threading
from typing import Iterator

import torch

from engine.decoding.drafters import Drafter
from engine.decoding.lossless import top_two
from engine.decoding.metrics import StepEvent
from engine.decoding.runtime import Clock, TextStream, capacity, emit, forward, keep_rows, prefill
from engine.decoding.sampling import SamplingConfig, verify, verify_tree


@torch.inference_mode()  # per resumption: a UI may resume this generator on another thread
def speculative_decode(
    target,
    tokenizer,
    prompt_ids: list[int],
    drafter: Drafter,
    cfg: SamplingConfig,
    max_new_tokens: int,
    eos: set[int],
    stop: threading.Event | None = None,
    width: int = 0,
) -> Iterator[StepEvent]:
    """Yield one StepEvent per target pass until EOS, max_new_tokens or `stop`. The drafter sizes each
    draft (engine.decoding.drafters) and hears after each step how much of it the target kept. `width`: strict mode,
    every verify pass padded to that many rows, as the baseline's passes are (engine.decoding.runtime.forward); a
    draft never outgrows it."""
    clock = Clock(target.device)
    generator = cfg.generator(target.device)
    stream = TextStream(tokenizer)
    drafter.fit(capacity(len(prompt_ids), max_new_tokens), width)  # a draft cache as large as the target's
    drafter.reset()
    head = drafter if drafter.layers else None  # a draft head reads the target's features (engine.decoding.heads)
    event, cache = prefill(target, prompt_ids, cfg, generator, stream, eos, max_new_tokens, clock, width > 0, head)
    elapsed = event.elapsed_s
    yield event
    ids = prompt_ids + event.tokens
    produced = len(event.tokens)
    finished = event.finished
    step = 0
    while finished is None:
        if stop is not None and stop.is_set():
            drafter.finish(ids)
            yield StepEvent(step + 1, "stopped", [], [], elapsed_s=elapsed, finished="stopped")
            return
        step += 1
        room = max_new_tokens - produced
        t0 = clock.now()

        # 1. draft: never more than fits, since the target adds one token of its own (nor past the strict width)
        draft = drafter.draft(ids, min(room, width or room) - 1, cfg, generator)
        t1 = clock.now()

        # 2. verify: the last emitted token plus the draft, one target pass (a tree's nodes each see their branch)
        tree = draft.parents
        scored = forward(target, [ids[-1]] + draft.tokens, cache, width=width, layers=drafter.layers, tree=tree)
        logits, features = scored if head is not None else (scored, None)  # (gamma+1, V), (gamma+1, F)
        t2 = clock.now()

        # 3. accept a prefix of the draft (a tree: the branch the target takes), then the target's own token
        k = len(draft.tokens)
        if tree is None:
            drafted = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)
            verdict = verify(drafted, logits, draft.probs, cfg, generator)
            walked, branch, kept = draft.tokens, [], slice(0, verdict.accepted + 1)  # the rows kept: a prefix
        else:
            verdict = verify_tree(draft.tokens, tree, logits, cfg, generator)
            walked = [draft.tokens[i] for i in verdict.path + verdict.tried]
            branch = [0] + [i + 1 for i in verdict.path]  # the rows kept: the root's and the branch's
            kept = torch.tensor(branch, device=logits.device)
        n = verdict.accepted
        tokens, pieces, finished = emit(stream, walked[:n] + [verdict.token], eos, room)
        top = top_two(logits[kept][: len(tokens)]) if cfg.greedy else []  # evidence for the lossless verdict

        # 4. roll back: the cache now holds [last, x_1..x_k]; keep [last, x_1..x_n] (a tree: the branch taken)
        if tree is not None and n:
            keep_rows(cache, cache.get_seq_length() - k - 1, branch)
        elif k > n:
            cache.crop(n - k)
        if head is not None:
            head.see(features[kept])  # the kept rows' features: [last, x_1..x_n]
        drafter.observe(len(walked), n)  # a tree's walked branch: all kept when it reached a leaf
        t3 = clock.now()

        rejected = [tokenizer.decode([t]) for t in walked[n:]]  # for display only: outside the clocks
        t0 += draft.untimed_s  # a measurement drafter's bookkeeping (drafters.Synthetic) is not drafting
        elapsed += t3 - t0
        ids += tokens
        produced += len(tokens)
        if finished is not None:
            drafter.finish(ids)  # before the last event: a consumer may stop reading there
        yield StepEvent(
            step, "target" if k == 0 else "bonus" if n == len(walked) else "correction", tokens, pieces,
            drafted=walked, tree=k if tree is not None else 0, p=verdict.p, q=verdict.q, accepted=n,
            rejected_pieces=rejected,
            token=verdict.token if len(tokens) > n else None, token_p=verdict.token_p,
            draft_s=t1 - t0, verify_s=t2 - t1, other_s=t3 - t2, elapsed_s=elapsed,
            draft_passes=draft.passes, draft_note=draft.note, top=top, finished=finished,
        )  # fmt: skip

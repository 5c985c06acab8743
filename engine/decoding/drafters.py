"""Drafters: whatever proposes the next gamma tokens for the target to verify.

One small interface for every drafter (after transformers' CandidateGenerator): ``propose`` returns
draft token ids and, when the drafter has them, its probabilities q over the vocabulary. Verification
never lives here; it is in engine.decoding.sampling.verify, the same for all drafters.

- DraftModel: a smaller causal LM with the same vocabulary and its own KV cache.
- PromptLookup: n-gram matching over prompt + generated text (Saxena 2023), no model; q is one-hot.
- Synthetic: proposes a known target continuation with probability alpha; a measurement tool for
  the engine's ceiling and for random-weight models where no trained draft exists.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass

import torch

from engine.decoding.runtime import forward, new_cache
from engine.decoding.sampling import SamplingConfig, argmax, logits_to_probs, sample
from engine.settings import MAX_GAMMA


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V) q over the target's vocabulary, None = one-hot
    passes: int = 0  # draft forward passes spent
    note: str = ""  # why the draft ended before its length, when it did (a confidence stop, a dropped draft)
    untimed_s: float = 0.0  # time the drafter spent on its own bookkeeping, not drafting (kept out of the clocks)
    parents: list[int] | None = None  # a draft tree (engine.decoding.tree): each token's parent, -1 the last token;
    # None: a chain, each token after the one before


class Drafter(ABC):
    """Proposes drafts and sizes them. `gamma` is the draft length; with `adaptive` it is where the
    length starts, and `observe` moves it by transformers' heuristic schedule: +2 after a fully accepted
    draft, -1 after a miss, within 1..MAX_GAMMA. Drafters with a better rule override `observe`."""

    name = "drafter"
    min_tokens = 0  # a shorter draft is dropped rather than verified (llama.cpp's --spec-draft-n-min)
    width = 0  # strict mode: the draft model's passes at the run's width too (engine.decoding.runtime.forward)
    max_len: int | None = None  # tokens a draft model's cache must hold (a static cache needs it up front)
    layers: tuple[int, ...] = ()  # target hidden states a draft head reads (engine.decoding.heads); () = none

    def __init__(self, gamma: int = 4, adaptive: bool = False):
        self.start, self.adaptive = gamma, adaptive
        self.reset()

    def draft(self, ids: list[int], limit: int, cfg: SamplingConfig, generator: torch.Generator) -> Draft:
        """propose(), less a draft shorter than min_tokens (its passes are still counted)."""
        draft = self.propose(ids, limit, cfg, generator)
        if 0 < len(draft.tokens) < self.min_tokens:
            note = f"a {len(draft.tokens)}-token draft is shorter than {self.min_tokens}: dropped"
            return Draft([], None, draft.passes, f"{draft.note}; {note}" if draft.note else note, draft.untimed_s)
        return draft

    def reset(self) -> None:
        """Forget any state from a previous run."""
        self.gamma = self.start

    def fit(self, max_len: int, width: int = 0) -> None:
        """The run's size and strict width (the loop calls this before reset): a draft model's cache holds
        max_len tokens, the target's capacity, so that in strict mode both attend over as many keys."""
        self.max_len, self.width = max_len, width

    @abstractmethod
    def propose(self, ids: list[int], limit: int, cfg: SamplingConfig, generator: torch.Generator) -> Draft:
        """Up to min(its draft length, limit) tokens to follow `ids` (prompt + everything emitted so far)."""

    def finish(self, ids: list[int]) -> None:
        """The run ended with `ids` (prompt + everything emitted); drafters that learn across runs keep it."""

    def observe(self, drafted: int, accepted: int) -> None:
        """The target kept `accepted` of the `drafted` tokens just proposed."""
        if self.adaptive and drafted:
            self.gamma = min(self.gamma + 2, MAX_GAMMA) if accepted == drafted else max(1, self.gamma - 1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModel(Drafter):
    """A second causal LM. Its cache is synchronised lazily: whatever of its past the target rejected
    is cropped off at the next proposal, and the tokens it has not seen yet are fed in one pass.

    With `p_min` it stops drafting at the first token whose top probability under the draft falls below
    it (a confidence stop, as llama.cpp's --spec-draft-p-min; transformers' assistant_confidence_threshold
    keeps that token, llama.cpp does not, nor do we): a token the draft itself doubts is rarely kept."""

    name = "draft-model"

    def __init__(
        self, model, vocab_size: int, max_len: int | None = None, gamma: int = 4, adaptive: bool = False,
        p_min: float = 0.0,
    ):  # fmt: skip
        self.model = model
        self.vocab_size = vocab_size  # the target's; q is cut or zero-padded to it
        self.max_len = max_len  # tokens the cache must hold (the loop's fit() sets it for a run)
        self.p_min = p_min
        super().__init__(gamma, adaptive)

    def reset(self) -> None:
        super().reset()
        self.cache = None
        self.fed: list[int] = []  # token ids whose keys/values sit in self.cache, in order

    def _sync(self, ids: list[int]) -> list[int]:
        """Crop the cache to its longest still-valid prefix; return the ids to feed next (never empty)."""
        if self.cache is None:
            self.cache = new_cache(self.model, self.max_len, role="draft", static=self.width > 0)
        keep = min(_common_prefix(self.fed, ids), len(ids) - 1)
        if len(self.fed) > keep:
            self.cache.crop(keep - len(self.fed))
            del self.fed[keep:]
        return ids[keep:]

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.vocab_size]
        if extra > 0:  # padding ids the draft cannot produce
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def propose(self, ids, limit, cfg, generator) -> Draft:
        gamma = min(self.gamma, limit)
        feed = self._sync(ids)
        tokens: list[int] = []
        rows, note, passes = [], "", 0
        if self.width and len(feed) > self.width:
            # strict: catch up on all but the last token in one pass, as the target's prefill did the prompt, so
            # that the last comes in a pass of the run's width like every later one
            forward(self.model, feed[:-1], self.cache, keep=1)
            self.fed.extend(feed[:-1])
            feed = feed[-1:]
        for _ in range(gamma):
            logits = self._to_target_vocab(forward(self.model, feed, self.cache, keep=1, width=self.width)[-1])  # (V,)
            self.fed.extend(feed)
            passes += 1
            probs = logits_to_probs(logits, cfg)
            if self.p_min:
                # greedy probs are one-hot: the draft's confidence is its softmax's top probability
                top = float((torch.softmax(logits.float(), -1) if cfg.greedy else probs).max())
                if top < self.p_min:
                    note = f"confidence stop before draft token {len(tokens) + 1}: top p {top:.2f} < {self.p_min:g}"
                    break
            token = int(argmax(logits)) if cfg.greedy else int(sample(probs, generator))
            tokens.append(token)
            rows.append(probs)
            feed = [token]
        return Draft(tokens, torch.stack(rows) if rows else None, passes=passes, note=note)


class PromptLookup(Drafter):
    """Find the last max_ngram..min_ngram tokens earlier in the text and propose what followed them.

    Strong when the output copies the input (summaries, edits, code changes, extraction), free to run.
    Where the n-gram occurs more than once, the draft follows what most occurrences agree on, token by
    token; ties go to the earliest occurrence, which in an edit or a summary is the source text itself.

    With `costs` (costs[k]: the target pass that verifies a k-token draft, relative to a one-token step),
    the drafter sizes every draft itself. It learns, from the tokens the target kept, how often its
    drafts hold (first token, per n-gram size; later tokens, once the first held), and proposes the
    length with the most expected tokens per unit of target time. That is no draft at all where a
    match is unlikely to hold and the pass would cost more than the tokens it may bring.
    """

    name = "prompt-lookup"
    # Beta priors, as (mean, weight in pseudo-drafts). A draft's first token holds more often after a longer
    # match: about 0.2 / 0.5 / 0.8 after 1 / 2 / 3 tokens over the task suite with the bundled model.
    FIRST_PRIOR = {1: 0.2, 2: 0.5, 3: 0.8}  # longer n-grams use the 3-gram's
    FOLLOW_PRIOR = 0.75  # each next token, once the first held: copied text tends to go on
    PRIOR_WEIGHT = 3.0
    MEMORY = 0.98  # evidence fades by this much per step, so a drafter that stopped drafting tries again

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 1, costs: list[float] | None = None, gamma: int = 4,
    ):  # fmt: skip
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.costs = max_ngram, min_ngram, costs
        super().__init__(gamma, adaptive=costs is not None)

    def reset(self) -> None:
        super().reset()
        self.first: dict[int, list[float]] = {}  # n-gram size -> [held, missed] first draft tokens seen
        self.follow = [0.0, 0.0]  # [held, missed] draft tokens after one that held
        self.last_n = 0  # n-gram size behind the last draft

    def propose(self, ids, limit, cfg, generator) -> Draft:
        if not self.adaptive:
            return Draft(self._lookup(ids, min(self.gamma, limit))[0])
        tokens, self.last_n = self._lookup(ids, min(MAX_GAMMA, limit))
        return Draft(tokens[: self._best_length(self.last_n, len(tokens))] if tokens else [])

    def _lookup(self, ids: list[int], gamma: int) -> tuple[list[int], int]:
        """Up to gamma tokens after the longest n-gram that matches, and that n (0: no match)."""
        if gamma <= 0:
            return [], 0
        seq = torch.tensor(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a following token
            starts = ((windows == seq[-n:]).all(dim=1).nonzero().flatten() + n).tolist()
            if starts:
                return _agreed_continuation(ids, starts, gamma), n
        return [], 0

    def observe(self, drafted: int, accepted: int) -> None:
        """Fade what was learnt before, then score the last draft: did its first token hold, and how
        far did it go on once it did."""
        if not self.adaptive:
            return
        for counts in (*self.first.values(), self.follow):
            counts[0] *= self.MEMORY
            counts[1] *= self.MEMORY
        if not drafted:
            return
        first = self.first.setdefault(self.last_n, [0.0, 0.0])
        first[0 if accepted else 1] += 1
        if accepted:
            self.follow[0] += accepted - 1
            self.follow[1] += accepted < drafted

    def _best_length(self, n: int, available: int) -> int:
        """The draft length with the most expected tokens per unit of target time; 0 = no draft."""
        p = self._mean(self.FIRST_PRIOR[min(n, 3)], self.first.get(n, (0.0, 0.0)))
        follow = self._mean(self.FOLLOW_PRIOR, self.follow)
        best, best_rate, expected = 0, 1.0 / self.costs[0], 0.0  # no draft: one token per one-token pass
        for k in range(1, min(available, len(self.costs) - 1) + 1):
            expected += p  # p = P(the first k draft tokens all hold)
            p *= follow
            rate = (1 + expected) / self.costs[k]  # the target adds one token of its own
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _mean(self, prior: float, seen) -> float:
        """Posterior mean of the chance a token holds, from the prior and seen = (held, missed)."""
        return (prior * self.PRIOR_WEIGHT + seen[0]) / (self.PRIOR_WEIGHT + seen[0] + seen[1])


def _agreed_continuation(ids: list[int], starts: list[int], gamma: int) -> list[int]:
    """Follow the occurrences that start at `starts`, token by token, keeping those that agree with the
    most common next token (on a tie, the earliest occurrence's); stop where none goes on."""
    tokens: list[int] = []
    for i in range(gamma):
        starts = [s for s in starts if s + i < len(ids)]
        if not starts:
            break
        votes = Counter(ids[s + i] for s in starts)  # counts in order of first occurrence
        token = max(votes, key=votes.__getitem__)  # max keeps the first of equals: the earliest occurrence
        tokens.append(token)
        starts = [s for s in starts if ids[s + i] == token]
    return tokens


class Synthetic(Drafter):
    """Proposes the target's own continuation (`reference`, e.g. its greedy output) with probability
    alpha per token, and a wrong token otherwise. A measurement tool: it shows what the engine reaches
    at a given acceptance rate. alpha=1 is an oracle, alpha=0 an adversary.

    Drafting costs nothing, unless `pace` is a draft model: then it runs that model's passes for every
    draft and throws their tokens away, so a random-weight pair of real sizes (engine.models.random_shapes)
    shows the speed a trained pair of those sizes would reach at this alpha.

    A run can leave the reference: in 16 bits a verify pass may round the target's two best tokens the other
    way than the baseline's pass did (engine.decoding.lossless), and from there every "right" token of a reference
    read by position would be wrong (alpha 0.8 asked, 0.02 measured on a GPU). So where the run's text
    leaves the reference, `regenerate(ids, n)` gives the target's next n greedy tokens from the run's own text,
    and the reference goes on from there. That is the tool's bookkeeping, not drafting: its time is reported
    in Draft.untimed_s, which the loop keeps out of its clocks."""

    name = "synthetic"

    def __init__(
        self, prompt_len: int, reference: list[int], alpha: float, vocab_size: int, seed: int = 0,
        pace: DraftModel | None = None, gamma: int = 4, adaptive: bool = False, regenerate=None,
    ):  # fmt: skip
        if not 0 <= alpha <= 1:
            raise ValueError("alpha must be in [0, 1]")
        self.prompt_len, self.alpha = prompt_len, alpha
        self.original = list(reference)
        self.vocab_size, self.seed, self.pace, self.regenerate = vocab_size, seed, pace, regenerate
        super().__init__(gamma, adaptive)

    def fit(self, max_len: int, width: int = 0) -> None:
        super().fit(max_len, width)
        if self.pace is not None:
            self.pace.fit(max_len, width)

    def reset(self) -> None:
        super().reset()
        self.rng = torch.Generator().manual_seed(self.seed)
        self.reference = list(self.original)
        self.checked = 0  # new tokens of the run known to follow the reference
        self.regenerated = 0  # times the reference was made again from the run's own text
        if self.pace is not None:
            self.pace.reset()

    def _follow(self, ids: list[int]) -> float:
        """Make the reference the run's own text so far and the target's greedy continuation of it; returns
        the seconds that took (0 while the run follows the reference)."""
        new = ids[self.prompt_len :]
        if new[self.checked :] == self.reference[self.checked : len(new)] or self.regenerate is None:
            self.checked = len(new)
            return 0.0
        start = time.perf_counter()
        more = max(len(self.original) - len(new), 0) + MAX_GAMMA
        self.reference = new + self.regenerate(ids, more)
        self.checked, self.regenerated = len(new), self.regenerated + 1
        return time.perf_counter() - start

    def propose(self, ids, limit, cfg, generator) -> Draft:
        gamma, passes = min(self.gamma, limit), 0
        untimed = self._follow(ids)
        if self.pace is not None:  # greedy: the pacing passes must not draw from the run's random stream
            passes = self.pace.propose(ids, gamma, SamplingConfig(), generator).passes
        start = len(ids) - self.prompt_len
        truth = self.reference[start : start + gamma]
        truth += [(self.reference[-1] if self.reference else 0)] * (gamma - len(truth))
        right = torch.rand(gamma, generator=self.rng) < self.alpha
        tokens = [t if ok else (t + 1) % self.vocab_size for t, ok in zip(truth, right.tolist())]
        return Draft(tokens, passes=passes, untimed_s=untimed)

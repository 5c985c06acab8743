"""Drafters: whatever proposes the next gamma tokens for the target to verify.

One small interface for every drafter (after transformers' CandidateGenerator): ``propose`` returns
draft token ids and, when the drafter has them, its probabilities q over the vocabulary. Verification
never lives here; it is in engine.sampling.verify, the same for all drafters.

- DraftModel: a smaller causal LM with the same vocabulary and its own KV cache.
- PromptLookup: n-gram matching over prompt + generated text (Saxena 2023), no model; q is one-hot.
- Synthetic: proposes a known target continuation with probability alpha; a measurement tool for
  the engine's ceiling and for random-weight models where no trained draft exists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.runtime import forward, new_cache
from engine.sampling import SamplingConfig, logits_to_probs, sample


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V) q over the target's vocabulary, None = one-hot
    passes: int = 0  # draft forward passes spent


class Drafter(ABC):
    name = "drafter"

    def reset(self) -> None:
        """Forget any state from a previous run."""

    @abstractmethod
    def propose(self, ids: list[int], gamma: int, cfg: SamplingConfig, generator: torch.Generator) -> Draft:
        """Up to gamma tokens to follow `ids` (prompt + everything emitted so far)."""


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModel(Drafter):
    """A second causal LM. Its cache is synchronised lazily: whatever of its past the target rejected
    is cropped off at the next proposal, and the tokens it has not seen yet are fed in one pass."""

    name = "draft-model"

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size  # the target's; q is cut or zero-padded to it
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.fed: list[int] = []  # token ids whose keys/values sit in self.cache, in order

    def _sync(self, ids: list[int]) -> list[int]:
        """Crop the cache to its longest still-valid prefix; return the ids to feed next (never empty)."""
        if self.cache is None:
            self.cache = new_cache(self.model)
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

    def propose(self, ids, gamma, cfg, generator) -> Draft:
        feed = self._sync(ids)
        tokens: list[int] = []
        rows = []
        for _ in range(gamma):
            logits = self._to_target_vocab(forward(self.model, feed, self.cache, keep=1)[-1])  # (V,)
            self.fed.extend(feed)
            probs = logits_to_probs(logits, cfg)
            token = int(logits.argmax()) if cfg.greedy else int(sample(probs, generator))
            tokens.append(token)
            rows.append(probs)
            feed = [token]
        return Draft(tokens, torch.stack(rows) if rows else None, passes=gamma)


class PromptLookup(Drafter):
    """Find the last max_ngram..min_ngram tokens earlier in the text and propose what followed them.

    Strong when the output copies the input (summaries, edits, code changes, extraction), free to run.
    The most recent match wins (recent context predicts best) unless its continuation is cut short by
    the end of the text, in which case the latest match with the longest continuation does.
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ids, gamma, cfg, generator) -> Draft:
        if gamma <= 0:
            return Draft([])
        seq = torch.tensor(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a following token
            starts = ((windows == seq[-n:]).all(dim=1).nonzero().flatten() + n).tolist()
            if starts:
                # the latest match whose continuation fills the draft; a match near the end has a short one
                best = max(reversed(starts), key=lambda start: min(len(ids) - start, gamma))
                return Draft(ids[best : best + gamma])
        return Draft([])


class Synthetic(Drafter):
    """Proposes the target's own continuation (`reference`, e.g. its greedy output) with probability
    alpha per token, and a wrong token otherwise. A measurement tool: it shows what the engine reaches
    at a given acceptance rate with zero drafting cost. alpha=1 is an oracle, alpha=0 an adversary."""

    name = "synthetic"

    def __init__(self, prompt_len: int, reference: list[int], alpha: float, vocab_size: int, seed: int = 0):
        if not 0 <= alpha <= 1:
            raise ValueError("alpha must be in [0, 1]")
        self.prompt_len, self.reference, self.alpha = prompt_len, list(reference), alpha
        self.vocab_size, self.seed = vocab_size, seed
        self.reset()

    def reset(self) -> None:
        self.rng = torch.Generator().manual_seed(self.seed)

    def propose(self, ids, gamma, cfg, generator) -> Draft:
        start = len(ids) - self.prompt_len
        truth = self.reference[start : start + gamma]
        truth += [(self.reference[-1] if self.reference else 0)] * (gamma - len(truth))
        right = torch.rand(gamma, generator=self.rng) < self.alpha
        return Draft([t if ok else (t + 1) % self.vocab_size for t, ok in zip(truth, right.tolist())])

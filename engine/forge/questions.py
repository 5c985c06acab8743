"""What the target is asked for the forge's data, in order (engine.forge.data makes the answers).

    1. the validation prompts, answered greedily (small)
    2. the training prompts, answered greedily and sampled
    3. with general prompts (engine.forge.bank): those in full batches of similar lengths, a round of follow-up
       questions after the given prompts' first answers between them (D.FOLLOW_UPS)
       without: the rounds of follow-ups, then rounds of new prompts the target writes (D.VARIATION) and answers

`Questions.plan` is a generator of (split, Batch) pairs, split "train", "val" or "ask" (the target writing new
prompts; its text is training data too). Later questions are built from earlier answers, so whoever drives the plan
sends each batch's sequences back in: `made = yield split, batch`.
"""

from __future__ import annotations

import random
import time
from typing import Generator

from engine.forge import data as D
from engine.forge.prompts import is_val

ASK_TEMPERATURE = 0.7  # new prompts written by the target: at 1.0 a small target's drift into noise
# general prompts taken for this many batches at once and batched by length: a text to rewrite is ~200 tokens where
# a question is ~45, and a few of them in a batch padded every row's prefill to their length
GENERAL_GROUP = 4

Plan = Generator[tuple[str, D.Batch], list[D.Sequence], None]


class Questions:
    """The questions of one forge run: its config (a ForgeConfig), the loaded target, its prompt sets."""

    def __init__(self, cfg, loaded, chat: bool, eos: set[int], prompts, stop):
        self.cfg, self.loaded, self.chat, self.eos, self.stop = cfg, loaded, chat, eos, stop
        self.train_set, self.val_set, self.held_set = prompts
        self.bank_shares: dict | None = None  # the general prompts' kinds (engine.forge.bank.kind_shares)

    def _encode(self, prompt) -> list[int]:
        from engine.decoding.runtime import encode_prompt

        return encode_prompt(self.loaded.tokenizer, prompt, self.chat)

    def _going(self, deadline: float) -> bool:
        return time.perf_counter() < deadline and not self.stop.is_set()

    def plan(self, deadline: float) -> Plan:
        cfg = self.cfg
        train = [(i.id, self._encode(i.prompt)) for i in self.train_set.items]
        val = [(i.id, self._encode(i.prompt)) for i in self.val_set.items]
        size, n = cfg.batch_size, cfg.max_new_tokens
        talks = {i.id: [{"role": "user", "content": i.prompt}] for i in self.train_set.items + self.val_set.items}
        for b in D.batches(val, size, (0.0,), n, ("greedy",)):
            self._answered(talks, (yield "val", b))
        for b in D.batches(train, size, (0.0, cfg.temperature), n, ("greedy", "sampled")):
            self._answered(talks, (yield "train", b))
        val_ids = {i.id for i in self.val_set.items}
        if cfg.general:
            yield from self._general(talks, val_ids, deadline)
            return
        for round_ in range(len(D.FOLLOW_UPS)):
            if not self._going(deadline):
                return
            yield from self._follow_ups(talks, val_ids, round_)
        seen = {D.normalised(i.prompt) for i in self.train_set.items + self.val_set.items}
        sources = [i.prompt for i in self.train_set.items]
        rounds = 0
        while cfg.variations and rounds < 50 and self._going(deadline):
            rounds += 1
            yield from self._variations(sources, seen, rounds)

    def _general(self, talks: dict[str, list[dict]], val_ids: set[str], deadline: float) -> Plan:
        """General prompts (engine.forge.bank) in full batches of similar lengths, a round of follow-ups on the given
        prompts between them while there are rounds left; each prompt answered once, greedily or sampled by turns. A
        first batch of them, answered greedily, is validation data: new subjects, as the held-out prompts are."""
        from engine.forge.bank import Bank

        cfg, tok = self.cfg, self.loaded.tokenizer
        given = self.train_set.items + self.val_set.items + self.held_set.items
        categories = [i.category for i in given] if cfg.bank == "workload" else None
        general = Bank(cfg.seed, [i.prompt for i in given], categories)
        self.bank_shares = general.shares.copy()
        general.use([t[1]["content"] for t in talks.values() if len(t) > 1])
        first = [(i, self._encode(p)) for i, p in general.take(min(32, cfg.batch_size))]
        for b in D.batches(first, cfg.batch_size, (0.0,), cfg.max_new_tokens, ("general",)):
            yield "val", b
        round_, pending = 0, []
        while self._going(deadline):
            if round_ < len(D.FOLLOW_UPS):
                yield from self._follow_ups(talks, val_ids, round_)
                round_ += 1
            if not pending:  # a few batches' worth at a time, by length: the long ones padded together
                pending = sorted(((i, self._encode(p)) for i, p in general.take(GENERAL_GROUP * cfg.batch_size)),
                                 key=lambda x: len(x[1]))  # fmt: skip
            prompts, pending = pending[: cfg.batch_size], pending[cfg.batch_size :]
            temperatures = [0.0 if k % 2 == 0 else cfg.temperature for k in range(len(prompts))]
            made = yield "train", D.Batch([p for _, p in prompts], [i for i, _ in prompts], temperatures,
                                          cfg.max_new_tokens, "general")  # fmt: skip
            greedy = [s for s, t in zip(made, temperatures) if t == 0.0]
            general.use(D.texts(tok, greedy, self.eos))

    def _answered(self, talks: dict[str, list[dict]], sequences: list[D.Sequence]) -> None:
        """The first greedy answers just made, added to their conversations as the assistant's turn."""
        firsts = [s for s in sequences if s.source == "greedy" and len(talks.get(s.prompt_id, ())) == 1]
        for s, text in zip(firsts, D.texts(self.loaded.tokenizer, firsts, self.eos)):
            if text:
                talks[s.prompt_id].append({"role": "assistant", "content": text})

    def _follow_ups(self, talks: dict[str, list[dict]], val_ids: set[str], round_: int) -> Plan:
        """A follow-up question after each first answer, a different one per conversation and round (always on the
        first exchange: deeper conversations made every prefill longer and the data 40% slower): validation
        conversations answered greedily, the others greedy and sampled."""
        cfg = self.cfg
        asked: dict[str, list] = {"val": [], "train": []}
        for k, (root, turns) in enumerate(talks.items()):
            if len(turns) == 2:
                question = {"role": "user", "content": D.FOLLOW_UPS[(round_ + k) % len(D.FOLLOW_UPS)]}
                ids = self._encode(turns + [question])
                asked["val" if root in val_ids else "train"].append((f"{root}+{round_ + 1}", ids))
        for b in D.batches(asked["val"], cfg.batch_size, (0.0,), cfg.max_new_tokens, ("follow-up",)):
            yield "val", b
        for b in D.batches(asked["train"], cfg.batch_size, (0.0, cfg.temperature), cfg.max_new_tokens,
                           ("follow-up", "sampled")):  # fmt: skip
            yield "train", b

    def _variations(self, sources: list[str], seen: set[str], round_: int) -> Plan:
        """A round of new prompts the target writes in the style of `sources` (a full batch of asks, each sampled
        anew), then its answers to the usable ones: greedy for validation, greedy and sampled for training."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1000 + round_)
        k = cfg.batch_size  # a full batch of asks even while the sources are few: each ask is sampled anew
        chosen = rng.sample(sources, k) if len(sources) >= k else [rng.choice(sources) for _ in range(k)]
        asks = [(f"ask-{round_}-{i}", self._encode(D.VARIATION.format(prompt=p))) for i, p in enumerate(chosen)]
        new: list[tuple[str, list[int]]] = []
        for b in D.batches(asks, cfg.batch_size, (ASK_TEMPERATURE,), min(160, cfg.max_new_tokens), ("ask",)):
            made = yield "ask", b
            for text in D.texts(self.loaded.tokenizer, made, self.eos):
                if D.usable_variation(text, seen):
                    new.append((D.prompt_id(text), self._encode(text)))
                    sources.append(text)
        val = [p for p in new if is_val(p[0], cfg.seed)]
        train = [p for p in new if not is_val(p[0], cfg.seed)]
        for b in D.batches(val, cfg.batch_size, (0.0,), cfg.max_new_tokens, ("variation",)):
            yield "val", b
        for b in D.batches(train, cfg.batch_size, (0.0, cfg.temperature), cfg.max_new_tokens,
                           ("variation", "variation")):  # fmt: skip
            yield "train", b

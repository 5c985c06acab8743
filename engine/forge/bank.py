"""General prompts for the forge: what the target answers beside the user's own prompts.

A head trained on a few dozen prompts learns their subjects rather than the target: on the bundled model, a head
forged on 33 prompts (with follow-ups and many sampled answers) reached 0.72 top-1 on its training data and 0.31
acceptance at the first draft position on new prompts. EAGLE trains on general chat data for that reason; with no
network, the forge composes its own from presets/forge_bank.json: subjects under task patterns (explain, compare,
a poem, a quiz...), translation, code tasks, word problems with fresh numbers, records to format, and tasks on the
target's own earlier answers (rewrite, summarise, fix typos, translate), which teach a head to copy from the context
as rewriting and summarising need. The choices are seeded, no prompt is asked twice.

The kinds take turns in proportion to the workload: each given prompt's category names the kind nearest it (open
questions and creative writing: subjects under task patterns; code: code tasks; ...), and a quarter of the turns
keep the even mix, for what a category's name does not say. On the bundled model (AMX Xeon, 15-minute forges
measured on the open-ended suite prompts, none trained on) subjects alone lifted the head's first-draft hits from
0.33 to 0.38 and the top-3 tree's speedup from 1.15x to 1.40x against the even mix in the forges' own tables (one
pair per prompt); benched again with two pairs, 0.36 and 1.25x (docs/forge.md).
"""

from __future__ import annotations

import json
import random
from functools import lru_cache

from engine.forge.data import normalised, prompt_id
from engine.presets import PRESETS

KINDS = ("topic", "topic", "topic", "code", "problem", "translate", "record", "text", "text")  # the even mix
# a category's kind by a word in its name, first match (math_reasoning: a problem); others (repeated_work) the mix
CATEGORY_KINDS = (("code", "code"), ("math", "problem"), ("arith", "problem"), ("transl", "translate"),
                  ("format", "record"), ("extract", "record"), ("record", "record"), ("json", "record"),
                  ("summar", "text"), ("rewrit", "text"), ("rag", "text"), ("edit", "text"), ("paraphras", "text"),
                  ("qa", "topic"), ("question", "topic"), ("creative", "topic"), ("writ", "topic"),
                  ("mt_bench", "topic"), ("roleplay", "topic"), ("stem", "topic"), ("humanit", "topic"),
                  ("reason", "topic"), ("chat", "topic"))  # fmt: skip
EVEN_SHARE = 0.25  # of the turns that keep the even mix whatever the workload
SPENT_AFTER = 200  # repeats in a row that retire a kind (a code-only workload asks every code task in time)


def kind_of(category: str) -> str | None:
    name = category.lower()
    return next((kind for word, kind in CATEGORY_KINDS if word in name), None)


def kind_shares(categories: list[str] | None = None) -> dict[str, float]:
    """The share of turns each kind gets for a workload of prompts with these categories (one entry per prompt):
    the even mix for none, else EVEN_SHARE of it and the rest in proportion to the prompts' kinds."""
    even = {k: KINDS.count(k) / len(KINDS) for k in dict.fromkeys(KINDS)}
    if not categories:
        return even
    workload = dict.fromkeys(even, 0.0)
    for category in categories:
        kind = kind_of(category)
        for k, share in ({kind: 1.0} if kind else even).items():
            workload[k] += share / len(categories)
    return {k: EVEN_SHARE * even[k] + (1 - EVEN_SHARE) * workload[k] for k in even}


@lru_cache(maxsize=1)
def bank() -> dict:
    return json.loads((PRESETS / "forge_bank.json").read_text())


def typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """The text with a letter dropped, doubled or swapped in about `rate` of its longer words."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            k = rng.randrange(1, len(w) - 1)
            words[i] = rng.choice([w[:k] + w[k + 1 :], w[:k] + w[k] + w[k:], w[: k - 1] + w[k] + w[k - 1] + w[k + 1 :]])
    return " ".join(words)


def excerpt(text: str, most: int = 700) -> str:
    """The text cut to at most `most` characters at a sentence's end."""
    if len(text) <= most:
        return text
    cut = text[:most]
    end = max(cut.rfind(". "), cut.rfind(".\n"))
    return cut[: end + 1] if end > most // 3 else cut.rsplit(" ", 1)[0]


class Bank:
    """An endless, seeded stream of general prompts; `use` gives it the target's answers for the text tasks."""

    def __init__(self, seed: int = 0, avoid: list[str] | set[str] | None = None, categories: list[str] | None = None):
        self.rng = random.Random(seed)
        self.seen = {normalised(p) for p in avoid or ()}  # prompts never to ask (the user's, the held-out ones)
        self.texts: list[str] = []
        self.shares = kind_shares(categories)
        self.credit = dict.fromkeys(self.shares, 0.0)  # smooth weighted round robin: each kind in its share, spread
        self.repeats = dict.fromkeys(self.shares, 0)

    def use(self, texts: list[str]) -> None:
        """The target's own answers, inputs for the text tasks (the longer ones; the most recent kept)."""
        self.texts = (self.texts + [t for t in texts if len(t) >= 200])[-400:]

    def take(self, n: int) -> list[tuple[str, str]]:
        """n new (id, prompt) pairs."""
        out = []
        for _ in range(50 * n):
            if len(out) == n:
                break
            kind = self._turn()
            text = self._one("topic" if kind == "text" and not self.texts else kind)
            key = normalised(text)
            if key in self.seen:
                self.repeats[kind] += 1
                if self.repeats[kind] >= SPENT_AFTER and kind != "topic":  # subjects under patterns never run out
                    self.shares[kind] = 0.0
                continue
            self.repeats[kind] = 0
            self.seen.add(key)
            out.append((prompt_id(text, "bank"), text))
        return out

    def _turn(self) -> str:
        """The kind furthest behind its share (nginx's smooth weighted round robin: exact shares, evenly spread)."""
        live = {k: s for k, s in self.shares.items() if s > 0} or {"topic": 1.0}
        for k, s in live.items():
            self.credit[k] += s
        kind = max(live, key=lambda k: self.credit[k])
        self.credit[kind] -= sum(live.values())
        return kind

    def _one(self, kind: str) -> str:
        b, r = bank(), self.rng
        if kind == "topic":
            subject, other = r.sample(b["subjects"], 2)
            return r.choice(b["topic_asks"]).format(subject=subject, other=other)
        if kind == "code":
            return r.choice(b["code_asks"]).format(task=r.choice(b["code_tasks"]))
        if kind == "problem":
            a, bb, c = r.randint(3, 250), r.randint(2, 40), r.randint(2, 60)
            # c above a (a rise); g and k below what there is (given away, taken away: never more than there is)
            numbers = {"a": a, "b": bb, "c": a + c, "g": r.randint(1, a - 1), "k": r.randint(1, a * bb - 1),
                       "p": r.choice([5, 10, 15, 20, 25, 30, 40, 50]), "m": r.choice(["05", "15", "30", "45"])}
            return r.choice(b["word_problems"]).format(**numbers)
        if kind == "translate":
            said = " ".join(r.sample(b["sentences"], r.choice([1, 2])))
            return f"Translate into {r.choice(b['languages'])}: {said}"
        if kind == "record":
            people = " ".join(f"{n} is {r.randint(19, 80)} and lives in {c}."
                              for n, c in zip(r.sample(b["names"], 3), r.sample(b["cities"], 3)))  # fmt: skip
            goods = ", ".join(f"{i} {r.randint(1, 20)}.{r.randint(0, 99):02d}" for i in r.sample(b["items"], 4))
            return r.choice(b["record_asks"]).format(people=people, goods=goods)
        text = excerpt(r.choice(self.texts))
        return r.choice(b["text_asks"]).format(text=text, typos=typos(text, r), language=r.choice(b["languages"]))

"""Suffix decoding (Oliaro et al., SuffixDecoding, arXiv 2411.04975): drafts from everything the session
has produced, not only the current prompt.

A depth-limited suffix trie holds every window of up to DEPTH tokens of the session's texts (prompts and
outputs of earlier runs, and the current run as it grows), each node counting how often its path occurs.
To draft, the longest suffix of the current text (up to MAX_MATCH tokens) that the trie knows is looked
up, and the most frequent continuation is followed token by token while its share of what followed there,
multiplied along the way, stays above MIN_SHARE. The draft may be at most FACTOR x the match length long:
a long match is good evidence, a one-token match is not (the paper's adaptive speculation length). Where
work repeats (the same extraction over many inputs, agents calling the same tools), the earlier outputs
supply whole stretches that prompt lookup, which sees only the current prompt, cannot.

Memory is bounded: MEMORY_TOKENS tokens at most (SPECARENA_SUFFIX_MEMORY_TOKENS), the oldest texts dropped
first. Honesty in measuring: when a run starts, texts from earlier runs of the *same prompt* are forgotten
(a repeat, a warm-up, the other side of an A/B pair), so a speedup never comes from having seen the very
answer; texts of other prompts stay, which is what the method is for.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from engine.decoding.drafters import PromptLookup
from engine.settings import MAX_GAMMA

MAX_MATCH = 12  # longest suffix of the current text looked up
DEPTH = MAX_MATCH + MAX_GAMMA  # trie depth: a match plus the longest draft that can follow it
FACTOR = 1.0  # draft length <= FACTOR x match length
MIN_SHARE = 0.1  # stop where the continuation's cumulative share falls below this


def memory_tokens() -> int:
    return int(os.environ.get("SPECARENA_SUFFIX_MEMORY_TOKENS", "20000"))


class Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixMemory:
    """The session's texts in a suffix trie, oldest dropped past `cap` tokens. Thread-safe: a Playground
    run and a Lab sweep of the same session may touch it at once."""

    def __init__(self, cap: int | None = None):
        self.cap = memory_tokens() if cap is None else cap
        self.root = Node()
        self.texts: OrderedDict[int, tuple[tuple, list[int]]] = OrderedDict()  # id -> (prompt key, tokens)
        self.open: dict[int, list[Node]] = {}  # id -> nodes of its windows still shorter than DEPTH
        self.tokens = 0
        self._next = 0
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return self.tokens

    def clear(self) -> None:
        with self.lock:
            self.root, self.tokens = Node(), 0
            self.texts.clear()
            self.open.clear()

    # -- texts in and out ------------------------------------------------------------------------------

    def begin(self, key: tuple, tokens: list[int]) -> int:
        """Start a text (a run's prompt): forget earlier texts of the same prompt, index this one."""
        with self.lock:
            for old in [i for i, (k, _) in self.texts.items() if k == key]:
                self._remove(old)
            text_id, self._next = self._next, self._next + 1
            self.texts[text_id] = (key, [])
            self.extend(text_id, tokens)
            return text_id

    def extend(self, text_id: int, tokens: list[int]) -> None:
        """Append tokens to a text: every window that ends in them is counted."""
        with self.lock:
            if text_id not in self.texts:
                return  # dropped meanwhile (cleared, or pushed out by newer texts)
            text, frontier = self.texts[text_id][1], self.open.setdefault(text_id, [])
            for token in tokens:
                text.append(token)
                grown = []
                for node in [*frontier, self.root]:  # every window ending here is one longer, and one is new
                    child = node.children.get(token)
                    if child is None:
                        child = node.children[token] = Node()
                    child.count += 1
                    grown.append(child)
                frontier[:] = grown[-(DEPTH - 1) :] if DEPTH > 1 else []
            self.tokens += len(tokens)
            while self.tokens > self.cap and len(self.texts) > 1:
                self._remove(next(iter(self.texts)))

    def _remove(self, text_id: int) -> None:
        """Uncount every window of a text: the windows that start at one position are the nodes along one
        path from the root."""
        _, text = self.texts.pop(text_id)
        self.open.pop(text_id, None)
        self.tokens -= len(text)
        for start in range(len(text)):
            path, node = [], self.root
            for token in text[start : start + DEPTH]:
                path.append((node, token))
                node = node.children[token]
                node.count -= 1
            for parent, token in reversed(path):
                if parent.children[token].count == 0:
                    del parent.children[token]

    def _walk(self, path: list[int]) -> Node | None:
        node = self.root
        for t in path:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    # -- drafting ----------------------------------------------------------------------------------------

    def continuation(self, context: list[int], limit: int, by_match: bool = True) -> tuple[list[int], int]:
        """The most frequent continuation after the longest known suffix of `context`, and that suffix's
        length (0: none known). It stops where what followed there disagrees (the continuation's share,
        multiplied along the way, falls below MIN_SHARE) and, `by_match`, at FACTOR x the match length."""
        with self.lock:
            for m in range(min(MAX_MATCH, len(context)), 0, -1):
                node = self._walk(context[-m:])
                if node is None or not node.children:
                    continue
                tokens, share = [], 1.0
                room = min(limit, DEPTH - m, int(FACTOR * m) if by_match else limit)
                while node.children and len(tokens) < room:
                    total = sum(c.count for c in node.children.values())
                    token, child = max(node.children.items(), key=lambda kv: kv[1].count)  # ties: the earliest
                    share *= child.count / total
                    if share < MIN_SHARE:
                        break
                    tokens.append(token)
                    node = child
                return tokens, m
            return [], 0


MEMORIES: dict[str, SuffixMemory] = {}
_MEMORIES_LOCK = threading.Lock()


def memory_for(session: str) -> SuffixMemory:
    """The suffix memory of one session (a browser session of the app, or "default")."""
    with _MEMORIES_LOCK:
        if session not in MEMORIES:
            MEMORIES[session] = SuffixMemory()
        return MEMORIES[session]


class SuffixDrafter(PromptLookup):
    """Prompt lookup's drafting with the session's memory as its source: the same draft sizing (up to gamma;
    with `costs`, adaptive: the length with the most expected tokens per unit of target time, from what
    held so far in this run, the match length standing in for the n-gram size), drafts from the trie."""

    name = "suffix"

    def __init__(self, memory: SuffixMemory, gamma: int = 4, costs: list[float] | None = None):
        self.memory = memory
        super().__init__(max_ngram=MAX_MATCH, costs=costs, gamma=gamma)

    def reset(self) -> None:
        super().reset()
        self.text_id: int | None = None
        self.indexed = 0

    def _learn(self, ids: list[int]) -> None:
        if self.text_id is None:  # the run's first draft: ids are the prompt and the first token
            self.text_id = self.memory.begin(tuple(ids[:-1]), ids)
        else:
            self.memory.extend(self.text_id, ids[self.indexed :])
        self.indexed = len(ids)

    def finish(self, ids: list[int]) -> None:
        if self.text_id is not None:
            self._learn(ids)

    def _lookup(self, ids: list[int], gamma: int) -> tuple[list[int], int]:
        """The memory's continuation where it knows a longer match than the current text alone; else the
        current text's own, as prompt lookup drafts it (every occurrence votes, ties go to the earliest,
        which in an edit is the source). What held is learnt per match length 1, 2, 3+, as prompt lookup
        learns it per n-gram size."""
        self._learn(ids)
        if gamma <= 0:
            return [], 0
        tokens, m = self.memory.continuation(ids, gamma, by_match=not self.adaptive)
        own, n = super()._lookup(ids, gamma)
        if n and n >= m:
            tokens = own if self.adaptive else own[: max(1, int(FACTOR * n))]
        return tokens, min(m, 3)

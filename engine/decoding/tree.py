"""Draft trees: several candidates per position, verified together in one target pass (EAGLE-2, Li et al. 2024;
SpecInfer, Miao et al. 2024).

A chain stakes each position on one token; a weak drafter's second or third choice is often the target's. A tree
keeps the drafter's likeliest branches: node i holds a token and the node it follows (`parents[i]`, -1 for the last
emitted token, the root). The target scores the root and every node in one pass, each row attending to the context
and to its own ancestors only (`ancestry`), at the position its depth gives it (`depths`), so each row's distribution
is the one a chain along that branch would get. The walk (engine.decoding.sampling.verify_tree) then follows the
branch the target itself takes, and the target's cache keeps only the rows of that branch (`LeanCache.keep`).

Which nodes to verify (`select`): EAGLE-2 ranks nodes by their path confidence, the product of the drafter's
probabilities along the branch, which estimates the chance the target walks through them; the expected accepted
length of a tree is the sum of its nodes' chances. A verify pass grows dearer with its rows on a CPU (engine.decoding.
runtime.measure_verify_costs), so the tree keeps the top nodes that give the most expected tokens per unit of target
time, as adaptive prompt lookup sizes its drafts. Ranked by confidence, a kept node's ancestors are kept too.
"""

from __future__ import annotations

import math

import torch


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (1 for a child of the root); parents come before their children."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ancestry(parents: list[int]) -> torch.Tensor:
    """(n + 1, n + 1) bool: row r may see row s, for the root (row 0) and node i (row i + 1): s is r or above it."""
    n = len(parents)
    seen = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    seen[:, 0] = True
    for i, parent in enumerate(parents):
        seen[i + 1] = seen[parent + 1]
        seen[i + 1, i + 1] = True
    return seen


def layout(parents: list[int], past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify pass over the root and a tree's nodes after `past` cached tokens: each row's position (rows,), float32,
    and which keys it sees (rows, past + rows): the cached ones, its ancestors and itself."""
    positions = torch.tensor([past] + [past + d for d in depths(parents)], dtype=torch.float32)
    mask = torch.ones((len(parents) + 1, past + len(parents) + 1), dtype=torch.bool)
    mask[:, past:] = ancestry(parents)
    return positions, mask


def branch(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node`, in order."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def select(scores: list[float], parents: list[int], costs: list[float] | None, most: int,
           trust: float = 1.0) -> list[int]:  # fmt: skip
    """The nodes worth verifying, ancestors first: the top of `scores` (log path confidences, a child never above
    its parent) up to the count with the most expected tokens per unit of target time, (1 + trust x the sum of
    their confidences) / costs[count] (costs[k]: a pass of k + 1 rows over a one-token pass); without costs, the
    top `most`. `trust` scales the confidences by how well they have matched what the target kept."""
    level = depths(parents)
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], level[i], i))[:most]
    if costs is None:
        count = len(order)
    else:
        count, best, expected = 0, 1.0 / costs[0], 1.0
        for k, node in enumerate(order[: len(costs) - 1], 1):
            expected += trust * math.exp(scores[node])
            if expected / costs[k] > best:
                count, best = k, expected / costs[k]
    kept = set(order[:count])
    for node in list(kept):  # ties aside, a node's ancestors rank above it; make sure
        kept.update(branch(parents, node))
    return sorted(kept, key=lambda i: (level[i], -scores[i], i))


def reindex(nodes: list[int], parents: list[int]) -> list[int]:
    """Parents of the kept `nodes` (ancestors first) as indices into `nodes` (-1: the root)."""
    at = {node: i for i, node in enumerate(nodes)}
    return [at[parents[n]] if parents[n] >= 0 else -1 for n in nodes]

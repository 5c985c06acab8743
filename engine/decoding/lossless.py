"""Did speculation change the output? The verdict on a greedy comparison, from evidence.

With greedy decoding the speculative ids must equal the baseline's. In float32 they do. In 16-bit dtypes a
verify pass over k+1 tokens runs other kernels, with other reduction orders, than a one-token decode pass,
and where the target's two best tokens are closer than the dtype can resolve, the two passes may pick
different ones: both are the target's greedy choice within rounding, and from there the two texts go their
own ways. Every engine says so (vLLM: lossless "up to the precision limits of hardware numerics").

A bug looks different: at the first differing token, the token one run chose is far behind in the other's
pass. So both loops keep, for every token they emit, the two best candidates of the pass that chose it and
their scores (logits; a server's log-probabilities differ from them by a constant per position, so their
gaps are the same), and `judge` reads the first position where the runs part:

- identical: the same ids;
- rounding: at the first difference, each run's token led the other's by no more than the rounding these two
  runs showed on the tokens they share (see NOISE_FACTOR), in both passes;
- differs: one pass preferred its token by more than that: not rounding, a bug;
- unjudged: the backend reported no scores there, or the other run's token was not among a pass's two best
  while those two were within rounding of each other (a three-way tie), so the cause cannot be told.

Strict mode (engine.decoding.runtime.forward's `width`) runs every target pass of both runs at one width, so the
kernels and their rounding are the same and even 16-bit greedy ids come out identical. Where every pass runs our
fused kernels on a CPU, each row already rounds as a one-token pass does, whatever the pass's size: no width is
needed, and a run that parts is judged a bug (`exact`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
# How far two passes may move a logit by rounding alone. Each comparison measures it: where both runs still
# agree, the same token's logit in the baseline's pass and in the verify pass differ by rounding only, and a
# flip is rounding when it needs no more than twice the largest such move (NOISE_FACTOR), held between
# FLOOR_ULPS and CEILING_ULPS units in the last place of the dtype at that logit's size. On the bundled model
# in bfloat16 (CPU) the moves reached 1-17 ulp (most 2-5); a bug moves logits by whole units (in bfloat16 at
# a logit of 16, one unit is 16 ulp), and the ceiling keeps a run whose prefix was already off from passing.
NOISE_FACTOR = 2.0
FLOOR_ULPS, CEILING_ULPS = 4, 64


def ulp(dtype: str, size: float) -> float:
    """One unit in the last place of `dtype` at a value of `size`."""
    bits = MANTISSA_BITS.get(dtype, MANTISSA_BITS["float32"])
    return 2.0 ** (math.floor(math.log2(max(abs(size), 1e-3))) - bits)


def top_two(logits: torch.Tensor) -> list[list]:
    """[first id, its score, second id, its score] per row of (n, V) scores: kept for every emitted token."""
    values, ids = torch.topk(logits.float(), 2, dim=-1)  # (n, 2) each
    return [[a, x, b, y] for (a, b), (x, y) in zip(ids.tolist(), values.tolist())]


@dataclass
class Judgement:
    kind: str  # "identical" | "rounding" | "differs" | "unjudged" | "sampled" | "stopped"
    message: str  # one sentence for people
    position: int | None = None  # the first differing new token (0-based)
    agreed: int | None = None  # new tokens both runs share before it
    evidence: dict = field(default_factory=dict)  # the candidates, their scores in both passes, the tolerance

    @property
    def lossless(self) -> bool | None:
        """True for identical or rounding, False for a real difference, None where nothing can be said."""
        return {"identical": True, "rounding": True, "differs": False}.get(self.kind)

    def to_dict(self) -> dict:
        return asdict(self)


def tops(steps) -> list[list | None]:
    """The top-two record of every emitted token of a run, in order (None where a backend kept none)."""
    out: list[list | None] = []
    for s in steps:
        kept = getattr(s, "top", None) or []
        out += [kept[i] if i < len(kept) and kept[i] else None for i in range(len(s.tokens))]
    return out


def _gap(top: list | None, chosen: int, other: int) -> tuple[float | None, str]:
    """How far `chosen` led `other` in one pass: (gap, "") when both are among its two best, (a lower bound,
    "bound") when `other` is not, (None, "none") when the pass kept no record of `chosen`. Exact ties are
    common in 16 bits, and topk may list tied tokens in either order, so the record is read as a mapping."""
    if top is None:
        return None, "none"
    scores = {top[0]: top[1], top[2]: top[3]}
    if chosen not in scores:
        return None, "none"
    if other in scores:
        return scores[chosen] - scores[other], ""
    return scores[chosen] - min(top[1], top[3]), "bound"


def rounding_seen(base: list, spec: list, upto: int) -> float:
    """The largest move of one token's score between the two runs' passes over the first `upto` tokens, where
    both chose the same token: what rounding alone did in this pair of runs."""
    moved = 0.0
    for x, y in zip(base[:upto], spec[:upto]):
        if x is None or y is None:
            continue
        for token, score in ((x[0], x[1]), (x[2], x[3])):
            other = {y[0]: y[1], y[2]: y[3]}.get(token)
            if other is not None:
                moved = max(moved, abs(score - other))
    return moved


def judge(base_steps, spec_steps, base_ids: list[int], spec_ids: list[int], dtype: str, decode=None,
          exact: bool = False) -> Judgement:  # fmt: skip
    """The verdict on two greedy runs of the same prompt: see the module docstring. `decode` turns one id into
    its text for the message. `exact`: every target pass rounded each row as a one-token pass does (our fused
    kernels: engine.decoding.lean.rounds_alike), so no rounding can part the runs, and a difference is a bug."""
    if base_ids == spec_ids:
        return Judgement("identical", "outputs identical (lossless)", agreed=len(base_ids))
    i = next((k for k, (a, b) in enumerate(zip(base_ids, spec_ids)) if a != b), min(len(base_ids), len(spec_ids)))
    if i >= min(len(base_ids), len(spec_ids)):
        return Judgement("unjudged", f"identical for the first {i} tokens, then one run ended before the other",
                         i, i)  # fmt: skip
    a, b = base_ids[i], spec_ids[i]
    words = {t: repr(decode([t])) if decode else str(t) for t in (a, b)}
    head = (f"identical for the first {i} tokens; at token {i + 1} the baseline chose {words[a]} and speculation "
            f"{words[b]}")  # fmt: skip
    if exact:
        return Judgement("differs", f"{head}, where every target pass rounds each row as a one-token pass does (our "
                         "fused kernels), so rounding cannot part them: this is a bug, please report it", i, i)
    base_tops, spec_tops = tops(base_steps), tops(spec_steps)
    base_top, spec_top = base_tops[i], spec_tops[i]
    if base_top is None or spec_top is None:
        return Judgement("unjudged", f"{head}, and the backend reported no scores there: the cause cannot be judged",
                         i, i)  # fmt: skip
    unit = ulp(dtype, max(abs(base_top[1]), abs(spec_top[1])))
    seen = rounding_seen(base_tops, spec_tops, i)
    tol = min(max(NOISE_FACTOR * seen, FLOOR_ULPS * unit), CEILING_ULPS * unit)
    base_gap, base_how = _gap(base_top, a, b)
    spec_gap, spec_how = _gap(spec_top, b, a)
    evidence = {"baseline_token": a, "speculative_token": b, "baseline_top2": base_top, "speculative_top2": spec_top,
                "baseline_gap": base_gap, "speculative_gap": spec_gap, "rounding_seen": seen, "tolerance": tol,
                "ulp": unit, "dtype": dtype}  # fmt: skip
    if base_gap is None or spec_gap is None:
        return Judgement("unjudged", f"{head}, and the runs' records there do not cover both tokens", i, i, evidence)
    gap = max(base_gap, spec_gap)
    if gap > tol:
        which = "baseline's" if base_gap > tol else "verify"
        return Judgement("differs", f"{head}; the {which} pass preferred its token by {gap:.3g}, beyond {dtype} "
                         f"rounding ({tol:.2g}; rounding moved the shared tokens' logits by up to {seen:.2g}): this "
                         "is a bug, please report it", i, i, evidence)  # fmt: skip
    if "bound" in (base_how, spec_how):
        return Judgement("unjudged", f"{head}; three or more tokens were within {dtype} rounding of each other there, "
                         "so the cause cannot be told from the two best", i, i, evidence)  # fmt: skip
    return Judgement("rounding", f"{head}: the two passes' logits for them differ by less than {dtype} rounding "
                     f"({gap:.2g} <= {tol:.2g}; on the shared tokens rounding moved logits by up to {seen:.2g}), so "
                     "both are the target's greedy choice", i, i, evidence)  # fmt: skip

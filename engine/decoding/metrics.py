"""Step events and the run summary computed from them.

Every decoding loop yields one StepEvent per target forward pass. A RunResult is derived from the
events alone, so whatever a consumer sees streaming is exactly what the summary counts.

Terms (Leviathan et al. 2023): alpha is the probability that a draft token is accepted, given that
every draft token before it was (tokens after a rejection are never tested); gamma the number of draft
tokens per step; c the cost of drafting one token relative to one target pass. The plainer
acceptance rate, accepted / drafted, counts the untested tokens as failures, so it is lower than alpha
whenever drafts get rejected mid-way; both are reported. The expected
speedup of a step that drafts gamma tokens is

    (1 - alpha^(gamma+1)) / ((1 - alpha) * (gamma * c + 1)),

which assumes verifying gamma+1 tokens costs one target pass; on bandwidth-bound hardware that holds
roughly, on a CPU less so (see README).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepEvent:
    step: int  # 0 is the prefill, which yields the first token
    kind: str  # how `token` came about: "prefill" | "target" (no draft) | "correction" | "bonus";
    # "stopped" marks a run cancelled by the caller (no tokens, no pass)
    tokens: list[int]  # emitted this step, in order: accepted drafts, then `token` (unless cut by EOS/limit)
    pieces: list[str]  # decoded text of each emitted token ("" while a character is incomplete)
    drafted: list[int] = field(default_factory=list)  # the draft's proposal (a tree: the tokens of the branch the
    # target took, then the candidates it turned down there)
    tree: int = 0  # nodes of the draft tree the target verified (0: the draft was a chain)
    p: list[float] = field(default_factory=list)  # target probability of each drafted token
    q: list[float] = field(default_factory=list)  # draft probability of each drafted token (1.0 if one-hot)
    accepted: int = 0  # how many drafted tokens were kept (a prefix)
    rejected_pieces: list[str] = field(default_factory=list)  # text of each rejected draft token, for display
    token: int | None = None  # the target's own token; None when EOS inside the accepted drafts ended the run
    token_p: float | None = None  # its probability under the target
    draft_s: float = 0.0
    verify_s: float = 0.0  # the target forward (prefill on step 0)
    other_s: float = 0.0  # acceptance, cache roll-back, detokenising
    elapsed_s: float = 0.0  # engine clock since the run began, excluding the consumer's time between events
    draft_passes: int = 0
    draft_note: str = ""  # why the draft was shorter than asked, when the drafter says (a confidence stop)
    top: list[list] = field(default_factory=list)  # greedy: per emitted token, [first id, score, second id,
    # score] of the pass that chose it (engine.decoding.lossless); empty where not kept
    finished: str | None = None  # "eos" | "length" | "stopped" on the last event

    def to_dict(self) -> dict:
        return asdict(self)


def leviathan_speedup(alpha: float, gamma: float, c: float) -> float:
    """Expected walltime improvement factor for acceptance rate alpha, draft length gamma, cost ratio c."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        tokens = gamma + 1
    else:
        tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


@dataclass
class Metrics:
    new_tokens: int
    ttft_s: float
    total_s: float
    tokens_per_s: float  # decode speed: tokens after the first, over the time after the first
    target_passes: int  # prefill included
    draft_passes: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None  # accepted / drafted; None when nothing was drafted
    alpha: float | None  # accepted / tested: per-token acceptance, what Leviathan's formula expects
    mean_accepted_length: float  # tokens emitted per target pass after the prefill (1.0 for baseline)
    per_position_acceptance: list[float | None]  # P(accept draft i | drafts 1..i-1 accepted), i = 1..
    accepted_length_hist: list[int]  # steps with a draft that accepted 0, 1, ..., gamma of its tokens
    no_draft_steps: int  # decode steps where the drafter proposed nothing (the target decoded alone)
    prefill_s: float
    draft_s: float
    verify_s: float
    overhead_s: float
    mean_gamma: float  # draft tokens per decode step (a tree: of the branch the target walked)
    tree_nodes: float | None  # draft tree nodes verified per decode step; None for chains
    cost_ratio_c: float | None  # time to draft one token (a tree: one drafter pass) / time of one verify pass
    predicted_speedup: float | None  # Leviathan et al., from the measured alpha, gamma and c
    finish_reason: str | None


@dataclass
class RunResult:
    mode: str  # "baseline" | "speculative"
    token_ids: list[int]
    text: str
    metrics: Metrics
    steps: list[StepEvent]

    def to_dict(self, with_steps: bool = True) -> dict:
        out = {"mode": self.mode, "token_ids": self.token_ids, "text": self.text, "metrics": asdict(self.metrics)}
        if with_steps:
            out["steps"] = [s.to_dict() for s in self.steps]
        return out


def position_counts(decode: list[StepEvent]) -> list[tuple[int, int]]:
    """Per draft position i: (steps that drafted i with drafts 1..i-1 all accepted, of those, steps keeping i). A
    tree's position is its depth: its `drafted` holds the branch taken, then the candidates turned down below it, which
    sit at one depth and are counted there once."""
    longest = max((min(len(s.drafted), s.accepted + 1) if s.tree else len(s.drafted) for s in decode), default=0)
    reached, kept = [0] * longest, [0] * longest
    for s in decode:
        for i in range(min(len(s.drafted), s.accepted + 1)):
            reached[i] += 1
            kept[i] += i < s.accepted
    return list(zip(reached, kept))


def summarise(mode: str, steps: list[StepEvent], text: str) -> RunResult:
    """Turn a finished run's events into a RunResult."""
    if not steps:
        raise ValueError("a run yields at least its prefill event")
    passes = [s for s in steps if s.kind != "stopped"]  # a stop marker is not a target pass
    decode = passes[1:]
    ids = [t for s in passes for t in s.tokens]
    ttft, total = passes[0].elapsed_s, passes[-1].elapsed_s
    drafted = sum(len(s.drafted) for s in decode)
    accepted = sum(s.accepted for s in decode)
    draft_s = sum(s.draft_s for s in decode)
    verify_s = sum(s.verify_s for s in decode)
    counts = position_counts(decode)
    tested = sum(r for r, _ in counts)
    alpha = sum(k for _, k in counts) / tested if tested else None
    # a tree's depth is its drafter's passes, each drafting a level: the formula's gamma and c count those
    trees = [s for s in decode if s.tree]
    depth = [s.draft_passes if trees else len(s.drafted) for s in decode]
    units = sum(depth)
    # c is unknown where drafting is not timed apart from verifying (a server backend reports no draft time)
    c = (draft_s / units) / (verify_s / len(decode)) if units and verify_s > 0 and draft_s > 0 else None
    # Leviathan's formula per step, summed: exact for a constant gamma, fair when gamma varies
    predicted = None
    if alpha is not None and c is not None:
        gained = sum(leviathan_speedup(alpha, g, c) * (g * c + 1) for g in depth)
        predicted = gained / sum(g * c + 1 for g in depth)
    rates = [k / r if r else None for r, k in counts]
    hist = [0] * (len(counts) + 1)
    for s in decode:
        if s.drafted:
            hist[s.accepted] += 1
    metrics = Metrics(
        new_tokens=len(ids),
        ttft_s=ttft,
        total_s=total,
        tokens_per_s=(len(ids) - 1) / (total - ttft) if len(ids) > 1 and total > ttft else 0.0,
        target_passes=len(passes),
        draft_passes=sum(s.draft_passes for s in passes),
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        alpha=alpha,
        mean_accepted_length=sum(len(s.tokens) for s in decode) / len(decode) if decode else 0.0,
        per_position_acceptance=rates,
        accepted_length_hist=hist,
        no_draft_steps=sum(not s.drafted for s in decode),
        prefill_s=passes[0].verify_s + passes[0].other_s,
        draft_s=draft_s,
        verify_s=verify_s,
        overhead_s=sum(s.other_s for s in decode),
        mean_gamma=drafted / len(decode) if decode else 0.0,
        tree_nodes=sum(s.tree for s in decode) / len(decode) if trees else None,
        cost_ratio_c=c,
        predicted_speedup=predicted,
        finish_reason=steps[-1].finished,
    )
    return RunResult(mode, ids, text, metrics, steps)

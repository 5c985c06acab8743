"""Why speculation lost, or won less than predicted, said with the run's own numbers.

A speculative run's speed against its baseline is exactly

    speedup = L / S

with L the tokens a speculative step kept (tokens per target pass, the prefill aside) and S the time of a
speculative step in baseline steps (a baseline step makes one token, so it is the unit a token costs alone).
Speculation pays when a step keeps more tokens than it costs. The in-process loop times the parts of S apart:
the verify pass V (one target pass over up to gamma+1 tokens), the drafting D (gamma draft tokens; c, as the summary
shows it, is one draft token's time over one verify pass's) and the rest (acceptance, cache roll-back,
detokenising). Leviathan's prediction (engine.decoding.metrics) counts V as one step and the rest as nothing, so a
costly verify pass is what usually makes a run fall short of it. The break-even and "what gamma would do" come from
the same predictor the Lab fits (engine.measure.predict), fed with this one run's acceptance and costs.

vLLM and llama.cpp report how many tokens each step drafted and kept, and send tokens as steps end, but not the
verify pass's time apart from the drafting's, nor the draft's probabilities: there S is measured whole (vLLM: the
client's clock at each streamed step; llama.cpp: the server's own clock) and the sentence says what it could not
measure.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile

from engine.measure.predict import expected_tokens, interpolate
from engine.settings import MAX_GAMMA

LESS = 0.8  # a win under this share of its prediction is explained too: it was not what the run's numbers promised
SERVERS = {"vllm": ("vLLM", "the client's clock at each streamed step"),
           "llama.cpp": ("llama.cpp", "the server's own clock")}  # fmt: skip


@dataclass
class StepCosts:
    """A speculative step in baseline steps' time, and what it kept. verify, draft and rest are None where the
    backend times whole steps only."""

    steps: int  # decode steps of the speculative run (its target passes after the prefill)
    kept: float  # L: tokens kept per step
    step: float  # S: a step's time in baseline steps
    depth: float  # draft tokens per step (a tree: drafter passes per step)
    verify: float | None = None
    draft: float | None = None
    rest: float | None = None


def step_costs(c) -> StepCosts | None:
    """S and, in process, its parts; None where a run has no decode step or no time to divide."""
    base, spec = c.baseline.metrics, c.speculative.metrics
    steps = spec.target_passes - 1
    if steps < 1 or base.tokens_per_s <= 0 or spec.total_s <= spec.ttft_s:
        return None
    unit = 1 / base.tokens_per_s  # one baseline step's time
    depth = (spec.draft_passes if spec.tree_nodes else spec.drafted_tokens) / steps
    costs = StepCosts(steps, spec.mean_accepted_length, (spec.total_s - spec.ttft_s) / steps / unit, depth)
    if c.settings.backend not in SERVERS:
        costs.verify = spec.verify_s / steps / unit
        costs.draft = spec.draft_s / steps / unit
        costs.rest = max(0.0, costs.step - costs.verify - costs.draft)  # overhead, and any time between the parts
    return costs


def tokens_at(alpha: float, gamma: int) -> float:
    """Tokens a step drafting gamma keeps on average at acceptance alpha (Leviathan)."""
    return expected_tokens([], alpha, gamma)


def alpha_to_pay(step: float, gamma: int) -> float | None:
    """The acceptance at which a step drafting gamma keeps `step` tokens: the break-even. None where even a draft
    that is always right keeps fewer (gamma + 1 tokens)."""
    if step >= gamma + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):  # tokens_at rises with alpha: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_at(mid, gamma) < step else (low, mid)
    return high


def other_gamma(spec, k: StepCosts, gamma: int) -> tuple[int, float]:
    """The gamma the predictor names best with this run's acceptance (per position) and costs: drafting at the run's
    cost per token, the verify pass's cost drawn from (0, 1) through (gamma, V) and beyond, the rest as it was."""
    alpha = spec.alpha or 0.0
    alphas = list(takewhile(lambda a: a is not None, spec.per_position_acceptance))
    per_token = k.draft / max(k.depth, 1e-9)

    def speedup(g: int) -> float:
        return expected_tokens(alphas, alpha, g) / (g * per_token + interpolate({gamma: k.verify}, g) + k.rest)

    return max(((g, speedup(g)) for g in range(1, MAX_GAMMA + 1)), key=lambda gs: gs[1])


def cheapest_cure(spec, k: StepCosts) -> str:
    """What to change when gamma alone does not pay: the part of a step that costs most beyond the one pass a token
    needs anyway."""
    extra = {"draft": k.draft, "verify": k.verify - 1, "rest": k.rest}
    worst = max(extra, key=extra.get)
    cure = {"draft": f"a cheaper drafter (drafting cost {k.draft:.2f} of a step's {k.step:.2f})",
            "verify": f"a device where a wider pass costs about one, such as a GPU (verifying cost {k.verify:.2f})",
            "rest": f"less work around the passes (it cost {k.rest:.2f})"}[worst]  # fmt: skip
    if (spec.alpha or 0.0) < 0.5:
        cure += f", or a drafter the target agrees with more often (alpha {spec.alpha or 0.0:.2f})"
    return cure


def better_gamma(spec, k: StepCosts, gamma: int) -> str:
    """The predictor's better gamma for this run's acceptance and costs, where one does better than this run."""
    if spec.tree_nodes:
        return ""  # the predictor's curve is for chains
    best, predicted = other_gamma(spec, k, gamma)
    if best == gamma or predicted <= max(1.0, k.kept / k.step):
        return ""
    return f"with this acceptance and these costs gamma {best} would do about {predicted:.2f}x"


def what_would_pay(c, k: StepCosts) -> str:
    """After a loss: the break-even and what to try, from the predictor."""
    spec = c.speculative.metrics
    if not spec.drafted_tokens:
        return (f"The drafter proposed nothing in any of the {k.steps} steps, so only another drafter, or for prompt "
                "lookup a prompt that repeats itself, can pay here.")  # fmt: skip
    if spec.no_draft_steps * 2 > k.steps:
        return (f"{spec.no_draft_steps} of the {k.steps} steps found nothing to draft and kept one token each: a "
                "drafter that finds drafts more often (another drafter, or a prompt that repeats itself) would pay "
                "sooner.")  # fmt: skip
    gamma = max(1, round(k.depth))
    # a confidence stop or an adaptive draft drafts fewer than gamma: the break-even is for what it drafted
    at = f"gamma {gamma}" if gamma == c.settings.gamma else f"{gamma} draft tokens a step (gamma {c.settings.gamma} " \
        "the most)"  # fmt: skip
    need = alpha_to_pay(k.step, gamma)
    if need is None:
        seen = (f"At {at} even a draft that is always right keeps {gamma + 1} tokens, under the {k.step:.2f} a step "
                "costs")  # fmt: skip
    else:
        seen = f"To pay at {at} it needs alpha above {need:.2f} (it had {spec.alpha or 0.0:.2f})"
    other = better_gamma(spec, k, gamma)
    if other:
        return f"{seen}; {other}."
    return f"{seen}; no other gamma pays with this acceptance and these costs: try {cheapest_cure(spec, k)}."


def in_process(c, k: StepCosts, predicted: float | None) -> str:
    spec, speedup = c.speculative.metrics, c.speedup
    cost = f" at c = {spec.cost_ratio_c:.3f} a {'drafter pass' if spec.tree_nodes else 'token'}" \
        if spec.cost_ratio_c is not None else ""  # fmt: skip
    parts = (f"a speculative step took {k.step:.2f} baseline steps' time (verifying {k.verify:.2f}, drafting "
             f"{k.draft:.2f}{cost}, the rest {k.rest:.2f}) and kept {k.kept:.2f} tokens")  # fmt: skip
    promise = f"this run's acceptance and c predict {predicted or 0.0:.2f}x, counting a verify pass as one step"
    if speedup < 1.0:
        head = f"Speculation lost here ({speedup:.2f}x" + (f"; {promise}" if predicted else "") + f"): {parts}, "
        return head + "and a step pays only when it keeps more tokens than it costs. " + what_would_pay(c, k)
    other = better_gamma(spec, k, max(1, round(k.depth)))
    more = other[0].upper() + other[1:] if other else f"To win more, try {cheapest_cure(spec, k)}"
    return f"Speculation won {speedup:.2f}x where {promise}: {parts}. {more}."


def on_server(c, k: StepCosts) -> str:
    spec = c.speculative.metrics
    engine, clock = SERVERS[c.settings.backend]
    return (f"Speculation lost here ({c.speedup:.2f}x): {engine} reports {k.kept:.2f} tokens kept per step "
            f"({spec.accepted_tokens} of {spec.drafted_tokens} draft tokens accepted) and a speculative step took "
            f"{k.step:.2f} baseline steps' time by {clock}, so a step would pay only by keeping more than {k.step:.2f} "
            f"tokens. {engine} does not report how that time splits between the verify pass and drafting, nor the "
            "draft's probabilities, so the verify cost and c could not be measured there: try a smaller gamma or a "
            "cheaper drafter, or the transformers backend to see the split.")  # fmt: skip


def explain(c) -> str:
    """Why this comparison's speculation lost, or won under LESS of its prediction, in one or two sentences from
    its own numbers; "" when it won about as predicted, or was stopped."""
    if c.stopped or c.speedup is None:
        return ""
    predicted = c.speculative.metrics.predicted_speedup
    short = predicted is not None and c.speedup < LESS * predicted
    if c.speedup >= 1.0 and not short:
        return ""
    k = step_costs(c)
    if k is None:
        return ""
    if k.verify is None:
        return on_server(c, k) if c.speedup < 1.0 else ""
    return in_process(c, k, predicted)

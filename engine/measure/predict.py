"""Predict speedup over gamma from measured acceptance and costs, and name the best gamma.

Leviathan et al. (2023): with acceptance rate alpha and draft cost c (one draft token relative to one
target step), a step that drafts gamma tokens emits on average (1 - alpha^(gamma+1)) / (1 - alpha)
tokens and costs gamma*c + 1 target steps. Two refinements, both from measurements:

- alpha per position: acceptance often falls along the draft, so the expected tokens per step are
  1 + sum_i prod_{j<=i} alpha_j, with alpha_j pooled over every run (the overall alpha past the data);
- the verify cost V(gamma): checking gamma+1 tokens in one pass is not free on every device (on a CPU
  it grows clearly with gamma), so the denominator is gamma*c + V(gamma), V measured per swept gamma
  relative to one baseline step and interpolated linearly between them (V(0) = 1).

The paper's curve (V = 1, one alpha) is reported beside it.
"""

from __future__ import annotations

import statistics

from engine.decoding.metrics import leviathan_speedup
from engine.settings import MAX_GAMMA


def expected_tokens(alphas: list[float], alpha: float, gamma: int) -> float:
    """Mean tokens emitted by a step drafting gamma tokens, with per-position acceptance alphas."""
    total, survive = 1.0, 1.0
    for i in range(gamma):
        survive *= alphas[i] if i < len(alphas) else alpha
        total += survive
    return total


def interpolate(points: dict[int, float], gamma: int) -> float:
    """V(gamma) from measured points: at least 1 and never falling with gamma (noise can make a longer
    verify pass look cheaper; physics cannot), linear between (0, 1) and the points, and beyond the last
    point the least-squares slope of V - 1 over gamma."""
    pts, level = {0: 1.0}, 1.0
    for g in sorted(points):
        level = max(level, points[g])
        pts[g] = level
    xs = sorted(pts)
    for a, b in zip(xs, xs[1:]):
        if gamma <= b:
            return pts[a] + (pts[b] - pts[a]) * (gamma - a) / (b - a)
    slope = max(0.0, sum(g * (pts[g] - 1) for g in xs) / sum(g * g for g in xs)) if len(xs) > 1 else 0.0
    return pts[xs[-1]] + slope * (gamma - xs[-1])


def step_cost(c: float, verify: dict[int, float], gamma: int) -> float:
    """What a step drafting gamma tokens costs, in one-token target passes: gamma drafts at c each, then V(gamma)."""
    return gamma * c + interpolate(verify, gamma)


def predict(alphas: list[float], alpha: float, c: float, verify: dict[int, float], gamma: int) -> float:
    return expected_tokens(alphas, alpha, gamma) / step_cost(c, verify, gamma)


def fit(cells: list) -> dict:
    """One drafter at one temperature, over the gammas swept: alpha(s), c, V, the curve and a verdict."""
    samples = [s for cell in cells for s in cell.samples]
    pooled: list[list[int]] = []
    for s in samples:
        for i, (reached, kept) in enumerate(s.positions):
            if i == len(pooled):
                pooled.append([0, 0])
            pooled[i][0] += reached
            pooled[i][1] += kept
    tested = sum(r for r, _ in pooled)
    alpha = sum(k for _, k in pooled) / tested if tested else 0.0  # per tested token, as the formula means
    alphas = [k / r for r, k in pooled if r >= 5]  # positions with too little data fall back to alpha
    alphas = alphas[: next((i for i, (r, _) in enumerate(pooled) if r < 5), len(pooled))]
    ratios = [s.draft_token_s / s.baseline_step_s for s in samples if s.draft_token_s and s.baseline_step_s]
    # a server backend times whole steps: drafting is inside V, and c is not known apart (0 in the formula)
    c = statistics.median(ratios) if ratios else 0.0
    verify = {}
    for cell in cells:
        vs = [s.verify_pass_s / s.baseline_step_s for s in cell.samples if s.baseline_step_s]
        if vs:
            verify[cell.gamma] = statistics.median(vs)
    measured = {cell.gamma: statistics.median([s.speedup for s in cell.samples]) for cell in cells if cell.samples}
    curve = [
        {"gamma": g, "predicted": predict(alphas, alpha, c, verify, g), "paper": leviathan_speedup(alpha, g, c),
         "measured": measured.get(g), "extrapolated": g > max(verify, default=0)}
        for g in range(1, MAX_GAMMA + 1)
    ]  # fmt: skip
    best_measured = max(measured, key=measured.get) if measured else None
    # beyond the largest gamma measured V is extrapolated: name a predicted best only inside the data
    inside = [p for p in curve if p["gamma"] <= max(verify, default=MAX_GAMMA)]
    best_predicted = max(inside, key=lambda p: p["predicted"])
    return {
        "drafter": cells[0].drafter,
        "temperature": cells[0].temperature,
        "p_min": cells[0].p_min,
        "topk": cells[0].topk,
        "alpha": alpha,
        "alpha_by_position": alphas,
        "cost_ratio_c": c if ratios else None,
        "verify_cost": [{"gamma": g, "cost": v} for g, v in sorted(verify.items())],
        "curve": curve,
        "best_gamma": best_measured,
        "best_speedup": measured.get(best_measured) if best_measured else None,
        "best_predicted_gamma": best_predicted["gamma"],
        "best_predicted_speedup": best_predicted["predicted"],
        "verdict": verdict(alpha, c, verify, best_measured, measured, best_predicted, c_known=bool(ratios),
                           pairs=len(samples), tested=tested),  # fmt: skip
    }


FEW_PAIRS, FEW_TESTED = 2, 20  # below either, a verdict says its sample is too small to conclude from


def verdict(alpha, c, verify, best_gamma, measured, best_predicted, c_known: bool = True, pairs: int = FEW_PAIRS,
            tested: int = FEW_TESTED) -> str:  # fmt: skip
    """One plain sentence from the numbers it shows: which gamma to use, or why nothing wins here; and whether the
    sample (`pairs` A/B pairs, `tested` draft tokens the target checked) is too small to conclude anything."""
    few = (f" Too few samples to conclude ({pairs} A/B pair(s), {tested} draft token(s) checked): add prompts, "
           "repeats or new tokens." if pairs < FEW_PAIRS or tested < FEW_TESTED else "")  # fmt: skip
    cost = f"c {c:.3f}" if c_known else "drafting timed within each step"
    if best_gamma is not None and measured[best_gamma] > 1.0:
        return (
            f"use gamma {best_gamma}: measured {measured[best_gamma]:.2f}x "
            f"(alpha {alpha:.2f}, {cost}; the model predicts {best_predicted['predicted']:.2f}x at "
            f"gamma {best_predicted['gamma']})." + few
        )
    if not c_known:  # a server backend: drafting is timed inside each step
        g = max(verify, key=verify.get) if verify else 1
        v, brings = verify.get(g, 1.0), leviathan_speedup(alpha, g, 0.0)
        if brings > v:  # the steps that drafted paid: the loss is in the steps that found nothing to draft
            why = (f"its drafting steps pay (a {g}-token draft costs {v:.2f} one-token steps and brings {brings:.2f} "
                   f"tokens at alpha = {alpha:.2f}), but too few steps found a draft to outweigh the rest")  # fmt: skip
        else:
            why = (f"a step that drafts {g} and verifies costs {v:.2f} one-token steps, more than the {brings:.2f} "
                   f"tokens it brings at alpha = {alpha:.2f}")  # fmt: skip
    elif alpha <= c:
        why = f"c = {c:.2f} is not below alpha = {alpha:.2f}: drafting a token costs more than it is worth"
    else:  # compare what a drafting step brings with what it costs, at the gamma that did best
        g = best_gamma if best_gamma is not None else min(verify, default=1)
        brings, costs = expected_tokens([], alpha, g), step_cost(c, verify, g)
        if brings <= costs:
            why = (f"at gamma {g} a step brings {brings:.2f} tokens (alpha = {alpha:.2f}) and costs {costs:.2f} "
                   f"one-token steps (drafting c = {c:.2f} a token, then verifying)")  # fmt: skip
        else:
            why = (f"its drafting steps pay (at gamma {g} one brings {brings:.2f} tokens at alpha = {alpha:.2f} and "
                   f"costs {costs:.2f} one-token steps), but too few steps found a draft, or the time around the "
                   "passes outweighs them")  # fmt: skip
    return f"break-even: this pair cannot win here because {why}. Best measured {max(measured.values()):.2f}x." + few


def fit_all(cells: list) -> list[dict]:
    """A fit per (drafter, temperature, confidence stop, tree top-k) found among the cells."""
    groups: dict[tuple, list] = {}
    for cell in cells:
        groups.setdefault((cell.drafter, cell.temperature, cell.p_min, cell.topk), []).append(cell)
    return [fit(group) for group in groups.values()]

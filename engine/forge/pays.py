"""Does it pay: the forged head against prompt lookup, suffix decoding and the target alone, on the held-out prompts.

The engine's own bench (engine.measure.bench.sweep): A/B pairs of the baseline (the target alone) and each drafter,
greedy, at every gamma up to the trained length for the head and at 4 for the n-gram drafters; the predictor
(engine.measure.predict) fitted to the same runs gives the expected speedup beside the measured one.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from engine.settings import Settings


def measure(cfg, held_out, summary: dict, progress=lambda done, total, what: None,
            stop: threading.Event | None = None) -> dict:  # fmt: skip
    from engine.measure.bench import sweep

    base = Settings(target=cfg.target, drafter="eagle3", draft=str(cfg.out), dtype=cfg.dtype, device=cfg.device,
                    max_new_tokens=cfg.pays_max_new_tokens, temperature=0.0, seed=cfg.seed)  # fmt: skip
    head = sweep(base, held_out, list(range(1, cfg.steps + 1)), [0.0], ["eagle3"], cfg.pays_repeats, progress, stop)
    others = sweep(replace(base, drafter="prompt-lookup", draft=""), held_out, [4], [0.0],
                   ["prompt-lookup", "suffix"], cfg.pays_repeats, progress, stop)  # fmt: skip
    return summarise(head, others, summary.get("held_out", {}).get("recommended", {}).get("gamma"))


def summarise(head: dict, others: dict, recommended: int | None) -> dict:
    fits = {f["drafter"]: f for f in head["fits"] + others["fits"]}
    rows = []
    for data in (head, others):
        for cell in data["cells"]:
            fit = fits.get(cell["drafter"], {})
            predicted = next((p["predicted"] for p in fit.get("curve", []) if p["gamma"] == cell["gamma"]), None)
            rows.append({"drafter": cell["drafter"], "gamma": cell["gamma"],
                         "speedup": cell["speedup"]["median"], "predicted": predicted,
                         "mean_accepted_length": cell["mean_accepted_length"]["median"],
                         "acceptance_rate": cell["acceptance_rate"]["median"], "identical": cell["all_identical"],
                         "by_category": {k: v["speedup"]["median"]
                                         for k, v in cell["by_category"].items()}})  # fmt: skip
    rows.append({"drafter": "target alone", "gamma": 0, "speedup": 1.0, "predicted": 1.0, "mean_accepted_length": 1.0,
                 "acceptance_rate": None, "identical": True, "by_category": {}})  # fmt: skip
    mine = [r for r in rows if r["drafter"] == "eagle3"]
    best = max(mine, key=lambda r: r["speedup"] or 0)
    at = next((r for r in mine if r["gamma"] == recommended), best)
    rivals = [r for r in rows if r["drafter"] in ("prompt-lookup", "suffix")]
    rival = max(rivals, key=lambda r: r["speedup"] or 0) if rivals else None
    verdict = (f"at the recommended gamma {at['gamma']} the head gives {at['speedup']:.2f}x (predicted "
               f"{at['predicted'] or 0:.2f}x), accepted length {at['mean_accepted_length']:.2f}; best gamma "
               f"{best['gamma']} {best['speedup']:.2f}x")  # fmt: skip
    if rival:
        verdict += f"; {rival['drafter']} {rival['speedup']:.2f}x on the same prompts"
    verdict += "." if all(r["identical"] is not False for r in mine) else " (ids differed from the baseline's!)"
    return {"rows": rows, "verdict": verdict, "head_fit": fits.get("eagle3"), "recommended": at,
            "prompts": head["prompt_set"]["ids"]}  # fmt: skip

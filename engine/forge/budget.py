"""The forge's clock: the wall-clock budget of a run and the plan that cuts it into phases once the target is loaded.

Every phase spends from one budget (ForgeConfig.minutes), the final measurement included: loading first (whatever it
takes), then a Plan made from what loading took and the target's one-token pass gives the data, training, export and
the measurement their seconds. A phase that ends early leaves the difference to the next (engine.forge.pipeline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

PAYS_SHARE = 0.3  # of the budget, the most the final measurement is planned to take: the rest makes the head
PROCESS_S = 10.0  # the measurement's own process: Python, torch and transformers imported before it loads the target
FLOORS = {"data": 10.0, "train": 5.0, "export": 5.0}  # seconds no phase gets less of, whatever the budget


class Budget:
    """Wall-clock budget of a run, from its start; each phase's seconds recorded."""

    def __init__(self, minutes: float):
        self.start = time.perf_counter()
        self.end = self.start + minutes * 60
        self.spent: dict[str, float] = {}
        self._phase, self._since = None, self.start

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if self._phase:
            self.spent[self._phase] = self.spent.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = name, now

    def left(self) -> float:
        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass
class Plan:
    """The budget cut into the phases' seconds, made once the target is loaded: what loading took, then the data,
    training (the vocabulary with it), export and the final measurement. The measurement is planned from the target's
    one-token pass (it runs A/B pairs of answers on the held-out prompts) and measures as many of those prompts as
    PAYS_SHARE of the budget allows, one at least. The seconds add up to the budget unless the FLOORS outgrow it (a
    budget of well under a minute): `over` says by how much."""

    load: float
    data: float
    train: float
    export: float
    pays: float
    prompts: int  # held-out prompts the measurement takes (the first ones of held-out.jsonl)
    held_out: int  # held-out prompts there are
    over: float = 0.0

    def seconds(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("load", "data", "train", "export", "pays")}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds().items() if k != "load")
        pays = ""
        if self.prompts:
            share = "all" if self.prompts == self.held_out else f"{self.prompts} of"
            pays = f"; the measurement takes {share} {self.held_out} held-out prompts"
        over = f"; {self.over:.0f} s over the budget: its floors outgrow it" if self.over > 0 else ""
        return f"plan after loading ({self.load:.0f} s): {parts}{pays}{over}"


def measured_cells(cfg, beside: int = 0) -> int:
    """The measurement's cells per prompt-turn: per trained gamma a chain (and for EAGLE-3 a tree), then prompt
    lookup and suffix, then `beside` chains of a head measured beside this one."""
    return (2 if cfg.kind == "eagle3" else 1) * cfg.steps + 2 + beside


def measurement_s(cfg, turns: list[int], pass_s: float, load_s: float, beside: int = 0) -> float:
    """Seconds the does-it-pay measurement of prompts with these turns is planned at: its process, the target loaded
    again, then per prompt-turn and cell a warm-up and `pays_repeats` A/B pairs of `pays_max_new_tokens` tokens, each
    side counted as one one-token pass a token (the speculative side takes fewer: a margin for prefills and the
    head's steps)."""
    from engine.compare import WARM_STEPS

    per_turn = measured_cells(cfg, beside) * (2 * WARM_STEPS + cfg.pays_repeats * 2 * cfg.pays_max_new_tokens) * pass_s
    return PROCESS_S + load_s + per_turn * sum(turns)


def plan_budget(cfg, load_s: float, pass_s: float, turns: list[int], beside: int = 0) -> Plan:
    """The phases' seconds for a budget of cfg.minutes (a ForgeConfig), `load_s` of it spent loading, a one-token
    pass of `pass_s`, held-out prompts of `turns` turns each and `beside` chains of another head measured (see
    Plan)."""
    budget = cfg.minutes * 60
    export = max(FLOORS["export"], 0.02 * budget)
    prompts, pays = 0, 0.0
    if cfg.pays and turns:
        fits = [k for k in range(1, len(turns) + 1)
                if measurement_s(cfg, turns[:k], pass_s, load_s, beside) <= PAYS_SHARE * budget]  # fmt: skip
        prompts = max(fits, default=1)
        pays = measurement_s(cfg, turns[:prompts], pass_s, load_s, beside)
    rest = budget - load_s - export - pays
    data = max(FLOORS["data"], cfg.data_share * rest)
    train = max(FLOORS["train"], rest - data)
    over = load_s + data + train + export + pays - budget
    return Plan(load_s, data, train, export, pays, prompts, len(turns), over)

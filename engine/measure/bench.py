"""Repeated A/B measurements: sweeps over gamma, temperature and drafter, on a prompt set by category.

Prompts come as a PromptSet (engine.measure.promptsets: the task suite, a file, a Hub dataset). A multi-turn
question runs as Spec-Bench runs it: each later turn is asked after the model's own answer to the earlier ones,
through the chat template, and each turn is its own sample. The answers are the first cell's baseline outputs,
kept for the whole sweep, so every cell measures the same conversations.

Every measurement is a pair of runs on one prompt, baseline and speculative, one after the other on the
same device, their order alternating between repeats so that drift (thermal, caches, other load) hits
both sides alike. Speedup is the ratio within a pair; a cell reports the median and the spread (min,
max) over its pairs. A warm-up on each prompt comes first.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from engine.backends.transformers import guarded
from engine.compare import open_backend, result_of, run, warm_up
from engine.decoding.lossless import judge
from engine.decoding.metrics import RunResult, position_counts
from engine.errors import UserError
from engine.measure.promptsets import PromptItem, PromptSet, Skip, as_set, too_long
from engine.measure.report import option_label
from engine.settings import TAKES_DRAFT, Settings

Progress = Callable[[int, int, str], None]  # (done, total, what)


def _quiet(done: int, total: int, what: str) -> None:
    pass


class Stopped(Exception):
    """The caller's stop flag was set between two measurements."""


@dataclass
class Sample:
    """One A/B pair on one prompt."""

    prompt: int
    repeat: int
    order: str  # "AB" (baseline first) or "BA"
    baseline_tps: float
    speculative_tps: float
    speedup: float
    acceptance_rate: float | None
    mean_accepted_length: float
    new_tokens: int
    identical: bool | None
    lossless: str | None  # greedy: the verdict (engine.decoding.lossless): identical, rounding, differs, unjudged
    baseline_step_s: float  # decode time per baseline token
    draft_token_s: float | None  # draft time per drafted token
    verify_pass_s: float  # verify time per decode pass
    drafted: int
    accepted: int
    positions: list[list[int]] = field(default_factory=list)  # per draft position: [reached, kept]
    item: str = ""  # the prompt set's item id
    turn: int = 1  # which turn of a multi-turn question (1 for single-turn prompts)
    tree_nodes: float | None = None  # draft tree nodes verified per step (None: chains)

    @classmethod
    def of(cls, prompt: int, repeat: int, order: str, base: RunResult, spec: RunResult, greedy: bool,
           dtype: str = "float32", exact: bool = False) -> "Sample":  # fmt: skip
        b, s = base.metrics, spec.metrics
        verdict = judge(base.steps, spec.steps, base.token_ids, spec.token_ids, dtype, exact=exact) if greedy else None
        decode_passes = max(s.target_passes - 1, 1)
        return cls(
            prompt=prompt,
            repeat=repeat,
            order=order,
            baseline_tps=b.tokens_per_s,
            speculative_tps=s.tokens_per_s,
            speedup=s.tokens_per_s / b.tokens_per_s if b.tokens_per_s else 0.0,
            acceptance_rate=s.acceptance_rate,
            mean_accepted_length=s.mean_accepted_length,
            new_tokens=s.new_tokens,
            identical=(base.token_ids == spec.token_ids) if greedy else None,
            lossless=verdict.kind if verdict else None,
            baseline_step_s=1 / b.tokens_per_s if b.tokens_per_s else 0.0,
            draft_token_s=s.draft_s / s.drafted_tokens if s.drafted_tokens else None,
            verify_pass_s=s.verify_s / decode_passes,
            drafted=s.drafted_tokens,
            accepted=s.accepted_tokens,
            positions=[list(p) for p in position_counts(spec.steps[1:])],
            tree_nodes=s.tree_nodes,
        )


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _all_identical(samples: list[Sample]) -> bool | None:
    """Greedy pairs: were all of them identical? None for sampled pairs, which are never compared."""
    compared = [s.identical for s in samples if s.identical is not None]
    return all(compared) if compared else None


VERDICTS = ("identical", "rounding", "unjudged", "differs")  # from best to worst


def worst(kinds) -> str | None:
    """The worst of some lossless verdicts (VERDICTS; None and anything else, a sampled pair's, are skipped), None
    when there are none."""
    kinds = [k for k in kinds if k in VERDICTS]
    return max(kinds, key=VERDICTS.index) if kinds else None


def worst_verdict(samples: list[Sample]) -> str | None:
    """Greedy pairs: the worst lossless verdict among them (a cell is as good as its worst pair); None when
    sampled."""
    return worst(s.lossless for s in samples)


def _stats(samples: list[Sample]) -> dict:
    return {
        "speedup": spread([s.speedup for s in samples]),
        "acceptance_rate": spread([s.acceptance_rate for s in samples]),
        "mean_accepted_length": spread([s.mean_accepted_length for s in samples]),
        "baseline_tps": spread([s.baseline_tps for s in samples]),
        "speculative_tps": spread([s.speculative_tps for s in samples]),
        "tree_nodes": spread([s.tree_nodes for s in samples]),
        "all_identical": _all_identical(samples),
        "lossless": worst_verdict(samples),
    }


def positions(samples: list[Sample]) -> list[list[int]]:
    """Per draft position, [reached, kept] summed over the samples: acceptance at position i is kept / reached."""
    longest = max((len(s.positions) for s in samples), default=0)
    total = [[0, 0] for _ in range(longest)]
    for s in samples:
        for i, (reached, kept) in enumerate(s.positions):
            total[i][0] += reached
            total[i][1] += kept
    return total


@dataclass
class Cell:
    drafter: str
    gamma: int
    temperature: float
    samples: list[Sample]
    categories: list[str]  # the category of each sample
    p_min: float = 0.0
    server_command: str = ""  # a server backend's speculative command line, exactly as it ran this cell
    topk: int = 1  # an EAGLE-3 head's candidates per position (above 1: a draft tree)

    def summary(self) -> dict:
        by_category = {}
        for name in dict.fromkeys(self.categories):
            by_category[name] = _stats([s for s, c in zip(self.samples, self.categories) if c == name])
        head = {"drafter": self.drafter, "gamma": self.gamma, "temperature": self.temperature, "p_min": self.p_min,
                "topk": self.topk}  # fmt: skip
        if self.server_command:
            head["server_command"] = self.server_command
        pooled = positions(self.samples)
        return head | _stats(self.samples) | {"by_category": by_category, "positions": pooled,
                                              "alpha": alpha_of(pooled)}  # fmt: skip


def alpha_of(pooled: list[list[int]]) -> float | None:
    """Alpha as the predictor means it: kept over checked draft tokens ([reached, kept] per position, pooled), not
    kept over drafted (the acceptance rate counts the tokens after a rejection, never checked, as rejected)."""
    checked = sum(r for r, _ in pooled)
    return sum(k for _, k in pooled) / checked if checked else None


def verdicts_by_cell(fits: list[dict], cells: list[Cell]) -> list[dict]:
    """Each fit's verdict said with the alpha of the cell it names (its best measured gamma's), the alpha the cells
    table shows for that cell; the predictor's own alpha pools every gamma of the fit (a verdict read 0.59 beside
    a table's 0.45). The pooled alpha still draws the curve."""
    from engine.measure.predict import verdict

    for fit in fits:
        key = (fit["drafter"], fit["temperature"], fit["p_min"], fit["topk"])
        group = [c for c in cells if (c.drafter, c.temperature, c.p_min, c.topk) == key]
        named = next((c for c in group if c.gamma == fit["best_gamma"]), None) or min(group, key=lambda c: c.gamma)
        alpha = alpha_of(positions(named.samples))
        if alpha is None:
            continue
        measured = {p["gamma"]: p["measured"] for p in fit["curve"] if p["measured"] is not None}
        best = next(p for p in fit["curve"] if p["gamma"] == fit["best_predicted_gamma"])
        samples = [s for c in group for s in c.samples]
        fit["verdict"] = verdict(alpha, fit["cost_ratio_c"] or 0.0, {v["gamma"]: v["cost"] for v in fit["verify_cost"]},
                                 fit["best_gamma"], measured, best, c_known=fit["cost_ratio_c"] is not None,
                                 pairs=len(samples), tested=sum(r for r, _ in positions(samples)))  # fmt: skip
        fit["verdict_alpha"] = {"gamma": named.gamma, "alpha": alpha}
    return fits


class Session:
    """An opened backend plus the settings every measurement shares; runs A/B pairs on demand."""

    def __init__(self, base: Settings, progress: Progress = _quiet, stop: threading.Event | None = None):
        self.base = base.validate()
        self._progress, self.stop = progress, stop
        self.at = (0, 1)  # the last (done, total) reported: a status line in between keeps the bar where it is
        from engine.decoding.suffix import SuffixMemory

        self.memory = SuffixMemory()  # the suffix drafter's: a cell's earlier prompts (sweep clears it per cell)
        self.backend = open_backend(base)
        self.backend.memory = self.memory
        self.environment = self.backend.environment
        self._references: dict[tuple, list[int]] = {}
        self.answer = ""  # the last ab()'s first baseline text: the model's own answer to that prompt
        self._warm: set[tuple] = set()

    def progress(self, done: int, total: int, what: str) -> None:
        self.at = (done, total)
        self._progress(done, total, what)

    def say(self, what: str) -> None:
        """A status line (a compile step of the warm-up, say) without moving the progress bar."""
        self._progress(*self.at, what)

    def ready_for(self, s: Settings) -> "Session":
        """The backend is opened again when a cell needs what it does not serve: a draft model that only a
        later cell uses, or (on a server backend) another speculative configuration."""
        if not self.backend.serves(s):
            self.backend = open_backend(s)
            self.backend.memory = self.memory
        return self

    def check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped()

    def baseline(self, ids: list[int], s: Settings) -> RunResult:
        return result_of(run("baseline", self.backend.baseline(ids, s), self.backend.decode))

    def speculative(self, ids: list[int], s: Settings, reference: list[int]) -> RunResult:
        return result_of(run("speculative", self.backend.speculative(ids, s, reference), self.backend.decode))

    def reference(self, prompt: str | list[dict], ids: list[int]) -> list[int]:
        """The target's greedy continuation, for the synthetic drafter (computed once per prompt)."""
        key = (_key(prompt), self.base.max_new_tokens)
        if key not in self._references:
            self._references[key] = self.baseline(ids, replace(self.base, temperature=0.0)).token_ids
        return self._references[key]

    def ab(self, s: Settings, prompt: str | list[dict], prompt_index: int, repeats: int) -> list[Sample]:
        """`repeats` A/B pairs on one prompt (a string, or a conversation's chat messages), alternating which
        side runs first. A warm-up comes first whenever the drafter, gamma, temperature or prompt changes."""
        self.ready_for(s)
        ids = self.backend.encode(prompt, s)
        reference = self.reference(prompt, ids) if s.drafter == "synthetic" else []
        key = (_key(prompt), s.drafter, s.gamma, s.temperature, s.p_min, s.topk)
        with guarded():
            if key not in self._warm:
                for status in warm_up(self.backend, ids, s):
                    self.say(status.message)
                self._warm.add(key)
            samples = []
            for r in range(repeats):
                self.check_stop()
                seeded = replace(s, seed=(s.seed or 0) + r)
                if r % 2 == 0:
                    base = self.baseline(ids, seeded)
                    spec = self.speculative(ids, seeded, reference)
                else:
                    spec = self.speculative(ids, seeded, reference)
                    base = self.baseline(ids, seeded)
                order = "AB" if r % 2 == 0 else "BA"
                if r == 0:
                    self.answer = base.text
                exact = bool((getattr(self.backend, "strict", None) or {}).get("exact"))  # engine.decoding.lossless
                samples.append(Sample.of(prompt_index, r, order, base, spec, s.sampling.greedy,
                                         self.environment.get("dtype", "float32"), exact))  # fmt: skip
        return samples


def _cell_settings(base: Settings, drafter: str, gamma: int, temperature: float, p_min: float = 0.0,
                   topk: int = 1) -> Settings:  # fmt: skip
    draft = base.draft if drafter in TAKES_DRAFT else ""
    draft_min = min(base.draft_min, gamma)
    return replace(base, drafter=drafter, draft=draft, gamma=gamma, temperature=temperature, p_min=p_min,
                   draft_min=draft_min, topk=topk).validate()  # fmt: skip



def _key(prompt: str | list[dict]) -> str:
    """A prompt as a dictionary key: a conversation by its JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def conversation(item: PromptItem, turn: int, answers: list[str]) -> str | list[dict]:
    """What the model is asked at `turn` (0-based): the first turn as a plain prompt; a later one as chat
    messages, the earlier turns each followed by the model's own answer (Spec-Bench's multi-turn protocol)."""
    if turn == 0:
        return item.turns[0]
    messages = []
    for question, answer in zip(item.turns[:turn], answers):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": item.turns[turn]}]


def fit_context(session: Session, prompts: PromptSet, s: Settings) -> PromptSet:
    """The set without the items whose first turn does not fit the context with max new tokens (each skipped,
    counted and said in the set's `skipped`)."""
    kept, skipped = [], list(prompts.skipped)
    for item in prompts.items:
        try:
            session.backend.encode(item.prompt, s)
            kept.append(item)
        except UserError as exc:
            if not too_long(exc):
                raise
            skipped.append(Skip(item.where or item.id, f"longer than the target's context: {exc}"))
    if not kept:
        raise UserError(f"every prompt of {prompts.name} is longer than the target's context with {s.max_new_tokens} "
                        "new tokens: lower max new tokens or use shorter prompts.")  # fmt: skip
    return PromptSet(prompts.name, prompts.fingerprint, prompts.layout, kept, skipped, prompts.selection)


def sweep(
    base: Settings,
    prompts: PromptSet | dict[str, list[str]],
    gammas: list[int],
    temperatures: list[float],
    drafters: list[str],
    repeats: int = 3,
    progress: Progress = _quiet,
    stop: threading.Event | None = None,
    p_mins: list[float] | None = None,
    topks: list[int] | None = None,
) -> dict:
    """Every (drafter, gamma, temperature, confidence stop, tree top-k) cell measured on every prompt of the set
    (each turn of a multi-turn question its own sample, grouped by category). The confidence stops apply to the
    draft model only, other drafters run at the first; the tree widths to the EAGLE-3 head only, others draft
    chains.

    A task-suite run is a sweep with one cell: its `by_category` gives speedup and acceptance per task.
    """
    p_mins = p_mins or [base.p_min]
    topks = topks or [base.topk]
    prompts = as_set(prompts)
    if not prompts.items or not gammas or not temperatures or not drafters:
        raise UserError("a sweep needs at least one prompt, gamma, temperature and drafter.")
    if repeats < 1:
        raise UserError(f"repeats {repeats} is out of range: use 1 or more.")
    if "draft-model" in drafters and not base.draft:
        raise UserError("the sweep includes the draft-model drafter but no draft model is set.")
    grid = [(d, g, t, p, k) for d in drafters for t in temperatures for g in gammas
            for p in (p_mins if d == "draft-model" else p_mins[:1])
            for k in (topks if d == "eagle3" else [1])]  # fmt: skip
    for cell in grid:  # every cell's settings are checked before hours of measuring start
        _cell_settings(base, *cell)
    started = time.perf_counter()
    session = Session(_cell_settings(base, *grid[0]), progress, stop)
    prompts = fit_context(session, prompts, session.base)
    answers: dict[tuple[str, int, float], str] = {}  # (item, turn, temperature) -> the model's answer, sweep-wide
    late: list[Skip] = []  # later turns that outgrew the context
    total, done, cells = len(grid) * prompts.turns(), 0, []
    for drafter, gamma, temperature, p_min, topk in grid:
        samples, categories = [], []
        session.memory.clear()  # each cell's prompts start from the same (empty) session
        stops = option_label(p_min, topk)
        cell = _cell_settings(base, drafter, gamma, temperature, p_min, topk)
        for i, item in enumerate(prompts.items):
            for turn in range(len(item.turns)):
                turn_name = f" turn {turn + 1}" if len(item.turns) > 1 else ""
                session.progress(done, total, f"{drafter}, gamma {gamma}, temperature {temperature}{stops}: "
                                 f"{item.category} {i + 1}{turn_name}")  # fmt: skip
                done += 1
                earlier = [answers[(item.id, k, temperature)] for k in range(turn)]
                try:
                    got = session.ab(cell, conversation(item, turn, earlier), len(samples) // repeats, repeats)
                except UserError as exc:
                    if not too_long(exc):
                        raise
                    where = f"{item.where or item.id} turn {turn + 1}"
                    if where not in {k.where for k in late}:  # said once, not once per cell
                        late.append(Skip(where, f"after the earlier answers, longer than the target's context: {exc}"))
                    done += len(item.turns) - turn - 1
                    break
                answers.setdefault((item.id, turn, temperature), session.answer)
                samples += [replace(x, item=item.id, turn=turn + 1) for x in got]
                categories += [item.category] * len(got)
        command = getattr(session.backend, "command_line", lambda: "")()
        cells.append(Cell(drafter, gamma, temperature, samples, categories, p_min, command, topk))
    progress(total, total, "done")
    from engine.measure.predict import fit_all

    settings = _settings(base, prompts, repeats) | {"gammas": gammas, "temperatures": temperatures,
                                                    "drafters": drafters, "p_mins": p_mins, "topks": topks}  # fmt: skip
    measured = sum(len(c.samples) for c in cells) // repeats
    wall = time.perf_counter() - started
    described = prompts.describe() | {"skipped": [asdict(k) for k in prompts.skipped + late]}
    return {
        "kind": "sweep",
        "settings": settings,
        "prompt_set": described,
        # strict mode is settled at the first run, after the environment was read at load
        "environment": session.environment | {"strict": getattr(session.backend, "strict", None)},
        "cells": [c.summary() for c in cells],
        "samples": [
            dict(cell=i, category=cat, **asdict(s))
            for i, c in enumerate(cells)
            for s, cat in zip(c.samples, c.categories)
        ],  # fmt: skip
        "fits": verdicts_by_cell(fit_all(cells), cells),
        # wall time of the whole sweep (loading, warm-ups, every A/B pair) per prompt-turn and cell measured
        "timing": {"wall_s": wall, "prompt_turns": measured, "per_prompt_s": wall / measured if measured else None},
    }


def _settings(base: Settings, prompts: PromptSet, repeats: int) -> dict:
    listed = [{"category": i.category, "id": i.id, "prompt": i.prompt} | ({"turns": list(i.turns)}
              if len(i.turns) > 1 else {}) for i in prompts.items]  # fmt: skip
    return base.to_dict() | {"prompts": listed, "repeats": repeats, "prompt_set": prompts.name,
                             "prompt_set_fingerprint": prompts.fingerprint}  # fmt: skip

"""What a comparison reports while it runs, as typed events (the app renders them, the CLI drains them).

Status: a line of progress (loading, warming up, downloading). RunStarts: a timed run is next; its clocks
start when the consumer asks for the next event, so a consumer can finish its own work first. Step: one
target pass of a run, as the loop yielded it. RunDone: a run's RunResult. Done: the whole Comparison, both
runs with their verdict (engine.decoding.lossless), what may make their speedup doubtful (engine.measure.trust) and why
speculation lost, or won less than predicted (engine.measure.explain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from engine.decoding.lossless import Judgement, judge
from engine.decoding.metrics import RunResult, StepEvent
from engine.settings import Settings


@dataclass
class Status:
    message: str


@dataclass
class RunStarts:
    mode: str  # "baseline" | "speculative"

    @property
    def message(self) -> str:
        return f"running {self.mode}"


@dataclass
class Step:
    mode: str  # "baseline" | "speculative"
    event: StepEvent


@dataclass
class RunDone:
    result: RunResult

    @property
    def mode(self) -> str:
        return self.result.mode


@dataclass
class Comparison:
    settings: Settings
    prompt: str
    baseline: RunResult
    speculative: RunResult | None  # None when the baseline was stopped
    environment: dict
    started_at: float = 0.0  # wall clock (time.time()) around warm-up and both runs, for logs and audits
    finished_at: float = 0.0
    loaded_models: list[str] = field(default_factory=list)  # models this comparison had to load first
    other_load: float = 0.0  # share of all CPUs other processes used during the two runs (engine.measure.trust)
    suspect: list[str] = field(default_factory=list)  # why the speedup may not be what this machine does
    verdict: Judgement | None = None  # is the output the baseline's, and if not, why (engine.decoding.lossless)
    explanation: str = ""  # why speculation lost or won under its prediction, in its numbers (engine.measure.explain)

    @property
    def stopped(self) -> bool:
        runs = (self.baseline, self.speculative)
        return any(r is None or r.metrics.finish_reason == "stopped" for r in runs)

    @property
    def status(self) -> str:
        return "stopped" if self.stopped else "done"

    @property
    def identical(self) -> bool | None:
        """Greedy runs must produce the same ids; sampled or stopped runs are not compared."""
        if self.stopped or not self.settings.sampling.greedy:
            return None
        return self.baseline.token_ids == self.speculative.token_ids

    def judge(self, decode=None) -> Judgement:
        """The lossless verdict: greedy ids compared, and where they part, judged from the passes' scores."""
        if self.stopped:
            return Judgement("stopped", "stopped: partial runs, not compared")
        if not self.settings.sampling.greedy:
            return Judgement("sampled", "sampled: same distribution, not the same text")
        b, s = self.baseline, self.speculative
        exact = bool((self.environment.get("strict") or {}).get("exact"))
        return judge(b.steps, s.steps, b.token_ids, s.token_ids, self.environment.get("dtype", "float32"), decode,
                     exact)  # fmt: skip

    @property
    def speedup(self) -> float | None:
        if self.stopped:
            return None
        base = self.baseline.metrics.tokens_per_s
        return self.speculative.metrics.tokens_per_s / base if base else None

    def to_dict(self, with_steps: bool = True) -> dict:
        return {
            "status": self.status,
            "settings": self.settings.to_dict(),
            "prompt": self.prompt,
            "environment": self.environment,
            "baseline": self.baseline.to_dict(with_steps),
            "speculative": self.speculative.to_dict(with_steps) if self.speculative else None,
            "identical": self.identical,
            "verdict": self.verdict.to_dict() if self.verdict else None,
            "speedup": self.speedup,
            "suspect": self.suspect,
            "explanation": self.explanation,
            "other_load": self.other_load,
            "loaded_models": self.loaded_models,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


@dataclass
class Done:
    comparison: Comparison


Event = Union[Status, RunStarts, Step, RunDone, Done]

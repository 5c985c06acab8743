"""What a comparison reports while it runs, as typed events (the app renders them, the CLI drains them).

Status: a line of progress (loading, warming up, downloading). RunStarts: a timed run is next; its clocks
start when the consumer asks for the next event, so a consumer can finish its own work first. Step: one
target pass of a run, as the loop yielded it. RunDone: a run's RunResult. Done: the whole Comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from engine.metrics import RunResult, StepEvent

if TYPE_CHECKING:
    from engine.compare import Comparison


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
class Done:
    comparison: "Comparison"


Event = Union[Status, RunStarts, Step, RunDone, Done]

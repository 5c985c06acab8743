"""One comparison: validate the settings, open the pair on its backend, warm up, run baseline then speculative.

This is the single entry point the CLI, the app and the benchmarks share. `stream_compare` yields typed
events (engine.events): Status lines while loading, every StepEvent of both runs, each run's result,
then the Comparison, so a UI can render while the engine alone does the timing. The runs never
overlap: on one device two concurrent generations would each slow the other and both numbers would be
wrong. A stop ends the comparison where it is: a stopped baseline is not followed by a speculative run,
and a stopped comparison is never checked for identity or turned into a speedup.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import replace
from typing import Iterator

from engine.backends import backend_for
from engine.backends.servers import servers_up
from engine.backends.transformers import guarded, widest_pass
from engine.decoding.metrics import RunResult, StepEvent, summarise
from engine.decoding.runtime import BUCKETS, capacity
from engine.events import Comparison, Done, Event, RunDone, RunStarts, Status, Step
from engine.measure.explain import explain
from engine.measure.trust import OtherLoad, suspicions
from engine.settings import Settings, check_prompt


def run(mode: str, events: Iterator[StepEvent], decode) -> Iterator[Step | RunDone]:
    """A run's StepEvents as Step events, then its RunDone."""
    steps: list[StepEvent] = []
    for event in events:
        steps.append(event)
        yield Step(mode, event)
    yield RunDone(summarise(mode, steps, decode([t for s in steps for t in s.tokens])))


def result_of(events: Iterator[Event]) -> RunResult:
    """Drain a run's events and return its RunResult."""
    return [e for e in events if isinstance(e, RunDone)][-1].result


WARM_STEPS = 8  # steps of each kind of run in a warm-up


def warm_up(backend, ids: list[int], s: Settings) -> Iterator[Status]:
    """Compile what the runs need (a compiled model), then a few steps of each kind of run, so the timed runs
    see warm caches, allocators and kernels. In-process runs warm up at the timed runs' own size and stop
    after WARM_STEPS steps: a static cache (strict mode, compile) has the capacity of the run, and a warm-up
    on a shorter one would leave the timed run to allocate its own (and record new CUDA graphs for it) while
    its clocks run. A server is asked for WARM_STEPS tokens instead: closing its stream early would leave it
    generating into the timed run."""
    in_process = hasattr(backend, "prepare")  # only the in-process backend compiles, or has static caches
    if in_process:
        yield from backend.prepare(ids, s)
    runs = {"baseline": backend.baseline, "speculative": lambda ids, s: backend.speculative(ids, s, [])}
    for mode, start in runs.items():
        if in_process:
            steps = start(ids, s)
            for _ in itertools.islice(steps, WARM_STEPS):
                pass
            steps.close()
        else:
            result_of(run(mode, start(ids, replace(s, max_new_tokens=min(WARM_STEPS, s.max_new_tokens))),
                          backend.decode))  # fmt: skip


class WarmUps:
    """The warm-ups done in this process, so that a comparison warms up once and not before every run.

    A warm-up brings the device to the steady state the clocks should measure: kernels chosen and loaded for
    each pass size, caches and allocator pools of the run's size, on a GPU the compiled sizes and CUDA graphs.
    None of that depends on the prompt. It depends on the models (the objects in memory: a reloaded model is
    new), dtype, device, compile, the drafter, the pass sizes (gamma, adaptive, strict mode), greedy or sampled,
    and the cache capacity, which caches round up to a power of two (engine.decoding.runtime.new_cache). While
    those stay the same, the next comparison reuses the warm-up. Only the in-process backend is keyed: a
    server keeps its own state, and its warm-up is a few tokens."""

    def __init__(self, keep: int = 32):
        self.keep = keep
        self._done: dict[tuple, list] = {}  # key -> weak references to the models it warmed
        self._lock = threading.Lock()

    @staticmethod
    def key(backend, ids: list[int], s: Settings) -> tuple | None:
        pair = getattr(backend, "pair", None)
        if pair is None or not hasattr(backend, "prepare"):
            return None
        models = [m for m in (pair.target.model, getattr(pair.draft, "model", None), getattr(pair, "head", None))
                  if m is not None]  # fmt: skip
        need = capacity(len(ids), s.max_new_tokens) + BUCKETS[-1]  # as new_cache sizes a static cache
        cache = max(256, 1 << (need - 1).bit_length())
        return (tuple(id(m) for m in models), s.dtype, s.device, s.compile, s.drafter, widest_pass(s), s.strict,
                s.temperature > 0, cache), models  # fmt: skip

    def done(self, key) -> bool:
        if key is None:
            return False
        with self._lock:
            refs = self._done.get(key[0])
            return refs is not None and all(ref() is not None for ref in refs)

    def add(self, key) -> None:
        if key is None:
            return
        try:
            refs = [weakref.ref(m) for m in key[1]]
        except TypeError:  # an object that takes no weak reference: not remembered, warmed every time
            return
        with self._lock:
            self._done[key[0]] = refs
            while len(self._done) > self.keep:
                self._done.pop(next(iter(self._done)))

    def clear(self) -> None:
        with self._lock:
            self._done.clear()


WARM_UPS = WarmUps()


def warm_once(backend, ids: list[int], s: Settings) -> Iterator[Status]:
    """Warm up unless a comparison in this process already did for the same key (WarmUps); says which. Sets
    backend.warm_up to "done" or "reused" for the comparison's record."""
    key = WARM_UPS.key(backend, ids, s)
    if WARM_UPS.done(key):
        # the steady state holds; only this prompt's length may be new: one prefill, so that the baseline's
        # first token does not pay for a pass size the speculative run then finds ready
        steps = backend.baseline(ids, s)
        next(steps, None)
        steps.close()
        backend.warm_up = "reused"
        return
    yield Status(f"warming up: {WARM_STEPS} steps of each run, once for this model, dtype, pass sizes and cache size"
                 if key else "warming up")  # fmt: skip
    yield from warm_up(backend, ids, s)
    WARM_UPS.add(key)
    backend.warm_up = "done"


def open_backend(s: Settings):
    """Validate and open the settings' backend, without the status events."""
    backend = backend_for(s.validate())
    for _ in backend.open(s):
        pass
    return backend


def stream_compare(s: Settings, prompt: str, stop: threading.Event | None = None, memory=None) -> Iterator[Event]:
    """Validate, open the pair, warm up, then run baseline and speculative one after the other. `memory`: the
    caller's session's SuffixMemory, for the suffix drafter (engine.decoding.suffix)."""
    s.validate()
    check_prompt(prompt)
    backend = backend_for(s)
    if memory is not None:
        backend.memory = memory
    with guarded():
        yield from backend.open(s)
        ids = backend.encode(prompt, s)
        started = time.time()
        if s.warmup:
            yield from warm_once(backend, ids, s)
        yield RunStarts("baseline")
        load = OtherLoad()
        baseline = None
        for event in run("baseline", backend.baseline(ids, s, stop), backend.decode):
            baseline = event.result if isinstance(event, RunDone) else baseline
            yield event
        speculative = None
        if baseline.metrics.finish_reason != "stopped":
            yield RunStarts("speculative")
            for event in run("speculative", backend.speculative(ids, s, baseline.token_ids, stop), backend.decode):
                speculative = event.result if isinstance(event, RunDone) else speculative
                yield event
        # the managed engine servers up beside the runs (they share this machine with them)
        environment = backend.environment | {"warm_up": getattr(backend, "warm_up", "off"), "servers_up": servers_up()}
        c = Comparison(s, prompt, baseline, speculative, environment, started, time.time(),
                       backend.loaded, load.share())  # fmt: skip
        c.suspect = suspicions(c)
        c.verdict = c.judge(backend.decode)
        c.explanation = explain(c)
        yield Done(c)


def compare(s: Settings, prompt: str, stop: threading.Event | None = None) -> Comparison:
    """Run a whole comparison and return its result (no streaming)."""
    return [e for e in stream_compare(s, prompt, stop) if isinstance(e, Done)][-1].comparison

"""Is a comparison's speedup believable? Reasons to doubt one, in words, so that a UI flags the run instead
of presenting its number.

A run is doubted only for what was measured about it:

- other processes took a share of the CPUs while it ran (OtherLoad);
- the measured speedup is far ABOVE what the run's own alpha, gamma and c allow with a verify pass as cheap as a
  one-token pass (Leviathan's formula). A real verify pass costs at least that and the time around the passes
  adds to it, so that prediction is about the most a run can do: far above it, the baseline was slowed. Far BELOW
  it is no sign of a disturbance: a verify pass that costs several one-token passes (on a CPU, a wide pass does)
  makes exactly that, and engine.measure.explain says so with the run's numbers;
- the baseline ran far slower than a one-token pass of the model timed when it was loaded;
- the baseline ran far slower than the same model's recent CLEAN runs. Only runs with no doubt of their own enter
  that history (a busy minute must not set what "usual" means), old entries expire (a machine that really slowed
  down is the new usual after a while), and a run faster than its history is never doubted for it. Only the
  baseline is compared: its speed depends on the model and the machine, where the speculative run's depends on
  how draftable the prompt is, so a speculative run far from its recent ones says more about the prompt than the
  machine. On a remote server this history is the only sign of other clients' load.

The first run after loading a model is named beside the other reasons and kept out of the history. Each reason
says what was seen, then what would settle it, with numbers that agree with its claim.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque

import psutil

FAR = 2.0  # a factor: measured vs predicted speedup, or the baseline vs a reference speed
RECENT = 8  # clean runs remembered per model
RECENT_S = 600.0  # seconds a remembered run counts: after a while a slower machine is the new usual
MIN_RECENT = 3  # clean runs needed before "usual" means anything
BUSY = 0.25  # share of all CPUs that other processes used during the runs


class OtherLoad:
    """CPU time that other processes (not ours, nor those we started) took while the runs went on, as a share
    of all CPUs."""

    def __init__(self):
        self.process = psutil.Process()
        self.start = self._read()

    def _read(self) -> tuple[float, float, float]:
        """(all CPUs' busy time, ours, now). Ours includes the processes we started: the engine servers of
        the vLLM and llama.cpp backends do the runs' work."""
        times, own = psutil.cpu_times(), self.process.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        ours = own.user + own.system + own.children_user + own.children_system  # children that ended, too
        for child in self.process.children(recursive=True):
            try:
                spent = child.cpu_times()
                ours += spent.user + spent.system
            except psutil.Error:
                pass  # it ended meanwhile
        return busy, ours, time.monotonic()

    def share(self) -> float:
        busy0, own0, t0 = self.start
        busy1, own1, t1 = self._read()
        capacity = max(t1 - t0, 1e-6) * (psutil.cpu_count() or 1)
        # CPU times move in clock ticks (10 ms): over a short window a tick of other work reads as more than
        # every CPU could do, so the share is held to what it means, 0 to 1
        return min(1.0, max(0.0, (busy1 - busy0) - (own1 - own0)) / capacity)


class RecentSpeeds:
    """Baseline tokens/s of recent clean runs, per model settings: what 'usual' means on this machine now."""

    def __init__(self, keep_s: float = RECENT_S, clock=time.monotonic):
        self._runs: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=RECENT))
        self._lock = threading.Lock()
        self.keep_s, self.clock = keep_s, clock

    def usual(self, key: tuple) -> list[float]:
        """The speeds of the clean runs of the last keep_s seconds, oldest first."""
        now = self.clock()
        with self._lock:
            return [speed for at, speed in self._runs[key] if now - at <= self.keep_s]

    def add(self, key: tuple, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            with self._lock:
                self._runs[key].append((self.clock(), tokens_per_s))


RECENT_SPEEDS = RecentSpeeds()


def speed_key(c) -> tuple:
    """Baselines whose speeds are comparable: the same model on the same backend and device."""
    s = c.settings
    return s.backend, s.target, s.dtype, s.device, c.environment.get("device")


def own_reasons(c) -> list[str]:
    """What was measured about this comparison itself that makes its speedup doubtful."""
    reasons = []
    predicted = c.speculative.metrics.predicted_speedup
    if c.speedup and predicted and c.speedup > FAR * predicted:
        reasons.append(
            f"the measured speedup {c.speedup:.2f}x is {c.speedup / predicted:.1f} times the {predicted:.2f}x that "
            "this run's own acceptance and draft cost allow even with verifying as cheap as a one-token pass, so "
            "the baseline was likely slowed: run again to see which number holds"
        )
    step_s = c.environment.get("step_s_at_load")
    base = c.baseline.metrics.tokens_per_s
    if step_s and base and base * step_s * FAR < 1:
        reasons.append(
            f"the baseline ran at {base:.1f} tok/s, under half the {1 / step_s:.1f} tok/s of a one-token pass of "
            f"this model timed when it was loaded ({step_s * 1000:.1f} ms): run again to see whether something else "
            "slowed it"
        )
    if c.other_load >= BUSY:
        reasons.append(f"other processes used {c.other_load:.0%} of the CPUs during the runs, so the machine was "
                       "busy: run again when it is quiet")  # fmt: skip
    return reasons


def history_reason(c, usual: list[float]) -> str | None:
    """The baseline far slower than its recent clean runs (never: faster than them)."""
    if len(usual) < MIN_RECENT:
        return None
    speed, median = c.baseline.metrics.tokens_per_s, statistics.median(usual)
    if speed * FAR >= median:
        return None
    return (f"the baseline ran at {speed:.1f} tok/s, under half the {median:.1f} tok/s median of this model's "
            f"{len(usual)} recent clean runs here: run again to see whether something else slowed it")  # fmt: skip


def suspicions(c, recent: RecentSpeeds = RECENT_SPEEDS) -> list[str]:
    """Why this comparison's speedup may not be what the machine does (empty: nothing odd). A clean comparison's
    baseline speed joins the recent runs; a doubted one never does. Stopped comparisons are not judged."""
    if c.stopped:
        return []
    key = speed_key(c)
    reasons = own_reasons(c)
    slower = history_reason(c, recent.usual(key))
    reasons += [slower] if slower else []
    if not reasons and not c.loaded_models:  # a first run after loading is not yet what the machine does
        recent.add(key, c.baseline.metrics.tokens_per_s)
    if reasons and c.loaded_models:
        reasons.append(f"it was the first run after loading {', '.join(c.loaded_models)}, whose caches were still "
                       "settling")  # fmt: skip
    return reasons

"""Is a comparison's speedup believable? Reasons to doubt one, in words, so that a UI flags the run instead
of presenting its number.

A measured speedup far from what the run's own alpha, c and verify costs predict, a baseline far slower than
the one-token pass timed when the model was loaded, or a side running far from the speed the same model
showed in recent runs, usually means the machine did something else
meanwhile: the first run after loading a model (caches, allocators, packed weights settling), another
process taking the CPU, a thermal or frequency change. Each check names what it saw.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque

import psutil

FAR = 2.0  # a factor: measured vs predicted speedup, or a side vs its recent runs
RECENT = 8  # runs remembered per model and side
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
    """Tokens/s of recent runs, per (model settings, side): what 'usual' means on this machine today."""

    def __init__(self):
        self._runs: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=RECENT))
        self._lock = threading.Lock()

    def usual(self, key: tuple) -> list[float]:
        with self._lock:
            return list(self._runs[key])

    def add(self, key: tuple, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            with self._lock:
                self._runs[key].append(tokens_per_s)


RECENT_SPEEDS = RecentSpeeds()


def speed_keys(c) -> dict[str, tuple]:
    """Runs whose speeds are comparable: the same model (and drafter settings) on the same backend."""
    s = c.settings
    model = (s.backend, s.target, s.dtype, s.device, c.environment.get("device"))
    return {"baseline": model, "speculative": model + (s.drafter, s.draft, s.gamma, s.adaptive, s.temperature)}


def suspicions(c, recent: RecentSpeeds = RECENT_SPEEDS) -> list[str]:
    """Why this comparison's speedup may not be what the machine does (empty: nothing odd), and records its
    speeds as recent runs. Stopped comparisons are not judged."""
    if c.stopped:
        return []
    reasons = []
    predicted = c.speculative.metrics.predicted_speedup
    if c.speedup and predicted and not 1 / FAR <= c.speedup / predicted <= FAR:
        reasons.append(
            f"the measured speedup {c.speedup:.2f}x is far from the {predicted:.2f}x that this run's own "
            "acceptance, draft cost and verify costs predict"
        )
    step_s = c.environment.get("step_s_at_load")
    base = c.baseline.metrics.tokens_per_s
    if step_s and base and base * step_s * FAR < 1:
        reasons.append(
            f"the baseline ran at {base:.1f} tok/s where a one-token pass of this model, timed when it was loaded, "
            f"took {step_s * 1000:.0f} ms (about {1 / step_s:.0f} tok/s)"
        )
    for side, key in speed_keys(c).items():
        speed = getattr(c, side).metrics.tokens_per_s
        usual = recent.usual(key)
        if len(usual) >= 2 and not 1 / FAR <= speed / statistics.median(usual) <= FAR:
            reasons.append(
                f"the {side} ran at {speed:.1f} tok/s where its recent runs here ran at "
                f"{min(usual):.1f}-{max(usual):.1f}"
            )
        recent.add(key, speed)
    if reasons and c.loaded_models:
        reasons.append(f"it was the first run after loading {', '.join(c.loaded_models)}")
    if c.other_load >= BUSY:
        reasons.append(f"other processes used {c.other_load:.0%} of the CPUs during the runs: the machine was busy")
    return reasons

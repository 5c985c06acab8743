"""Speculation under load: total tokens/s and request latency at 1, 2, 4, 8 simultaneous requests.

A serving engine batches requests, and a batch of several sequences makes a target pass less
memory-bound: the spare compute that pays for verifying draft tokens shrinks as load rises, and so does
the speedup. This runs the suite's prompts at each concurrency level against the baseline server, then the
speculative one (order alternating between levels, never both at once), and reports per level the total
tokens/s of each side, their ratio, and per-request latency P50/P90/P99. For server backends (vLLM).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from engine.compare import open_backend, result_of, run
from engine.errors import UserError
from engine.settings import Settings

Progress = Callable[[int, int, str], None]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def _level(backend, role: str, batches: list[list[int]], s: Settings, level: int) -> dict:
    """All requests of one level on one side, `level` at a time; totals over the wall time of the batch."""

    def one(ids: list[int]) -> tuple[float, float, int]:
        started = time.perf_counter()
        events = backend.baseline(ids, s) if role == "baseline" else backend.speculative(ids, s, [])
        result = result_of(run(role, events, backend.decode))
        return time.perf_counter() - started, result.metrics.ttft_s, result.metrics.new_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(level) as pool:
        done = list(pool.map(one, batches))
    wall = time.perf_counter() - started
    latencies, ttfts, tokens = [d[0] for d in done], [d[1] for d in done], sum(d[2] for d in done)
    return {
        "requests": len(done), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
        "latency_p99_s": percentile(latencies, 0.99), "ttft_p50_s": statistics.median(ttfts),
    }  # fmt: skip


def load_curve(
    s: Settings, prompts: list[str], levels: list[int], rounds: int = 2, progress: Progress = lambda *a: None
) -> dict:
    """Each level sends level x rounds requests (the prompts in turn) to each side; see the module doc."""
    if s.backend == "transformers":
        raise UserError("concurrency needs a serving backend (--backend vllm): the in-process engine runs one "
                        "request at a time.", field="backend")  # fmt: skip
    if not levels or min(levels) < 1 or not prompts:
        raise UserError("concurrency levels are whole numbers from 1, e.g. 1,2,4,8, and there must be prompts.")
    backend = open_backend(s)
    encoded = [backend.encode(p, s) for p in prompts]
    for role in ("baseline", "speculative"):  # warm-up: both servers have compiled and cached what they need
        _level(backend, role, encoded[:1], s, 1)
    rows = []
    for i, level in enumerate(levels):
        batch = [encoded[j % len(encoded)] for j in range(level * rounds)]
        order = ("baseline", "speculative") if i % 2 == 0 else ("speculative", "baseline")
        sides = {}
        for role in order:
            progress(i, len(levels), f"{level} at a time: {role}")
            sides[role] = _level(backend, role, batch, s, level)
        speedup = sides["speculative"]["tokens_per_s"] / sides["baseline"]["tokens_per_s"]
        rows.append({"concurrency": level, "order": list(order), "speedup": speedup, **sides})
    progress(len(levels), len(levels), "done")
    pays = [r["concurrency"] for r in rows if r["speedup"] > 1.0]
    return {
        "kind": "load",
        "settings": s.to_dict() | {"prompts": prompts, "rounds": rounds},
        "environment": backend.environment,
        "levels": rows,
        "verdict": (f"speculation pays up to {max(pays)} requests at a time" if pays else
                    "speculation does not pay at any of these loads"),  # fmt: skip
    }

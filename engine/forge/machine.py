"""What the machine at hand does fastest: threads and 16-bit matrix units, timed in a second before the forge starts.

On a 2-core CPU shared with other work, OpenMP's threads wait on each other at every barrier: a 48-row linear layer
took 12.8 ms on two threads against 1.2 ms on one (Intel Xeon with AMX, five other processes busy). So the forge
times a linear layer of the target's width on one thread and on all, and runs on what won.

Training runs in bfloat16 (autocast over float32 master weights) where the CPU has a unit for it: a training step of
the bundled model's head (1,024 rows, four train-time-test steps) took 0.61 s in bfloat16 against 0.95 s in float32
on the AMX Xeon. The data passes do not: they run in the target's own dtype, since the head must learn the features
the served target produces (engine.forge.data). The head itself is stored (and served) in the target's dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Choice:
    threads: int
    train_dtype: torch.dtype  # what training passes run in: bfloat16 where it is clearly faster, else the target's
    timings: dict  # what was measured, ms

    def describe(self) -> str:
        dtype = str(self.train_dtype).replace("torch.", "")
        return f"{self.threads} thread(s), training in {dtype} (" + ", ".join(
            f"{k} {v:.2f} ms" for k, v in self.timings.items()) + ")"  # fmt: skip


def _time(rows: int, width: int, dtype: torch.dtype, repeats: int = 10) -> float:
    a, w = torch.randn(rows, width, dtype=dtype), torch.randn(4 * width, width, dtype=dtype)
    for _ in range(2):
        torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1000


def choose(width: int, device: torch.device, dtype: torch.dtype, allow_bf16: bool = True) -> Choice:
    """Threads and the training dtype for this machine, now. Not on GPUs (they keep their settings) and not when the
    target is already in 16 bits."""
    threads = torch.get_num_threads()
    if device.type != "cpu":
        return Choice(threads, dtype, {})
    timings = {}
    best, best_ms = threads, None
    width = max(width, 512)  # a product small enough to run on one thread anyway would not tell
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        timings[f"fp32 {n}t"] = ms = _time(48, width, torch.float32)
        if best_ms is None or ms < best_ms * 0.9:
            best, best_ms = n, ms
    torch.set_num_threads(best)
    train = dtype
    if allow_bf16 and dtype == torch.float32:  # a training batch's shape
        timings[f"fp32 {best}t x1024"] = full = _time(1024, width, torch.float32, repeats=3)
        timings[f"bf16 {best}t x1024"] = ms = _time(1024, width, torch.bfloat16, repeats=3)
        if ms < full / 1.5:
            train = torch.bfloat16
    return Choice(best, train, timings)

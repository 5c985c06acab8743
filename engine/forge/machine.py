"""What the machine at hand does fastest: threads and 16-bit matrix units, timed in a second before the forge starts.

On a 2-core CPU shared with other work, OpenMP's threads wait on each other at every barrier: a 48-row linear layer
took 12.8 ms on two threads against 1.2 ms on one (Intel Xeon with AMX, five other processes busy). Where AMX or
another bfloat16 unit is there, the same product runs 3-7x faster in bfloat16. So the forge times a linear layer of
its own shape both ways and runs data generation and training in what won; the head itself is always stored (and
served) in the target's dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Choice:
    threads: int
    fast_dtype: torch.dtype  # what batched passes run in: bfloat16 where it is clearly faster, else float32
    timings: dict  # what was measured, ms

    def describe(self) -> str:
        dtype = str(self.fast_dtype).replace("torch.", "")
        return f"{self.threads} thread(s), batched passes in {dtype} (" + ", ".join(
            f"{k} {v:.2f} ms" for k, v in self.timings.items()) + ")"  # fmt: skip


def _time(rows: int, width: int, dtype: torch.dtype, repeats: int = 20) -> float:
    a, w = torch.randn(rows, width, dtype=dtype), torch.randn(4 * width, width, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1000


def choose(width: int, device: torch.device, dtype: torch.dtype, allow_bf16: bool = True) -> Choice:
    """Threads and the batched dtype for this machine, now. Not on GPUs (they keep their settings) and not when the
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
    fast = dtype
    if allow_bf16 and dtype == torch.float32:
        timings[f"bf16 {best}t"] = ms = _time(48, width, torch.bfloat16)
        if ms < best_ms / 2:
            fast = torch.bfloat16
    return Choice(best, fast, timings)

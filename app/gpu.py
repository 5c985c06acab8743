"""Hugging Face ZeroGPU support: `on_gpu` is `spaces.GPU` when the `spaces` package is installed.

On ZeroGPU Spaces a GPU is attached only while a decorated function runs, for the time it asks for; elsewhere
(no `spaces`, or `spaces` outside a ZeroGPU Space) the function runs unchanged. The functions Gradio calls for
a comparison (a generator: Run, Run again, Enter in the prompt) and for a sweep are the decorated ones, and
each asks for time in proportion to what it was asked to do: loading the pair, a warm-up and two runs of max
new tokens, sized for the largest preset pair (an 8B target, eager, ~20 ms a token on an H200, with a margin).
SPECARENA_GPU_SECONDS fixes the time instead.
"""

from __future__ import annotations

import os

LOAD_S = 90  # an 8B pair from the Space's disk onto the GPU, with its warm-up
TOKEN_S = 0.03  # one token of an 8B target, eager, with a margin

try:
    import spaces
except ImportError:
    spaces = None


def _number(value, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def comparison_seconds(*args, **form) -> int:
    """GPU time for one comparison: load, warm-up, the baseline and the speculative run."""
    fixed = os.environ.get("SPECARENA_GPU_SECONDS")
    if fixed:
        return int(fixed)
    tokens = _number(form.get("max_new_tokens"), 128)
    return int(LOAD_S + 2 * tokens * TOKEN_S)


def sweep_seconds(gammas=(), temperatures="0", drafters=(), categories=(), per_category=1, repeats=1,
                  sweep_max_new_tokens=48, *args, **form) -> int:  # fmt: skip
    """GPU time for a sweep: every cell's A/B pairs on every prompt, and a warm-up per cell and prompt."""
    fixed = os.environ.get("SPECARENA_GPU_SECONDS")
    if fixed:
        return int(fixed)
    cells = max(len(gammas or ()), 1) * max(len(str(temperatures).split(",")), 1) * max(len(drafters or ()), 1)
    prompts = max(len(categories or ()), 1) * _number(per_category, 1)
    pairs = cells * prompts * (_number(repeats, 1) + 1)  # the warm-up runs as long as a pair, nearly
    return int(LOAD_S + pairs * 2 * _number(sweep_max_new_tokens, 48) * TOKEN_S)


def on_gpu(fn, seconds=comparison_seconds):
    return spaces.GPU(duration=seconds)(fn) if spaces is not None else fn

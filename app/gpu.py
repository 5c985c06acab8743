"""Hugging Face ZeroGPU support: `on_gpu` is `spaces.GPU` when the `spaces` package is installed.

On ZeroGPU Spaces a GPU is attached only while a decorated function runs; elsewhere the decorator does
nothing, and without the package `on_gpu` returns the function unchanged.
"""

from __future__ import annotations

import os

DURATION = int(os.environ.get("SPECARENA_GPU_SECONDS", "120"))  # a comparison: load, warm-up, two runs

try:
    import spaces
except ImportError:
    spaces = None


def on_gpu(fn):
    return spaces.GPU(duration=DURATION)(fn) if spaces is not None else fn

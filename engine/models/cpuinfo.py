"""The CPU as /proc/cpuinfo describes it: one reader for the fields the engine keys its measurements and builds on.

No torch here: llama-server's crash check and the kernel build read these without loading a model.
"""

from __future__ import annotations

from pathlib import Path


def field(name: str) -> str:
    """The first value of a /proc/cpuinfo field ("model name", "flags", "vendor_id"), "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (avx2, avx512f, amx_bf16, ...)."""
    return set(field("flags").split())

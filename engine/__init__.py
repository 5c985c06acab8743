"""SpecArena's engine: pure Python, torch and transformers; it never imports gradio.

    compare        one comparison, the entry point of the CLI, the app and the benchmarks: validate,
                   open a backend, warm up, baseline then speculative, the verdict
    backends/      where it runs: this process (transformers), vLLM's or llama.cpp's servers
    decoding/      the loops and what they are made of: baseline, speculative, drafters, sampling, the
                   per-step record and its metrics, the lossless verdict
    models/        resolving and loading models, random shapes, the CPU's linear forms, sizing, the doctor
    measure/       benchmarks, the comparison with HF generate(), load curves, prediction, trust, reports,
                   the GPU check
    settings, events, errors, worker, presets, policy: what every part shares

Dependencies point down the list (compare -> backends -> models, decoding); tests/test_architecture.py
fails on an import circle. A package's __init__ names what others use and imports it only when asked
(`exports`), so importing one module of a package never loads the rest.
"""

from __future__ import annotations

import importlib


def exports(package: str, names: dict[str, str]):
    """A module __getattr__ for `package` that imports names[name] (a module of the package) on first use."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return __getattr__

"""Measuring speculation: many comparisons, and what to believe of them.

    promptsets  the prompts measured on: the task suite, files (JSONL, JSON, CSV, text), Hub datasets; samples,
                held-out splits, fingerprints
    bench       A/B sweeps over gamma, temperature and drafters, on a prompt set by category (multi-turn too)
    hfcompare   ours against Hugging Face generate() and assisted generation, in one process
    load        server backends under concurrent load; overhead: our path on vLLM against raw reads
    predict     the Leviathan model fitted to measured alpha, draft cost and verify cost
    trust       reasons to doubt a speedup (a busy machine, a first run, far above prediction, a slowed baseline)
    explain     why speculation lost, or won under its prediction, in the run's own costs
    report      exports: JSON, CSV, settings and the engines' command lines
    gpucheck    the one-shot diagnosis of the GPU path
    roofline    a model's bound on this machine beside each kernel's GB/s and the engine's passes
"""

from engine import exports

__all__ = ["sweep", "compare_hf", "load_curve", "suspicions", "diagnose"]
__getattr__ = exports(__name__, {
    "sweep": "bench", "compare_hf": "hfcompare", "load_curve": "load", "suspicions": "trust", "diagnose": "gpucheck",
})  # fmt: skip

"""`python -m engine roofline`: a model's bound on this machine beside what each linear-layer kernel and the
engine's own passes reach (engine.models.bandwidth has the bound; engine.models.cpu the kernels)."""

from __future__ import annotations

import torch

from engine.models.bandwidth import bound, kernel_rates, limit, measure_bandwidth


def roofline(target: str, dtype: str = "float32", device: str = "auto", rows=(1, 2, 3, 5, 8), progress=print) -> dict:
    """Everything `python -m engine roofline` prints: the limit, each kernel's GB/s over the model's linear weights
    (float32 or bfloat16 on CPU), and whole passes as the engine runs them (lean forward, the forms chosen for this
    CPU; again with its layers in torch operations where they run fused) and as transformers runs them (the model's
    own forward, stock layers: what generate() runs), per pass size."""
    from engine.decoding.runtime import time_passes
    from engine.models.cpu import NAMES, device_name
    from engine.models.loading import MODELS

    plain = MODELS.get(target, dtype, device, progress=progress, pack=False)
    ours = MODELS.get(target, dtype, device, progress=progress)
    progress("timing each kernel over the model's weight shapes, then whole passes")
    # the memory of a shared machine reads at another rate from one minute to the next (a 2-core EPYC: 30-71 GB/s),
    # so the bandwidth is read just before and just after each kernel's and each pass's timing, and each figure is
    # set against the mean of those two reads: the fraction that means something
    beside: dict[str, float] = {}
    kernels = {NAMES[form]: {str(n): rate for n, rate in rates.items()}
               for form, rates in kernel_rates(plain.model, rows, reads=beside).items()}  # fmt: skip
    reads = {NAMES[form]: round(gbs / 1e9, 1) for form, gbs in beside.items()}
    passes = {}
    stack = getattr(getattr(ours.model, "lean", None), "stack", None)
    runs = [("SpecArena (as loaded)", ours, stack)]
    if stack is not None:  # the same pass with its layers in torch operations: what fusing them buys
        runs.append(("SpecArena, layers in torch ops", ours, None))
    runs.append(("transformers forward, stock", plain, None))
    for name, loaded, fused in runs:
        if stack is not None:
            ours.model.lean.stack = fused
        before = measure_bandwidth(ours.device)
        with torch.inference_mode():
            took = time_passes(loaded.model, tuple(rows), repeats=5)
        read = (before + measure_bandwidth(ours.device)) / 2
        passes[name] = {"tok_s": 1 / took[rows[0]], "cost": {str(n): took[n] / took[rows[0]] for n in rows},
                        "ms": {str(n): took[n] * 1000 for n in rows}, "read_gbs": round(read / 1e9, 1),
                        "bound_tok_s": round(bound(ours.token_bytes, read), 1)}  # fmt: skip
    if stack is not None:
        ours.model.lean.stack = stack
    every = list(reads.values()) + [p["read_gbs"] for p in passes.values()]
    low, now = min(every) * 1e9, max(every) * 1e9
    return {"target": target, "dtype": str(ours.dtype).replace("torch.", ""), "device_name": device_name(ours.device),
            "threads": torch.get_num_threads(), "linear_forms": ours.linear_forms, "rows": list(rows),
            "limit": limit(ours.token_bytes, ours.device)
            | {"now_gbs": round(now / 1e9, 1), "now_bound_tok_s": round(bound(ours.token_bytes, now), 1),
               "low_gbs": round(low / 1e9, 1)},
            "kernels": kernels, "reads": reads, "passes": passes}  # fmt: skip

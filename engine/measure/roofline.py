"""`python -m engine roofline`: a model's bound on this machine beside what each linear-layer kernel and the
engine's own passes reach (engine.models.bandwidth has the bound; engine.models.cpu the kernels)."""

from __future__ import annotations

import torch

from engine.decoding.runtime import Clock
from engine.models.bandwidth import bound, keep_best, kernel_rates, limit, measure_bandwidth


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
    heads = head_passes(ours)
    every = list(reads.values()) + [p["read_gbs"] for p in passes.values()] + [h["read_gbs"] for h in heads.values()]
    low, now = min(every) * 1e9, max(every) * 1e9
    keep_best(ours.device, now)  # the best read ever seen includes this run's
    return {"target": target, "dtype": str(ours.dtype).replace("torch.", ""), "device_name": device_name(ours.device),
            "threads": torch.get_num_threads(), "linear_forms": ours.linear_forms, "rows": list(rows),
            "limit": limit(ours.token_bytes, ours.device)
            | {"now_gbs": round(now / 1e9, 1), "now_bound_tok_s": round(bound(ours.token_bytes, now), 1),
               "low_gbs": round(low / 1e9, 1)},
            "kernels": kernels, "reads": reads, "passes": passes, "heads": heads}  # fmt: skip


DRAFT_VOCAB = 8192  # the forge's EAGLE-3 heads draft over the target's 8,192 likeliest tokens (docs/forge.md)
BLOCK = 4  # a DFlash block as the forge serves it on a CPU: the last token and 3 masks, drafting γ 3


def head_passes(loaded, repeats: int = 30) -> dict:
    """A draft head's passes in the target's shapes (random weights: the cost is the same) against the bound of the
    weights each reads, in torch's stock layers and in the kernels the target's layers run
    (engine.models.heads.in_target_kernels; serving keeps the faster: engine.models.heads.serve_forms), and where the
    head's layers run as one call of ours, also with its layers in torch operations around our products: what the one
    call buys. The variants take turns. An EAGLE-3 chain step (its layer over one row, then its LM head
    over the draft vocabulary) and a DFlash block pass (the context row through fc, its layer over the block, the
    target's LM head over the γ drafting rows). {name: {"ms", "bytes", "read_gbs", "bound_ms", "of_bound"}}. A head's
    weights are small: where the CPU's caches hold most of them, a step beats the bound."""
    from engine.models.cpu import swap_back
    from engine.models.heads import draft_pass, in_target_kernels, random_head

    target, device = loaded.model, loaded.device
    clock = Clock(device)
    out = {}
    for kind in ("eagle3", "dflash"):
        vocab = min(DRAFT_VOCAB, target.config.get_text_config().vocab_size) if kind == "eagle3" else 0
        head = random_head(target, kind, draft_vocab=vocab, block_size=BLOCK)
        weights = _read_bytes(head)
        swaps = in_target_kernels(head, target)
        stack, step = head.stack, draft_pass(head, block=BLOCK)
        variants = {"stock layers": (False, None)}  # name: (our kernels, the layers' one call)
        if swaps:
            variants["our kernels"] = (True, stack)
        if stack is not None:
            variants["our products, torch ops"] = (True, None)
        what = "EAGLE-3 chain step" if kind == "eagle3" else f"DFlash block of {BLOCK}"
        before = measure_bandwidth(device)
        best = dict.fromkeys(variants, float("inf"))
        with torch.inference_mode():
            for _ in range(repeats + 1):
                for name, (ours, head.stack) in variants.items():
                    swap_back(swaps, back=not ours)
                    start = clock.now()
                    step()
                    best[name] = min(best[name], clock.now() - start)
        read = (before + measure_bandwidth(device)) / 2
        for name, took in best.items():
            out[f"{what}, {name}"] = {"ms": took * 1000, "bytes": weights, "read_gbs": round(read / 1e9, 1),
                                      "bound_ms": weights / read * 1000, "of_bound": weights / read / took}  # fmt: skip
    return out


def _read_bytes(head) -> int:
    """The weight bytes a step reads: the layers and norms, the LM head the head drafts through, and fc where the
    pass fuses features (a DFlash block; an EAGLE-3 chain step feeds back its own state)."""
    size = next(head.parameters()).element_size()
    seen, total = set(), 0
    for name, module in head.named_modules():
        if id(module) in seen or name.startswith("embed_tokens") or (name == "fc" and head.config.eagle):
            continue
        if name == "lm_head" or name.startswith("layers.") or name in ("fc", "norm", "hidden_norm"):
            seen.add(id(module))
            if hasattr(module, "plain_weight"):  # engine.models.cpu.CpuLinear: its weights are no parameters
                total += module.in_features * module.out_features * size
            else:
                total += sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
    return total

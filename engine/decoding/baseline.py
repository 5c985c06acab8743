"""Plain autoregressive decoding: the target alone, one token per forward pass, with a KV cache.

The reference every speculative run is compared with. It yields the same StepEvent as the
speculative loop (one per target pass), from the same prefill and the same sampling code.
"""

from __future__ import annotations

import threading
from typing import Iterator

import torch

from engine.decoding.lossless import top_two
from engine.decoding.metrics import StepEvent
from engine.decoding.runtime import Clock, TextStream, emit, forward, prefill
from engine.decoding.sampling import SamplingConfig, choose


@torch.inference_mode()  # per resumption: a UI may resume this generator on another thread
def baseline_decode(
    target,
    tokenizer,
    prompt_ids: list[int],
    cfg: SamplingConfig,
    max_new_tokens: int,
    eos: set[int],
    stop: threading.Event | None = None,
    width: int = 0,
) -> Iterator[StepEvent]:
    """Yield one StepEvent per generated token until EOS, max_new_tokens or `stop`. `width`: strict mode, every
    pass padded to that many rows, as the speculative run's verify passes are (engine.decoding.runtime.forward)."""
    clock = Clock(target.device)
    generator = cfg.generator(target.device)
    stream = TextStream(tokenizer)
    event, cache = prefill(target, prompt_ids, cfg, generator, stream, eos, max_new_tokens, clock, width > 0)
    elapsed = event.elapsed_s
    yield event
    last, produced, finished, step = event.tokens[-1], len(event.tokens), event.finished, 0
    while finished is None:
        if stop is not None and stop.is_set():
            yield StepEvent(step + 1, "stopped", [], [], elapsed_s=elapsed, finished="stopped")
            return
        step += 1
        t0 = clock.now()
        logits = forward(target, [last], cache, width=width)[-1]  # (V,)
        last, p = choose(logits, cfg, generator)
        top = top_two(logits[None]) if cfg.greedy else []  # evidence for the lossless verdict
        t1 = clock.now()
        tokens, pieces, finished = emit(stream, [last], eos, max_new_tokens - produced)
        t2 = clock.now()
        elapsed += t2 - t0
        produced += 1
        yield StepEvent(
            step, "target", tokens, pieces, token=last, token_p=p, top=top,
            verify_s=t1 - t0, other_s=t2 - t1, elapsed_s=elapsed, finished=finished,
        )  # fmt: skip

"""The decoding loops and what they are made of (Leviathan et al. 2023: target p, draft q, gamma, alpha).

    speculative   THE loop: draft, verify in one target pass, accept, roll back
    baseline      the target alone, one token per pass, with the same events
    drafters      what proposes: a draft model, prompt lookup, the synthetic measurement tool
    heads         draft heads over the target's hidden states: EAGLE-3 chains and trees, DFlash blocks
    tree          draft trees (EAGLE-2): shapes, their masks, which nodes are worth a verify pass
    suffix        suffix decoding over a session's earlier outputs; crosstok: a draft with another tokenizer
    sampling      logits to probabilities, sampling, the rejection rule that keeps sampling lossless
    runtime       the forward pass (strict width, compiled buckets), caches, clock, prompt and text
    lean          a Llama-family forward pass on CPU in fewer tensor operations, bit-identical, and its cache
    metrics       StepEvent, the per-step record, and RunResult's metrics
    lossless      the verdict where greedy runs part: rounding or a bug, from the passes' scores
"""

from engine import exports

__all__ = ["speculative_decode", "baseline_decode", "Drafter", "DraftModel", "PromptLookup", "Synthetic",
           "SamplingConfig", "StepEvent", "RunResult", "summarise", "Judgement", "judge"]  # fmt: skip
__getattr__ = exports(__name__, {
    "speculative_decode": "speculative", "baseline_decode": "baseline", "Drafter": "drafters",
    "DraftModel": "drafters", "PromptLookup": "drafters", "Synthetic": "drafters", "SamplingConfig": "sampling",
    "StepEvent": "metrics", "RunResult": "metrics", "summarise": "metrics", "Judgement": "lossless",
    "judge": "lossless",
})  # fmt: skip

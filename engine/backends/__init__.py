"""Where a comparison runs. A backend opens a pair for some Settings (yielding Status events while it loads or
starts servers), encodes prompts, and runs baseline and speculative generation as StepEvents; compare, the
benchmarks and the app ask `backend_for` and never care which.

- transformers: the in-process engine (engine.models loads the pair, engine.decoding runs the loops);
- vllm, llamacpp: the same comparison on vLLM's and llama.cpp's servers;
- heads: a draft head for those servers, checked before one starts, and converted to GGUF for llama-server;
- llamacpp_source: llama.cpp's sources from PyPI: the build, and its own HF-to-GGUF converter;
- servers, guard: starting, reusing and stopping those servers, never leaving one behind.
"""

from __future__ import annotations


def backend_for(s):
    """The backend of the settings `s` (engine.settings.Settings), not yet opened."""
    if s.backend == "vllm":
        from engine.backends.vllm import VLLM

        return VLLM()
    if s.backend == "llama.cpp":
        from engine.backends.llamacpp import LlamaCpp

        return LlamaCpp()
    from engine.backends.transformers import Transformers

    return Transformers()

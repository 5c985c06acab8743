"""Models: what a spec names, loading it, and what a pair needs before any weights load.

    loading        specs (Hub id, folder, bundled, random shape) to loaded models, kept in an LRU cache
    random_shapes  random weights in the shapes of real models, for measuring at real sizes offline
    cpuinfo        /proc/cpuinfo's fields (model name, flags, vendor), read in one place
    cpu            the CPU's identity, and the linear layers' forms (stock, oneDNN-packed, OpenBLAS, ours, padding)
    native         our own few-row linear kernel (kernels/rows.cpp), compiled for this CPU at first use
    bandwidth      the machine's read bandwidth, the weights' bytes per token, the bound tok/s; kernels' GB/s
    sizing         parameters, KV cache bytes, context length, free memory
    doctor         the pair doctor: vocabulary, context, memory, from configs and tokenizers
    heads          draft heads as published (SafeAILab, speculators, z-lab): read, checked, written
"""

from engine import exports

__all__ = ["MODELS", "LoadedModel", "resolve", "load_tokenizer", "diagnose", "diagnose_gguf"]
__getattr__ = exports(__name__, {
    "MODELS": "loading", "LoadedModel": "loading", "resolve": "loading", "load_tokenizer": "loading",
    "diagnose": "doctor", "diagnose_gguf": "doctor",
})  # fmt: skip

"""How big a model is and how much room there is, from configs alone: parameters, KV cache per token,
context length, free device memory. Shared by the pair doctor and the random-weight models, and free
of model loading, so that neither has to import the other."""

from __future__ import annotations

import psutil
import torch


def count_params(config, trust_remote_code: bool = False) -> int:
    """Parameters of a model built from its config on the meta device: no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    cfg = config.get_text_config()
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def context_length(config) -> int | None:
    """The longest sequence a model config allows, under whichever name its architecture uses."""
    cfg = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available

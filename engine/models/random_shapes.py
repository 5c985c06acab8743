"""Random-weight models of real sizes, built from a config: speed measurements where nothing can be downloaded.

    random:llama-3.1-8b   the shape of Llama-3.1-8B (8.0B parameters)
    random:llama-3.2-1b   the shape of Llama-3.2-1B (1.2B), the usual draft for it
    random:smollm2-135m   the shape of SmolLM2-135M, small enough for any CPU

The weights are random (seeded), so the text is noise and two such models agree only by chance. Pair them
with the synthetic drafter, which proposes the target's own tokens with probability alpha; given a draft
model too, it runs the draft's forward passes so that drafting costs what it would. What they measure is
the engine on this device at these sizes: tokens/s, verify cost, memory, the speedup a given alpha buys.

The tokenizer maps each printable ASCII character to its own id and shows every other id as ‹id›. A shape
is refused before anything is allocated when it does not fit the device's free memory, and on a CPU when
it has more than 2B parameters (a token would take seconds to minutes).
"""

from __future__ import annotations

import functools

import torch

from engine.errors import OutOfMemory, UserError
from engine.models import sizing

PREFIX = "random:"
SHAPES = {
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
    ),
}  # fmt: skip
SPECS = [PREFIX + name for name in SHAPES]
CPU_MAX_PARAMS = 2e9  # larger shapes are for GPUs


def shape_of(spec: str) -> str:
    """'random:llama-3.2-1b' -> 'llama-3.2-1b', or a UserError listing the shapes there are."""
    name = spec[len(PREFIX) :]
    if name not in SHAPES:
        raise UserError(f"unknown random model {spec!r}: use one of {', '.join(SPECS)}.")
    return name


def config(shape: str):
    from transformers import LlamaConfig

    # no EOS: a random model would otherwise stop wherever it happens to pick that id
    return LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)


@functools.lru_cache(maxsize=4)
def tokenizer(vocab_size: int):
    """Built once per vocabulary size (~0.6 s for 128k ids): the pair check and both models of a pair share it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0} | {chr(c): c - 31 for c in range(32, 127)}
    vocab |= {f"‹{i}›": i for i in range(len(vocab), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def build(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(model, tokenizer), the weights initialised on `device` in `dtype`, after checking they fit there."""
    from transformers import AutoModelForCausalLM

    cfg = config(shape)
    params = sizing.count_params(cfg)
    if device.type == "cpu" and params > CPU_MAX_PARAMS:
        raise UserError(
            f"{PREFIX}{shape} is a GPU measurement tool: on a CPU one token would take seconds to minutes. "
            f"Run it with a CUDA GPU, or use {PREFIX}llama-3.2-1b or {PREFIX}smollm2-135m here."
        )
    need = params * torch.finfo(dtype).bits // 8
    free = sizing.free_memory_bytes(device)
    if need > 0.9 * free:
        dt = str(dtype).replace("torch.", "")
        raise OutOfMemory(
            f"{PREFIX}{shape} needs {need / 2**30:.1f} GiB in {dt} and {device} has {free / 2**30:.1f} GiB free: "
            f"use a GPU, a 16-bit dtype, or a smaller shape ({', '.join(SPECS)})."
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model, tokenizer(cfg.vocab_size)


def config_folder(shape: str):
    """A model folder with this shape's config and tokenizer and no weights, for engines that build random
    weights themselves (vLLM's --load-format dummy)."""
    from engine.settings import cache_dir

    folder = cache_dir() / f"random-{shape}"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cfg = config(shape)
        cfg.save_pretrained(folder)
        tokenizer(cfg.vocab_size).save_pretrained(folder)
    return folder

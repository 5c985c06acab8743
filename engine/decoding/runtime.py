"""Small pieces shared by the baseline and the speculative loop: clock, forward pass, prompt and text.

Kept apart so both loops read the same way and time the same way.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from engine.decoding.lean import LeanCache
from engine.decoding.lossless import top_two
from engine.decoding.metrics import StepEvent
from engine.decoding.sampling import choose
from engine.decoding.tree import layout
from engine.settings import MAX_GAMMA


class Clock:
    """Wall clock that waits for queued CUDA work first, so a reading means the work is done."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


# A compiled model (compile_decoding) runs its short passes at one of these lengths, padded up, so that
# torch.compile builds a handful of graphs rather than one per draft length. Longer inputs run eagerly.
BUCKETS = (1, 2, 4, 8, 16, 32)


class CompiledStep:
    """model.forward through torch.compile, remembering what the first pass of each shape cost: that pass
    compiles (seconds to a minute cold, less from the compile cache), so a UI can say so."""

    def __init__(self, model, backend: str, mode: str | None):
        self.fn = torch.compile(model.forward, backend=backend, mode=mode, dynamic=False)
        self.clock = Clock(model.device)
        self.first: dict[tuple, float] = {}  # (rows, cache capacity) -> seconds of its first (compiling) pass

    def __call__(self, **kwargs):
        key = (kwargs["input_ids"].shape[1], getattr(kwargs.get("cache"), "max_cache_len", None),
               "output_hidden_states" in kwargs)
        if key in self.first:
            return self.fn(**kwargs)
        start = self.clock.now()
        out = self.fn(**kwargs)
        self.first[key] = self.clock.now() - start
        return out


def compile_decoding(model, backend: str = "inductor", mode: str | None = "reduce-overhead") -> None:
    """Run this model's decode and verify passes through torch.compile over a static KV cache (with the
    default mode on CUDA: CUDA graphs, which remove the per-kernel launch cost of small batches). Each
    bucket compiles on its first use; `precompile` pays for the ones a run needs before it is timed."""
    # dynamo counts recompilations per code object, and every model of a class shares its forward's: leave
    # room for all buckets of a target and its draft at a few cache capacities, or it falls back to eager
    # without a word
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16 * len(BUCKETS))
    model.compiled_step = CompiledStep(model, backend, mode)
    model.static_caches = {}  # role -> (capacity, StaticCache), kept across runs (see new_cache)


def bucket(rows: int) -> int:
    """The pass size a compiled model runs `rows` tokens at (longer passes run eagerly)."""
    return next((b for b in BUCKETS if b >= rows), rows)


def precompile(model, rows, max_len: int, role: str = "run", static: bool = False) -> Iterator[tuple[int, float]]:
    """Compile, and record as CUDA graphs, the passes of each of `rows` tokens a run will make, on the very cache
    that run will use (CUDA graphs read it at the addresses they were recorded with); yields (bucket, seconds)
    per bucket as it is done. Three passes each: dynamo compiles on the first, CUDA graph trees warm up on the
    second and record on the third."""
    clock = Clock(model.device)
    cache = new_cache(model, max_len, role=role, static=static)
    forward(model, [0], cache, keep=1)  # a cache's first pass is eager: it allocates the cache
    for size in sorted({bucket(n) for n in rows if n <= BUCKETS[-1]}):
        start = clock.now()
        for _ in range(3):
            forward(model, [0] * size, cache)
            cache.crop(-size)
        yield size, clock.now() - start
    cache.reset()


def new_cache(model, max_len: int | None = None, role: str = "run", static: bool = False):
    """An empty KV cache for a run: a DynamicCache, or a StaticCache with room for max_len tokens plus one padded
    pass (a verify pass, with its draft, fits in that too) for a compiled model or a strict run (`static`).

    A compiled model keeps one static cache per role ("run" for prefill, decode and verify; "draft" for a
    draft model; "measure" for timing passes) and resets it for the next run, as `generate()` does. CUDA
    graphs read the cache at the addresses they were recorded with: a new cache per run would make every
    graph record again inside the timed steps, and pile up recordings. The capacity is rounded up to a
    power of two, so that a longer run rarely needs a new cache (and new graphs of that shape).

    In strict mode the capacity is exactly that rounding of max_len, never a larger cache left by an earlier
    run: attention then runs over the same number of keys in every pass of the baseline, the speculative run
    and its draft (later keys masked), so no query's reduction depends on which pass it came in. Over a
    growing cache, a token at row 3 of a verify pass and the same token alone in a one-token pass reduce over
    different key counts, and in 16 bits that alone rounds differently."""
    from transformers import DynamicCache, StaticCache

    if getattr(model, "compiled_step", None) is None and not static:
        if getattr(model, "lean", None) is not None:  # engine.decoding.lean
            # room for the run, up to 1024 tokens at first: it grows as it fills, so a run that stops early
            # never holds memory for the max_new_tokens it did not make
            return LeanCache(model, min((max_len or 224) + BUCKETS[-1], 1024))
        return DynamicCache(config=model.config)
    if max_len is None:
        raise ValueError("a static cache needs its length up front")
    need = max_len + BUCKETS[-1]
    size = max(256, 1 << (need - 1).bit_length())
    caches = model.__dict__.setdefault("static_caches", {})
    have, cache = caches.get(role, (0, None))
    if have == size or (have > size and not static):
        with torch.inference_mode():  # its tensors were made in inference mode
            cache.reset()
        return cache
    cache = StaticCache(config=model.config, max_cache_len=size)
    caches[role] = (size, cache)
    return cache


def forward(model, token_ids: list[int], cache, keep: int = 0, width: int = 0, layers: tuple[int, ...] = (),
            tree: list[int] | None = None):  # fmt: skip
    """Feed token_ids after what `cache` holds; return logits (n, V), or the last `keep` rows (keep, V).

    `tree`: token_ids are a root and the nodes of a draft tree with these parents (engine.decoding.tree): each node
    at its depth's position, seeing the context and its ancestors only; `keep_rows` then keeps the branch taken.
    Over a growing cache only (not strict mode's or a compiled model's static one).

    `layers` (a draft head's, engine.decoding.heads): also return the hidden states of those layers (indices into
    transformers' hidden_states; PRE_NORM, the last layer's output before the final norm, which an MTP head reads)
    for every one of the n tokens, concatenated: (logits, (n, len(layers) x hidden)).

    `width` > 0 (strict mode) runs a pass of up to `width` tokens padded to exactly `width` rows, all of whose
    logits are computed: every such pass then runs the same kernels, so a token's logits do not depend on
    whether it came in a one-token pass or a verify pass (in 16 bits they otherwise round differently;
    engine.decoding.lossless). Longer inputs (a prompt) run as they are. Padding goes after the real tokens, so
    causal attention keeps it out of their results; its keys and values are cropped off again."""
    n = len(token_ids)
    if type(cache) is LeanCache:  # a lean pass (engine.decoding.lean): never padded, never compiled
        return model.lean(torch.tensor([token_ids], dtype=torch.long), cache, keep, layers, tree)
    if tree is not None:
        return _tree_pass(model, token_ids, cache, layers, tree)
    step = getattr(model, "compiled_step", None)
    # a cache's first pass runs eagerly: it allocates the cache there, where it can be marked as static for
    # CUDA graphs (inside a compiled pass the tensors would become graph outputs, overwritten by the next replay)
    compiled = step is not None and max(n, width) <= BUCKETS[-1] and cache.is_initialized
    if compiled:
        size = bucket(max(n, width))
    else:
        size = width if n <= width else n
    ids = torch.tensor([token_ids + token_ids[-1:] * (size - n)], dtype=torch.long, device=model.device)  # (1, size)
    extra = {"output_hidden_states": True} if layers else {}
    trim = compiled or size > n  # every row's logits come back: the padding and all but `keep` are cut here
    with _pre_norm(model, layers) as final:
        if compiled:
            out = step(input_ids=ids, cache=cache, use_cache=True, **extra)  # causal: padding changes nothing
        else:
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=0 if trim else keep, **extra)
    logits = out.logits[0, :n] if trim else out.logits[0]
    if size > n:
        cache.crop(n - size)  # drop the padding's keys and values
    if trim and keep:
        logits = logits[n - keep :]
    if compiled:
        logits = logits.clone()  # a CUDA graph reuses its output buffer
    if not layers:
        return logits
    features = torch.cat([_state(out, final, i)[0, :n] for i in layers], -1)  # (n, len(layers) x hidden)
    return logits, features.clone() if compiled else features


PRE_NORM = -1  # a feature index: the last decoder layer's output before the final norm (vLLM's aux layer L)


@contextlib.contextmanager
def _pre_norm(model, layers: tuple[int, ...]):
    """Where `layers` asks for PRE_NORM, the final norm's input of the next pass, caught as it goes in."""
    caught: list[torch.Tensor] = []
    if PRE_NORM not in layers:
        yield caught
        return
    norm = model.get_decoder().norm
    hook = norm.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        yield caught
    finally:
        hook.remove()


def _state(out, final: list[torch.Tensor], index: int) -> torch.Tensor:
    return final[-1] if index == PRE_NORM else out.hidden_states[index]


def _tree_pass(model, token_ids: list[int], cache, layers: tuple[int, ...], tree: list[int]):
    """The model's own forward over a draft tree: positions by depth, a 4D mask of ancestors (as-is to attention)."""
    from transformers import DynamicCache

    if not isinstance(cache, DynamicCache):
        raise ValueError("a draft tree runs over a growing cache, not a static one (strict mode, compiled passes)")
    positions, mask = layout(tree, cache.get_seq_length())
    ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    with _pre_norm(model, layers) as final:
        out = model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions.long()[None].to(model.device),
                    attention_mask=mask[None, None].to(model.device), output_hidden_states=bool(layers))  # fmt: skip
    logits = out.logits[0]
    if not layers:
        return logits
    return logits, torch.cat([_state(out, final, i)[0] for i in layers], -1)


def keep_rows(cache, start: int, rows: list[int]) -> None:
    """Keep, of the cache rows from `start` on, those at offsets `rows` (ascending), moved up into a row: the branch
    of a draft tree the target took."""
    if type(cache) is LeanCache:
        return cache.keep(start, rows)
    index = torch.tensor(rows, device=cache.layers[0].keys.device) + start
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., index, :]], -2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., index, :]], -2)


def fitting(model, context: int, more: int) -> int:
    """A prefix of at most `context` tokens that leaves room for `more` within the model's positions (a model
    with learned positions and a short context cannot take a long prefix and the passes after it)."""
    text = model.config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return max(1, min(context, limit - more)) if limit else context


def time_passes(model, rows, repeats: int = 3, context: int = 64, warmup: int = 1, variants=None):
    """Best-of-`repeats` seconds of a forward pass of each row count, after a `context`-token prefix (shorter
    where the model's positions end before the prefix and the longest pass): {rows: seconds}. The sizes take
    turns, round after round, the first `warmup` rounds untimed, so that a burst of load from elsewhere slows
    one round of every size rather than every try of one size.

    `variants` ({name: a function that sets the model up one way}, such as a layout of its weights): each size
    is timed in each variant, the variants taking turns too, and {name: {rows: seconds}} is returned."""
    clock = Clock(model.device)
    text = model.config.get_text_config()
    context = fitting(model, context, max(rows))
    cache = new_cache(model, context + max(rows), role="measure")
    forward(model, [i % text.vocab_size for i in range(context)], cache, keep=1)
    setups = variants or {None: lambda: None}
    best = {name: dict.fromkeys(rows, float("inf")) for name in setups}
    for round_ in range(warmup + repeats):
        for n in rows:
            for name, setup in setups.items():
                setup()
                start = clock.now()
                forward(model, [1] * n, cache)
                took = clock.now() - start
                cache.crop(-n)
                if round_ >= warmup:
                    best[name][n] = min(best[name][n], took)
    return best if variants else best[None]


def time_strict(model, width: int, steps: int = 16, repeats: int = 3, context: int = 64) -> float:
    """What strict mode costs the baseline: `steps` decode steps as strict mode runs them (`width` rows over a
    static cache) over the same steps run plainly (one row, a growing cache), best of `repeats`, in turns after
    a `context`-token prefix. Whole steps, not single passes: a plain run's steps also pay for growing their
    cache, a strict run's do not. On the AMX Xeon, bfloat16, this gave 1.09-1.15 at widths 5-6, and whole
    64-token baselines ran at 0.865x the tokens/s in strict mode."""
    clock = Clock(model.device)
    text = model.config.get_text_config()
    context = fitting(model, context, width + steps)
    room = capacity(context, 128)  # a typical run's capacity
    prefix = [i % text.vocab_size for i in range(context)]
    best = {0: float("inf"), width: float("inf")}
    for round_ in range(repeats + 1):  # the first round untimed
        for w in best:
            cache = new_cache(model, room, role="measure-strict" if w else "measure", static=w > 0)
            forward(model, prefix, cache, keep=1)
            start = clock.now()
            for _ in range(steps):
                forward(model, [1], cache, width=w)
            took = clock.now() - start
            if round_:
                best[w] = min(best[w], took)
    return best[width] / best[0]


def measure_verify_costs(model, max_draft: int, repeats: int = 2, context: int = 64) -> list[float]:
    """costs[k]: the time of the target pass that verifies a k-token draft (k + 1 tokens) over a one-token
    pass, for k = 0..max_draft, on this model and device. Timed at every k (best of `repeats`) after a
    `context`-token prefix, and kept non-decreasing: a longer pass never costs less, whatever the noise says
    (a pass size that is dearer than a longer one runs padded to it on CPU: engine.models.cpu). Every k, not a few
    points: costs do not grow smoothly (a two-row pass once cost ~12% more than a three-row one). A compiled
    model runs each size twice first: the first call compiles, the second records the CUDA graph.

    Longer passes cost relatively more as the context grows (17 tokens: 1.38 one-token passes after 64
    tokens, 1.53 after 160), but costs timed after 160 tokens did not make adaptive prompt lookup faster on
    the rewrite + summarise prompts (2.62x, 2.32x, 2.28x against 2.44x, 2.37x, 2.41x), so 64 it is."""
    untimed = 2 if getattr(model, "compiled_step", None) is not None else 0
    timed = time_passes(model, range(1, max_draft + 2), repeats, context, warmup=untimed)
    costs = []
    for n in timed:
        costs.append(max(timed[n] / timed[1], costs[-1] if costs else 1.0))
    return costs


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """Prompt -> token ids; with chat, wrapped in the model's chat template as one user turn. A conversation
    (chat messages: a later turn of a multi-turn question, after the model's own answers) goes through the
    template whole, or without one as a plain transcript."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt if isinstance(prompt, str) else transcript(messages))["input_ids"]


def transcript(messages: list[dict]) -> str:
    """A conversation as plain text for a model without a chat template: role-labelled turns, ending where the
    assistant speaks next."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines + ["Assistant:"])


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends generation: the generation config's EOS (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class TextStream:
    """Incremental detokenizer: one text piece per token, pieces concatenate to the decoded text.

    Decoding a token alone loses leading spaces and splits multi-byte characters, so each piece is the
    difference between decoding a short window with and without the new tokens (the usual offsets trick).
    A token that completes no character yet gets an empty piece; its text arrives with a later token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: a few tokens of context for spacing
        self.read = 0  # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the very end)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if after.startswith(before) else ""


def emit(stream: TextStream, tokens: list[int], eos: set[int], room: int) -> tuple[list[int], list[str], str | None]:
    """Cut `tokens` at the first EOS and at `room` tokens; decode each. Returns tokens, pieces, finish."""
    out: list[int] = []
    finished = None
    for t in tokens:
        if len(out) == room:
            finished = "length"
            break
        out.append(t)
        if t in eos:
            finished = "eos"
            break
    if finished is None and len(out) == room:
        finished = "length"
    return out, [stream.push(t) for t in out], finished


def capacity(prompt_len: int, max_new_tokens: int) -> int:
    """Tokens a run's KV caches must hold: the prompt, the new tokens, and a draft past the last of them. The
    target's cache, a draft model's and the compiled warm-up's all take this one number, so that in strict
    mode they attend over as many keys (new_cache)."""
    return prompt_len + max_new_tokens + MAX_GAMMA


def prefill(model, prompt_ids, cfg, generator, stream, eos, max_new_tokens, clock, static: bool = False,
            head=None) -> tuple[StepEvent, object]:  # fmt: skip
    """Encode the prompt into a fresh cache (of the run's `capacity`) and choose the first token (both loops
    start this way). A draft `head` (engine.decoding.heads) is handed the prompt's features."""
    start = clock.now()
    cache = new_cache(model, capacity(len(prompt_ids), max_new_tokens), static=static)
    if head is not None:
        logits, features = forward(model, prompt_ids, cache, keep=1, layers=head.layers)
        head.see(features)
        logits = logits[-1]  # (V,)
    else:
        logits = forward(model, prompt_ids, cache, keep=1)[-1]  # (V,)
    token, p = choose(logits, cfg, generator)
    top = top_two(logits[None]) if cfg.greedy else []
    forwarded = clock.now()
    tokens, pieces, finished = emit(stream, [token], eos, max_new_tokens)
    end = clock.now()
    event = StepEvent(
        0, "prefill", tokens, pieces, token=token, token_p=p, top=top,
        verify_s=forwarded - start, other_s=end - forwarded, elapsed_s=end - start, finished=finished,
    )  # fmt: skip
    return event, cache

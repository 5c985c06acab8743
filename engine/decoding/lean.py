"""A lean forward pass for Llama-family decoders on CPU: transformers' arithmetic with less around it.

On a 2-core CPU a one-token pass of the bundled model (SmolLM2-135M, 30 layers) spends about a third of its time
outside the matrix products: ~1,700 small tensor operations (a norm in eight, rotary embeddings through slices
and concatenations, a mask built per pass, a cache that concatenates every layer's keys and values) and the
module, decorator and keyword plumbing around them. `LeanDecoder` runs the same weights through the same
arithmetic, in the order transformers runs it, so its logits are bit-identical to `LlamaForCausalLM`'s with SDPA
attention (tests/test_lean.py), in ~1,400 operations and plain Python, over a `LeanCache` of preallocated
tensors written in place. On the AMX Xeon, float32, alternating with the model's own forward (30 pairs after a
64-token prefix): one-token passes 12-18% cheaper, five-row verify passes 8-12% cheaper.

A verify pass attends through a mask, where transformers copies every layer's keys and values once per query head
that shares them (repeat_kv: ~110 MB of copies per pass after 400 tokens, a fifth of the weights' bytes); here SDPA
reads them in place (enable_gqa), to the same bits. On the AMX Xeon, float32, a two-row pass of the bundled model
then cost 0.99-1.01 one-token passes instead of 1.06-1.14, and a three-row pass 1.07-1.09 instead of 1.11-1.20
(contexts of 64-400 tokens).

The linear layers are called as modules, whatever form they are in (engine.models.cpu), and the activation
is the model's own. Rotary: transformers computes q * cos + rotate_half(q) * sin, with rotate_half(q) =
cat(-q2, q1) and sin = cat(s, s); here the second product is roll(q) * cat(-s, s), the same products to the
bit (negation is exact), in four operations instead of seven.

Where every product of a pass runs our own kernel (engine.models.native), the layers run as one call of our kernels
instead (`native.Stack`, kernels/layers.cpp): logits equal these to float32 rounding rather than to the bit, and every
row of a verify, prompt or tree pass rounds exactly like a one-token pass (tests/test_fused.py); SPECARENA_FUSED=0
keeps the torch operations.

Used for Llama and Qwen2 models with full attention and a static rotary frequency (not "dynamic" or
"longrope", which change per pass), on CPU, unless SPECARENA_LEAN=0. Elsewhere (GPU, other architectures,
strict mode's static cache, compiled passes) the model's own forward runs.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from engine.decoding.tree import layout

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def enabled() -> bool:
    return os.environ.get("SPECARENA_LEAN", "1") != "0"


def fused_enabled() -> bool:
    return os.environ.get("SPECARENA_FUSED", "1") != "0"


def supported(model) -> bool:
    """Whether LeanDecoder computes exactly what this model's own forward does."""
    config = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    rope_type = getattr(rotary, "rope_type", "default")
    return (
        type(model).__name__ in ARCHITECTURES
        and type(model).__module__.startswith("transformers.models.")  # not remote code of the same name
        and next(model.parameters()).device.type == "cpu"
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and all(kind == "full_attention" for kind in layer_types)
        and rotary is not None
        and "dynamic" not in rope_type
        and "longrope" not in rope_type
        and getattr(config, "pretraining_tp", 1) == 1
        and model.model.layers[0].self_attn.head_dim <= 256  # where transformers' SDPA groups heads as we do
    )


def attach(model) -> bool:
    """Give `model` a LeanDecoder (as `model.lean`, which runtime.forward and runtime.new_cache look for) where it
    is enabled and supported; whether it did."""
    if not (enabled() and supported(model)):
        return False
    # in the instance dict, not as a submodule: its layers are the model's own, registered there already
    model.__dict__["lean"] = LeanDecoder(model)
    return True


class LeanCache:
    """Keys and values of every layer in tensors of (1, kv heads, capacity, head dim), written in place; grows by
    doubling when a pass would overrun it. Rolling back (`crop`) only moves the length."""

    def __init__(self, model, capacity: int):
        config = model.config
        self.layers = config.num_hidden_layers
        self.kv_heads, self.head_dim = config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
        self.dtype = next(model.parameters()).dtype
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        shape = (1, self.kv_heads, capacity, self.head_dim)
        with torch.inference_mode():
            keys = [torch.empty(shape, dtype=self.dtype) for _ in range(self.layers)]
            values = [torch.empty(shape, dtype=self.dtype) for _ in range(self.layers)]
            for new, old in zip(keys + values, self.keys + self.values):
                new[:, :, : self.length] = old[:, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity
        self._pointers = None

    def pointers(self):
        """Each layer's keys and values as ctypes arrays of pointers, for the fused pass (native.Stack)."""
        if self._pointers is None:
            self._pointers = cache_pointers(self.keys, self.values)
        return self._pointers

    def make_room(self, length: int) -> None:
        if length > self.capacity:
            self._allocate(max(length, 2 * self.capacity))

    def get_seq_length(self, layer: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """DynamicCache.crop's meaning: keep the first max_length tokens, or drop -max_length from the end."""
        self.length = max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length)

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep, of the rows written from `start` on, those at offsets `rows` (ascending), moved up to sit in a row:
        the branch of a draft tree the target took (engine.decoding.tree)."""
        index = torch.tensor(rows) + start
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[:, :, start : start + len(rows)] = t[:, :, index]
        self.length = start + len(rows)


def layer_spec(layer, qkv, gate_up) -> dict:
    """A Llama-family decoder layer as the layers' one call takes it (engine.models.native.Stack): its norms' weights
    and its products packed for our kernel, q/k/v and gate/up joined (`qkv`, `gate_up`: engine.models.cpu.join's);
    the target's layers (lean) and a draft head's."""
    return {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
            "qkv": qkv.rows, "o": layer.self_attn.o_proj._own, "gate_up": gate_up.rows,
            "down": layer.mlp.down_proj._own}  # fmt: skip


def cache_pointers(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """Each layer's keys and values as ctypes arrays of pointers, as the layers' one call takes them
    (engine.models.native.Stack; a cache keeps them until it reallocates): lean's cache and a draft head's."""
    array = ctypes.c_void_p * len(keys)
    return array(*(t.data_ptr() for t in keys)), array(*(t.data_ptr() for t in values))


class RotaryTable:
    """cos and the signed sin (rotate_half's sign moved onto sin: the same products) of positions, as the layers' one
    call of kernels/layers.cpp takes them: (rows, D) float32 holding values of the model's dtype, read from a table of
    the first positions that grows by doubling. Made at each pass they cost ~15 torch operations, ~0.1 ms; lean's
    fused pass and a draft head's keep one each."""

    def __init__(self):
        self.cos = self.sin = self.dtype = None

    def __call__(self, fill, start: int, rows: int, dtype, positions: torch.Tensor | None = None):
        """Of positions start.. or of `positions` ((rows,) long); `fill(positions, dtype)` makes the (n, D) cos and
        signed sin of float32 positions when the table must grow or the dtype changed."""
        end = start + rows if positions is None else int(positions.max()) + 1
        if self.cos is None or self.cos.shape[0] < end or self.dtype != dtype:
            size = max(256, 1 << (end - 1).bit_length())
            cos, sin = fill(torch.arange(size, dtype=torch.float32), dtype)
            self.cos, self.sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
            self.dtype = dtype
        if positions is None:
            return self.cos[start:end], self.sin[start:end]
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: in float32, scaled in the input's dtype."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LeanDecoder(torch.nn.Module):
    """model(input_ids, cache) for a supported model: logits (n, V) of the last `keep` rows (all when 0)."""

    def __init__(self, model):
        super().__init__()
        config = model.config
        self.model = [model]  # a list: no submodule registration (see attach)
        attn = model.model.layers[0].self_attn
        self.groups = config.num_attention_heads // config.num_key_value_heads  # query heads per key/value head
        self.head_dim, self.half = attn.head_dim, attn.head_dim // 2
        self.scaling = attn.scaling
        self.eps = config.rms_norm_eps
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.to(torch.float32)
        self.rotary_scale = rotary.attention_scaling
        self.joined: list[tuple] = []  # per layer: (q/k/v, gate/up) as one call each, or None (see join)
        self.stack = None  # every layer as one call of our kernels, where they all run ours (see join)
        self._roles: list = []  # a layer 0 linear of each weight role: which form a pass of n rows runs
        self._table = RotaryTable()  # the fused pass's cos and sin
        self._final_norm = None  # the final norm's weight in float32, for the kernel (set with the stack)

    def join(self, join, stack=None) -> int:
        """Once the linear layers have their forms, make each layer's q, k and v projections one call of our kernel,
        and gate and up another, where they run it (`join`: engine.models.cpu.join, given by the model's loader):
        ~90 calls fewer in a one-token pass of the bundled model, the same bits; and with `stack`
        (engine.models.native.Stack) every layer one call where all are joined. How many layers were joined."""
        layers = self.model[0].model.layers
        self.joined = [(join([a.q_proj, a.k_proj, a.v_proj]), join([m.gate_proj, m.up_proj]))
                       for a, m in ((layer.self_attn, layer.mlp) for layer in layers)]  # fmt: skip
        count = sum(qkv is not None for qkv, _ in self.joined)
        self.stack = self._stack(stack) if stack and count == len(layers) and fused_enabled() else None
        return count

    def _stack(self, stack):
        """Every layer as one call of kernels/layers.cpp (`stack`: engine.models.native.Stack), where each layer's
        products run our kernel under the same tables as layer 0's and the MLP is SiLU-gated; else None."""
        model = self.model[0]
        config, layers = model.config, model.model.layers
        if getattr(config, "hidden_act", None) not in ("silu", "swish"):
            return None
        roles = lambda layer: (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj)  # noqa: E731
        first = roles(layers[0])
        for layer in layers:
            for ours, lead in zip(roles(layer), first):
                if getattr(ours, "_own", None) is None or (ours.table, ours.pad) != (lead.table, lead.pad):
                    return None
        lib = first[0]._own.lib
        specs = [layer_spec(layer, qkv, gate_up) for layer, (qkv, gate_up) in zip(layers, self.joined)]
        shape = {"hidden": config.hidden_size, "heads": config.num_attention_heads, "head_dim": self.head_dim,
                 "kv_heads": config.num_key_value_heads, "intermediate": layers[0].mlp.down_proj.in_features,
                 "eps": self.eps, "scale": self.scaling}  # fmt: skip
        self._roles = list(first)
        self._final_norm = model.model.norm.weight.detach().to(torch.float32).contiguous()
        return stack(specs, shape, lib)

    def fused_words(self, most: int) -> str:
        """"; whole layers in our kernels for every pass" (or for which of the sizes up to `most` rows, the longest
        the forms are timed at), "" where none run fused."""
        sizes = self.fused_sizes(most)
        if not sizes:
            return ""
        if sizes == list(range(1, most + 1)):
            return "; whole layers in our kernels for every pass"
        spans: list[list[int]] = []
        for n in sizes:
            if spans and spans[-1][1] == n - 1:
                spans[-1][1] = n
            else:
                spans.append([n, n])
        words = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
        return f"; whole layers in our kernels for passes of {words} row{'s' if sizes != [1] else ''}"

    def fused_sizes(self, most: int) -> list[int]:
        """The pass sizes up to `most` rows that run as one call."""
        return [n for n in range(1, most + 1) if self._fused(n)]

    def rounds_alike(self, most: int) -> bool:
        """Whether every pass of 1 to `most` rows rounds each row as a one-token pass does: its layers fused and the
        LM head in our kernel at each size (tests/test_fused.py checks the whole pass's logits). Then 16-bit greedy
        ids of speculation equal the baseline's by construction, and strict mode's padded passes are not needed."""
        model = self.model[0]
        if getattr(model, "compiled_step", None) is not None:  # a compiled model's passes are its own forward's
            return False
        head = model.lm_head  # engine.models.cpu.CpuLinear where its forms were chosen
        return hasattr(head, "form") and all(self._fused(n) and head.form(n) == "own" for n in range(1, most + 1))

    def _fused(self, rows: int) -> bool:
        """Whether a pass of `rows` rows runs as one call: every weight role's form for it is our kernel."""
        if self.stack is None:
            return False
        return all(layer.form(rows) == "own" for layer in self._roles)

    def forward(self, input_ids: torch.Tensor, cache: LeanCache, keep: int = 0, layers: tuple[int, ...] = (),
                tree: list[int] | None = None):  # fmt: skip
        """Logits; with `layers` (indices into transformers' hidden_states), also those states of every row,
        concatenated in that order: (logits, (rows, len(layers) x hidden)). `tree`: the rows after the first are
        draft tree nodes with these parents (engine.decoding.tree), each at its depth's position, seeing its
        ancestors only."""
        model = self.model[0]
        taken: dict[int, torch.Tensor] = {}
        rows, past = input_ids.shape[1], cache.length
        total = past + rows
        cache.make_room(total)
        x = model.model.embed_tokens(input_ids)  # (1, rows, E)
        if self._fused(rows):
            return self._fused_pass(x, cache, past, keep, layers, taken, tree)
        # as transformers' SDPA path: no mask for one row or a first pass (causal); a boolean mask otherwise,
        # over keys and values repeated per query head
        mask = None
        if tree is not None:
            positions, mask = layout(tree, past)
            mask = mask[None, None]  # (1, 1, rows, total)
        else:
            positions = torch.arange(past, total, dtype=torch.float32)
            if rows > 1 and past:
                mask = (torch.arange(total) <= torch.arange(past, total)[:, None])[None, None]  # (1, 1, rows, total)
        cos, sin = self._rotary(positions, x.dtype)  # (1, 1, rows, D)
        x = self._run_layers(x, cache, past, cos, sin, mask, layers, taken)
        cache.length = total
        if -1 in layers:  # runtime.PRE_NORM: the last layer's output before the final norm (an MTP head's feature)
            taken[-1] = x[0]
        last = len(model.model.layers)
        if last in layers:  # transformers' last hidden state is after the final norm
            taken[last] = _rms(x, model.model.norm.weight, self.eps)[0]
        x = x[:, -keep:] if keep else x
        logits = model.lm_head(_rms(x, model.model.norm.weight, self.eps))[0]
        return (logits, torch.cat([taken[i] for i in layers], -1)) if layers else logits

    def _run_layers(self, x, cache: LeanCache, past: int, cos, sin, mask, layers, taken) -> torch.Tensor:
        """The layers in torch operations, transformers' arithmetic in transformers' order; x: (1, rows, E) in, out."""
        model = self.model[0]
        rows = x.shape[1]
        total = past + rows
        for i, layer in enumerate(model.model.layers):
            if i in layers:
                taken[i] = x[0]  # the residual stream entering layer i (x is rebound, never written in place)
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = self.joined[i] if self.joined else (None, None)
            h = _rms(x, layer.input_layernorm.weight, self.eps)
            q, k, v = (qkv and qkv(h)) or (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
            q = q.view(1, rows, -1, self.head_dim).transpose(1, 2)  # (1, H, rows, D)
            k = k.view(1, rows, -1, self.head_dim).transpose(1, 2)  # (1, KV, rows, D)
            v = v.view(1, rows, -1, self.head_dim).transpose(1, 2)
            q = q * cos + q.roll(self.half, -1) * sin
            k = k * cos + k.roll(self.half, -1) * sin
            keys, values = cache.keys[i], cache.values[i]
            keys[:, :, past:total] = k
            values[:, :, past:total] = v
            a = self._attend(q, keys[:, :, :total], values[:, :, :total], mask, rows)  # (1, H, rows, D)
            x = x + attn.o_proj(a.transpose(1, 2).reshape(1, rows, -1))
            h = _rms(x, layer.post_attention_layernorm.weight, self.eps)
            gate, up = (gate_up and gate_up(h)) or (mlp.gate_proj(h), mlp.up_proj(h))
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        return x

    def _fused_pass(self, x, cache: LeanCache, past: int, keep: int, layers, taken, tree):
        """forward's pass where every layer runs as one call of our kernels (kernels/layers.cpp), or one call per
        stretch between the layers whose input states are asked for, and the final norm in the kernel too (its rows
        as the layers' norms compute them). The rotary embedding comes from a table, a causal pass needs no mask (the
        kernel sees every key up to a row's own) and the final norm is one call: made in torch operations at each
        pass, they cost the bundled model's passes 0.6-0.8 ms of 14-16 (bfloat16, 1-5 rows) and 0.8-1.2 of 26-29
        (float32) on the AVX2 EPYC, timed in turns."""
        model, dtype, count = self.model[0], x.dtype, self.stack.count
        rows = x.shape[1]
        total = past + rows
        h = x[0].to(torch.float32, copy=True).contiguous()  # the kernel keeps the residual stream in float32
        mask = None
        if tree is not None:
            positions, mask = layout(tree, past)
            cos, sin = self._kernel_rotary(past, rows, dtype, positions.long())
            mask = mask.to(torch.uint8).contiguous()
        else:
            cos, sin = self._kernel_rotary(past, rows, dtype)
        keys, values = cache.pointers()
        start = 0
        for stop in sorted({i for i in layers if 0 <= i < count} | {count}):
            if stop > start:
                self.stack(h, start, stop, past, cos, sin, mask, keys, values, cache.capacity)
            if stop in layers:
                taken[stop] = h.to(dtype, copy=True)
            start = stop
        cache.length = total
        if -1 in layers:  # runtime.PRE_NORM: the last layer's output before the final norm (an MTP head's feature)
            taken[-1] = h.to(dtype)
        if count in layers:  # transformers' last hidden state is after the final norm
            taken[count] = _rms(h.to(dtype), model.model.norm.weight, self.eps)
        h = h[-keep:].contiguous() if keep else h
        logits = model.lm_head(self.stack.norm(h, self._final_norm, self.eps).to(dtype)[None])[0]
        return (logits, torch.cat([taken[i] for i in layers], -1)) if layers else logits

    def _kernel_rotary(self, start: int, rows: int, dtype, positions: torch.Tensor | None = None):
        """cos and the signed sin of positions start.. (or of `positions`) as the layers' one call takes them."""
        return self._table(lambda p, d: (t[0, 0] for t in self._rotary(p, d)), start, rows, dtype, positions)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin of `positions` (float32), as LlamaRotaryEmbedding computes them."""
        freqs = positions[:, None] * self.inv_freq  # (rows, D/2)
        cos = torch.cat((freqs, freqs), dim=-1).cos() * self.rotary_scale
        s = freqs.sin() * self.rotary_scale
        sin = torch.cat((-s, s), dim=-1)  # rotate_half's sign moved onto sin: the same products
        return cos.to(dtype)[None, None], sin.to(dtype)[None, None]

    def _attend(self, q, keys, values, mask, rows: int) -> torch.Tensor:
        # keys and values shared by query heads are read in place (enable_gqa), with or without a mask; transformers
        # repeats them per query head where a mask is given (repeat_kv), the same products on copies
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and rows > 1,
                                              scale=self.scaling, enable_gqa=self.groups > 1)  # fmt: skip

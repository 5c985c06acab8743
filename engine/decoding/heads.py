"""Draft heads: small drafters that read the target's own hidden states (EAGLE-3, Li et al. 2025; DFlash, z-lab 2026).

A head is a Drafter like the others. It names the target layers it reads (`layers`, as indices into transformers'
`hidden_states`: 0 is the embedding output, i the residual stream entering decoder layer i); the loop asks the
target's passes for those rows' features and hands the head the rows the target kept (`see`). The head keeps them
until its next proposal, so its picture of the text is always the target's own, never one of its guesses.

EAGLE-3 (chain drafting). Row t of the head pairs the embedding of token t+1 with the target's fused feature at
position t, g_t = fc(concat of three layers' states), and predicts token t+2. One decoder layer whose attention takes
both halves (2H wide); its output h, before the final norm, stands in for g at the next position, so drafting k tokens
costs one pass over the rows the target just kept plus k-1 one-row passes. The head has its own KV cache: rows built
from real features stay, rows built from its own guesses are cropped before the next proposal. Its vocabulary may be a
subset of the target's (`d2t`: draft id -> target id); q is zero outside it. Greedy runs draft the head's argmax (as
vLLM does); sampled runs draw each draft token from the head's q, with the run's temperature, top-k and top-p, so the
rejection rule of engine.decoding.sampling keeps the output exactly the target's distribution.

DFlash (block drafting). The target's features of the kept rows become context keys and values in every draft layer
(hidden_norm(fc(concat)), never normed again); one pass over a block [last token, mask x gamma] proposes gamma tokens at
once (gamma < B, the block size it was trained with), through the target's own embedding and LM head. Each layer's
block is causal or not as its config says, resolved the way vLLM resolves it (engine.models.heads): z-lab's heads and
full-attention layers see the whole block, the speculators trainer's sliding-window layers only the rows before. The
block has gamma + 1 rows, as vLLM and llama.cpp run it (z-lab's reference always runs B rows; in a non-causal block the
length changes the proposals). The head's cache keeps only context rows.

Sliding windows. A layer with a window W (`HeadConfig.windows`) lets a row at position p see the keys at positions
above p - W only, as vLLM's attention does (the speculators trainer's default: every layer windowed at 2048).

The layer code (HeadLayer, Head.layer_input, Head.logits) serves drafting here and training (engine.forge.train) alike,
for a batch of sequences; the drafting loops below keep the attention over their caches, as vLLM keeps its proposer
apart from the model files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.decoding.drafters import Draft, Drafter
from engine.decoding.lean import RotaryTable, cache_pointers, layer_spec
from engine.decoding.sampling import SamplingConfig, argmax, logits_to_probs, sample
from engine.decoding.tree import reindex, select
from engine.settings import MAX_GAMMA


@dataclass
class HeadConfig:
    """What a head is, whatever layout it was published in (engine.models.heads reads the layouts)."""

    kind: str  # "eagle3" | "peagle" (P-EAGLE: EAGLE-3's layers, drafting every position in one pass) | "dflash" |
    # "dspark" (DSpark: DFlash's block, then a Markov bias on each draft's logits and a confidence per position) |
    # "dflash2" (DFlash2: DFlash's block with local convolutions in each layer, then a candidate selector's walk) |
    # "mtp-head" (an MTP layer in speculators' layout: the target's final state and the next token, one per draft)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary
    layers: tuple[int, ...]  # target features read, as indices into transformers' hidden_states
    draft_vocab_size: int = 0  # 0: the target's vocabulary
    target_hidden_size: int = 0  # 0: hidden_size
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope: dict = field(default_factory=dict)  # the layer config's rope fields (rope_theta / rope_parameters, ...)
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features (speculators `input_norm`)
    fc_norm: bool = False  # one RMSNorm per feature before fc (speculators `fc_norm.i`)
    norm_output: bool = False  # EAGLE-3.1: the post-norm state is fed back
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3-style DFlash layers)
    windows: tuple[int, ...] = ()  # per layer: the sliding window, 0 = full attention (empty: all full)
    causal: tuple[bool, ...] = ()  # per layer, DFlash: whether the block is causal (empty: none is)
    logit_scale: float = 1.0  # the draft logits are multiplied by it (vLLM's `logit_scale`)
    block_size: int = 0  # DFlash: tokens per block, the first being the last verified token
    mask_token_id: int = 0  # DFlash: the token that fills the block after it; P-EAGLE: the mask rows' token
    verifier: str = ""  # the target the head was trained for, where its config says
    proposed_gamma: int = 0  # the draft length its config proposes (speculators' speculative_tokens), 0: none
    markov_rank: int = 0  # DSpark: the rank of its Markov logit bias (0: none)
    confidence: str = ""  # DSpark: its confidence head's input, "hidden" or "hidden+markov" ("": no confidence head)
    sample_from_anchor: bool = False  # DSpark: the block's first row drafts too (B drafts from a block of B)
    conv_kernel_size: int = 0  # DFlash2: taps of each layer's two local convolutions over the block (0: none)
    conv_group_size: int = 0  # DFlash2: channels that share one dynamic tap
    selector_rank: int = 0  # DFlash2: the candidate selector's rank
    selector_top_k: int = 0  # DFlash2: the candidates per position the selector scores (0: no selector)
    layout: str = ""  # the layout it was read from: eagle3-original | speculators-eagle3 | dflash | speculators-dflash
    refused: tuple[str, ...] = ()  # fields of its config SpecArena does not run, by name: loading refuses the head
    note: str = ""  # where the references disagree on this head, which one it follows

    @property
    def eagle(self) -> bool:
        """EAGLE-3's layers (a first layer 2H wide, reading the token and the feature): EAGLE-3 and P-EAGLE."""
        return self.kind in ("eagle3", "peagle")

    @property
    def block(self) -> bool:
        """DFlash's backbone (a block of drafts in one pass over context features): DFlash, DSpark, DFlash2."""
        return self.kind in ("dflash", "dspark", "dflash2")

    @property
    def most_drafts(self) -> int:
        """A block head's drafts per step: the block's mask rows, and its first row where that drafts too."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def feature_size(self) -> int:
        return len(self.layers) * (self.target_hidden_size or self.hidden_size)

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def block_causal(self, layer: int) -> bool:
        return bool(self.causal[layer]) if self.causal else False

    def rotary(self) -> tuple[torch.Tensor, float]:
        """inv_freq and attention scaling, computed by transformers from the head's own rope fields."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                             head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                             **self.rope)  # fmt: skip
        rotary = LlamaRotaryEmbedding(config)
        return rotary.inv_freq.float(), float(rotary.attention_scaling)


class RMSNorm(nn.Module):
    """LlamaRMSNorm's arithmetic: normalised in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HeadCache:
    """Keys and values of every head layer, (1, kv heads, capacity, head dim), and each row's position (a tree's rows
    sit at their depth's position), written in place; grows by doubling. Cropping only moves the length."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.shape, self.dtype, self.device = (1, kv_heads, 0, head_dim), dtype, device
        shape = (1, kv_heads, 0, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.positions = torch.empty(0, dtype=torch.long, device=device)
        self.length, self.capacity, self._pointers = 0, 0, None
        self.make_room(capacity)

    def make_room(self, length: int) -> None:
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity)
        shape = self.shape[:2] + (capacity,) + self.shape[3:]
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = torch.empty(shape, dtype=self.dtype, device=self.device)
                new[:, :, : self.length] = old[:, :, : self.length]
                tensors[i] = new
        positions = torch.empty(capacity, dtype=torch.long, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        self.positions, self.capacity = positions, capacity
        self._pointers = None

    def pointers(self):
        """Each layer's keys and values as ctypes arrays of pointers, for the layers' one call (native.Stack)."""
        if self._pointers is None:
            self._pointers = cache_pointers(self.keys, self.values)
        return self._pointers

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x of (B, heads, rows, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class BlockConv(nn.Module):
    """DFlash2's local convolution around a sublayer (speculators' GroupedDynamicCausalConv, vLLM's alike): over the
    rows of a block, causal, `kernel_size` taps, each tap a learnt base per channel plus a per-row dynamic part per
    group of `group_size` channels, projected from the sublayer's normed input. `prepare` convolves the input side
    and returns the output side's dynamic taps, which `finish` uses. Initialised as the identity, as the trainer
    starts it (a fresh DFlash2 head is DFlash until trained)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, rows, H) block rows from slot 0 -> the convolved input and the output side's taps."""
        taps = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self.conv(x, taps[..., 0, :, :], self.base_kernel[0]), taps[..., 1, :, :]

    def finish(self, y: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        return self.conv(y, taps, self.base_kernel[1])

    def conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """out[s, c] = the sum over taps t up to s's slot in its block of x[s - t, c] * (base[t, c] + delta[s, t, c's
        group]): (B, rows, H)."""
        b, rows, hidden = x.shape
        grouped = x.view(b, rows, self.groups, self.group_size)
        slots = torch.arange(rows, device=x.device).remainder(self.block_size)
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            shifted = grouped if tap == 0 else F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))
            coefficient = base[tap].to(x.dtype).view(1, 1, self.groups, self.group_size) + delta[:, :, tap, :, None]
            out = out + shifted * coefficient * slots.ge(tap).view(1, rows, 1, 1)
        return out.view(b, rows, hidden)


class HeadLayer(nn.Module):
    """One Llama-style decoder layer of a head. `wide` (EAGLE-3's first layer): q/k/v read the token embedding and
    the feature side by side (2H), each normed on its own. `qk_norm`: Qwen3's per-head norms (DFlash)."""

    def __init__(self, c: HeadConfig, wide: bool):
        super().__init__()
        h, width = c.hidden_size, 2 * c.hidden_size if wide else c.hidden_size
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        if wide:
            self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = nn.Module()
        attn = self.self_attn
        attn.q_proj = nn.Linear(width, c.num_heads * c.head_dim, bias=c.attention_bias)
        attn.k_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        attn.v_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        attn.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=c.attention_bias)
        if c.qk_norm:
            attn.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            attn.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=c.mlp_bias)
        self.mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=c.mlp_bias)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=c.mlp_bias)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[c.hidden_act]
        if c.conv_kernel_size:  # DFlash2
            self.attention_conv = BlockConv(h, c.conv_kernel_size, c.conv_group_size, c.block_size)
            self.mlp_conv = BlockConv(h, c.conv_kernel_size, c.conv_group_size, c.block_size)

    def split(self, x: torch.Tensor, proj: nn.Linear, heads: int, norm: str | None = None) -> torch.Tensor:
        """(B, rows, width) -> (B, heads, rows, D), through `proj` and the per-head norm named `norm`, if any."""
        y = proj(x).view(x.shape[0], x.shape[1], heads, self.head_dim)
        if norm is not None and hasattr(self.self_attn, norm):
            y = getattr(self.self_attn, norm)(y)
        return y.transpose(1, 2)

    def query(self, inp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, rows, width) -> roped queries (B, heads, rows, D)."""
        return rope(self.split(inp, self.self_attn.q_proj, self.heads, "q_norm"), cos, sin)

    def keys_values(self, inp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(B, rows, width) -> roped keys and values, (B, kv heads, rows, D) each."""
        keys = rope(self.split(inp, self.self_attn.k_proj, self.kv_heads, "k_norm"), cos, sin)
        return keys, self.split(inp, self.self_attn.v_proj, self.kv_heads)

    def finish(self, residual: torch.Tensor, attended: torch.Tensor, taps: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj, the residual, and the MLP block: (B, H, rows, D) -> (B, rows, hidden). A DFlash2 layer convolves
        the attention's output with `taps` (its attention_conv.prepare's) and the MLP's input and output."""
        b, rows = attended.shape[0], attended.shape[2]
        out = self.self_attn.o_proj(attended.transpose(1, 2).reshape(b, rows, -1))
        if taps is not None:
            out = self.attention_conv.finish(out, taps)
        h = residual + out
        m, normed = self.mlp, self.post_attention_layernorm(h)
        conv = getattr(self, "mlp_conv", None)
        if conv is None:
            return h + m.down_proj(self.act(m.gate_proj(normed)) * m.up_proj(normed))
        normed, taps = conv.prepare(normed)
        return h + conv.finish(m.down_proj(self.act(m.gate_proj(normed)) * m.up_proj(normed)), taps)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int = 0,
            mask: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
    """Which keys each query row sees, (rows, keys), or None for all: keys at positions up to the row's own when
    `causal`, above its position - `window` when windowed (vLLM's sliding window), and only those `mask` allows."""
    rows = q_pos.shape[0]
    if causal and mask is None and rows > 1:
        mask = k_pos[None, :] <= q_pos[:, None]
    if window and int(q_pos.max()) - int(k_pos.min()) >= window:
        inside = k_pos[None, :] > q_pos[:, None] - window
        mask = inside if mask is None else mask & inside
    return mask


def attend(q, keys, values, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of q's rows over keys/values (1, KV, total, D); `mask` (rows, total): which keys each row sees."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


class Head(nn.Module):
    """The weights of a head, EAGLE-3, P-EAGLE, DFlash, DSpark or DFlash2, and its forward passes. `embed` (and for
    the block kinds `lm_head`) are the target's, unless the head ships its own."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(c.feature_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size or c.hidden_size, c.rms_norm_eps)
                                         for _ in c.layers)  # fmt: skip
        if c.block:
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.kind == "mtp-head":  # input_proj over [token_layernorm(embedding), hidden_layernorm(state)]
            self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.token_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(HeadLayer(c, wide=c.eagle and i == 0) for i in range(c.num_layers))
        if c.kind == "peagle":  # the feature of a mask row, in the concatenated features' space (fused as theirs)
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, c.feature_size))
        if c.markov_rank:  # DSpark: bias = markov_w2(markov_w1[previous token]), W1 over the target's vocabulary
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
            self.markov_head.markov_w2 = nn.Linear(c.markov_rank, c.draft_vocab_size or c.vocab_size, bias=False)
        if c.selector_top_k:  # DFlash2: score = unary + (predecessor_codebook[prev] * hidden_projection(state)) .
            # successor_codebook[candidate], over the unary top-k
            self.candidate_selector = nn.Module()
            self.candidate_selector.predecessor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
            self.candidate_selector.successor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
            self.candidate_selector.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        if c.confidence:  # DSpark: sigmoid(proj(final state, and the Markov embedding where it says so))
            self.confidence_head = nn.Module()
            extra = c.markov_rank if c.confidence == "hidden+markov" else 0
            self.confidence_head.proj = nn.Linear(c.hidden_size + extra, 1)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed_tokens: nn.Embedding | None = None  # set by attach: the head's own, or the target's
        self.lm_head: nn.Linear | None = None
        self.register_buffer("d2t", None)  # (draft vocab,) target id of each draft id; None = the same ids
        self.register_buffer("inv_freq", None, persistent=False)
        self.reset_rotary()
        self.stack = None  # the layers as one call of our kernels, where join made them so
        self._table = RotaryTable()  # the layers' one call's cos and sin

    def join(self, join, stack) -> bool:
        """Once the linear layers have the target's forms (engine.models.cpu.like_target), make each layer's q/k/v
        one call of our kernel and gate/up another (`join`: engine.models.cpu.join), and the layers one call of
        kernels/layers.cpp (`stack`: engine.models.native.Stack), as the target's lean pass runs its own
        (engine.decoding.lean): an EAGLE-3 chain step of the bundled model's head spent ~2 ms of its 3.7 in ~100
        torch operations around the products. For EAGLE-3 and P-EAGLE heads (`eagle3`'s passes) and DFlash and
        DSpark heads (`dflash`'s; DFlash2's convolutions stay torch operations) with SiLU-gated MLPs, where every
        product runs our kernel under one table; the passes of the sizes where one does not run it stay in torch
        operations. Its outputs equal those to float32 rounding, and each row of a pass rounds as a one-row pass
        does. Whether the layers run as one call."""
        from engine.decoding.lean import fused_enabled

        self.stack, c = None, self.config
        kinds = c.eagle and not c.qk_norm or c.kind in ("dflash", "dspark") and not c.conv_kernel_size
        if not (kinds and c.hidden_act in ("silu", "swish") and c.head_dim <= 256 and fused_enabled()):
            return False  # (the kernel's rotary and attention hold a head's values on the stack: lean's limit)
        linears = self._linears()
        if any(getattr(layer, "_own", None) is None for layer in linears):
            return False
        if len({(layer.table, layer.pad) for layer in linears}) != 1:
            return False
        specs = []
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            qkv, gate_up = join([a.q_proj, a.k_proj, a.v_proj]), join([m.gate_proj, m.up_proj])
            if qkv is None or gate_up is None:
                return False
            spec = layer_spec(layer, qkv, gate_up)
            if i == 0 and c.eagle:  # EAGLE-3's first layer reads the token's embedding beside the state
                spec |= {"hidden_norm": layer.hidden_norm.weight, "normed_residual": c.norm_before_residual}
            if c.qk_norm:
                spec |= {"q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight}
            specs.append(spec)
        shape = {"hidden": c.hidden_size, "heads": c.num_heads, "head_dim": c.head_dim, "kv_heads": c.num_kv_heads,
                 "intermediate": c.intermediate_size, "eps": c.rms_norm_eps, "scale": c.head_dim**-0.5}  # fmt: skip
        self.stack = stack(specs, shape, linears[0]._own.lib)
        self._final_norm = self.norm.weight.detach().to(torch.float32).contiguous()
        self._table, self._ends = RotaryTable(), None
        return True

    def _linears(self) -> list:
        """Every layer's linear layers, as they are now (like_target and its timing swap them), read from the
        modules' dictionaries: through nn.Module's attribute lookups, asking `fused` cost a draft step ~40 us."""
        linears = []
        for layer in self.layers:
            attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
            linears += [attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"], mlp["gate_proj"],
                        mlp["up_proj"], mlp["down_proj"]]  # fmt: skip
        return linears

    def fused(self, rows: int) -> bool:
        """Whether the layers' products over `rows` rows run as one call of our kernels (Head.join): every product's
        form for that many rows is ours."""
        if self.stack is None:
            return False
        return all(getattr(linear, "_own", None) is not None and linear.form(rows) == "own"
                   for linear in self._linears())  # fmt: skip

    def reset_rotary(self) -> None:
        """The rotary frequencies, on the device of the head's weights (also after a meta-device build)."""
        device = self.fc.weight.device
        with torch.device("cpu"):
            inv_freq, self.rotary_scale = self.config.rotary()
        self.inv_freq = inv_freq if device.type == "meta" else inv_freq.to(device)
        self._table = RotaryTable()

    def rotary(self, start: int, rows: int, dtype, positions: torch.Tensor | None = None):
        """cos and sin (1, 1, rows, D) of positions start.., or of `positions` (rows,) when given."""
        if positions is None:
            positions = torch.arange(start, start + rows, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq  # (rows, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rotary_scale, emb.sin() * self.rotary_scale
        return cos.to(dtype)[None, None], sin.to(dtype)[None, None]  # (1, 1, rows, D)

    def _kernel_rotary(self, start: int, rows: int, dtype, positions: torch.Tensor | None = None):
        """`rotary` as the layers' one call takes it: cos and sin (rows, D) in float32, rotate_half's sign moved onto
        sin, of positions start.. or of `positions` (rows,), from the head's RotaryTable."""
        return self._table(self._signed_rotary, start, rows, dtype, positions)

    def _signed_rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary`'s (rows, D) cos and sin of float32 `positions`, sin's first half negated (the same products)."""
        cos, sin = (t[0, 0] for t in self.rotary(0, 0, dtype, positions.to(self.inv_freq.device)))
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), -1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(rows, n x target hidden) -> (rows, hidden): the target's layers fused into one feature."""
        if self.config.fc_norm:
            features = torch.cat([n(f) for n, f in zip(self.fc_norm, features.chunk(len(self.fc_norm), -1))], -1)
        if self.config.kind == "mtp-head":  # the state goes in as it is: the layer fuses it with the token
            return features
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        fused = self.fc(features)
        return self.hidden_norm(fused) if self.config.block else fused

    def to_target(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits (rows, Vd) -> the target's vocabulary (rows, V), -inf where the head cannot go."""
        if self.d2t is None:
            return logits if logits.shape[-1] == vocab_size else F.pad(logits, (0, vocab_size - logits.shape[-1]),
                                                                         value=float("-inf"))  # fmt: skip
        full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        return full.index_copy_(1, self.d2t, logits)

    def draft_to_target(self, i: int) -> int:
        """The target id of draft id `i` (d2t), from a list copy of d2t made once per d2t tensor (the loader assigns a
        new one, never changes it in place): indexing the tensor and reading the value back cost a greedy draft token
        more than the lookup."""
        if getattr(self, "_d2t_ids", (None, None))[0] is not self.d2t:
            self._d2t_ids = (self.d2t, self.d2t.tolist())
        return self._d2t_ids[1][i]

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of final states (..., hidden) -> (..., Vd), scaled by the config's logit_scale."""
        logits = self.lm_head(states)
        scale = self.config.logit_scale
        return logits if scale == 1.0 else logits * scale

    def layer_input(self, i: int, tokens_embedded: torch.Tensor | None, h: torch.Tensor):
        """EAGLE-3 layer i's residual and attention input for rows (B, rows, hidden): layer 0 reads the token
        embedding and the feature (or its own earlier output) side by side, each normed on its own (2H); later layers
        read the state below. norm_before_residual: the residual is the normed feature (vLLM, speculators)."""
        layer = self.layers[i]
        if i > 0:
            return h, layer.input_layernorm(h)
        if self.config.kind == "mtp-head":  # speculators' MTPLayerMixin: [embedding ; state] projected to H first
            residual = self.fc(torch.cat((self.token_norm(tokens_embedded), self.hidden_norm(h)), dim=-1))
            return residual, layer.input_layernorm(residual)
        normed = layer.hidden_norm(h)
        residual = normed if self.config.norm_before_residual else h
        return residual, torch.cat((layer.input_layernorm(tokens_embedded), normed), dim=-1)  # (B, rows, 2H)

    def markov(self, state: torch.Tensor, previous: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DSpark, one draft position: its logits (draft vocabulary,) from its final state (hidden,) with the Markov
        bias of the token before it (a target id), scaled by logit_scale as vLLM scales both; and its confidence,
        sigmoid of the confidence head over the state (and the Markov embedding), None without one."""
        c = self.config
        logits = self.lm_head(state)
        embedded = None
        if c.markov_rank:
            embedded = self.markov_head.markov_w1.weight[previous]
            logits = logits + self.markov_head.markov_w2(embedded)
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if not c.confidence:
            return logits, None
        features = torch.cat((state, embedded.to(state.dtype))) if c.confidence == "hidden+markov" else state
        return logits, torch.sigmoid(self.confidence_head.proj(features)[0].float())

    def select(self, unary: torch.Tensor, state: torch.Tensor, previous: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash2, one draft position: its candidates, the top `selector_top_k` of its logits `unary` (vocabulary,),
        and their scores, each logit plus (predecessor_codebook[previous] * hidden_projection(state)) .
        successor_codebook[candidate], as speculators' CandidateSelector.score_candidates adds them."""
        selector = self.candidate_selector
        values, candidates = unary.topk(self.config.selector_top_k)
        context = selector.predecessor_codebook[previous] * selector.hidden_projection(state).to(
            selector.predecessor_codebook.dtype)  # fmt: skip
        return candidates, values + (context[None] * selector.successor_codebook[candidates]).sum(-1).to(values.dtype)

    def output(self, h: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's states -> (the state fed back at the next position, draft-vocab logits); `out`: their
        final norm where it was computed already (the one call's, in our kernel)."""
        out = self.norm(h) if out is None else out
        return (out if self.config.norm_output else h), self.logits(out)

    def eagle3(self, tokens: torch.Tensor, x: torch.Tensor, cache: HeadCache, positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """EAGLE-3 rows after what `cache` holds: tokens (rows,), x (rows, hidden) = fused target features or the
        head's own earlier output. Returns (the state to feed back (rows, hidden), draft-vocab logits (rows, Vd)).
        Rows of a draft tree give their `positions` (rows,) and `mask` (rows, cache rows after them): which rows
        each sees (its ancestors'), where a chain's rows follow each other causally."""
        c, rows, past, given = self.config, tokens.shape[0], cache.length, positions
        cache.make_room(past + rows)
        if positions is None:
            positions = torch.arange(past, past + rows, device=tokens.device)
        cache.positions[past : past + rows] = positions
        k_pos = cache.positions[: past + rows]
        e, h = self.embed_tokens(tokens)[None], x[None]  # (1, rows, H)
        seen = [visible(positions, k_pos, True, c.window(i), mask) for i in range(c.num_layers)]
        if self.fused(rows):
            rotary, ends = self._kernel_rotary(past, rows, x.dtype, given), self._final(rows)
            h, done = self._run_stack(e[0], x, cache, past, rotary, seen, final=ends)
            cache.length = past + rows
            if done is None:
                return self.output(h.to(x.dtype), self.stack.norm(h, self._final_norm, c.rms_norm_eps).to(x.dtype))
            normed, logits = done  # the final norm and the LM head ran in the same call
            scale = c.logit_scale
            return (normed if c.norm_output else h).to(x.dtype), logits if scale == 1.0 else logits * scale
        cos, sin = self.rotary(past, rows, x.dtype, positions)
        for i, layer in enumerate(self.layers):
            residual, inp = self.layer_input(i, e, h)
            q = layer.query(inp, cos, sin)
            cache.keys[i][:, :, past : past + rows], cache.values[i][:, :, past : past + rows] = layer.keys_values(
                inp, cos, sin)  # fmt: skip
            h = layer.finish(residual, attend(q, cache.keys[i][:, :, : past + rows],
                                              cache.values[i][:, :, : past + rows], seen[i]))  # fmt: skip
        cache.length = past + rows
        state, logits = self.output(h[0])
        return state, logits

    def _final(self, rows: int):
        """The final norm and LM head as the last steps of the layers' call (native.Stack.final), where the LM head
        runs our kernel for `rows` rows; else None. Made once per packed LM head (the forms' timing swaps it)."""
        head = self._modules["lm_head"]
        own = getattr(head, "_own", None)
        if own is None or head.form(rows) != "own":
            return None
        if self._ends is None or self._ends.head is not own:
            self._ends = self.stack.final(self._final_norm, own)
        return self._ends

    def _run_stack(self, embedded, x, cache: HeadCache, past: int, rotary, masks: list,
                   context: torch.Tensor | None = None, final=None):  # fmt: skip
        """The layers as calls of our kernels (one per stretch of layers that see the same keys): x (rows, H) in, the
        last layer's output (rows, H) out, in float32 (values of x's dtype); `eagle3`'s with the rows' token
        embeddings (rows, H), `dflash`'s with the context rows (C, H) whose keys and values come first; rotary: cos
        and sin of the context rows and rows (`_kernel_rotary`); masks: each layer's `visible` keys, (rows, past + C
        + rows), or None (causal). Returns (the output, None), or with `final` (`_final`), where the last call runs the
        final norm and LM head too, (the output, (the normed rows, their logits))."""
        h = x.to(torch.float32, copy=True).contiguous()  # the kernel keeps the residual stream in float32
        embedded = None if embedded is None else embedded.to(torch.float32).contiguous()
        context = None if context is None else context.to(torch.float32).contiguous()
        (cos, sin), (keys, values) = rotary, cache.pointers()

        def same(a, b) -> bool:
            return a is b or (a is not None and b is not None and torch.equal(a, b))

        start, done = 0, None
        for stop in range(1, len(masks) + 1):
            if stop == len(masks) or not same(masks[stop], masks[start]):
                mask = None if masks[start] is None else masks[start].to(torch.uint8).contiguous()
                last = final if stop == len(masks) else None
                done = self.stack(h, start, stop, past, cos, sin, mask, keys, values, cache.capacity, embedded, context,
                                  last)  # fmt: skip
                start = stop
        return h, done

    def dflash(self, context: torch.Tensor, block: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """One DFlash block: context (rows, features) of the positions after what `cache` holds, then the block's
        tokens (B,) at the positions after them. Returns the block's final states (B, hidden); the cache keeps the
        context rows only. Each layer's block is causal or not, and windowed or not, as the config says."""
        c, past, rows, size = self.config, cache.length, context.shape[0], block.shape[0]
        cache.make_room(past + rows + size)
        total = past + rows + size
        positions = torch.arange(past, total, device=block.device)
        cache.positions[past:total] = positions
        k_pos, q_pos = cache.positions[:total], positions[rows:]
        ctx = self.fuse(context)[None]  # (1, rows, H): keys and values come straight from it in every layer
        h = self.embed_tokens(block)[None]  # (1, B, H)
        if self.fused(size) and self.fused(rows + size):  # the kernels' products run over both sizes
            every, seen = torch.ones(size, total, dtype=torch.bool, device=block.device), []
            for i in range(c.num_layers):  # the kernel reads None as causal: a non-causal block sees every key
                mask = visible(q_pos, k_pos, c.block_causal(i), c.window(i))
                seen.append(every if mask is None and not c.block_causal(i) else mask)
            rotary = self._kernel_rotary(past, rows + size, ctx.dtype)
            h = self._run_stack(None, h[0], cache, past, rotary, seen, ctx[0])[0]
            cache.length = past + rows
            return self.stack.norm(h, self._final_norm, c.rms_norm_eps).to(ctx.dtype)  # the final norm, as norm's
        cos, sin = self.rotary(past, rows + size, ctx.dtype)
        for i, layer in enumerate(self.layers):
            inp, taps = layer.input_layernorm(h), None
            if c.conv_kernel_size:  # DFlash2: the block rows convolved before attention (the context is not)
                inp, taps = layer.attention_conv.prepare(inp)
            q = layer.query(inp, cos[:, :, rows:], sin[:, :, rows:])  # the block's positions
            keys, values = layer.keys_values(torch.cat((ctx, inp), dim=1), cos, sin)  # (1, KV, rows + B, D)
            cache.keys[i][:, :, past:total], cache.values[i][:, :, past:total] = keys, values
            seen = visible(q_pos, k_pos, c.block_causal(i), c.window(i))
            h = layer.finish(h, attend(q, cache.keys[i][:, :, :total], cache.values[i][:, :, :total], seen), taps)
        cache.length = past + rows  # the block's own keys are dropped: the next block comes with new context
        return self.norm(h[0])


class HeadDrafter(Drafter):
    """What EAGLE-3 and DFlash drafters share: the target features they were handed and have not used yet."""

    def __init__(self, head: Head, vocab_size: int, gamma: int = 4, adaptive: bool = False):
        self.head, self.vocab_size = head, vocab_size
        self.layers = head.config.layers
        super().__init__(gamma, adaptive)

    def reset(self) -> None:
        super().reset()
        p = next(self.head.parameters())
        c = self.head.config
        self.cache = HeadCache(c.num_layers, c.num_kv_heads, c.head_dim, p.dtype, p.device, (self.max_len or 224) + 32)
        self.pending: list[torch.Tensor] = []  # target features (rows, F) handed over and not fed yet
        self.fed = 0  # positions whose target features the head's cache holds

    def see(self, features: torch.Tensor) -> None:
        """Features of the rows the target just kept, in order (the prompt's at prefill, then each step's)."""
        self.pending.append(features.to(self.head.fc.weight.dtype))

    def _take(self, ids: list[int]) -> torch.Tensor:
        features = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        if self.fed + features.shape[0] != len(ids) - 1:
            raise RuntimeError(f"head out of step: {self.fed} + {features.shape[0]} rows for {len(ids) - 1} positions")
        return features

    def _choose(self, logits: torch.Tensor, cfg: SamplingConfig, generator) -> tuple[int, torch.Tensor | None]:
        """A draft token from the head's logits (draft vocabulary,): when greedy the argmax, mapped to its target id
        (d2t ascends, so ties fall as over the whole vocabulary); else a draw from q over the target's vocabulary."""
        head = self.head
        if cfg.greedy:
            best = int(argmax(logits))
            return best if head.d2t is None else head.draft_to_target(best), None
        probs = logits_to_probs(head.to_target(logits[None], self.vocab_size)[0], cfg)
        return int(sample(probs, generator)), probs


class Eagle3(HeadDrafter):
    """EAGLE-3 drafting: one pass over the kept rows, then one row per further draft token (a chain), or with
    `topk` > 1 a tree (EAGLE-2): each pass after the first expands the `topk` likeliest nodes of the last depth at
    once, each into its `topk` likeliest children, and the nodes worth a verify pass on this machine are kept
    (engine.decoding.tree.select, with the target's verify `costs`)."""

    name = "eagle3"
    TRUST_PRIOR = 8.0  # pseudo-tokens behind the start of the confidences' trust (1: taken at their word)

    def __init__(self, head: Head, vocab_size: int, gamma: int = 4, adaptive: bool = False, topk: int = 1,
                 costs: list[float] | None = None):  # fmt: skip
        self.topk, self.costs = topk, costs
        super().__init__(head, vocab_size, gamma, adaptive)

    def reset(self) -> None:
        super().reset()
        self.expected = 0.0  # the last tree's expected accepted length, by its confidences
        self.kept_sum = self.expected_sum = self.TRUST_PRIOR

    @property
    def trust(self) -> float:
        """Tokens the target kept over those the trees' confidences expected, so far in the run."""
        return self.kept_sum / self.expected_sum

    def observe(self, drafted: int, accepted: int) -> None:
        if self.topk > 1 and drafted:
            self.kept_sum += accepted
            self.expected_sum += self.expected
        super().observe(drafted, accepted)

    def _real_rows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's pass over the rows the target kept since the last proposal: their states and logits."""
        head, device = self.head, self.head.fc.weight.device
        self.cache.crop(self.fed)  # rows built from its own guesses go
        features = self._take(ids)
        rows = features.shape[0]
        tokens_in = torch.tensor(ids[self.fed + 1 : self.fed + 1 + rows], device=device)
        state, logits = head.eagle3(tokens_in, head.fuse(features), self.cache)  # (rows, H), (rows, Vd)
        self.fed += rows
        return state, logits

    def propose(self, ids, limit, cfg, generator) -> Draft:
        gamma = min(self.gamma, limit)
        if gamma <= 0:
            return Draft([])
        if self.topk > 1:
            return self._tree(ids, gamma, cfg)
        head, device = self.head, self.head.fc.weight.device
        state, logits = self._real_rows(ids)
        tokens, probs = [], []
        for k in range(gamma):
            token, q = self._choose(logits[-1], cfg, generator)
            tokens.append(token)
            probs.append(q)
            if k + 1 < gamma:
                state, logits = head.eagle3(torch.tensor([token], device=device), state[-1:], self.cache)
        return Draft(tokens, None if cfg.greedy else torch.stack(probs), passes=gamma)

    def _ranked(self, logits: torch.Tensor, cfg: SamplingConfig) -> list[tuple[list[int], list[float]]]:
        """Per row of draft-vocabulary logits (rows, Vd): the `topk` likeliest tokens (target ids) and their log
        confidences, the head's softmax or its q under the run's sampling settings (tokens q cannot draw are left
        out). One pass over the rows, one copy to the host."""
        probs = torch.softmax(logits.float(), -1) if cfg.greedy else logits_to_probs(logits, cfg)  # (rows, Vd)
        top = probs.topk(min(self.topk, probs.shape[-1]), -1)
        ids = top.indices if self.head.d2t is None else self.head.d2t[top.indices]
        out = []
        for row_ids, row_p in zip(ids.tolist(), top.values.log().tolist()):
            kept = [(i, lp) for i, lp in zip(row_ids, row_p) if lp > float("-inf")]
            out.append(([i for i, _ in kept], [lp for _, lp in kept]))
        return out

    def _tree(self, ids: list[int], depth: int, cfg: SamplingConfig) -> Draft:
        """Grow a tree `depth` deep (EAGLE-2), then keep the nodes worth verifying."""
        head, device, k = self.head, self.head.fc.weight.device, self.topk
        state, logits = self._real_rows(ids)
        base = self.cache.length  # the real rows; every tree row comes after them
        (tokens, scores), = self._ranked(logits[-1:], cfg)
        parents = [-1] * len(tokens)
        states = {-1: state[-1]}  # node -> the state its children are fed with (its own row's output)
        rows_of: dict[int, list[int]] = {-1: []}  # node -> the head cache rows it sees of the tree (its branch's)
        frontier, passes = list(range(len(tokens))), 1
        for level in range(1, depth):  # expand nodes of depth `level`: their rows sit at position base + level - 1
            grow = sorted(frontier, key=lambda n: -scores[n])[:k]
            if not grow:
                break
            past = self.cache.length
            mask = torch.zeros((len(grow), past + len(grow)), dtype=torch.bool)
            mask[:, :base] = True
            for r, n in enumerate(grow):
                rows_of[n] = rows_of[parents[n]] + [past + r]
                mask[r, rows_of[n]] = True
            x = torch.stack([states[parents[n]] for n in grow])  # (rows, H)
            at = torch.full((len(grow),), base + level - 1, device=device)
            grown = torch.tensor([tokens[n] for n in grow], device=device)
            out, lg = head.eagle3(grown, x, self.cache, at, mask.to(device))  # (rows, H), (rows, Vd)
            passes += 1
            frontier = []
            for r, (n, (more, confidence)) in enumerate(zip(grow, self._ranked(lg, cfg))):
                states[n] = out[r]
                frontier += range(len(tokens), len(tokens) + len(more))
                tokens += more
                scores += [scores[n] + c for c in confidence]
                parents += [n] * len(more)
        kept = select(scores, parents, self.costs, MAX_GAMMA, self.trust)
        self.expected = sum(math.exp(scores[n]) for n in kept)
        return Draft([tokens[n] for n in kept], None, passes=passes, parents=reindex(kept, parents))


class DFlash(HeadDrafter):
    """DFlash block drafting: one pass over a block proposes up to block size - 1 tokens."""

    name = "dflash"

    def propose(self, ids, limit, cfg, generator) -> Draft:
        c = self.head.config
        size = min(self.gamma, c.block_size - 1)  # proposals of the block; where its attention is non-causal its
        gamma = min(size, limit)  # length changes them: gamma + 1 rows, as vLLM and llama.cpp run it
        if gamma <= 0:
            return Draft([])
        device = self.head.fc.weight.device
        features = self._take(ids)
        block = torch.tensor([ids[-1]] + [c.mask_token_id] * size, device=device)
        states = self.head.dflash(features, block, self.cache)  # (B, H)
        self.fed += features.shape[0]
        logits = self.head.logits(states[1 : 1 + gamma])  # (gamma, draft vocabulary)
        tokens, probs = [], []
        for row in logits:
            token, q = self._choose(row, cfg, generator)
            tokens.append(token)
            probs.append(q)
        return Draft(tokens, None if cfg.greedy else torch.stack(probs), passes=1)


class DSpark(HeadDrafter):
    """DSpark drafting: DFlash's block pass, then one draft position after another, each position's logits biased by
    the Markov head from the token drafted before it (the last verified token before the first), and drafting stops
    at the first position whose confidence is below `p_min`, as llama.cpp's --spec-draft-p-min stops it (0: never).
    With `sample_from_anchor` (the trainer's default) the block's first row drafts too: γ drafts from a block of γ
    rows, [last token, mask x (γ-1)]; without it the block is DFlash's, γ + 1 rows, its mask rows drafting.
    (speculators' DSparkDraftModel; llama.cpp's draft-dspark; vLLM 0.32 runs it on GPUs only.)"""

    name = "dspark"

    def __init__(self, head: Head, vocab_size: int, gamma: int = 4, adaptive: bool = False, p_min: float = 0.0):
        self.p_min = p_min
        super().__init__(head, vocab_size, gamma, adaptive)

    def propose(self, ids, limit, cfg, generator) -> Draft:
        c = self.head.config
        gamma = min(self.gamma, c.most_drafts, limit)
        if gamma <= 0:
            return Draft([])
        device = self.head.fc.weight.device
        features = self._take(ids)
        first = 0 if c.sample_from_anchor else 1  # the block's row of the first draft
        block = torch.tensor([ids[-1]] + [c.mask_token_id] * (gamma - 1 + first), device=device)
        states = self.head.dflash(features, block, self.cache)  # (rows, H)
        self.fed += features.shape[0]
        tokens, probs, previous, note = [], [], ids[-1], ""
        for state in states[first : first + gamma]:
            logits, confidence = self.head.markov(state, previous)
            if self.p_min and confidence is not None and float(confidence) < self.p_min:
                note = f"confidence stop before draft token {len(tokens) + 1}: {float(confidence):.2f} < {self.p_min:g}"
                break
            token, q = self._choose(logits, cfg, generator)
            tokens.append(token)
            probs.append(q)
            previous = token
        return Draft(tokens, None if cfg.greedy or not probs else torch.stack(probs), passes=1, note=note)


class DFlash2(HeadDrafter):
    """DFlash2 drafting: DFlash's block pass through layers with local convolutions, then the candidate selector's
    walk, left to right: each position's candidates are the top `selector_top_k` of its logits, each scored by its
    logit plus a bilinear term of the token before it (the last verified token before the first draft), the
    position's final state and the candidate; greedy runs take the best, sampled runs draw from the scores (q is
    zero outside the candidates), and the token taken is the next position's predecessor (speculators'
    DFlash2DraftModel and CandidateSelector; vLLM's dflash2 speculator walks the same way, on GPUs)."""

    name = "dflash2"

    def propose(self, ids, limit, cfg, generator) -> Draft:
        c, head = self.head.config, self.head
        size = min(self.gamma, c.block_size - 1)
        gamma = min(size, limit)
        if gamma <= 0:
            return Draft([])
        device = head.fc.weight.device
        features = self._take(ids)
        block = torch.tensor([ids[-1]] + [c.mask_token_id] * size, device=device)
        states = head.dflash(features, block, self.cache)[1 : 1 + gamma]  # (gamma, H)
        self.fed += features.shape[0]
        tokens, probs, previous = [], [], ids[-1]
        for state, unary in zip(states, head.logits(states)):
            candidates, scores = head.select(unary, state, previous)
            if cfg.greedy:
                token, q = int(candidates[scores.argmax()]), None
            else:
                full = scores.new_full((self.vocab_size,), float("-inf")).index_copy_(0, candidates, scores)
                q = logits_to_probs(full, cfg)
                token = int(sample(q, generator))
            tokens.append(token)
            probs.append(q)
            previous = token
        return Draft(tokens, None if cfg.greedy else torch.stack(probs), passes=1)


class MTPHead(Eagle3):
    """An MTP layer in speculators' layout drafting a chain, as its trainer runs it: row t pairs token t+1 with the
    target's last-layer state at position t (before the final norm), the layer's output after its final norm
    (`final_layernorm`) stands in for the state at the next position; one pass over the kept rows, then one row per
    further draft (speculators' MTPDraftModel; vLLM serves MTP only from inside a target's own checkpoint)."""

    name = "mtp-head"


class PEagle(HeadDrafter):
    """P-EAGLE (parallel EAGLE-3) drafting: one pass of EAGLE-3's layers over the rows the target kept, the last
    pairing the newest token with the feature before it, then γ - 1 mask rows (the mask token, the learnt
    `mask_hidden` feature) at the positions after: every row attends causally, and the last real row and the mask
    rows propose the γ drafts at once (speculators' PEagleDraftModel; vLLM's `parallel_drafting`). The mask rows'
    keys are dropped before the next pass, which brings real features for the rows kept."""

    name = "peagle"

    def reset(self) -> None:
        super().reset()
        self.mask_row = self.head.fuse(self.head.mask_hidden[0])  # (1, hidden): every mask row's fused feature

    def propose(self, ids, limit, cfg, generator) -> Draft:
        gamma = min(self.gamma, limit)
        if gamma <= 0:
            return Draft([])
        head, device = self.head, self.head.fc.weight.device
        self.cache.crop(self.fed)  # the last pass's mask rows go
        features = self._take(ids)
        rows = features.shape[0]
        masks = gamma - 1
        tokens = torch.tensor(ids[self.fed + 1 : self.fed + 1 + rows] + [head.config.mask_token_id] * masks,
                              device=device)  # fmt: skip
        x = head.fuse(features)
        if masks:
            x = torch.cat((x, self.mask_row.expand(masks, -1)))
        _, logits = head.eagle3(tokens, x, self.cache)  # (rows + masks, Vd)
        self.fed += rows
        drafts, probs = [], []
        for row in logits[rows - 1 :]:
            token, q = self._choose(row, cfg, generator)
            drafts.append(token)
            probs.append(q)
        return Draft(drafts, None if cfg.greedy else torch.stack(probs), passes=1)

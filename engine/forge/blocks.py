"""Training a DFlash head (z-lab 2026; speculators' dflash trainer): its starting weights, the anchored-block forward
and its loss.

Served (engine.decoding.heads.DFlash), the head drafts from the last verified token x_a at position a: one pass over
a block [x_a, mask x gamma] at positions a..a+gamma, whose queries attend over the target's features of the positions
before a (context keys and values, through fc and hidden_norm) and over the whole block, non-causally (every layer
full attention, as the head's config states); slot i's final state through the LM head proposes x_{a+i}.

Trained as speculators trains it: anchors among a sequence's answer positions (x_a a token the target wrote; every
one when there are few, a random `most` of them when there are more), each with a block of its own; a batch's
sequences packed end to end into one row, and a mask that lets block j see its own sequence's context before its
anchor and its own block, nothing else. Slot i's label is the target's distribution at position a+i-1 (of x_{a+i}):
the data's top-k soft label (engine.forge.data), renormalised over the draft vocabulary, so the loss is the forward
KL to the target (speculators' default loss) up to a constant; slot i weighs exp(-(i-1)/DECAY) (speculators' fixed
exponential decay). Rows are the head's own modules, run as Head.dflash runs them (tests/test_forge.py checks that
both give the same logits).

Block lengths. Served, the block has gamma + 1 rows (as vLLM and llama.cpp run it), and in a non-causal block its
length changes every slot's output. So each anchor's block length is drawn from 2..steps+1: every gamma up to the
longest trained is trained as it is served (speculators trains blocks of one size, z-lab serves that size always).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import torch

from engine.decoding.heads import Head, attend, visible
from engine.forge.data import Sequence
from engine.forge.train import step_loss, trainable

DECAY = 4.0  # slot i's loss weight exp(-(i - 1) / DECAY): speculators' dflash_decay_gamma default
MOST_ANCHORS = 512  # blocks per training batch at most (speculators' max_anchors)


# --- the head's starting point ------------------------------------------------------------------------------------


def mask_token(target) -> int:
    """The token that fills a block after its anchor: the target's padding token, else its end of sequence. The
    embedding is the target's (shared, frozen), so it must be a row the target trained (z-lab adds a token of its
    own to the vocabulary; a forged head cannot)."""
    config = target.config.get_text_config()
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    for token in (config.pad_token_id, eos):
        if token is not None and bool(target.get_input_embeddings().weight[token].abs().sum() > 0):
            return int(token)
    return 0


def start_head(target, ids: torch.Tensor, steps: int, draft_layers: int = 1, init: str = "random",
               seed: int = 0) -> Head:  # fmt: skip
    """A trainable DFlash head for `target`: `draft_layers` Qwen3-style layers reading EAGLE-3's three target layers
    (the forge's data), blocks of steps + 1, the target's embedding (frozen, shared) and its LM head rows for the
    draft vocabulary `ids` (a copy, frozen); with init="target" each layer starts as the target's last one."""
    from engine.models.heads import eagle3_layers, random_head

    depth = target.config.get_text_config().num_hidden_layers
    proto = random_head(target, "dflash", layers=draft_layers, block_size=steps + 1, mask_token_id=mask_token(target))
    c = replace(proto.config, layers=eagle3_layers(depth), draft_vocab_size=ids.numel())
    p = next(target.parameters())
    torch.manual_seed(seed)
    head = Head(c).to(p.device, p.dtype)
    head.embed_tokens = target.get_input_embeddings()
    head.lm_head = torch.nn.Linear(c.hidden_size, ids.numel(), bias=False, device=p.device, dtype=p.dtype)
    return trainable(head, target, ids, _from_target if init == "target" else None)


def _from_target(head: Head, target) -> None:
    src = target.model.layers[-1]
    with torch.no_grad():
        for layer in head.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                if hasattr(src.self_attn, name):
                    getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            layer.input_layernorm.weight.copy_(src.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.model.norm.weight)


# --- batches ------------------------------------------------------------------------------------------------------


def anchors(s: Sequence) -> range:
    """Positions a block may start at: the answer's tokens whose next token has a label (a = P .. n-2)."""
    return range(s.prompt_len, len(s.tokens) - 1)


def collate(sequences: list[Sequence], steps: int, t2d: torch.Tensor, dtype: torch.dtype,
            rng: random.Random | None = None, gamma: int | None = None, most: int = MOST_ANCHORS) -> dict:  # fmt: skip
    """The sequences packed into one row of context and their blocks after it (see the module docstring). With
    `gamma`, every anchor and blocks of gamma + 1 (an evaluation of that draft length); else `most` anchors at
    random (by `rng`) with lengths from 2 to steps + 1."""
    contexts, ctx_doc, ctx_pos = [], [], []
    chosen: list[tuple[int, int, int]] = []  # (sequence, anchor, block length)
    for i, s in enumerate(sequences):
        n = len(s.tokens)
        contexts.append(s.features.to(dtype))
        ctx_doc += [i] * (n - 1)
        ctx_pos += range(n - 1)
        chosen += [(i, a, 0) for a in anchors(s)]
    if gamma is None and len(chosen) > most:
        chosen = sorted(rng.sample(chosen, most)) if rng is not None else chosen[:most]
    lengths = [gamma + 1 if gamma else (rng.randint(2, steps + 1) if rng is not None else steps + 1)
               for _ in chosen]  # fmt: skip
    tokens, pos, doc, anchor, block, slot = [], [], [], [], [], []
    for j, ((i, a, _), length) in enumerate(zip(chosen, lengths)):
        s = sequences[i]
        for k in range(length):
            tokens.append(s.tokens[a] if k == 0 else -1)  # -1: the mask token (the head's own, filled in forward)
            pos.append(a + k)
            doc.append(i)
            anchor.append(a)
            block.append(j)
            slot.append(k)
    # a batch of sequences with no answer position to anchor on has no block row: long tensors even then
    q_doc, q_anchor, q_block = (torch.tensor(x, dtype=torch.long) for x in (doc, anchor, block))
    c_doc, c_pos = torch.tensor(ctx_doc, dtype=torch.long), torch.tensor(ctx_pos, dtype=torch.long)
    sees_context = (c_doc[None] == q_doc[:, None]) & (c_pos[None] < q_anchor[:, None])
    mask = torch.cat((sees_context, q_block[:, None] == q_block[None]), 1)  # (Q, C + Q)
    slots = torch.tensor(slot, dtype=torch.long)
    labelled = torch.nonzero(slots > 0)[:, 0]  # (R,): the rows that propose a token
    top = sequences[0].top_ids.shape[1]
    label_ids = torch.full((labelled.numel(), top), -1, dtype=torch.long)
    label_p = torch.zeros((labelled.numel(), top), dtype=torch.float32)
    for r, q in enumerate(labelled.tolist()):
        s, row = sequences[doc[q]], anchor[q] + slot[q] - 1  # the target's distribution of x_{a+i}
        if row <= len(s.tokens) - 2:
            label_ids[r] = t2d[s.top_ids[row].long()]
            label_p[r] = s.top_p[row].float()
    return {"features": torch.cat(contexts), "ctx_positions": c_pos, "tokens": torch.tensor(tokens, dtype=torch.long),
            "positions": torch.tensor(pos, dtype=torch.long), "mask": mask, "block": q_block, "doc": q_doc,
            "block_slot": slots, "labelled": labelled, "slot": slots[labelled], "seq": q_doc[labelled],
            "anchor": q_anchor[labelled], "label_ids": label_ids, "label_p": label_p,
            "shape": (len(sequences), max(len(s.tokens) - 1 for s in sequences))}  # fmt: skip


# --- the forward and the loss -------------------------------------------------------------------------------------


def block_forward(head: Head, batch: dict) -> torch.Tensor:
    """Final states (Q, hidden) of every block row of a packed batch (collate), as Head.dflash computes a block's,
    with the same layer code: context keys and values from the fused features in every layer, queries from the
    block; the batch's mask says who sees what, narrowed per layer as the config says (a causal block, a window)."""
    c = head.config
    ctx = head.fuse(batch["features"])[None]  # (1, C, H)
    rows = ctx.shape[1]
    tokens = batch["tokens"].clamp(min=0) + (batch["tokens"] < 0) * c.mask_token_id
    h = head.embed_tokens(tokens)[None]  # (1, Q, H)
    q_pos = batch["positions"]
    k_pos = torch.cat((batch["ctx_positions"], q_pos))
    cos, sin = head.rotary(0, 0, ctx.dtype, k_pos)
    for i, layer in enumerate(head.layers):
        inp = layer.input_layernorm(h)
        q = layer.query(inp, cos[:, :, rows:], sin[:, :, rows:])  # the blocks' positions
        keys, values = layer.keys_values(torch.cat((ctx, inp), dim=1), cos, sin)  # (1, KV, C + Q, D)
        seen = batch["mask"]
        if c.block_causal(i):  # within its block a row sees the rows up to its own
            slot = batch["block_slot"]
            seen = seen & torch.cat((torch.ones_like(seen[:, :rows]), slot[None, :] <= slot[:, None]), 1)
        h = layer.finish(h, attend(q, keys, values, visible(q_pos, k_pos, False, c.window(i), seen)))
    return head.norm(h[0])


def batch_loss(head: Head, batch: dict, steps: int) -> tuple[torch.Tensor, list[dict]]:
    """The weighted loss over the proposing rows and, per draft position 1..steps, the counts and where the head was
    right: hit_mask and valid (sequences, rows) at row a - 1 for anchor a, the layout of EAGLE-3's step stats
    (engine.forge.train.step_loss), so the loop scores and replays both kinds alike."""
    states = block_forward(head, batch)[batch["labelled"]]  # (R, H)
    logits = head.logits(states)[None]  # (1, R, Vd)
    label_ids, label_p = batch["label_ids"][None], batch["label_p"][None]
    total, weights = logits.sum() * 0.0, 0.0  # a tensor even for a batch without a label
    stats = []
    for k in range(1, steps + 1):
        at = torch.nonzero(batch["slot"] == k)[:, 0]
        loss, s = step_loss(logits[:, at], label_ids[:, at], label_p[:, at])
        weight = math.exp(-(k - 1) / DECAY) * s["rows"]
        total, weights = total + weight * loss, weights + weight
        hit = torch.zeros(batch["shape"], dtype=torch.bool, device=logits.device)
        valid = torch.zeros(batch["shape"], dtype=torch.bool, device=logits.device)
        where = (batch["seq"][at], batch["anchor"][at] - 1)
        hit[where], valid[where] = s["hit_mask"][0], s["valid"][0]
        stats.append(s | {"loss": loss.item(), "hit_mask": hit, "valid": valid})
    return total / max(weights, 1e-9), stats

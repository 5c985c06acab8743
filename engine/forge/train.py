"""Training an EAGLE-3 head: the draft vocabulary, the starting weights, the train-time-test forward and its loss.

Train-time test (EAGLE-3; HASS). At inference the head drafts k tokens from the last real row t: step 0 reads the
target's feature g_t with the embedding of x_{t+1}; step k reads its own previous output h (before the final norm)
with the embedding of the token it drafted, one position further on, attending over the real rows 0..t and its own
earlier steps from t (engine.decoding.heads.Head.eagle3; rows built from its own guesses are cropped before the next
proposal). `ttt_forward` runs every anchor t of a batch of sequences at once, for `steps` steps: step k's row for
anchor t sits at position t+k, attends causally over the real rows' keys (step 0) and over its own chain's keys of
steps 1..k (one key per step: a diagonal), and is fed the teacher's token x_{t+k+1} (a draft token is only worth
anything when it was the target's, so the chain is trained on the target's tokens). The weights are the Head's own
modules and its layer code (Head.layer_input, HeadLayer.query / keys_values / finish, Head.output), so what trains is
exactly what Head.eagle3 runs; only the attention is the trainer's own. tests/test_forge.py checks both agree.

Loss: soft cross-entropy against the target's distribution (its top-k, renormalised over the draft vocabulary), per
step weighted 0.8^k (SafeAILab), rows whose target argmax lies outside the draft vocabulary left out.

Draft vocabulary: the target tokens most frequent among the labels, enough to cover `coverage` of them (d2t maps
draft id -> target id; vLLM and llama.cpp give q = 0 elsewhere). The LM head rows start as the target's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.decoding.heads import Head
from engine.forge.data import Sequence

STEP_DECAY = 0.8  # loss weight of TTT step k: 0.8^k


# --- vocabulary -----------------------------------------------------------------------------------------------------


def label_counts(sequences: list[Sequence], vocab_size: int, soft: bool = False) -> torch.Tensor:
    """How often each target token is the target's own choice (top-1 label) at an answer position; with `soft`, the
    target's probability mass on each token over every answer position, which spreads over the
    tokens it would also have written and so predicts unseen text better than a few thousand argmaxes do."""
    counts = torch.zeros(vocab_size, dtype=torch.float64 if soft else torch.int64)
    for s in sequences:
        start = s.prompt_len - 1  # the answer's labels
        if soft:
            counts.index_add_(0, s.top_ids[start:].reshape(-1).long(), s.top_p[start:].reshape(-1).double())
        else:
            top = s.top_ids[start:, 0].long()
            counts += torch.bincount(top, minlength=vocab_size)[:vocab_size]
    return counts


def _covering(counts: torch.Tensor, coverage: float) -> list[int]:
    """The fewest ids, most frequent first (ties by id, as speculators does), that hold `coverage` of the counts."""
    order = sorted(range(counts.numel()), key=lambda i: (-float(counts[i]), i))
    total = float(counts.sum())
    if total == 0:
        return []
    running = torch.cumsum(counts[torch.tensor(order)].double(), 0)
    return order[: int(torch.searchsorted(running, torch.tensor(coverage * total, dtype=torch.float64))) + 1]


def draft_vocabulary(*counts: torch.Tensor, coverage: float = 0.97, least: int | None = None,
                     most: int = 32768) -> torch.Tensor:  # fmt: skip
    """Sorted target ids of the draft vocabulary: for each of `counts` (hard and soft label counts, say) the most
    frequent ids until they hold `coverage` of it, together; then the most frequent of the first counts up to a
    multiple of 256 (32 for small vocabularies) and at least `least` ids (default: a quarter of the vocabulary up to
    4096: a few minutes of data see too few distinct tokens to estimate the tail, and a missing token is a sure
    rejection; yet every row beyond what the labels need is read at every draft step and trained at every update:
    on the bundled model's 30-minute data, the 5,120 ids that cover 97% of the labels trained 2,628 updates where a
    floor of 8,192 trained 1,696 in the same time, and served 1.15x against 1.06x on the held-out prompts); at most
    `most`. Ids never counted come last, lowest first."""
    vocab = counts[0].numel()
    multiple = 256 if vocab >= 16384 else 32
    least = min(4096, vocab // 4) if least is None else least
    chosen = set()
    for c in counts:
        chosen.update(_covering(c, coverage))
    size = min(vocab, max(least, min(most, -(-len(chosen) // multiple) * multiple)))
    order = sorted(range(vocab), key=lambda i: (-float(counts[0][i]), i))
    for i in order:
        if len(chosen) >= size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen)[:size] if len(chosen) > size else sorted(chosen), dtype=torch.long)


def covered(counts: torch.Tensor, ids: torch.Tensor) -> float:
    total = float(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


# --- the head's starting point ------------------------------------------------------------------------------------


def start_head(target, ids: torch.Tensor, init: str = "target", seed: int = 0) -> Head:
    """A trainable EAGLE-3 head for `target` over the draft vocabulary `ids`: the target's embedding (frozen, shared)
    and its LM head rows (a copy, frozen as speculators does); with init="target" the layer's weights start as the
    target's last decoder layer (q/k/v read both halves, so each half gets that layer's projection at half scale)
    and the final norm is the target's; fc starts random."""
    from engine.models.heads import random_head

    head = random_head(target, "eagle3", draft_vocab=ids.numel(), seed=seed, norm_before_residual=True)
    return trainable(head, target, ids, _from_target if init == "target" else None)


def trainable(head: Head, target, ids: torch.Tensor, from_target=None) -> Head:
    """`head` (any kind, its LM head already `ids.numel()` rows) made ready to train: its LM head the target's rows
    for the draft vocabulary `ids` (a copy) and d2t mapping them, its layers started from the target's by
    `from_target(head, target)` where given, and only its own weights learning (the embedding and the LM head frozen,
    as speculators does)."""
    p = next(target.parameters())
    ids = ids.to(p.device)
    head.lm_head.weight.data = target.get_output_embeddings().weight[ids].detach().clone()
    head.d2t = None if ids.numel() == head.config.vocab_size else ids
    if from_target is not None:
        from_target(head, target)
    head.train()
    for name, param in head.named_parameters():
        param.requires_grad_(not name.startswith(("embed_tokens.", "lm_head.")))
    return head


def _from_target(head: Head, target) -> None:
    layer = head.layers[0]
    src = target.model.layers[-1]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(src.self_attn, name).weight
            getattr(layer.self_attn, name).weight.copy_(torch.cat([w, w], 1) * 0.5)
        layer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        layer.input_layernorm.weight.copy_(src.input_layernorm.weight)
        layer.hidden_norm.weight.copy_(src.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.model.norm.weight)
    # fc keeps its random start: passing the deepest feature straight through made the head start out predicting
    # the token the target had just predicted (the one it is fed), confidently wrong (training loss ~48 at start)


# --- the train-time-test forward ----------------------------------------------------------------------------------


def _ttt_attend(q, keys0, values0, chain, causal: torch.Tensor) -> torch.Tensor:
    """Attention of step k's rows (B, heads, T, D) over the real rows' keys (B, KV, T, D) where `causal` (T, T) allows,
    and over their own chain's keys of steps 1..k (one key per row and step: a diagonal)."""
    groups = q.shape[1] // keys0.shape[1]
    scale = q.shape[-1] ** -0.5
    k0, v0 = keys0.repeat_interleave(groups, 1), values0.repeat_interleave(groups, 1)  # (B, heads, T, D)
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # (B, heads, T, T)
    own = [(kc.repeat_interleave(groups, 1), vc.repeat_interleave(groups, 1)) for kc, vc in chain]
    scores += [(q * kc).sum(-1, keepdim=True) * scale for kc, _ in own]  # (B, heads, T, 1) each
    weights = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
    t = keys0.shape[2]
    attended = weights[..., :t] @ v0
    for j, (_, vc) in enumerate(own):
        attended = attended + weights[..., t + j : t + j + 1] * vc
    return attended


def ttt_forward(head: Head, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits of every anchor row for TTT steps 0..steps-1: a list of (B, T, Vd).

    tokens (B, T + steps) with tokens[:, t] = x_{t+1} (the sequence shifted by one, padded), features (B, T, F) =
    g_t. Step k's row t reads tokens[:, t + k] and sits at position t + k (see the module docstring). The layers'
    math is the Head's own (Head.layer_input, HeadLayer.query / keys_values / finish, Head.output), which drafting
    runs too; only the attention differs: every anchor's chain at once instead of one chain over a cache. A layer
    with a sliding window W lets step k's row t see the real rows above t + k - W, as drafting does."""
    c = head.config
    t = features.shape[1]
    x = head.fuse(features)  # (B, T, H)
    rows = torch.arange(t, device=x.device)
    real: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: step 0's keys and values, (B, KV, T, D)
    chain: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in head.layers]  # per layer, steps >= 1
    out = []
    for k in range(steps):
        cos, sin = head.rotary(k, t, x.dtype)  # row t at position t + k
        e = head.embed_tokens(tokens[:, k : k + t])  # (B, T, H)
        h = x
        for i, layer in enumerate(head.layers):
            residual, inp = head.layer_input(i, e, h)
            q = layer.query(inp, cos, sin)
            key, value = layer.keys_values(inp, cos, sin)
            if k == 0:
                real.append((key, value))
            else:
                chain[i].append((key, value))
            seen = rows[None, :] <= rows[:, None]
            if c.window(i):
                seen = seen & (rows[None, :] > rows[:, None] + k - c.window(i))
            h = layer.finish(residual, _ttt_attend(q, *real[i], chain[i], seen))
        x, logits = head.output(h)
        out.append(logits)
    return out


# --- batches and the loss -----------------------------------------------------------------------------------------


def to_draft_ids(vocab_size: int, ids: torch.Tensor | None) -> torch.Tensor:
    """target id -> draft id, -1 outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    if ids is None:
        return torch.arange(vocab_size)
    t2d[ids.cpu()] = torch.arange(ids.numel())
    return t2d


def collate(sequences: list[Sequence], steps: int, t2d: torch.Tensor, dtype: torch.dtype) -> dict:
    """Padded tensors for ttt_forward and the loss: per row t, the label of step k is the target's distribution at
    position t + k + 1, over the draft vocabulary."""
    rows = max(len(s.tokens) - 1 for s in sequences)
    b = len(sequences)
    width = sequences[0].features.shape[1]
    tokens = torch.zeros((b, rows + steps), dtype=torch.long)
    features = torch.zeros((b, rows, width), dtype=dtype)
    label_ids = torch.full((b, rows + steps, sequences[0].top_ids.shape[1]), -1, dtype=torch.long)
    label_p = torch.zeros((b, rows + steps, sequences[0].top_ids.shape[1]), dtype=torch.float32)
    for i, s in enumerate(sequences):
        n = len(s.tokens)
        tokens[i, : n - 1] = torch.tensor(s.tokens[1:])
        features[i, : n - 1] = s.features.to(dtype)
        # row j of the labels: the distribution at position j + 1 (of x_{j+2}); the answer's from row P - 2
        first = max(s.prompt_len - 2, 0)
        label_ids[i, first : n - 2] = t2d[s.top_ids[first + 1 : n - 1].long()]
        label_p[i, first : n - 2] = s.top_p[first + 1 : n - 1].float()
    return {"tokens": tokens, "features": features, "label_ids": label_ids, "label_p": label_p, "rows": rows}


def step_loss(logits: torch.Tensor, label_ids: torch.Tensor, label_p: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Soft cross-entropy of one TTT step over its valid rows, and the counts for accuracy.
    logits (B, T, Vd); label_ids / label_p (B, T, K) (draft ids, -1 outside; probabilities)."""
    valid = label_ids[..., 0] >= 0  # the target's argmax is in the draft vocabulary
    p = label_p * (label_ids >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    logq = F.log_softmax(logits.float(), -1)
    picked = logq.gather(-1, label_ids.clamp(min=0))  # (B, T, K)
    per_row = -(p * picked).sum(-1)
    n = int(valid.sum())
    loss = (per_row * valid).sum() / max(n, 1)
    hits = (logits.argmax(-1) == label_ids[..., 0]) & valid
    return loss, {"rows": n, "hits": int(hits.sum()), "hit_mask": hits, "valid": valid}


def batch_loss(head: Head, batch: dict, steps: int) -> tuple[torch.Tensor, list[dict]]:
    t = batch["rows"]
    outs = ttt_forward(head, batch["tokens"], batch["features"], steps)
    total, stats = 0.0, []
    for k, logits in enumerate(outs):
        loss, s = step_loss(logits, batch["label_ids"][:, k : k + t], batch["label_p"][:, k : k + t])
        total = total + STEP_DECAY**k * loss
        stats.append(s | {"loss": loss.item()})
    return total / sum(STEP_DECAY**k for k in range(steps)), stats


def expected_length(alphas: list[float]) -> float:
    """Tokens per verify pass of a greedy chain of len(alphas) drafts with per-position acceptance alphas."""
    total, survive = 1.0, 1.0
    for a in alphas:
        survive *= a
        total += survive
    return total


def served_lengths(hits: list[torch.Tensor], spans: list[tuple[int, int]], gammas: range) -> dict[int, tuple[int, int]]:
    """The greedy loop replayed over teacher-forced hits: {gamma: (tokens, verify passes)}.

    hits[k][i, t]: TTT step k at anchor row t of sequence i drafted the target's own token (step_loss's hit_mask: a
    token outside the draft vocabulary is a miss, as served). spans[i]: the first anchor the loop drafts from (row
    P - 1, after the prefill gave the first answer token) and the last row with a label. A pass from anchor t accepts
    the leading hits of steps 0..gamma-1 and adds the target's own token, so the next pass starts a + 1 rows on.
    For greedy decoding this is what the engine does (its drafts equal the head's teacher-forced argmax), and unlike
    the mean over every row it weights the rows as the loop visits them: a pass starts where the last one missed,
    and misses cluster. A head forged for the bundled model, on the whole task suite: 1.42 / 1.59 tokens per pass at
    gamma 1 / 2 from the mean over rows, 1.36 / 1.49 replayed, 1.34 / 1.49 measured by the engine."""
    rows = [h.tolist() for h in hits]
    out = {}
    for gamma in gammas:
        kept = [replay(rows, i, first, last, gamma) for i, (first, last) in enumerate(spans)]
        out[gamma] = (sum(a + 1 for k in kept for a in k), sum(len(k) for k in kept))
    return out


def replay(rows: list[list[list[bool]]], i: int, first: int, last: int, gamma: int) -> list[int]:
    """The draft tokens each verify pass keeps, sequence i, anchors first..last (see served_lengths)."""
    t, kept = first, []
    while t <= last:
        a = 0
        while a < min(gamma, len(rows)) and rows[a][i][t]:
            a += 1
        kept.append(a)
        t += a + 1
    return kept


"""From logits to tokens, and the rejection rule that makes speculative sampling lossless.

Naming follows Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding":
p is the target model's distribution, q the draft's. Both go through the same temperature / top-k /
top-p processing, so the rule below reproduces the *processed* target distribution exactly:

  accept draft token x with probability min(1, p(x) / q(x));
  on rejection sample from norm(max(0, p - q));
  when every draft token is accepted, sample one bonus token from p at the next position.

A drafter without probabilities (prompt lookup) has a one-hot q: x is accepted with probability p(x)
and the residual is p with x removed. With temperature 0 everything degenerates to argmax matching.

A tree of candidates (engine.decoding.tree) chosen without drawing from q, such as a head's top-k, is verified by
`verify_tree`: at each node the target draws its own token from p (its argmax when greedy) and the walk goes on into
the child holding that token. Every emitted token is then a draw from p at its position, whatever the tree held:
for one candidate per position that is the one-hot rule above (accept x with probability p(x), else draw from p
without x), for several it is SpecInfer's multi-candidate rule with deterministic candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> "SamplingConfig":
        if not 0 <= self.temperature <= 2:
            raise UserError(f"temperature {self.temperature} is out of range: use 0 (greedy) to 2.", "temperature")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p {self.top_p} is out of range: use a value in (0, 1]; 1 turns it off.", "top_p")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise UserError(f"top-k {self.top_k} is invalid: use a whole number >= 0; 0 turns it off.", field="top_k")
        if self.seed is not None and (int(self.seed) != self.seed or not 0 <= self.seed < 2**63):
            raise UserError(f"seed {self.seed} is invalid: use a whole number >= 0.", field="seed")
        return self

    def generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.

    Greedy runs get the plain softmax (temperature 1): it is only shown to the user, never sampled.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p; the first always stays
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same indices (the first of equal maxima), as a long tensor of x.shape[:-1]. On CPU through
    numpy over a float32 view (exact for bfloat16 values): torch's CPU argmax ran 6-40x slower over the bundled model's
    49,152-token vocabulary (one row 53 us in float32 against 6.6, 215 us from bfloat16 against 16; a verify pass's 5
    bfloat16 rows 641 us against 44, on the AVX2 EPYC), a tenth of a bfloat16 verify pass's own time."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(np.argmax(x.float().numpy(), -1)))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(..., V) -> (...) token ids drawn from probs."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> tuple[int, float]:
    """One next token from (V,) logits: the token and its probability under the processed distribution."""
    probs = logits_to_probs(logits, cfg)
    token = int(argmax(probs)) if cfg.greedy else int(sample(probs, generator))
    return token, float(probs[token])


@dataclass
class Verdict:
    accepted: int  # n: the first n draft tokens are kept
    token: int  # the target's own token at position n: a correction (n < gamma) or a bonus (n == gamma)
    p: list[float]  # target probability of each draft token
    q: list[float]  # draft probability of each draft token (1.0 for one-hot drafters)
    token_p: float  # target probability of `token` at its position


def verify(
    draft: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cfg: SamplingConfig,
    generator: torch.Generator,
) -> Verdict:
    """Accept a prefix of the draft and pick the next token, exactly as if the target decoded alone.

    draft: (gamma,) token ids; target_logits: (gamma+1, V); draft_probs: (gamma, V) or None (one-hot q).
    """
    gamma = draft.shape[0]
    p = logits_to_probs(target_logits, cfg)  # (gamma+1, V)
    rows = torch.arange(gamma, device=p.device)
    p_x = p[rows, draft]  # (gamma,)
    q_x = draft_probs[rows, draft] if draft_probs is not None else torch.ones_like(p_x)
    if cfg.greedy:
        target_tokens = argmax(target_logits).to(draft.device)  # (gamma+1,)
        ok = draft == target_tokens[:gamma]
    else:
        ok = torch.rand(gamma, generator=generator, device=p.device) * q_x < p_x  # u < p/q, without dividing
    # n = length of the all-accepted prefix; one host sync for everything we need
    n = int(torch.cumprod(ok.int(), dim=0).sum()) if gamma else 0
    p_list, q_list = p_x.tolist(), q_x.tolist()
    if cfg.greedy:
        token = int(target_tokens[n])
    elif n == gamma:
        token = int(sample(p[gamma], generator))
    else:
        token = _resample(p[n], draft_probs, draft, n, generator)
    return Verdict(n, token, p_list, q_list, float(p[n, token]))


@dataclass
class TreeVerdict(Verdict):
    path: list[int]  # the accepted nodes, root's child first (len = accepted)
    tried: list[int]  # the children of the last accepted node (or of the root), none holding `token`


def verify_tree(tokens: list[int], parents: list[int], target_logits: torch.Tensor, cfg: SamplingConfig,
                generator: torch.Generator) -> TreeVerdict:  # fmt: skip
    """Walk a draft tree as the target decodes: node i holds tokens[i] after node parents[i] (-1: the root, the last
    emitted token); target_logits (n + 1, V) has the root's row first, then node i's in row i + 1.

    p and q of the walked tokens: p at their parents' rows, q 1.0 (deterministic candidates)."""
    p = logits_to_probs(target_logits, cfg)  # (n + 1, V)
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path, node = [], -1
    while True:
        row = node + 1
        token = int(argmax(target_logits[row])) if cfg.greedy else int(sample(p[row], generator))
        follow = [c for c in children.get(node, []) if tokens[c] == token]
        if not follow:
            break
        path.append(node := follow[0])
    tried = children.get(node, [])
    walked = path + tried
    rows = [parents[i] + 1 for i in walked]
    p_list = p[rows, [tokens[i] for i in walked]].tolist() if walked else []
    return TreeVerdict(len(path), token, p_list, [1.0] * len(walked), float(p[node + 1, token]), path, tried)


def _resample(p: torch.Tensor, draft_probs: torch.Tensor | None, draft: torch.Tensor, n: int, generator) -> int:
    """Sample from norm(max(0, p - q)) at the rejected position n."""
    if draft_probs is None:
        residual = p.clone()
        residual[draft[n]] = 0.0  # q is one-hot on the rejected token
    else:
        residual = torch.clamp(p - draft_probs[n], min=0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: a rejection had probability ~0; p itself is the right law
        residual, total = p, p.sum()
    return int(sample(residual / total, generator))

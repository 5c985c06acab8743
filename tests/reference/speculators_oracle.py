"""The reference side of tests/test_heads_reference.py: run inside the speculators 0.9.0 environment (tests/run.sh).

    python speculators_oracle.py JOB.json

JOB names the target folder (the verifier), safetensors files of contexts (`ids.N` token ids) and of the target's
hidden states for all but their last position (`hidden.N`, transformers' hidden_states), gamma, heads to build with
speculators' own training path (variant name -> trainer flags) and folders of heads to load with
`SpeculatorModel.from_pretrained`. Every head, built or loaded, drafts greedily after every context with the
reference's own modules (embedding, fc and its norms, decoder layers, rotary, final norm, LM head, d2t); the attention
masks follow vLLM 0.32: a sliding layer lets a row at position p see positions above p - W, a DFlash block is causal
per layer as the head's config says, a P-EAGLE pass is causal over the real rows and the mask rows after them (at
inference every rollout is the newest anchor's: speculators' peagle mask reduces to causal), a DSpark head adds its
Markov bias draft by draft and says each position's confidence, a DFlash2 head walks its candidate selector (its
"logits" are the selector's scores, -inf outside each position's candidates), an MTP layer drafts a chain from the
verifier's last state before its final norm (`prenorm.N` in the hidden file). Writes, per head, the draft ids and the
draft logits of every step (`OUT/<name>.safetensors`) and a summary (`OUT/result.json`, DSpark's confidences
included).

Nothing here imports SpecArena: the reference stands on its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel
from speculators.models.dflash import DFlashDraftModel
from speculators.models.dflash2 import DFlash2DraftModel
from speculators.models.dspark import DSparkDraftModel
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.models.peagle import PEagleDraftModel
from speculators.train.cli import create_transformer_layer_config
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

torch.set_grad_enabled(False)


def build_mtp(target: str, seed: int):
    """An MTP layer with random weights for a Qwen3 verifier: its trainer extracts one from a checkpoint that ships
    `mtp.*` weights, which no random target has, so it is built from the verifier's config as the trainer's
    MTPSpeculatorConfig holds it (the verifier's own decoder config, one layer)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    torch.manual_seed(seed)
    verifier = AutoConfig.from_pretrained(target)
    proposals = [GreedyTokenProposalConfig(speculative_tokens=3)]
    config = MTPSpeculatorConfig(transformer_layer_config=verifier, speculators_config=SpeculatorsConfig(
        algorithm="mtp", proposal_methods=proposals, default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=target, architectures=["Qwen3ForCausalLM"])))  # fmt: skip
    model = MTPDraftModel(config)
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens.", "lm_head.", "verifier_")):
            continue
        p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.float().eval()


def build(kind: str, target: str, flags: dict, seed: int):
    """A head with random weights, built as speculators' trainer builds it (its layer config, its vocabulary
    mapping, from_training_args); norms made non-trivial so that every norm flag matters."""
    if kind == "mtp":
        return build_mtp(target, seed)
    torch.manual_seed(seed)
    layer_config = create_transformer_layer_config(
        target, flags.get("num_layers", 1), "qwen3" if kind in ("dflash", "dspark", "dflash2") else "llama", None,
        flags.get("sliding_window", 2048), flags.get("full_attention_indices", []),
    )  # fmt: skip
    vocab = layer_config.vocab_size
    draft_vocab = flags.get("draft_vocab_size", vocab)
    t2d = d2t = None
    if draft_vocab != vocab:
        counts = {i: int(c) for i, c in enumerate(torch.randint(0, 1000, (vocab,)).tolist())}
        d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab, vocab)
    common = dict(verifier_name_or_path=target, draft_vocab_size=draft_vocab, draft_attn_impl="eager",
                  target_layer_ids=flags.get("target_layer_ids"))  # fmt: skip
    if kind == "eagle3":
        model = Eagle3DraftModel.from_training_args(
            layer_config, t2d=t2d, d2t=d2t, ttt_steps=3, norm_before_residual=flags.get("norm_before_residual", True),
            norm_before_fc=flags.get("norm_before_fc", True), norm_output=flags.get("norm_output", True), **common,
        )  # fmt: skip
    elif kind == "peagle":
        model = PEagleDraftModel.from_training_args(
            layer_config, t2d=t2d, d2t=d2t, mask_token_id=flags.get("mask_token_id", 3), num_depths=4,
            norm_before_residual=flags.get("norm_before_residual", False),
            norm_before_fc=flags.get("norm_before_fc", False), **common,
        )  # fmt: skip
    elif kind == "dspark":
        model = DSparkDraftModel.from_training_args(
            layer_config, t2d=t2d, d2t=d2t, block_size=flags.get("block_size", 8),
            mask_token_id=flags.get("mask_token_id", 3), sample_from_anchor=flags.get("sample_from_anchor"),
            markov_rank=flags.get("markov_rank", 16), enable_confidence_head=flags.get("enable_confidence_head", True),
            confidence_head_with_markov=flags.get("confidence_head_with_markov", True), **common,
        )  # fmt: skip
        if model.markov_head is not None:  # its init (std 0.01) would leave the bias too small to move an argmax
            model.markov_head.markov_w1.weight.normal_()
    elif kind == "dflash2":
        model = DFlash2DraftModel.from_training_args(
            layer_config, block_size=flags.get("block_size", 8), mask_token_id=flags.get("mask_token_id", 3),
            sliding_window_non_causal=flags.get("sliding_window_non_causal"),
            conv_kernel_size=flags.get("conv_kernel_size", 2), conv_group_size=flags.get("conv_group_size", 16),
            selector_rank=flags.get("selector_rank", 32), selector_top_k=flags.get("selector_top_k", 8), **common,
        )  # fmt: skip
        for name, p in model.named_parameters():  # its convolutions start at the identity: random, so they matter
            if "_conv." in name or name.startswith("candidate_selector."):
                p.normal_(0.0, 0.3)
    else:
        model = DFlashDraftModel.from_training_args(
            layer_config, t2d=t2d, d2t=d2t, block_size=flags.get("block_size", 8),
            mask_token_id=flags.get("mask_token_id", 3),
            sliding_window_non_causal=flags.get("sliding_window_non_causal", False), **common,
        )  # fmt: skip
    for name, p in model.named_parameters():
        if "norm" in name and not name.startswith("verifier_"):
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.float().eval()


def load(folder: str):
    model = SpeculatorModel.from_pretrained(folder)
    if not isinstance(model, MTPDraftModel):  # MTP's from_pretrained loads them itself, and drops what it needs not
        model.load_verifier_weights()
    model.config.transformer_layer_config._attn_implementation = "eager"
    return model.float().eval()


def _mask(allowed: torch.Tensor) -> torch.Tensor:
    """A boolean (rows, keys) mask as the additive float mask eager attention takes, (1, 1, rows, keys)."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]


def _window(model, layer: int) -> int:
    config = model.config.transformer_layer_config
    types = getattr(config, "layer_types", None) or []
    sliding = layer < len(types) and types[layer] == "sliding_attention"
    return (getattr(config, "sliding_window", None) or 0) if sliding else 0


def _target_ids(model, draft: torch.Tensor) -> torch.Tensor:
    return draft if model.d2t is None else draft + model.d2t[draft]


def eagle3_draft(model, ids: torch.Tensor, features: torch.Tensor, gamma: int):
    """Greedy chain of `gamma` drafts after ids: row t pairs token t+1 with the fused feature of position t; each
    further row pairs the last draft with the previous row's state, one position on. Every pass recomputes all rows."""
    x = features[None]
    if model.input_norm is not None:
        x = model.input_norm(x)
    if model.fc_norm is not None:
        x = torch.cat([n(c) for n, c in zip(model.fc_norm, x.chunk(len(model.fc_norm), -1))], -1)
    x = model.fc(x)[0]  # (n, H)
    n = x.shape[0]
    tokens, drafts, logits_out, chain_states = list(ids[1:].tolist()), [], [], []
    for k in range(gamma):
        rows = n + k
        positions = torch.arange(rows)
        positions[n:] = torch.arange(n, n + k)  # chain row j sits at position n - 1 + j
        hidden = torch.cat([x] + chain_states, 0)[None] if chain_states else x[None]
        h = torch.cat((model.embed_tokens(torch.tensor(tokens + drafts[: k])[None]), hidden), -1)
        position_ids = positions[None]
        cos_sin = model.rotary_emb(h, position_ids)
        for i, layer in enumerate(model.layers):
            allowed = positions[None, :] <= positions[:, None]
            allowed[n:, n:] = torch.tril(torch.ones(k, k, dtype=torch.bool))  # a chain sees its own earlier rows
            allowed[:n, n:] = False
            if _window(model, i):
                allowed &= positions[None, :] > positions[:, None] - _window(model, i)
            h = layer(h, attention_mask=_mask(allowed), position_ids=position_ids, position_embeddings=cos_sin)
        normed = model.norm(h)
        logits = model.lm_head(normed)[0, -1]
        state = (normed if model.config.norm_output else h)[0, -1:]
        draft = int(_target_ids(model, logits.argmax()))
        drafts.append(draft)
        logits_out.append(logits)
        chain_states.append(state)
    return drafts, torch.stack(logits_out)


def _fused(model, features: torch.Tensor) -> torch.Tensor:
    """(1, rows, n x H) concatenated target features -> (1, rows, H), through the head's norms and fc."""
    x = features
    if model.input_norm is not None:
        x = model.input_norm(x)
    if model.fc_norm is not None:
        x = torch.cat([n(c) for n, c in zip(model.fc_norm, x.chunk(len(model.fc_norm), -1))], -1)
    return model.fc(x)


def peagle_draft(model, ids: torch.Tensor, features: torch.Tensor, gamma: int):
    """One pass over the real rows (token t+1 with the feature of position t) and gamma - 1 mask rows after them
    (the mask token with the learnt mask_hidden feature, as PEagleDraftModel.forward builds a rollout's rows); the
    last real row and the mask rows propose the gamma drafts."""
    n, masks = features.shape[0], gamma - 1
    hidden = torch.cat((features[None], model.mask_hidden.expand(1, masks, -1)), 1)
    x = _fused(model, hidden)  # (1, n + masks, H)
    tokens = torch.tensor(ids[1:].tolist() + [model.mask_token_id] * masks)[None]
    h = torch.cat((model.embed_tokens(tokens), x), -1)
    positions = torch.arange(n + masks)
    cos_sin = model.rotary_emb(h, positions[None])
    for i, layer in enumerate(model.layers):
        allowed = positions[None, :] <= positions[:, None]
        if _window(model, i):
            allowed &= positions[None, :] > positions[:, None] - _window(model, i)
        h = layer(h, attention_mask=_mask(allowed), position_ids=positions[None], position_embeddings=cos_sin)
    logits = model.lm_head(model.norm(h))[0, n - 1 :]  # (gamma, Vd)
    return [int(_target_ids(model, row.argmax())) for row in logits], logits


def _dflash_block(model, ids: torch.Tensor, features: torch.Tensor, gamma: int) -> torch.Tensor:
    """One block [last token, mask x gamma] after the context through the head's own layers: its final normed states
    (gamma + 1, H)."""
    config = model.config
    context = model.hidden_norm(model.fc(features[None]))  # (1, n, H)
    n = context.shape[1]
    block = torch.tensor([int(ids[-1])] + [config.mask_token_id] * gamma)[None]
    h = model.embed_tokens(block)
    positions = torch.arange(n + gamma + 1)
    cos_sin = model.rotary_emb(context, positions[None])
    q_pos = positions[n:]
    # vLLM 0.32: causal = not sliding_window_non_causal on every layer (speculators' forward: sliding layers only)
    causal = not config.sliding_window_non_causal
    for i, layer in enumerate(model.layers):
        allowed = torch.ones(gamma + 1, n + gamma + 1, dtype=torch.bool)
        if causal:
            allowed &= positions[None, :] <= q_pos[:, None]
        if _window(model, i):
            allowed &= positions[None, :] > q_pos[:, None] - _window(model, i)
        h = layer(hidden_states=h, target_hidden=context, attention_mask=_mask(allowed), position_ids=positions[None],
                  position_embeddings=cos_sin)  # fmt: skip
    return model.norm(h)[0]


def dflash_draft(model, ids: torch.Tensor, features: torch.Tensor, gamma: int):
    """One block [last token, mask x gamma] after the context: gamma drafts from its mask rows."""
    logits = model.lm_head(_dflash_block(model, ids, features, gamma)[1:])  # (gamma, Vd)
    return [int(_target_ids(model, row.argmax())) for row in logits], logits


def dflash2_draft(model, ids: torch.Tensor, features: torch.Tensor, gamma: int):
    """DFlash's block [last token, mask x gamma] through DFlash2's own layers (their convolutions included), then the
    selector's greedy walk as vLLM's dflash2 speculator makes it: each position's candidates are its unary top-k, scored
    by CandidateSelector.score_candidates with the token taken before (the last verified one first)."""
    hidden = _dflash_block(model, ids, features, gamma)[1:]  # (gamma, H)
    unary = model.lm_head(hidden)
    selector = model.candidate_selector
    previous, drafts, scores_out = int(ids[-1]), [], []
    for row, state in zip(unary, hidden):
        candidates = row.topk(selector.top_k).indices
        scores = selector.score_candidates(row[None], state[None], torch.tensor([previous]), candidates[None])[0]
        previous = int(candidates[scores.argmax()])
        drafts.append(previous)
        scores_out.append(torch.full_like(row, float("-inf")).index_copy(0, candidates, scores))
    return drafts, torch.stack(scores_out)


def dspark_draft(model, ids: torch.Tensor, features: torch.Tensor, gamma: int):
    """DFlash's block, then the Markov chain the trainer's comments describe for inference: each draft position's
    logits biased by markov_w2(markov_w1[previous token]), the previous token being the last verified one for the
    first draft and each draft for the next; and each position's confidence, sigmoid(confidence_head(final state,
    Markov embedding)). With sample_from_anchor the block [last, mask x (gamma - 1)] drafts from every row; without,
    [last, mask x gamma] from its mask rows. Each layer's block is causal where its type is sliding (vLLM's
    update_dspark sets no causality of its own; speculators' forward masks sliding layers causally)."""
    config = model.config
    context = model.hidden_norm(model.fc(features[None]))  # (1, n, H)
    n = context.shape[1]
    first = 0 if config.sample_from_anchor else 1
    block = torch.tensor([int(ids[-1])] + [config.mask_token_id] * (gamma - 1 + first))[None]
    rows = block.shape[1]
    h = model.embed_tokens(block)
    positions = torch.arange(n + rows)
    cos_sin = model.rotary_emb(context, positions[None])
    q_pos = positions[n:]
    for i, layer in enumerate(model.layers):
        allowed = torch.ones(rows, n + rows, dtype=torch.bool)
        if _window(model, i):
            allowed &= positions[None, :] <= q_pos[:, None]
            allowed &= positions[None, :] > q_pos[:, None] - _window(model, i)
        h = layer(hidden_states=h, target_hidden=context, attention_mask=_mask(allowed), position_ids=positions[None],
                  position_embeddings=cos_sin)  # fmt: skip
    hidden = model.norm(h)[0, first : first + gamma]  # (gamma, H)
    base = model.lm_head(hidden)
    previous, drafts, logits_out, confidences = int(ids[-1]), [], [], []
    for row, state in zip(base, hidden):
        prev = torch.tensor([[previous]])
        embedded = model.markov_head.prev_embeddings(prev) if model.markov_head is not None else None
        if embedded is not None:
            row = row + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=state[None, None],
                                                     prev_emb=embedded)[0, 0]  # fmt: skip
        if model.confidence_head is not None:
            features_in = torch.cat([state, embedded[0, 0]]) if config.confidence_head_with_markov else state
            confidences.append(float(torch.sigmoid(model.confidence_head(features_in[None, None]))[0, 0]))
        previous = int(_target_ids(model, row.argmax()))
        drafts.append(previous)
        logits_out.append(row)
    return drafts, torch.stack(logits_out), confidences


def mtp_draft(model, ids: torch.Tensor, features: torch.Tensor, gamma: int):
    """A greedy chain of `gamma` drafts with the MTP layer's own forward (MTPLayerMixin): row t pairs token t+1 with
    the verifier's last state at position t (before its final norm), each further row pairs the last draft with the
    previous row's output (after the layer's final norm), one position on; every pass recomputes all rows, causally."""
    layer = model.mtp_layers[0]
    n = features.shape[0]
    tokens, drafts, logits_out, chain = list(ids[1:].tolist()), [], [], []
    for k in range(gamma):
        rows = n + k
        positions = torch.arange(rows)
        hidden = torch.cat([features] + chain, 0)[None]  # (1, rows, H)
        embedded = model.embed_tokens(torch.tensor(tokens + drafts[:k])[None])
        allowed = positions[None, :] <= positions[:, None]
        out = layer(hidden_states=hidden, token_embeddings=embedded, attention_mask=_mask(allowed),
                    position_ids=positions[None], position_embeddings=model.rotary_emb(hidden, positions[None]))
        logits = model.lm_head(out)[0, -1]
        drafts.append(int(logits.argmax()))
        logits_out.append(logits)
        chain.append(out[0, -1:])
    return drafts, torch.stack(logits_out)


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    cases, hidden = load_file(job["cases"]), load_file(job["hidden"])
    count = sum(1 for k in cases if k.startswith("ids."))
    heads = {}
    for name, spec in job.get("build", {}).items():
        model = build(spec["kind"], job["target"], spec["flags"], spec.get("seed", 0))
        model.save_pretrained(str(out / "heads" / name))
        heads[name] = (spec["kind"], load(str(out / "heads" / name)))  # what a user of the saved head gets
    for name, folder in job.get("load", {}).items():
        model = load(folder)
        kind = ("peagle" if isinstance(model, PEagleDraftModel) else "eagle3" if isinstance(model, Eagle3DraftModel)
                else "dspark" if isinstance(model, DSparkDraftModel) else "dflash2"
                if isinstance(model, DFlash2DraftModel) else "mtp" if isinstance(model, MTPDraftModel)
                else "dflash")  # fmt: skip
        heads[name] = (kind, model)
    summary = {}
    for name, (kind, model) in heads.items():
        draft = {"eagle3": eagle3_draft, "peagle": peagle_draft, "dflash": dflash_draft, "dspark": dspark_draft,
                 "dflash2": dflash2_draft, "mtp": mtp_draft}[kind]
        tensors, drafts, confidences = {}, [], []
        layers = (() if kind == "mtp" else model.config.aux_hidden_state_layer_ids if kind in ("dflash", "dspark",
                  "dflash2") else model.config.eagle_aux_hidden_state_layer_ids)  # fmt: skip
        for c in range(count):
            ids = cases[f"ids.{c}"]
            if kind == "mtp":  # the verifier's last state before its final norm (verifier_last_hidden_states)
                features = hidden[f"prenorm.{c}"].float()
            else:
                features = torch.cat([hidden[f"hidden.{c}"][i] for i in layers], -1).float()  # (n - 1, layers x H)
            tokens, logits, *more = draft(model, ids, features, job["gamma"])
            drafts.append(tokens)
            confidences.append(more[0] if more else [])
            tensors[f"logits.{c}"] = logits.contiguous()
        save_file(tensors, str(out / f"{name}.safetensors"))
        summary[name] = {"drafts": drafts, "confidences": confidences,
                         "config": json.loads(model.config.to_json_string())}  # fmt: skip
    (out / "result.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])

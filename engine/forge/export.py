"""Writing a forged head: the speculators layout every engine reads, and a model card that says how it was made.

EAGLE-3 flags (HEADS.md, export checklist): one Llama-style layer with full attention, features [2, L//2, L-3],
`norm_before_residual` written out, no norm_before_fc / fc_norm / norm_output (llama.cpp implements none of them),
`lm_head` and int64 `d2t` / bool `t2d` in the file (engine.models.heads.write_head).

DFlash (speculators' `dflash` layout): Qwen3-style layers over the same three features, `block_size` = the longest
draft + 1, `mask_token_id`, and the block's causality stated as it was trained (engine.forge.blocks): every layer
`full_attention` with no sliding window and `sliding_window_non_causal: true`, which speculators' trainer, vLLM
(`qwen3_dflash`: full attention is non-causal; `dflash_config.causal = not sliding_window_non_causal`) and our
engine all read as one non-causal block. `lm_head` and `d2t` / `t2d` are in the file (a reduced vocabulary).

The gamma proposed at export comes from the validation acceptance per position and this machine's costs: the head's
own step (timed here, relative to a one-token target pass) and the target's verify passes (engine.measure.predict).
The final measurement (engine.forge.pays) then proposes the gamma measured fastest instead (proposed_gamma).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.decoding.heads import Head, HeadCache


def head_step_cost(head: Head, model, rows: int = 64, repeats: int = 20) -> float:
    """One draft step of the head (one row after `rows` real rows) over one one-token pass of the target, both timed
    here, now, with the same threads (a figure from load time may have run under other settings or load). Each step
    is timed right after a one-token pass of the target, as the loop meets it: that pass has pushed the head's
    weights out of the CPU's caches. Timed back to back the steps read them from cache (the bundled model's forged
    head: 0.046 of a target pass, this way 0.066, where runs measured 0.076 with the kept rows' features fused)."""
    c = head.config
    if c.kind == "dflash":
        return block_cost(head, model, rows, repeats)
    p = next(head.parameters())
    with torch.inference_mode():
        cache = HeadCache(c.num_layers, c.num_kv_heads, c.head_dim, p.dtype, p.device, rows + 32)
        features = torch.zeros(rows, c.feature_size, dtype=p.dtype, device=p.device)
        state, _ = head.eagle3(torch.zeros(rows, dtype=torch.long, device=p.device), head.fuse(features), cache)
        token = torch.zeros(1, dtype=torch.long, device=p.device)

        def step():
            head.to_target(head.eagle3(token, state[-1:], cache)[1], c.vocab_size).argmax()

        return _beside_target_passes(model, rows, repeats, lambda: cache.crop(rows), step)


def block_cost(head: Head, model, rows: int = 64, repeats: int = 20) -> float:
    """One DFlash proposal at the longest draft trained (a block pass over two kept rows' features after `rows`
    context rows) over one one-token pass of the target, timed here as head_step_cost times a chain's step."""
    c = head.config
    p = next(head.parameters())
    with torch.inference_mode():
        cache = HeadCache(c.num_layers, c.num_kv_heads, c.head_dim, p.dtype, p.device, rows + c.block_size + 32)
        context = torch.zeros(rows, c.feature_size, dtype=p.dtype, device=p.device)
        block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.long, device=p.device)
        head.dflash(context, block, cache)
        kept = torch.zeros(2, c.feature_size, dtype=p.dtype, device=p.device)

        def step():
            head.to_target(head.logits(head.dflash(kept, block, cache)[1:]), c.vocab_size).argmax(-1)

        return _beside_target_passes(model, rows, repeats, lambda: cache.crop(rows), step)


def _beside_target_passes(model, rows: int, repeats: int, reset, step) -> float:
    """`step()`'s time over a one-token pass of the target's: each step timed right after a target pass (after
    `rows` tokens of context), as the drafting loop meets it, `reset()` (untimed) first; the best of 3 means of
    `repeats`."""
    from engine.decoding.runtime import Clock, forward, new_cache, time_passes

    clock = Clock(next(model.parameters()).device)
    vocab = model.config.get_text_config().vocab_size
    target_cache = new_cache(model, rows + 1, role="measure")
    forward(model, [i % vocab for i in range(rows)], target_cache, keep=1)
    best = float("inf")
    for _ in range(3):
        took = 0.0
        for _ in range(repeats):
            forward(model, [1], target_cache)  # the target's pass between two drafts
            target_cache.crop(-1)
            reset()
            start = clock.now()
            step()
            took += clock.now() - start
        best = min(best, took / repeats)
    return best / time_passes(model, (1,))[1]


def recommend(acceptance: list[float], c: float, verify: list[float], per_pass: list[float] | None = None,
              block: bool = False) -> dict:  # fmt: skip
    """The gamma with the best predicted speedup, from the tokens per verify pass the greedy loop replayed over the
    validation answers gives at each trained gamma (`per_pass`, engine.forge.train.served_lengths): L(g) over
    g * c + V(g), with the head's cost c and verify costs V(k) (list: k = 0..); a `block` head (DFlash) drafts any g
    in one pass: L(g) over c + V(g). Without per_pass, from the per-position acceptance (beyond the trained steps,
    the last one's), which reads high: it weights every row alike."""
    from engine.measure.predict import predict, step_cost

    points = {k: v for k, v in enumerate(verify) if k > 0}
    per_token = (lambda g: c / g) if block else (lambda g: c)  # noqa: E731 (step_cost counts g drafts at c each)
    if per_pass:
        curve = [{"gamma": g, "predicted": length / step_cost(per_token(g), points, g), "per_pass": length}
                 for g, length in enumerate(per_pass, 1)]  # fmt: skip
    else:
        alpha = acceptance[-1] if acceptance else 0.0
        curve = [{"gamma": g, "predicted": predict(acceptance, alpha, per_token(g), points, g)}
                 for g in range(1, max(len(acceptance), 1) + 1)]  # fmt: skip
    useful = [p for p in curve if p["gamma"] <= reached(acceptance)]
    best = max(useful or curve[:1], key=lambda p: p["predicted"])
    return {"gamma": best["gamma"], "predicted_speedup": best["predicted"], "curve": curve, "c": c}


def reached(acceptance: list[float]) -> int:
    """The longest draft whose every position was ever accepted (at least 1): a token at a position whose acceptance
    is 0 never survives, so drafting it costs a head step and a wider verify pass for nothing, whatever noise says
    about the longer draft's speed. Without figures, no cap."""
    useful = next((k for k, a in enumerate(acceptance) if not a), len(acceptance))
    return max(1, useful) if acceptance else 1 << 30


def held_out(head: Head, loaded, acceptance: list[float], per_pass: list[float] | None = None) -> dict:
    """The figures the card and the config need: the head's cost, the target's verify costs, the recommended gamma."""
    from engine.decoding.runtime import measure_verify_costs

    with torch.inference_mode():
        verify = measure_verify_costs(loaded.model, max(len(acceptance), len(per_pass or []), 1))
    c = head_step_cost(head, loaded.model)
    block = head.config.kind == "dflash"
    return {"recommended": recommend(acceptance, c, verify, per_pass, block), "verify_costs": verify}


def write(head: Head, folder: Path, loaded, summary: dict) -> Path:
    """The head in the speculators layout of its kind, with README.md (summary["held_out"] filled by held_out
    first); a DFlash head's config states its block's causality (see the module docstring)."""
    import json

    from engine.models.heads import write_head
    from engine.models.loading import resolve

    arch = (getattr(loaded.model.config, "architectures", None) or [type(loaded.model).__name__])[0]
    verifier = resolve(summary["target"]).repo_id or summary["target"]
    kind = head.config.kind
    write_head(head, folder, layout=f"speculators-{kind}", verifier=verifier, verifier_arch=arch,
               speculative_tokens=summary["held_out"]["recommended"]["gamma"], card=card(summary))  # fmt: skip
    if kind == "dflash":
        path = Path(folder) / "config.json"
        config = json.loads(path.read_text())
        config["transformer_layer_config"] |= {"layer_types": ["full_attention"] * head.config.num_layers,
                                               "use_sliding_window": False, "sliding_window": None}  # fmt: skip
        config["sliding_window_non_causal"] = True
        path.write_text(json.dumps(config, indent=2) + "\n")
    return folder


def proposed_gamma(summary: dict) -> int | None:
    """The draft length a forged head's config proposes, a chain's (what vLLM and llama.cpp verify): the one measured
    fastest on the held-out prompts once measured (engine.forge.pays.summarise), before that the one its validation
    acceptance predicts best."""
    pays = summary.get("pays") or {}
    measured = pays.get("chain") or pays.get("recommended") or {}
    return measured.get("gamma") or ((summary.get("held_out") or {}).get("recommended") or {}).get("gamma")


def proposed_setting(summary: dict) -> dict:
    """What SpecArena's own engine runs the head with: the fastest measured row, tree or chain ({"gamma", "topk"});
    before the measurement, the config's chain."""
    best = (summary.get("pays") or {}).get("recommended") or {}
    if best.get("gamma"):
        return {"gamma": best["gamma"], "topk": best.get("topk", 1)}
    return {"gamma": proposed_gamma(summary), "topk": 1}


def set_gamma(folder: Path, gamma: int) -> None:
    """The draft length the config proposes (vLLM reads it as num_speculative_tokens' default), after measuring."""
    import json

    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    for method in config.get("speculators_config", {}).get("proposal_methods", []):
        method["speculative_tokens"] = gamma
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_card(folder: Path, summary: dict) -> None:
    (Path(folder) / "README.md").write_text(card(summary))


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def card(s: dict) -> str:
    """The model card: what the head is for, how it was made, what it does on held-out prompts."""
    v, d, t, h = s["vocabulary"], s["data"], s["training"], s.get("held_out", {})
    rec = h.get("recommended", {})
    acc = " / ".join(f"{a:.2f}" for a in t["val_acceptance"])
    kind = s.get("kind", "eagle3")
    lines = [
        "---", "library_name: speculators", f"tags: [{kind}, speculative-decoding, specarena-forge]", "---", "",
        f"# {NAMES[kind]} head for {s['target']}", "", ABOUT[kind],
        "", "## Target", "",
        f"- target: `{s['target']}`" + (f" ({s['origin']})" if s.get("origin") else ""),
        f"- revision / folder: `{s['revision']}`",
        "", "## Data", "",
        f"- prompts: {s['prompts']['source']} ({s['prompts']['fingerprint'][:19]}): {s['prompts']['train']} train, "
        f"{s['prompts']['val']} validation, {s['prompts']['held_out']} held out (never generated on or trained on)",
        f"- the target's own answers: {d['train_answers']} train ({d['train_answer_tokens']:,} answer tokens; by "
        f"source {d['sources']}), {d['val_answers']} validation ({d['val_answer_tokens']:,} tokens)"
        + (f", made in {d['dtype']}" if d.get("dtype") else "")
        + (f". {d['stopped'][:1].upper()}{d['stopped'][1:]}" if d.get("stopped") else ""),
        f"- draft vocabulary: {v['size']:,} of {v['target_vocabulary']:,} tokens, covering {v['train_coverage']:.1%} "
        f"of training labels and {v['val_coverage']:.1%} of validation labels",
        "", "## Training", "",
        f"- {t['steps']} steps, {t['rows']:,} rows, " + (f"blocks of up to {t['ttt_steps'] + 1} (anchor and "
        f"{t['ttt_steps']} drafts)" if kind == "dflash" else f"{t['ttt_steps']} train-time-test steps")
        + f", soft labels (top-16), best state at step {t['best_step']}" + (" (resumed)" if t.get("resumed") else ""),
        f"- time: {s['wall_s']:.0f} s in all: " + ", ".join(f"{k} {v:.0f} s" for k, v in s["timing"].items()),
        f"- machine: {s['machine']}; {s['machine_choice']}",
        "", "## Validation acceptance", "",
        f"- validation answers (prompts never trained on), greedy acceptance per draft position: {acc}; expected "
        f"accepted length per verify pass {t['val_expected_length']:.2f}",
    ]  # fmt: skip
    if t.get("val_per_pass"):
        lines.append("- the same answers replayed through the greedy loop, tokens per verify pass at gamma "
                     + ", ".join(f"{g}: {x:.2f}" for g, x in enumerate(t["val_per_pass"], 1))
                     + " (what the engine will count; the figure above weights every position alike)")  # fmt: skip
    pays = s.get("pays")
    gamma = proposed_gamma(s)
    if pays:
        lines.append(f"- proposed gamma {gamma}: measured fastest on the held-out prompts (below); the validation "
                     f"acceptance predicted gamma {rec.get('gamma')} best on this machine"
                     f" ({rec.get('predicted_speedup', 0):.2f}x, head step {rec.get('c', 0):.3f} of a target pass)")
    elif rec:
        lines.append(f"- proposed gamma {rec['gamma']} on this machine: predicted {rec['predicted_speedup']:.2f}x "
                     f"(head step {rec['c']:.3f} of a target pass)")  # fmt: skip
    if pays:
        lines += ["", "## Does it pay (held-out prompts, greedy, measured)", "",
                  _row(["drafter", "gamma", "speedup (median)", "predicted", "accepted length", "lossless"]),
                  _row(["---"] * 6)]  # fmt: skip
        for r in pays["rows"]:
            tree = f", tree top-{r['topk']}" if r.get("topk", 1) > 1 else ""
            beside = f" (beside: {Path(r['beside']).name})" if r.get("beside") else ""
            lines.append(_row([r["drafter"] + tree + beside, r["gamma"], _x(r["speedup"]), _x(r.get("predicted")),
                               _f(r["mean_accepted_length"]), r["lossless"] or "-"]))  # fmt: skip
        lines += ["", pays["verdict"]]
    best = proposed_setting(s)
    tree = f" --topk {best['topk']}" if best["topk"] > 1 else ""
    lines += ["", "## Use", "", f"- SpecArena: `python -m engine run --target {s['target']} --drafter {kind} "
              f"--draft THIS_FOLDER --gamma {best['gamma'] or 1}{tree} --prompt ...`",
              "- vLLM: `vllm serve TARGET --speculative-config "
              f"'{{\"method\":\"{kind}\",\"model\":\"THIS_FOLDER\",\"num_speculative_tokens\":"
              f"{gamma or 3}}}'`"]  # fmt: skip
    if kind == "eagle3":
        lines.append("- llama.cpp: `python convert_hf_to_gguf.py THIS_FOLDER --target-model-dir TARGET_DIR --outfile "
                     "head.gguf`, then `llama-server -m target.gguf -md head.gguf --spec-type draft-eagle3`")
    lines.append("")
    return "\n".join(lines)


NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}
ABOUT = {
    "eagle3": "Forged by SpecArena (`python -m engine forge`): one Llama-style layer over the target's layers "
              "[2, L//2, L-3], trained by self-distillation on the target's own answers, in vLLM's speculators layout "
              "(full attention, `norm_before_residual` written out, no extra norms, `lm_head` and `d2t`/`t2d` in the "
              "file).",
    "dflash": "Forged by SpecArena (`python -m engine forge --kind dflash`): Qwen3-style layers over the target's "
              "layers [2, L//2, L-3] that draft a whole block in one pass, trained by self-distillation on the "
              "target's own answers (random anchors, soft labels, position weights exp(-(k-1)/4)), in vLLM's "
              "speculators layout. The block is non-causal, and the config says so: every layer `full_attention`, "
              "`sliding_window_non_causal: true`.",
}  # fmt: skip


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"

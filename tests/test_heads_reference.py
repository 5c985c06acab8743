"""Heads against the format's own reference: speculators 0.9.0, in an environment of its own (tests/run.sh makes it
and sets SPECARENA_SPECULATORS_PYTHON). tests/reference/speculators_oracle.py builds heads there with the reference's
training path (random weights in a tiny Llama target's shapes), saves them, and drafts greedily with its own modules
after the same contexts as we do; it also loads heads SpecArena writes. For every head and every context our drafter's
proposals equal the reference's and the draft logits agree to float32 rounding; the contexts include one past the
trainer's 2048-token sliding window.

Variants: EAGLE-3 as the trainer makes it by default (every layer sliding at 2048, norm_before_residual,
norm_before_fc, norm_output, reduced draft vocabulary), EAGLE-3 with full attention and no norm flags, DFlash as the
trainer makes it by default (sliding at 2048, causal block), DFlash with full attention and a non-causal block, P-EAGLE
as the trainer makes it by default (sliding at 2048, no norm flags, reduced vocabulary) and with full attention and
norm_before_residual / norm_before_fc, DSpark as the trainer makes it by default (sliding at 2048, causal, drafting
from the block's first row, a rank-16 Markov bias, a confidence head over the state and the Markov embedding) and with
full attention, DFlash's bonus-anchor layout, a confidence head over the state alone and a reduced vocabulary (each
DSpark position's confidence compared too); and an EAGLE-3, a DFlash, a P-EAGLE and a DSpark head written by
SpecArena.

In CI (CI=true) a missing reference environment fails the module; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.decoding.sampling import SamplingConfig
from engine.models.heads import drafter_for, load_head, random_head, write_head
from tests.conftest import byte_tokenizer, tiny_llama

DEPTH, GAMMA, WINDOW = 8, 3, 2048
ORACLE = Path(__file__).parent / "reference" / "speculators_oracle.py"
GREEDY = SamplingConfig(temperature=0.0)
BUILT = {
    "eagle3-trainer-default": {"kind": "eagle3", "seed": 1, "flags": {"draft_vocab_size": 200}},
    "eagle3-full-attention": {"kind": "eagle3", "seed": 2, "flags": {
        "full_attention_indices": [0], "norm_before_residual": False, "norm_before_fc": False,
        "norm_output": False}},
    "dflash-trainer-default": {"kind": "dflash", "seed": 3, "flags": {"num_layers": 2, "mask_token_id": 3,
                                                                          "target_layer_ids": [2, 5]}},
    "dflash-full-non-causal": {"kind": "dflash", "seed": 4, "flags": {
        "num_layers": 2, "mask_token_id": 3, "full_attention_indices": [0, 1], "sliding_window_non_causal": True,
        "target_layer_ids": [3, 6]}},
    "peagle-trainer-default": {"kind": "peagle", "seed": 7, "flags": {"draft_vocab_size": 200, "mask_token_id": 3}},
    "peagle-full-attention-norms": {"kind": "peagle", "seed": 8, "flags": {
        "full_attention_indices": [0], "norm_before_residual": True, "norm_before_fc": True, "mask_token_id": 5}},
    "dspark-trainer-default": {"kind": "dspark", "seed": 12, "flags": {"num_layers": 2, "mask_token_id": 3,
                                                                           "target_layer_ids": [2, 5]}},
    "dspark-bonus-anchor-full-attention": {"kind": "dspark", "seed": 13, "flags": {
        "mask_token_id": 3, "full_attention_indices": [0], "sample_from_anchor": False, "draft_vocab_size": 200,
        "confidence_head_with_markov": False, "target_layer_ids": [3, 6]}},
    "dflash2-trainer-default": {"kind": "dflash2", "seed": 15, "flags": {"num_layers": 2, "mask_token_id": 3,
                                                                             "target_layer_ids": [2, 5]}},
    "dflash2-full-causal": {"kind": "dflash2", "seed": 16, "flags": {
        "mask_token_id": 3, "full_attention_indices": [0], "sliding_window_non_causal": False, "conv_kernel_size": 3,
        "selector_top_k": 5, "target_layer_ids": [3, 6]}},
}  # fmt: skip


def reference_python() -> str:
    """The reference environment's python; in CI its absence fails, elsewhere it skips with the reason."""
    found = os.environ.get("SPECARENA_SPECULATORS_PYTHON") or str(
        Path.home() / ".cache/specarena/speculators-env/bin/python")  # fmt: skip
    probe = [found, "-c", "import speculators"]
    if not Path(found).is_file() or subprocess.run(probe, capture_output=True).returncode:
        why = f"the speculators reference environment is missing ({found}): tests/run.sh makes it"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found


def contexts(target) -> list[list[int]]:
    """Greedy continuations of short prompts, cut after every other token, and a 2,100-token text cut past the
    2048-token window."""
    torch.manual_seed(11)
    out = []
    for prompt in ([5, 17, 42, 9], [100, 101, 102, 100, 101], list(range(30, 60))):
        full = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0].tolist()
        out += [full[:n] for n in range(len(prompt) + 1, len(full) + 1, 2)]
    long = torch.randint(4, 384, (2100,)).tolist()
    out += [long[:n] for n in (2040, 2049, 2060, 2100)]
    return out


def hidden_states(target, ids: list[int]) -> torch.Tensor:
    """Every layer's states (transformers' hidden_states) for all but the last token: (L + 1, n - 1, H)."""
    with torch.inference_mode():
        out = target(torch.tensor([ids[:-1]]), output_hidden_states=True)
    return torch.stack(out.hidden_states)[:, 0].float().contiguous()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    python = reference_python()
    root = tmp_path_factory.mktemp("reference")
    target = tiny_llama(layers=DEPTH)
    target.save_pretrained(root / "target")
    byte_tokenizer().save_pretrained(root / "target")
    cases = contexts(target)
    states = [hidden_states(target, ids) for ids in cases]
    ours = {"ours-eagle3": random_head(target, "eagle3", draft_vocab=150, norm_before_residual=True,
                                       norm_before_fc=True, seed=5),
            "ours-dflash": random_head(target, "dflash", layers=2, block_size=8, mask_token_id=3, seed=6),
            "ours-peagle": random_head(target, "peagle", draft_vocab=150, norm_before_residual=True, mask_token_id=3,
                                       seed=9),
            "ours-dspark": random_head(target, "dspark", layers=2, block_size=8, mask_token_id=3, markov_rank=16,
                                       confidence="hidden+markov", sample_from_anchor=True, windows=(WINDOW, WINDOW),
                                       causal=(True, True), seed=14),
            "ours-dflash2": random_head(target, "dflash2", layers=2, block_size=8, mask_token_id=3, conv_kernel_size=2,
                                        conv_group_size=16, selector_rank=8, selector_top_k=6, seed=17)}  # fmt: skip
    for head in ours.values():
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
    verifier = str(root / "target")
    written = {name: str(write_head(head, root / name, "speculators-" + head.config.kind, verifier=verifier))
               for name, head in ours.items()}  # fmt: skip
    tensors = {f"ids.{i}": torch.tensor(ids) for i, ids in enumerate(cases)}
    save_file(tensors, str(root / "cases.safetensors"))
    save_file({f"hidden.{i}": s for i, s in enumerate(states)}, str(root / "hidden.safetensors"))
    job = {"target": str(root / "target"), "cases": str(root / "cases.safetensors"),
           "hidden": str(root / "hidden.safetensors"), "gamma": GAMMA, "out": str(root / "out"), "build": BUILT,
           "load": written}  # fmt: skip
    (root / "job.json").write_text(json.dumps(job))
    run = subprocess.run([python, str(ORACLE), str(root / "job.json")], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((root / "out" / "result.json").read_text())
    heads = {name: str(root / "out" / "heads" / name) for name in BUILT} | written
    return {"target": target, "cases": cases, "states": states, "result": result, "heads": heads,
            "out": root / "out"}  # fmt: skip


def our_drafts(head, vocab: int, ids: list[int], states: torch.Tensor) -> tuple[list[int], torch.Tensor, list]:
    """Our drafter's greedy proposal after `ids`, handed the target features it would be, its draft logits, and a
    DSpark head's confidence at each position."""
    drafter = drafter_for(head, vocab, GAMMA)
    seen, confidences = [], []
    kind = head.config.kind  # EAGLE-3: a pass per draft; P-EAGLE: one over the real and mask rows; DFlash: a block;
    if kind == "dflash2":  # DFlash2: a block, then the selector's scores of each position's candidates
        select = head.select

        def scored(unary, state, previous):
            candidates, scores = select(unary, state, previous)
            seen.append(torch.full_like(unary, float("-inf")).index_copy(0, candidates, scores)[None])
            return candidates, scores

        head.select = scored
        hook = None
    elif kind == "dspark":  # DSpark: a block, then each position's logits with its Markov bias
        markov = head.markov

        def recorded(state, previous):
            logits, confidence = markov(state, previous)
            seen.append(logits[None] / head.config.logit_scale)
            confidences.append(float(confidence))
            return logits, confidence

        head.markov = recorded
        hook = None
    else:
        hook = head.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.inference_mode():
            drafter.see(torch.cat([states[i] for i in drafter.layers], -1))
            tokens = drafter.propose(ids, GAMMA, GREEDY, torch.Generator()).tokens
    finally:
        if hook is None:
            del head.__dict__["select" if kind == "dflash2" else "markov"]
        else:
            hook.remove()
    rows = [seen[0][-1]] + [s[-1] for s in seen[1:]] if kind in ("eagle3", "dspark", "dflash2", "mtp-head") else list(
        seen[0][-GAMMA:])  # fmt: skip
    scale = 1.0 if kind == "dflash2" else head.config.logit_scale  # the selector's scores are compared as they are
    return tokens, torch.stack(rows).float() * scale, confidences


def agreement(oracle, name: str) -> tuple[int, int, float]:
    """(steps whose drafts equal the reference's, steps compared, max |logit difference|) for one head."""
    target = oracle["target"]
    head = load_head(oracle["heads"][name], target)
    logits = load_file(str(oracle["out"] / f"{name}.safetensors"))
    agree, worst = 0, 0.0
    for i, ids in enumerate(oracle["cases"]):
        tokens, ours, confidences = our_drafts(head, target.config.vocab_size, ids, oracle["states"][i])
        agree += tokens == oracle["result"][name]["drafts"][i]
        kept = torch.isfinite(ours) | torch.isfinite(logits[f"logits.{i}"])  # DFlash2: its candidates' scores
        worst = max(worst, float((ours - logits[f"logits.{i}"])[kept].abs().max()))
        theirs = oracle["result"][name]["confidences"][i]
        assert len(confidences) == len(theirs)  # a DSpark head's, where it has a confidence head
        worst = max([worst] + [abs(a - b) for a, b in zip(confidences, theirs)])
    print(f"{name}: {agree}/{len(oracle['cases'])} steps agree, max logit difference {worst:.2e}", file=sys.stderr)
    return agree, len(oracle["cases"]), worst


@pytest.mark.parametrize("name", list(BUILT))
def test_a_head_the_reference_builds_drafts_here_what_it_drafts_there(oracle, name):
    agree, steps, worst = agreement(oracle, name)
    assert agree == steps and worst < 1e-4, (name, agree, steps, worst)


@pytest.mark.parametrize("name", ["ours-eagle3", "ours-dflash", "ours-peagle", "ours-dspark", "ours-dflash2"])
def test_a_head_specarena_writes_loads_in_the_reference_and_drafts_the_same(oracle, name):
    agree, steps, worst = agreement(oracle, name)
    assert agree == steps and worst < 1e-4, (name, agree, steps, worst)


def test_the_reference_heads_are_read_as_the_reference_made_them(oracle):
    """What the trainer's defaults mean here: sliding windows of 2048 on every layer, the norm flags, a causal
    DFlash block; full attention and a non-causal block where the trainer was told so."""
    target = oracle["target"]
    c = {name: load_head(oracle["heads"][name], target).config for name in BUILT}
    e = c["eagle3-trainer-default"]
    assert e.windows == (WINDOW,) and e.norm_before_residual and e.norm_before_fc and e.norm_output
    assert c["eagle3-full-attention"].windows == (0,) and not c["eagle3-full-attention"].norm_before_residual
    d, full = c["dflash-trainer-default"], c["dflash-full-non-causal"]
    assert d.windows == (WINDOW, WINDOW) and d.causal == (True, True)
    assert full.windows == (0, 0) and full.causal == (False, False)
    p, pn = c["peagle-trainer-default"], c["peagle-full-attention-norms"]
    assert p.kind == "peagle" and p.windows == (WINDOW,) and not p.norm_before_residual and p.mask_token_id == 3
    assert pn.windows == (0,) and pn.norm_before_residual and pn.norm_before_fc and pn.mask_token_id == 5
    s, sb = c["dspark-trainer-default"], c["dspark-bonus-anchor-full-attention"]
    assert s.kind == "dspark" and s.windows == (WINDOW, WINDOW) and s.causal == (True, True) and s.sample_from_anchor
    assert s.markov_rank == 16 and s.confidence == "hidden+markov" and s.most_drafts == 8
    assert sb.windows == (0,) and sb.causal == (False,) and not sb.sample_from_anchor and sb.confidence == "hidden"
    assert sb.most_drafts == 7 and sb.draft_vocab_size == 200
    f, fc = c["dflash2-trainer-default"], c["dflash2-full-causal"]
    assert f.kind == "dflash2" and f.windows == (WINDOW, WINDOW) and f.causal == (False, False)  # its own default
    assert (f.conv_kernel_size, f.conv_group_size, f.selector_rank, f.selector_top_k) == (2, 16, 32, 8)
    assert fc.windows == (0,) and fc.causal == (True,) and fc.conv_kernel_size == 3 and fc.selector_top_k == 5
    assert len(oracle["cases"][-1]) - 1 > WINDOW  # the last contexts reach past the window


@pytest.mark.parametrize("name", ["eagle3-trainer-default", "peagle-trainer-default", "dflash-trainer-default",
                                  "dspark-trainer-default", "dflash2-trainer-default"])  # fmt: skip
def test_a_head_the_reference_builds_runs_from_the_playground(oracle, name, monkeypatch):
    """Each kind's reference-built head, named in the Playground's draft field with its drafter picked, runs through
    the page's own handler: the run ends lossless and the status names the head's kind."""
    from tests.test_app import plain, run_handler, ui_values

    root = oracle["out"].parent
    monkeypatch.setenv("SPECARENA_MODELS_DIR", str(root))  # the folder whose models the app may read
    kind = BUILT[name]["kind"]
    values = ui_values({"target": str(root / "target"), "draft": oracle["heads"][name]}, drafter=kind, chat=False,
                       prompt="abcabcabcabc", max_new_tokens=20, gamma=GAMMA)  # fmt: skip
    outputs = run_handler(values, session=f"reference-{name}")
    result, summary, error = outputs[-1][0], outputs[-1][4], outputs[-1][9]
    assert error == "" and result["status"] == "done" and result["identical"] is True, (name, plain(error))
    assert result["speculative"]["metrics"]["draft_passes"] > 0 and "outputs identical" in summary
    said = " ".join(plain(out[1]) for out in outputs)
    assert {"eagle3": "EAGLE-3 head", "peagle": "P-EAGLE head", "dflash": "DFlash head", "dspark": "DSpark head",
            "dflash2": "DFlash2 head"}[kind] in said, said  # fmt: skip


def tiny_qwen3(layers: int = 4):
    """A Qwen3 target: speculators makes MTP layers for Qwen3-family verifiers only."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(21)
    config = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0)  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def pre_norm_states(target, ids: list[int]) -> torch.Tensor:
    """The target's last layer's output before its final norm for all but the last token: (n - 1, H)."""
    caught = []
    hook = target.model.norm.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        with torch.inference_mode():
            target(torch.tensor([ids[:-1]]))
    finally:
        hook.remove()
    return caught[0][0].float().contiguous()


@pytest.fixture(scope="module")
def mtp_oracle(tmp_path_factory):
    """The reference's MTP layer for a tiny Qwen3 target (random weights, its trainer's config class), and one
    SpecArena writes, each drafting after the same contexts, from the target's last state before its final norm."""
    python = reference_python()
    root = tmp_path_factory.mktemp("mtp")
    target = tiny_qwen3()
    target.save_pretrained(root / "target")
    byte_tokenizer().save_pretrained(root / "target")
    cases = contexts(target)
    states = [pre_norm_states(target, ids) for ids in cases]
    ours = random_head(target, "mtp-head", seed=22)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if not name.startswith(("embed_tokens.", "lm_head.")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    written = {"ours-mtp": str(write_head(ours, root / "ours-mtp", "speculators-mtp", verifier=str(root / "target")))}
    save_file({f"ids.{i}": torch.tensor(ids) for i, ids in enumerate(cases)}, str(root / "cases.safetensors"))
    save_file({f"prenorm.{i}": s for i, s in enumerate(states)}, str(root / "hidden.safetensors"))
    job = {"target": str(root / "target"), "cases": str(root / "cases.safetensors"),
           "hidden": str(root / "hidden.safetensors"), "gamma": GAMMA, "out": str(root / "out"),
           "build": {"mtp-reference": {"kind": "mtp", "seed": 23, "flags": {}}}, "load": written}  # fmt: skip
    (root / "job.json").write_text(json.dumps(job))
    run = subprocess.run([python, str(ORACLE), str(root / "job.json")], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((root / "out" / "result.json").read_text())
    heads = {"mtp-reference": str(root / "out" / "heads" / "mtp-reference")} | written
    return {"target": target, "cases": cases, "states": states, "result": result, "heads": heads, "out": root / "out"}


@pytest.mark.parametrize("name", ["mtp-reference", "ours-mtp"])
def test_an_mtp_layer_drafts_here_what_it_drafts_in_the_reference(mtp_oracle, name):
    """Our drafter is handed the target's features through the engine's own pass (runtime.forward with PRE_NORM), so
    the states it reads are checked too: they must be the ones the reference drafted from."""
    from engine.decoding.runtime import PRE_NORM, forward, new_cache

    target = mtp_oracle["target"]
    head = load_head(mtp_oracle["heads"][name], target)
    assert head.config.layers == (PRE_NORM,) and head.config.kind == "mtp-head"
    with torch.inference_mode():
        _, ours = forward(target, mtp_oracle["cases"][3][:-1], new_cache(target), layers=(PRE_NORM,))
    torch.testing.assert_close(ours, mtp_oracle["states"][3], rtol=0, atol=0)
    logits = load_file(str(mtp_oracle["out"] / f"{name}.safetensors"))
    agree, worst = 0, 0.0
    for i, ids in enumerate(mtp_oracle["cases"]):
        tokens, drafted, _ = our_drafts(head, 384, ids, mtp_oracle["states"][i][None].expand(1, -1, -1))
        agree += tokens == mtp_oracle["result"][name]["drafts"][i]
        worst = max(worst, float((drafted - logits[f"logits.{i}"]).abs().max()))
    print(f"{name}: {agree}/{len(mtp_oracle['cases'])} steps agree, max logit difference {worst:.2e}", file=sys.stderr)
    assert agree == len(mtp_oracle["cases"]) and worst < 1e-4, (agree, worst)


def test_an_mtp_layer_the_reference_builds_runs_from_the_playground(mtp_oracle, monkeypatch):
    """The reference's MTP layer for a Qwen3 target, named in the Playground's draft field with the MTP head drafter:
    the run (the target's own forward, which hands the layer its last state before the final norm) ends lossless."""
    from tests.test_app import plain, run_handler, ui_values

    root = mtp_oracle["out"].parent
    monkeypatch.setenv("SPECARENA_MODELS_DIR", str(root))
    values = ui_values({"target": str(root / "target"), "draft": mtp_oracle["heads"]["mtp-reference"]},
                       drafter="mtp-head", chat=False, prompt="abcabcabcabc", max_new_tokens=20, gamma=GAMMA)
    outputs = run_handler(values, session="reference-mtp")
    result, error = outputs[-1][0], outputs[-1][9]
    assert error == "" and result["status"] == "done" and result["identical"] is True, plain(error)
    assert result["speculative"]["metrics"]["draft_passes"] > 0
    assert "MTP head" in " ".join(plain(out[1]) for out in outputs)

"""Draft heads (engine.decoding.heads, engine.models.heads) on tiny random targets: the published layouts and
their layer-index conventions, greedy ids equal to the baseline's and HF generate()'s through every kind of target
pass, sampled marginals exact, the head's cache in step with rollbacks, and clear messages for heads that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.decoding.heads import DFlash, DFlash2, DSpark, Eagle3, MTPHead, PEagle
from engine.decoding.lean import attach
from engine.decoding.runtime import forward, new_cache
from engine.decoding.sampling import SamplingConfig
from engine.errors import UserError
from engine.models.heads import LAYOUTS, drafter_for, head_config, load_head, random_head, read_config, write_head
from tests.conftest import byte_tokenizer, tiny_llama
from tests.test_engine import GREEDY, PROMPTS, hf_generate, prompt_ids, run_baseline, run_spec
from tests.test_sampling import sampled_exactly

DEPTH = 6  # EAGLE-3 reads layers (2, 3, 3) of six, DFlash (2, 4) for two draft layers


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=DEPTH)


@pytest.fixture(scope="module")
def lean_target():
    model = tiny_llama(layers=DEPTH)
    model.config._attn_implementation = "sdpa"
    assert attach(model)
    return model


def heads_of(target):
    """One head of each kind and shape: full and reduced draft vocabularies, the speculators norm flags, DFlash."""
    return {
        "eagle3": random_head(target, "eagle3"),
        "eagle3-reduced": random_head(target, "eagle3", draft_vocab=200, norm_before_residual=True, seed=1),
        "eagle3-norms": random_head(target, "eagle3", draft_vocab=300, norm_before_fc=True, norm_output=True, seed=2),
        "dflash": random_head(target, "dflash", layers=2, block_size=6, mask_token_id=5, seed=3),
        "peagle": random_head(target, "peagle", draft_vocab=250, mask_token_id=7, seed=4),
        "dspark": random_head(target, "dspark", layers=2, block_size=6, mask_token_id=5, markov_rank=8,
                              confidence="hidden+markov", sample_from_anchor=True, windows=(2048, 2048),
                              causal=(True, True), seed=6),
        "dspark-bonus-anchor": random_head(target, "dspark", block_size=6, mask_token_id=5, markov_rank=8,
                                           confidence="hidden", seed=7),
        "dflash2": random_head(target, "dflash2", layers=2, block_size=6, mask_token_id=5, conv_kernel_size=2,
                               conv_group_size=16, selector_rank=8, selector_top_k=6, seed=8),
        "mtp-head": random_head(target, "mtp-head", seed=9),
    }  # fmt: skip


def test_every_layout_reads_back_what_was_written_with_its_layer_ids(target, tmp_path):
    """EAGLE-3 ids and speculators' dflash ids are hidden_states indices as they stand; z-lab's DFlash ids name the
    layer whose output is read, one lower; SafeAILab's weights sit under `midlayer.`."""
    heads = heads_of(target)
    cases = [("eagle3", "eagle3-original"), ("eagle3-reduced", "speculators-eagle3"),
             ("eagle3-norms", "speculators-eagle3"), ("dflash", "dflash"), ("dflash", "speculators-dflash"),
             ("peagle", "speculators-peagle"), ("dspark", "speculators-dspark"),
             ("dspark-bonus-anchor", "speculators-dspark"), ("dflash2", "speculators-dflash2"),
             ("mtp-head", "speculators-mtp")]
    for name, layout in cases:
        head = heads[name]
        folder = write_head(head, tmp_path / f"{name}-{layout}", layout, verifier="tiny")
        raw = read_config(folder)
        keys = set(load_file(folder / "model.safetensors"))
        if layout == "eagle3-original":
            assert "midlayer.self_attn.q_proj.weight" in keys and "draft_vocab_size" in raw
        if layout == "speculators-eagle3":
            assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and "layers.0.hidden_norm.weight" in keys
            assert {"d2t", "t2d", "lm_head.weight", "embed_tokens.weight"} <= keys
        if layout == "dflash":
            assert raw["dflash_config"]["target_layer_ids"] == [i - 1 for i in head.config.layers]
            assert not {"lm_head.weight", "embed_tokens.weight"} & keys
        if layout == "speculators-dflash":
            assert raw["aux_hidden_state_layer_ids"] == list(head.config.layers)
        if layout == "speculators-dspark":
            assert raw["speculators_model_type"] == "dspark" and raw["markov_rank"] == 8
            assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= keys
        if layout == "speculators-peagle":
            assert raw["speculators_model_type"] == "peagle" and raw["mask_token_id"] == 7
            assert {"mask_hidden", "d2t", "lm_head.weight", "embed_tokens.weight"} <= keys
        back = load_head(str(folder), target)
        assert back.config.layers == head.config.layers and back.config.layout == layout
        for layer in range(head.config.num_layers):  # () and all zeros / all False say the same
            assert back.config.window(layer) == head.config.window(layer), (layout, layer)
            assert back.config.block_causal(layer) == head.config.block_causal(layer), (layout, layer)
        for flag in ("norm_before_residual", "norm_before_fc", "norm_output", "block_size", "mask_token_id",
                     "markov_rank", "confidence", "sample_from_anchor", "conv_kernel_size", "conv_group_size",
                     "selector_rank", "selector_top_k"):
            assert getattr(back.config, flag) == getattr(head.config, flag), (layout, flag)
        ids = prompt_ids(byte_tokenizer(), PROMPTS[0])
        assert _drafts(target, head, ids) == _drafts(target, back, ids), layout


def _drafts(target, head, ids, gamma=4):
    """What the head proposes after `ids`, fed the target's features of all but the last position."""
    drafter = drafter_for(head, target.config.vocab_size, gamma)
    with torch.inference_mode():
        _, features = forward(target, ids[:-1], new_cache(target), layers=drafter.layers)
        drafter.see(features)
        return drafter.propose(ids, gamma, GREEDY, torch.Generator()).tokens


@pytest.mark.parametrize("lean", [False, True])
def test_greedy_head_drafts_give_the_baseline_and_hf_generate_ids(target, lean_target, llama_pair, lean):
    model = lean_target if lean else target
    tok = llama_pair[2]
    heads = heads_of(model)
    for text in PROMPTS[:2]:
        ids = prompt_ids(tok, text)
        expected = hf_generate(model, ids, 24)
        assert run_baseline(model, tok, ids, 24).token_ids == expected
        for gamma in (1, 4):
            for name, head in heads.items():
                result = run_spec(model, tok, ids, drafter_for(head, 384, gamma), gamma, 24)
                assert result.token_ids == expected, (name, text, gamma)
                assert result.metrics.draft_passes > 0


def test_a_head_proposes_after_every_step_what_it_would_from_scratch(target, llama_pair):
    """The head's cache in step with rollbacks: at every step of a run, its draft equals the draft of a fresh head
    fed the whole text at once, so rows built from rejected guesses never linger."""
    tok = llama_pair[2]
    for name, head in heads_of(target).items():
        drafter = drafter_for(head, 384, 4)
        seen = []
        real = drafter.propose

        def spy(ids, limit, cfg, generator, real=real):
            draft = real(ids, limit, cfg, generator)
            seen.append((list(ids), draft.tokens))
            return draft

        drafter.propose = spy
        run_spec(target, tok, prompt_ids(tok, PROMPTS[1]), drafter, 4, 24)
        assert len(seen) > 3
        for ids, tokens in seen:
            assert _drafts(target, head, ids, len(tokens)) == tokens, name


def test_draft_vocabulary_maps_to_target_ids_and_nothing_outside(target):
    head = random_head(target, "eagle3", draft_vocab=50, seed=4)
    drafter = drafter_for(head, 384, 4)
    cfg = SamplingConfig(temperature=1.0, seed=0)
    tok_ids = list(range(10, 30))
    with torch.inference_mode():
        _, features = forward(target, tok_ids[:-1], new_cache(target), layers=drafter.layers)
        drafter.see(features)
        draft = drafter.propose(tok_ids, 4, cfg, cfg.generator(torch.device("cpu")))
    assert all(t < 50 for t in draft.tokens)  # the head's ids are the first 50 target ids
    assert draft.probs.shape == (4, 384) and float(draft.probs[:, 50:].sum()) == 0.0


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "dspark", "dflash2", "mtp-head"])
def test_sampled_head_drafts_keep_the_target_distribution(kind):
    """Each draft token is drawn from the head's q with the run's temperature, top-k and top-p: the rejection rule
    then gives exactly the target's marginals. A reduced draft vocabulary (q = 0 outside it) too; a DSpark head's q
    is its logits with the Markov bias of the token drawn before; a DFlash2 head's, its selector's scores over its
    candidates (zero elsewhere)."""
    model = tiny_llama(vocab_size=8, layers=3, seed=5)
    flags = {"dspark": {"markov_rank": 4, "confidence": "hidden+markov", "sample_from_anchor": True},
             "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 5}}
    with torch.no_grad():
        head = random_head(model, kind, draft_vocab=0 if kind in ("dflash", "dspark", "dflash2", "mtp-head") else 6,
                           block_size=4,
                           mask_token_id=7, seed=7, **flags.get(kind, {}))  # fmt: skip
        for name, p in head.named_parameters():  # the other kinds' q is the target's LM head's (DSpark: a sharp bias)
            if kind in ("eagle3", "peagle") and not name.startswith("embed_tokens."):
                p.mul_(4.0)  # a sharper q, so that acceptance is neither 0 nor 1
    cfg = SamplingConfig(temperature=1.0)
    accepted, drafted = sampled_exactly(model, lambda: drafter_for(head, 8, 3), 3, cfg, [1, 2, 3], 3)
    assert 0.05 < accepted / drafted < 0.95


def test_a_dspark_head_stops_drafting_where_its_confidence_falls_below_p_min(target, llama_pair):
    """As llama.cpp's --spec-draft-p-min stops a DSpark draft: at the first position whose own confidence is below
    p_min, that position's token and those after it not drafted; at p_min 0 it drafts every position. Runs stay
    lossless whatever the stop, an empty draft included."""
    head = heads_of(target)["dspark"]
    tok = llama_pair[2]
    ids = prompt_ids(tok, PROMPTS[0])
    seen = []
    markov = head.markov

    def recorded(state, previous):
        logits, confidence = markov(state, previous)
        seen.append(float(confidence))
        return logits, confidence

    head.markov = recorded
    try:
        full = _drafts(target, head, ids, gamma=5)
    finally:
        del head.markov
    assert len(full) == 5 and len(seen) == 5
    for cut in range(5):
        p_min = seen[cut] + 1e-6 if seen[cut] < 0.999 else None  # stop at position `cut`, after the ones before it
        if p_min is None or any(c < p_min for c in seen[:cut]):
            continue
        drafter = drafter_for(head, 384, 5, p_min=p_min)
        with torch.inference_mode():
            _, features = forward(target, ids[:-1], new_cache(target), layers=drafter.layers)
            drafter.see(features)
            draft = drafter.propose(ids, 5, GREEDY, torch.Generator())
        assert draft.tokens == full[:cut] and "confidence stop" in draft.note, (cut, seen)
    expected = hf_generate(target, ids, 24)
    for p_min in (0.3, 0.5, 0.99):
        assert run_spec(target, tok, ids, drafter_for(head, 384, 4, p_min=p_min), 4, 24).token_ids == expected


def test_a_dspark_head_is_refused_where_no_engine_runs_it_as_the_trainer_does(target, tmp_path):
    head = heads_of(target)["dspark"]
    folder = write_head(head, tmp_path / "dspark", "speculators-dspark")
    raw = read_config(folder)
    for change, words in ((("markov_head_type", "gated"), "markov_head_type: gated"),
                          (("sliding_window_non_causal", True), "sliding_window_non_causal: true")):  # fmt: skip
        (folder / "config.json").write_text(json.dumps(raw | dict([change])))
        with pytest.raises(UserError, match=words):
            load_head(str(folder), target)
    with pytest.raises(ValueError, match="causal layers must be the sliding ones"):
        write_head(random_head(target, "dspark", markov_rank=4, causal=(True,)), tmp_path / "x", "speculators-dspark")


def test_strict_mode_keeps_bfloat16_head_runs_identical(llama_pair):
    """A head drafts in bfloat16 from the verify passes' features: with strict mode, greedy ids equal the baseline's."""
    from engine.decoding.baseline import baseline_decode
    from engine.decoding.metrics import summarise
    from engine.decoding.speculative import speculative_decode

    model = tiny_llama(layers=DEPTH).to(torch.bfloat16)
    tok = llama_pair[2]
    for head in (random_head(model, "eagle3", draft_vocab=100), random_head(model, "dflash", block_size=5)):
        for text in PROMPTS:
            ids = prompt_ids(tok, text)
            with torch.inference_mode():
                base = summarise("b", list(baseline_decode(model, tok, ids, GREEDY, 30, set(), width=5)), "")
                steps = list(speculative_decode(model, tok, ids, drafter_for(head, 384, 4), GREEDY, 30, set(),
                                                width=5))
            assert summarise("s", steps, "").token_ids == base.token_ids


def test_a_head_for_another_target_is_refused_in_one_sentence(target, tmp_path):
    head = random_head(target, "eagle3")
    folder = write_head(head, tmp_path / "h", "speculators-eagle3")
    wider = tiny_llama(layers=DEPTH)
    wider.config.hidden_size = 128
    with pytest.raises(UserError, match="features 64 wide, the target's hidden size is 128") as err:
        load_head(str(folder), wider)
    assert err.value.field == "draft"
    fitting = (folder / "config.json").read_text()
    raw = json.loads(fitting)
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 3, 9]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"reads target layers \[2, 3, 9\], the target has 6"):
        load_head(str(folder), target)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UserError, match="not a draft head.*draft-model drafter"):
        load_head(str(tmp_path / "model"), target)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(fitting)
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="SPECARENA_ALLOW_PICKLE=1"):
        load_head(str(pickled), target)


def test_every_layout_is_known():
    assert set(LAYOUTS) == {"speculators-eagle3", "eagle3-original", "dflash", "speculators-dflash",
                            "speculators-peagle", "speculators-dspark", "speculators-dflash2", "speculators-mtp"}
    kinds = {Eagle3.name, PEagle.name, DFlash.name, DSpark.name, DFlash2.name, MTPHead.name}
    assert kinds == {"eagle3", "peagle", "dflash", "dspark", "dflash2", "mtp-head"}
    raw = {"speculators_model_type": "eagle3", "transformer_layer_config": {
        "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128}}
    c = head_config(raw, tiny_llama(layers=DEPTH).config)
    assert c.layers == (2, 3, 3) and c.norm_before_residual  # vLLM reads an absent flag as True


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory, target):
    """A saved six-layer target and an EAGLE-3 and a DFlash head for it, as a user would have them on disk."""
    root = tmp_path_factory.mktemp("heads")
    target.save_pretrained(root / "target")
    byte_tokenizer().save_pretrained(root / "target")
    write_head(random_head(target, "eagle3", draft_vocab=200), root / "eagle3", verifier=str(root / "target"))
    write_head(random_head(target, "dflash", block_size=5), root / "dflash", "dflash")
    write_head(random_head(target, "peagle", mask_token_id=3), root / "peagle", "speculators-peagle",
               verifier=str(root / "target"))  # fmt: skip
    return {name: str(root / name) for name in ("target", "eagle3", "dflash", "peagle")}


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_cli_runs_a_head_lossless_and_the_doctor_checks_it(head_dirs, kind, capsys):
    from engine.__main__ import main

    code = main(["run", "--json", "--target", head_dirs["target"], "--drafter", kind, "--draft", head_dirs[kind],
                 "--prompt", "abc abc abc", "--max-new-tokens", "16", "--gamma", "3"])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["identical"] is True and data["speculative"]["metrics"]["draft_passes"] > 0
    assert main(["doctor", "--target", head_dirs["target"], "--drafter", kind, "--draft", head_dirs[kind]]) == 0
    out = capsys.readouterr().out
    assert f"{kind} head" in out and "reading target layers" in out


def test_the_doctor_counts_a_heads_weights_in_its_memory_check(head_dirs, monkeypatch):
    """A head's weights load beside the target's: the memory check counts them (it once counted the target alone)."""
    from engine.models.doctor import diagnose

    alone = diagnose(head_dirs["target"], dtype="float32", device="cpu")
    report = diagnose(head_dirs["target"], head_dirs["eagle3"], "float32", "cpu", head=True)
    parts = dict(report["memory"]["parts"])
    assert parts["head"] == report["params"]["draft"] * 4 > 0
    assert "+ head " in next(c for c in report["checks"] if c["name"] == "memory")["detail"]
    # just enough memory for the target alone: the head tips it over
    need = sum(size for _, size in alone["memory"]["parts"])
    monkeypatch.setattr("engine.models.sizing.free_memory_bytes", lambda device: need / 0.8 + 1)
    for head, status in ((None, "ok"), (head_dirs["eagle3"], "warn")):
        checks = diagnose(head_dirs["target"], head, "float32", "cpu", head=bool(head))["checks"]
        assert next(c for c in checks if c["name"] == "memory")["status"] == status


def test_the_pair_check_says_when_a_run_drafts_another_length_than_the_head_proposes(head_dirs, monkeypatch):
    """A head's config proposes a draft length (a forged head: the one measured fastest); γ 4 by habit with a head
    made for 1 ran at 0.64x. The page's pair check says so, with the run's γ beside it."""
    from app.handlers import API_FIELDS, check_pair
    from engine.models.doctor import diagnose
    from engine.settings import Settings

    def length(gamma):
        report = diagnose(head_dirs["target"], head_dirs["eagle3"], "float32", "cpu", head=True, gamma=gamma)
        return next(c for c in report["checks"] if c["name"] == "draft length")

    assert length(None)["status"] == length(3)["status"] == "ok" and "proposes γ 3" in length(3)["detail"]
    assert length(5)["status"] == "note" and "this run drafts γ 5: set γ to 3" in length(5)["detail"]
    monkeypatch.setenv("SPECARENA_MODELS_DIR", str(Path(head_dirs["target"]).parent))  # the app reads the folders
    form = {name: getattr(Settings(), name) for name in API_FIELDS if name != "prompt"}
    report = check_pair(**form | dict(target=head_dirs["target"], drafter="eagle3", draft=head_dirs["eagle3"], gamma=5))
    assert "ℹ **draft length**" in report and "set γ to 3" in report, report


def test_cli_head_errors_are_one_line(head_dirs, model_dirs, capsys):
    from engine.__main__ import main

    assert main(["run", "--target", head_dirs["target"], "--drafter", "eagle3", "--prompt", "hi"]) == 2
    assert "EAGLE-3 head drafter needs a head" in capsys.readouterr().err
    # the tiny two-layer target has no layer 2 to read
    assert main(["run", "--target", model_dirs["target"], "--drafter", "eagle3", "--draft", head_dirs["eagle3"],
                 "--prompt", "hi", "--max-new-tokens", "4"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "reads target layers [2, 3, 3], the target has 2" in err
    assert main(["doctor", "--target", model_dirs["target"], "--drafter", "eagle3", "--draft",
                 head_dirs["eagle3"]]) == 1  # fmt: skip
    assert "the target has 2" in capsys.readouterr().out
    # a head runs as what it is or not at all: the DFlash drafter once ran an EAGLE-3 head and called it DFlash
    for kind, other, said in (("eagle3", "dflash", "is an EAGLE-3 head (speculators-eagle3 layout), not a DFlash"),
                              ("dflash", "eagle3", "is a DFlash head (dflash layout), not an EAGLE-3")):  # fmt: skip
        assert main(["run", "--target", head_dirs["target"], "--drafter", other, "--draft", head_dirs[kind],
                     "--prompt", "hi", "--max-new-tokens", "4"]) == 2  # fmt: skip
        assert said in capsys.readouterr().err


def test_a_head_reads_the_output_layer_in_whatever_layout_the_cpu_path_keeps_it():
    from engine.models import cpu
    from engine.models.heads import linear_weight

    for dtype in (torch.float32, torch.bfloat16):
        linear = torch.nn.Linear(64, 96, bias=True).to(dtype)
        forms = cpu.measurable(dtype)
        assert "own" in forms or not cpu.own_built(), forms  # our kernel is the form a pass most often keeps
        for form in forms:
            wrapped = cpu.CpuLinear(linear, forms)
            wrapped.keep_only((form,))
            assert list(wrapped.weights) == [form]
            assert torch.equal(linear_weight(wrapped), linear.weight.detach()), (dtype, form)


def test_the_doctor_knows_the_bundled_model_under_each_of_its_names(target, tmp_path):
    """A forged head names its verifier as the forge was told ("bundled"); the target may be written
    bundled:smollm2-135m-instruct, its converted folder or its Hub id: all the same model, so no "expect lower
    acceptance" warning. Another model is warned about."""
    from engine.models.heads import doctor_checks
    from engine.settings import BUNDLED

    folder = write_head(random_head(target, "eagle3"), tmp_path / "h", "speculators-eagle3", verifier="bundled")
    for spec in (BUNDLED, "bundled", "/somewhere/cache/smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        found, _ = doctor_checks(str(folder), spec, target.config)
        assert ("verifier", "ok", "the head was trained for bundled") in found, (spec, found)
    found, _ = doctor_checks(str(folder), "meta-llama/Llama-3.2-1B", target.config)
    verifier = next(f for f in found if f[0] == "verifier")
    assert verifier[1] == "warn" and "expect lower acceptance" in verifier[2]


def _with_config(folder: Path, **changes) -> Path:
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key == "layer":
            raw["transformer_layer_config"] |= value
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_norm_before_residual_absent_is_read_as_vllm_reads_each_layout():
    """vLLM's speculators adapter (update_eagle3) makes an absent flag True; its llama_eagle3, which runs SafeAILab's
    layout, False."""
    config = tiny_llama(layers=DEPTH).config
    layer = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128}
    speculators = {"speculators_model_type": "eagle3", "transformer_layer_config": layer}
    assert head_config(speculators, config).norm_before_residual
    assert not head_config(layer | {"draft_vocab_size": 100}, config).norm_before_residual
    peagle = {"speculators_model_type": "peagle", "transformer_layer_config": layer, "mask_token_id": 3}
    assert not head_config(peagle, config).norm_before_residual  # vLLM's update_peagle: absent is False


def test_dflash_block_causality_and_windows_are_resolved_as_vllm_resolves_them():
    """qwen3_dflash: `is_causal`, else `dflash_config.causal` (speculators: not sliding_window_non_causal, absent =
    non-causal), else a sliding layer is causal; `use_swa` makes every layer sliding."""
    config = tiny_llama(layers=DEPTH).config
    layer = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "model_type": "qwen3"}  # fmt: skip
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
    spec = {"speculators_model_type": "dflash", "block_size": 8, "mask_token_id": 3, "transformer_layer_config": layer}
    zlab = layer | {"block_size": 8, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3]}}
    cases = [
        (spec, (False, False), (0, 0), ""),
        (spec | {"sliding_window_non_causal": True}, (False, False), (0, 0), ""),
        (spec | {"sliding_window_non_causal": False}, (True, True), (0, 0), "as vLLM 0.32 does"),
        (spec | {"sliding_window_non_causal": False, "transformer_layer_config": layer | sliding}, (True, True),
         (16, 0), "as vLLM 0.32 does"),
        (zlab, (False, False), (0, 0), ""),
        (zlab | sliding, (True, False), (16, 0), ""),
        (zlab | sliding | {"is_causal": False}, (False, False), (16, 0), ""),
        (zlab | {"dflash_config": zlab["dflash_config"] | {"use_swa": True, "swa_window_size": 32}}, (False, False),
         (32, 32), ""),
    ]  # fmt: skip
    for raw, causal, windows, note in cases:
        c = head_config(raw, config)
        assert (c.causal, c.windows) == (causal, windows) and note in c.note and not c.refused, raw


def test_fields_we_cannot_run_are_refused_by_name_before_any_weights_load(target, tmp_path):
    head = random_head(target, "dflash", layers=2, block_size=6, mask_token_id=5)
    for change, named in (
        ({"sample_from_anchor": True}, "sample_from_anchor"),
        ({"layer": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}, "rope_scaling` of type 'dynamic'"),
        ({"layer": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"layer": {"layer_types": ["sliding_attention"] * 2}}, "without a `sliding_window`"),
        ({"mask_token_id": None}, "mask_token_id"),
        ({"layer": {"hidden_act": "no-such-act"}}, "hidden_act"),
    ):  # fmt: skip
        folder = _with_config(write_head(head, tmp_path / "h", "speculators-dflash"), **change)
        (folder / "model.safetensors").unlink()  # the refusal comes before the weights are looked for
        with pytest.raises(UserError, match="does not run: .*" + named.replace("[", r"\[")) as err:
            load_head(str(folder), target)
        assert err.value.field == "draft"
    parallel = random_head(target, "peagle", mask_token_id=3)
    for change, named in (({"mask_token_id": None}, "mask_token_id"), ({"fc_norm": True}, "fc_norm")):
        folder = _with_config(write_head(parallel, tmp_path / "p", "speculators-peagle"), **change)
        (folder / "model.safetensors").unlink()
        with pytest.raises(UserError, match="does not run: .*" + named):
            load_head(str(folder), target)
    folder = write_head(head, tmp_path / "m", "dflash")
    (folder / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(UserError, match="mask_embedding.pt"):
        load_head(str(folder), target)


def test_rope_and_logit_scale_are_read(target, tmp_path):
    """A head's own rope base (speculators' DFlash default 1e6, as vLLM's qwen3_dflash sets it) and vLLM's
    logit_scale change its drafts' logits."""
    head = random_head(target, "dflash", layers=2, block_size=6, mask_token_id=5)
    folder = write_head(head, tmp_path / "d", "speculators-dflash")
    raw = json.loads((folder / "config.json").read_text())
    raw["transformer_layer_config"].pop("rope_theta")
    assert head_config(raw, target.config).rope == {"rope_theta": 1e6}
    _with_config(folder, layer={"logit_scale": 0.5})
    back = load_head(str(folder), target)
    assert back.config.logit_scale == 0.5
    states = torch.randn(3, 64)
    torch.testing.assert_close(back.logits(states), 0.5 * back.lm_head(states))


def test_a_sliding_window_hides_what_lies_before_it(target):
    """Past its window a head's drafts no longer depend on the earliest rows' features; with full attention they do."""
    ids = list(range(10, 50))
    gen = torch.Generator().manual_seed(0)
    for window, same in ((8, True), (0, False)):
        head = random_head(target, "eagle3", seed=3)
        head.config.windows = (window,)
        features = torch.randn(len(ids) - 1, head.config.feature_size, generator=gen)
        drafts = []
        for early in (features[:20], torch.randn(20, head.config.feature_size, generator=gen)):
            drafter = drafter_for(head, 384, 3)
            seen = []
            hook = head.lm_head.register_forward_hook(lambda m, a, out: seen.append(out[-1]))
            with torch.inference_mode():
                drafter.see(torch.cat((early, features[20:])))
                drafter.propose(ids, 3, GREEDY, torch.Generator())
            hook.remove()
            drafts.append(torch.stack(seen))
        assert torch.allclose(drafts[0], drafts[1], atol=1e-6) == same, window


def test_training_runs_the_drafting_layers_for_a_batch_with_windows_and_two_layers(target):
    """engine.forge.train.ttt_forward and Head.eagle3 share the layer code: for a two-layer head with a sliding
    window and EAGLE-3.1's post-norm feedback, every sequence of a batch, every anchor and every train-time-test step
    gives the logits the drafter gives."""
    from engine.decoding.heads import HeadCache
    from engine.forge.train import ttt_forward

    head = random_head(target, "eagle3", layers=2, norm_output=True, norm_before_residual=True, seed=9)
    head.config.windows = (4, 0)
    c, n, steps = head.config, 12, 3
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 384, (2, n), generator=gen)
    features = torch.randn(2, n - 1, c.feature_size, generator=gen)
    shifted = torch.zeros(2, n - 1 + steps, dtype=torch.long)
    shifted[:, : n - 1] = tokens[:, 1:]
    with torch.no_grad():
        trained = ttt_forward(head, shifted, features, steps)
        for b in range(2):
            for t in range(n - 1 - steps):
                cache = HeadCache(2, c.num_kv_heads, c.head_dim, torch.float32, "cpu", 64)
                state, logits = head.eagle3(tokens[b, 1 : t + 2], head.fuse(features[b, : t + 1]), cache)
                torch.testing.assert_close(logits[-1], trained[0][b, t], atol=1e-5, rtol=1e-5)
                for k in range(1, steps):
                    state, logits = head.eagle3(tokens[b, t + k + 1 : t + k + 2], state[-1:], cache)
                    torch.testing.assert_close(logits[-1], trained[k][b, t], atol=1e-5, rtol=1e-5)


def test_describe_counts_a_dflash_heads_own_weights_once():
    """A DFlash head drafts through the target's LM head, which a tied target shares with its embedding: the count
    once gave a negative number of parameters."""
    from engine.models.heads import describe, own_parameters

    tied = tiny_llama(layers=DEPTH)
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    head = random_head(tied, "dflash", layers=2, block_size=6, mask_token_id=5)
    own = sum(p.numel() for name, p in head.named_parameters() if not name.startswith(("embed_tokens.", "lm_head.")))
    assert own_parameters(head) == own > 0 and f"{own / 1e6:.1f}M parameters" in describe(head)
    assert "non-causal block" in describe(head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_served_head_runs_its_layers_in_the_target_kernels_where_they_are_faster_with_the_same_drafts(llama_pair,
                                                                                                      dtype):
    """A head's linear layers can take the target's forms per pass size, our kernel where the target's run it (here
    1-5 rows: chain steps and blocks), fc kept, and go back; either way it proposes the same drafts. Serving
    (engine.models.heads.serve_forms) times both and keeps the faster: all of the layers swapped, or none."""
    from engine.models import cpu
    from engine.models.heads import serve_forms
    from tests.test_engine import own_kernel

    own_kernel()
    model = tiny_llama(layers=DEPTH).to(dtype)
    table = ("stock",) + ("own",) * 5 + ("stock",)
    for layer in cpu.wrap_linears(model, ("stock", "own")):
        layer.keep_only(table)
    ids = prompt_ids(llama_pair[2], PROMPTS[0])
    for kind in ("eagle3", "dflash"):
        head = random_head(model, kind, draft_vocab=200 if kind == "eagle3" else 0, block_size=5, seed=1)
        stock = _drafts(model, head, ids)
        swaps = cpu.like_target(head, model, keep=("fc",))
        assert len(swaps) == 7 + (kind == "eagle3")  # q, k, v, o, gate, up, down; EAGLE-3's own LM head
        assert type(head.fc) is torch.nn.Linear and head.layers[0].mlp.down_proj.table == table
        assert head.layers[0].self_attn.q_proj.weights.keys() == {"stock", "own"}
        assert _drafts(model, head, ids) == stock, kind
        cpu.swap_back(swaps)
        assert type(head.layers[0].mlp.down_proj) is torch.nn.Linear and _drafts(model, head, ids) == stock
        swapped = serve_forms(head, model, repeats=2)
        kinds = {type(module) for module in head.layers.modules() if isinstance(module, (torch.nn.Linear,
                                                                                           cpu.CpuLinear))}  # fmt: skip
        assert kinds == ({cpu.CpuLinear} if swapped else {torch.nn.Linear}) and _drafts(model, head, ids) == stock
    plain = tiny_llama(layers=DEPTH)  # a target in stock layers: its heads keep theirs
    assert cpu.like_target(random_head(plain, "eagle3"), plain) == []
    assert serve_forms(random_head(plain, "eagle3"), plain) is False


def test_a_greedy_draft_maps_its_draft_id_through_d2t_also_one_made_in_inference_mode():
    """A head over a reduced vocabulary drafts its argmax's target id (d2t) from a list copy made once per d2t tensor:
    one the loader made in inference mode (which keeps no version counter) too, and a new d2t is read anew."""
    from engine.decoding.heads import Eagle3
    from engine.decoding.sampling import SamplingConfig

    head = random_head(tiny_llama(layers=DEPTH), "eagle3", draft_vocab=200, seed=1)
    drafter = Eagle3(head, head.config.vocab_size)
    logits = torch.zeros(200)
    logits[17] = 5.0
    for scale in (3, 5):
        with torch.inference_mode():
            head.d2t = torch.arange(200) * scale
            assert drafter._choose(logits, SamplingConfig(), None) == (17 * scale, None)

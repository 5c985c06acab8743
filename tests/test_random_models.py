"""Random-weight models of real sizes (`random:<shape>`) and the synthetic drafter paced by a draft model."""

from __future__ import annotations

import json

import pytest
import torch

from engine.__main__ import main
from engine.decoding.drafters import DraftModel, Synthetic
from engine.errors import OutOfMemory, UserError
from engine.models import random_shapes as random_models
from engine.models.loading import resolve
from tests.test_engine import PROMPTS, prompt_ids, run_baseline, run_spec


def test_random_specs_resolve_to_known_shapes():
    assert resolve("random:llama-3.1-8b").shape == "llama-3.1-8b"
    with pytest.raises(UserError, match="random:llama-3.2-1b"):
        resolve("random:llama-70b")


def test_real_sizes_from_the_configs():
    from engine.models.sizing import count_params

    billions = {shape: count_params(random_models.config(shape)) / 1e9 for shape in random_models.SHAPES}
    assert billions["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)
    assert billions["llama-3.2-1b"] == pytest.approx(1.24, abs=0.01)
    assert billions["smollm2-135m"] == pytest.approx(0.1345, abs=0.001)


def test_the_tokenizer_covers_every_id():
    tok = random_models.tokenizer(1000)
    ids = tok("Hi there!")["input_ids"]
    assert tok.decode(ids) == "Hi there!"
    assert tok.decode([999, ids[0]]) == "‹999›H"
    assert len(tok) == 1000


def test_a_shape_that_does_not_fit_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr("engine.models.sizing.free_memory_bytes", lambda device: 2**30)
    with pytest.raises(OutOfMemory, match="needs 4.6 GiB in float32 and cpu has 1.0 GiB free"):
        random_models.build("llama-3.2-1b", torch.device("cpu"), torch.float32)
    with pytest.raises(UserError, match="GPU measurement tool"):
        random_models.build("llama-3.1-8b", torch.device("cpu"), torch.bfloat16)


def test_synthetic_drafter_paced_by_a_draft_model_pays_its_passes(llama_pair):
    target, draft, tok = llama_pair
    ids = prompt_ids(tok, PROMPTS[0])
    reference = run_baseline(target, tok, ids, 40, eos=()).token_ids
    free = run_spec(target, tok, ids, Synthetic(len(ids), reference, 0.8, 384), 4, 40, eos=())
    paced = run_spec(target, tok, ids, Synthetic(len(ids), reference, 0.8, 384, pace=DraftModel(draft, 384)), 4, 40,
                     eos=())  # fmt: skip
    assert paced.token_ids == free.token_ids == reference
    assert [s.drafted for s in paced.steps] == [s.drafted for s in free.steps]  # the same draws
    assert free.metrics.draft_passes == 0 < paced.metrics.draft_passes
    assert paced.metrics.draft_passes == sum(len(s.drafted) for s in paced.steps)


def test_cli_runs_a_random_pair_offline(capsys):
    pair = ["--target", "random:smollm2-135m", "--drafter", "synthetic", "--draft", "random:smollm2-135m"]
    code = main(["run", *pair, "--alpha", "0.8", "--gamma", "5", "--max-new-tokens", "12", "--prompt", "hi", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["identical"] is True
    spec = data["speculative"]["metrics"]
    assert spec["new_tokens"] == 12 and spec["draft_passes"] > 0 and spec["cost_ratio_c"] > 0

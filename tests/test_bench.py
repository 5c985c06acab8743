"""Sweeps, the predictor, reports, the HF comparison and the synthetic drafter, on tiny models."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from engine.__main__ import main
from engine.decoding.drafters import Synthetic
from engine.decoding.metrics import leviathan_speedup
from engine.decoding.sampling import SamplingConfig
from engine.measure import bench, hfcompare, predict, report
from engine.measure.bench import Cell, Sample
from engine.settings import Settings


@pytest.fixture
def base(model_dirs):
    return Settings(target=model_dirs["target"], draft=model_dirs["draft"], drafter="draft-model", max_new_tokens=12,
                    seed=0)  # fmt: skip


def test_sweep_returns_the_complete_grid(base):
    prompts = {"copy": ["abc abc abc"], "free": ["hello there", "one two"]}
    data = bench.sweep(base, prompts, [1, 3], [0.0, 0.8], ["draft-model", "prompt-lookup"], repeats=2)
    cells = data["cells"]
    assert [(c["drafter"], c["temperature"], c["gamma"]) for c in cells] == [
        (d, t, g) for d in ("draft-model", "prompt-lookup") for t in (0.0, 0.8) for g in (1, 3)
    ]
    for c in cells:
        assert c["speedup"]["n"] == 3 * 2  # prompts x repeats
        assert c["speedup"]["min"] <= c["speedup"]["median"] <= c["speedup"]["max"]
        assert set(c["by_category"]) == {"copy", "free"}
        # greedy pairs identical; sampled ones are not compared
        assert c["all_identical"] is (True if c["temperature"] == 0 else None)
    assert len(data["samples"]) == 8 * 6
    assert {s["order"] for s in data["samples"]} == {"AB", "BA"}
    assert len(data["fits"]) == 4
    for fit in data["fits"]:
        assert len(fit["curve"]) == predict.MAX_GAMMA and fit["verdict"]
    assert data["environment"]["torch"] == torch.__version__


def test_sweep_loads_the_draft_when_its_first_cell_comes_up(base):
    """A sweep that starts with a drafter needing no model loads the draft when a cell that uses it comes up."""
    data = bench.sweep(base, {"p": ["abc abc"]}, [2], [0.0], ["prompt-lookup", "draft-model", "synthetic"], repeats=1)
    assert [c["drafter"] for c in data["cells"]] == ["prompt-lookup", "draft-model", "synthetic"]
    assert all(c["all_identical"] for c in data["cells"])


def test_sweep_rejects_bad_settings_before_measuring(base):
    from engine.errors import UserError

    with pytest.raises(UserError, match="gamma 0"):
        bench.sweep(base, {"p": ["hi"]}, [2, 0], [0.0], ["draft-model"])
    with pytest.raises(UserError, match="temperature 9"):
        bench.sweep(base, {"p": ["hi"]}, [2], [9.0], ["draft-model"])


def test_predictor_formulas_against_hand_computed_values():
    assert predict.expected_tokens([], 0.5, 2) == pytest.approx(1.75)
    assert predict.expected_tokens([0.9, 0.5], 0.1, 3) == pytest.approx(1 + 0.9 + 0.45 + 0.045)
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert leviathan_speedup(1.0, 4, 0.0) == 5.0
    assert predict.interpolate({4: 1.5}, 2) == pytest.approx(1.25)
    assert predict.interpolate({4: 1.5}, 8) == pytest.approx(2.0)
    assert predict.interpolate({2: 1.2, 4: 1.6}, 3) == pytest.approx(1.4)
    # noise that makes a longer pass look cheaper is flattened, and extrapolation never falls
    assert predict.interpolate({2: 1.5, 4: 1.3}, 4) == pytest.approx(1.5)
    assert predict.interpolate({2: 1.5, 4: 1.3}, 8) == pytest.approx(1.5 + 0.15 * 4)
    assert predict.predict([], 0.8, 0.1, {4: 1.0}, 4) == pytest.approx(leviathan_speedup(0.8, 4, 0.1))


def _sample(gamma, alpha, speedup, c=0.1, verify=1.2):
    drafted = 100 * gamma
    return Sample(0, 0, "AB", 10.0, 10.0 * speedup, speedup, alpha, 1 + gamma * alpha, 50, True, "identical",
                  baseline_step_s=0.1, draft_token_s=0.1 * c, verify_pass_s=0.1 * verify,
                  drafted=drafted, accepted=round(drafted * alpha),
                  positions=[[100, round(100 * alpha)] for _ in range(gamma)])  # fmt: skip


def test_fit_names_the_best_measured_gamma_and_its_alpha_and_costs():
    cells = [Cell("draft-model", g, 0.0, [_sample(g, 0.8, s)], ["all"]) for g, s in ((2, 1.6), (4, 1.9), (8, 1.7))]
    fit = predict.fit(cells)
    assert fit["best_gamma"] == 4 and fit["best_speedup"] == pytest.approx(1.9)
    assert fit["alpha"] == pytest.approx(0.8) and fit["cost_ratio_c"] == pytest.approx(0.1)
    assert [v["cost"] for v in fit["verify_cost"]] == pytest.approx([1.2, 1.2, 1.2])
    assert fit["curve"][3]["predicted"] == pytest.approx(predict.expected_tokens([], 0.8, 4) / (0.4 + 1.2))
    assert fit["verdict"].startswith("use gamma 4")


def test_fit_says_plainly_when_nothing_wins():
    cells = [Cell("draft-model", g, 0.0, [_sample(g, 0.3, 0.7, c=0.6)], ["all"]) for g in (1, 2)]
    verdict = predict.fit(cells)["verdict"]
    assert verdict.startswith("break-even: this pair cannot win here because")
    assert "c = 0.60" in verdict


def test_report_round_trip_and_snippets(base, tmp_path):
    data = bench.sweep(base, {"p": ["abc abc"]}, [2, 3], [0.0], ["draft-model"], repeats=1)
    paths = report.write(data, tmp_path)
    assert report.read(paths["json"]) == json.loads(json.dumps(data))
    assert report.read(paths["json"]) == data
    csv_text = paths["csv"].read_text().splitlines()
    assert csv_text[0].startswith("drafter,gamma") and len(csv_text) == 1 + 2 * 2
    snippets = report.snippets(data)
    best = report.best_setting(data)["gamma"]
    assert f"num_assistant_tokens={best}" in snippets["transformers"]
    assert f'"num_speculative_tokens": {best}' in snippets["vllm"]
    assert f"--spec-type draft-simple --spec-draft-n-max {best}" in snippets["llama.cpp"]
    assert "--draft-max" not in snippets["llama.cpp"]  # removed from llama.cpp in 2026
    assert "Best setting" in paths["settings"].read_text()


def _cell(drafter: str, gamma: int, speedup: float) -> dict:
    return {"drafter": drafter, "gamma": gamma, "temperature": 0.0, "speedup": {"median": speedup}}


def test_exports_name_real_models_and_never_a_synthetic_cell():
    from engine.settings import BUNDLED

    data = {"settings": {"target": BUNDLED, "draft": "", "ngram": 2},
            "cells": [_cell("synthetic", 5, 3.0), _cell("prompt-lookup", 4, 1.8)]}  # fmt: skip
    assert report.best_setting(data)["drafter"] == "prompt-lookup"  # the faster synthetic cell is a measuring tool
    snippets = report.snippets(data)
    assert 'LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct"' in snippets["vllm"] and "bundled" not in snippets["vllm"]
    assert '"prompt_lookup_max": 2' in snippets["vllm"]
    assert snippets["llama.cpp"] == (
        "llama-server -m SmolLM2-135M-Instruct.gguf --spec-type ngram-simple --spec-ngram-simple-size-n 2 "
        "--spec-ngram-simple-size-m 4"  # ngram-simple drafts its m-gram: --spec-draft-n-max is not its length
    )
    only_synthetic = data | {"cells": [_cell("synthetic", 5, 3.0)]}
    assert report.snippets(only_synthetic) == {} and "only synthetic" in report.snippets_markdown(only_synthetic)


def test_cli_bench_writes_valid_json(model_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--target", model_dirs["target"], "--drafter", "prompt-lookup", "--prompt", "ab ab ab",
                 "--gamma", "1,2", "--temperature", "0", "--repeats", "1", "--max-new-tokens", "8",
                 "--json", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert [c["gamma"] for c in data["cells"]] == [1, 2]
    assert "speedup (min-max)" in capsys.readouterr().out


def test_cli_bench_says_what_strict_mode_did(model_dirs, tmp_path, capsys):
    """bfloat16 with strict mode on: the header says whether the verify passes were padded or needed no padding, as
    `run` and the page say it (strict mode is settled at the first run, after the environment was read at load)."""
    from engine.__main__ import strict_words

    out = tmp_path / "bench.json"
    assert main(["bench", "--target", model_dirs["target"], "--drafter", "prompt-lookup", "--prompt", "ab ab ab",
                 "--gamma", "2", "--dtype", "bfloat16", "--strict", "on", "--repeats", "1", "--max-new-tokens", "8",
                 "--json", str(out)]) == 0  # fmt: skip
    strict = json.loads(out.read_text())["environment"]["strict"]
    assert strict["setting"] == "on" and (strict.get("exact") or strict["width"] >= 3)
    assert strict_words(strict).startswith("strict mode") and strict_words(strict) in capsys.readouterr().out


def test_cli_hf_comparison_writes_valid_json(model_dirs, tmp_path, capsys):
    out = tmp_path / "hf.json"
    code = main(["bench", "--compare", "hf", "--target", model_dirs["target"], "--drafter", "prompt-lookup",
                 "--prompt", "ab ab ab", "--gamma", "2", "--repeats", "1", "--max-new-tokens", "8",
                 "--json", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "compare_hf" and data["settings"]["temperature"] == 0.0
    assert set(data["ratios"]) == set(hfcompare.RATIOS)
    printed = capsys.readouterr().out
    assert "ours_spec_over_hf_assisted" in printed and "ours speculative = ours baseline in 1 of 1" in printed


def test_the_hf_comparison_says_which_outputs_parted():
    """One "all identical: NO" hid whether a speculative run parted from its own baseline or the two engines did."""
    from engine.__main__ import identical_words

    def row(ours: bool, hf: bool, engines: bool) -> dict:
        return {"identical": dict(zip(hfcompare.PAIRS, (ours, hf, engines)))}

    assert identical_words([row(True, True, True)] * 2).endswith("in 2 of 2: all identical")
    engines = identical_words([row(True, True, False), row(True, True, True)])
    assert "ours baseline = HF generate() in 1 of 2" in engines and "each engine lossless" in engines
    ours = identical_words([row(False, True, True), row(True, True, True)])
    assert "ours speculative = ours baseline in 1 of 2" in ours and "ours speculative = ours baseline parted" in ours
    assert "HF assisted" not in ours.split(":", 1)[1].split("parted")[0]
    assert "draws" in identical_words([row(False, False, False)], temperature=0.8)


def test_cli_bench_rejects_a_bad_gamma_list(model_dirs, capsys):
    assert main(["bench", "--target", model_dirs["target"], "--gamma", "1,x"]) == 2
    assert "comma-separated" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_hf_comparison_reports_every_contender(base, drafter):
    data = hfcompare.compare_hf(replace(base, drafter=drafter, gamma=3), ["abc abc abc"], repeats=2)
    assert set(data["speeds"]) == set(hfcompare.CONTENDERS)
    assert set(data["ratios"]) == set(hfcompare.RATIOS)
    for row in data["runs"]:
        assert row["all_identical"]  # greedy: HF and ours agree token for token
        assert all(row["identical"].values()) and set(row["identical"]) == set(hfcompare.PAIRS)
        assert row["ours_predicted_speedup"] > 0  # both drafters draft on this prompt: alpha and c are measured
    assert data["runs"][0]["order"] != data["runs"][1]["order"]


def test_synthetic_drafter_accepts_at_rate_alpha():
    reference = list(range(10, 410))
    for alpha in (0.3, 0.8):
        drafter = Synthetic(prompt_len=5, reference=reference, alpha=alpha, vocab_size=1000, seed=1)
        right = total = 0
        for start in range(0, 400, 4):
            proposal = drafter.propose([0] * (5 + start), 4, SamplingConfig(), torch.Generator()).tokens
            right += sum(p == t for p, t in zip(proposal, reference[start : start + 4]))
            total += 4
        bound = 4.5 * math.sqrt(alpha * (1 - alpha) / total)
        assert abs(right / total - alpha) < bound


def test_synthetic_drafter_in_the_loop_measures_alpha(llama_pair):
    from engine.decoding.baseline import baseline_decode
    from engine.decoding.metrics import summarise
    from engine.decoding.speculative import speculative_decode

    target, _, tok = llama_pair
    ids = list(tok("The cat sat")["input_ids"][:-1])
    greedy = SamplingConfig()
    reference = summarise("b", list(baseline_decode(target, tok, ids, greedy, 200, set())), "").token_ids
    drafter = Synthetic(len(ids), reference, 0.6, 384, seed=2)
    result = summarise("s", list(speculative_decode(target, tok, ids, drafter, greedy, 200, set())), "")
    m = result.metrics
    tested = m.accepted_tokens / m.alpha  # draft tokens the target actually judged
    assert abs(m.alpha - 0.6) < 4.5 * math.sqrt(0.24 / tested)
    assert m.acceptance_rate < m.alpha  # untested tokens after a rejection count against the plain rate
    assert result.token_ids == reference


def test_adaptive_prompt_lookup_drafts_past_gamma_and_stays_identical(base, monkeypatch):
    from engine.compare import compare
    from engine.models.loading import LoadedModel

    # verify costs as a GPU or a large model would measure them; timed on a tiny model under a busy test run,
    # noise alone could make long drafts look dear
    monkeypatch.setattr(LoadedModel, "verify_costs", property(lambda self: [1 + 0.02 * k for k in range(17)]))
    s = replace(base, drafter="prompt-lookup", adaptive=True, gamma=2, max_new_tokens=40)
    c = compare(s, "abc abc abc abc abc")
    assert c.identical
    lengths = [len(step.drafted) for step in c.speculative.steps]
    assert max(lengths) > s.gamma  # gamma is where a schedule starts; this drafter sizes its own drafts


def test_a_vllm_sweep_exports_the_speculative_config_it_measured():
    from engine.backends.vllm import speculative_config
    from engine.settings import BUNDLED, Settings

    data = {"settings": {"target": BUNDLED, "draft": "", "ngram": 2, "backend": "vllm"},
            "cells": [_cell("prompt-lookup", 6, 1.8)]}  # fmt: skip
    measured = speculative_config(Settings(backend="vllm", gamma=6, ngram=2), None)
    assert report.snippets(data) == {
        "vllm": f"vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config '{json.dumps(measured)}'"
    }


def test_the_backends_side_by_side_names_a_tree_apart_from_the_chain_of_the_same_gamma():
    """`bench --backends ... --topk 1,3`: the servers verify chains, ours also a tree; the tree's row says so."""
    from engine.__main__ import backends_table

    def cell(topk, positions):
        one = {"median": 1.0}
        return {"drafter": "eagle3", "gamma": 1, "temperature": 0.0, "p_min": 0.0, "topk": topk, "positions": positions,
                "acceptance_rate": {"median": 0.3}, "baseline_tps": one, "speculative_tps": one, "speedup": one}

    chain, tree = cell(1, [[10, 3]]), cell(3, [[10, 5]])
    runs = {"transformers": {"cells": [chain, tree]}, "vllm": {"cells": [chain]}}
    lines = backends_table(runs).splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [["eagle3", "1"], ["vllm", "1.0"], ["eagle3", "k3"]]
    assert lines[2].split()[-1] == "0.50" and lines[1].split()[-1] == "0.30"


def test_the_verdict_quotes_the_alpha_the_table_shows_for_the_cell_it_names():
    """A verdict read alpha 0.59 beside a table's 0.45 for the same gamma: the predictor pools every gamma of the
    fit. Each cell now carries its own alpha (kept over checked draft tokens), the cells table shows it, and the
    verdict names the cell's."""
    from app import lab

    cells = [Cell("draft-model", 2, 0.0, [_sample(2, 0.8, 1.6)], ["all"]),
             Cell("draft-model", 4, 0.0, [_sample(4, 0.5, 1.9)], ["all"])]  # fmt: skip
    fits = bench.verdicts_by_cell(predict.fit_all(cells), cells)
    assert fits[0]["alpha"] == pytest.approx(0.6)  # pooled over both cells: no cell's
    assert fits[0]["verdict"].startswith("use gamma 4: measured 1.90x (alpha 0.50,")
    rows = lab.cell_rows({"cells": [c.summary() for c in cells]})
    alpha = lab.CELL_COLUMNS.index("α")
    assert [r[1] for r in rows] == [2, 4] and [r[alpha] for r in rows] == [0.8, 0.5]
    assert fits[0]["verdict_alpha"] == {"gamma": 4, "alpha": pytest.approx(0.5)}


def test_a_refused_sweep_leaves_no_earlier_results_and_load_shows_only_on_vllm(model_dirs):
    """A sweep refused (or started) empties the verdict, tables, charts and files of the one before, so that its
    status line is not read beside another sweep's results. The "under load" chart and table, and the concurrency
    field, are shown for vLLM alone: the in-process engine and llama-server (one slot) have no load axis."""
    from types import SimpleNamespace

    import gradio as gr

    from app import lab
    from tests.test_app import lab_form, plain

    outputs = []
    with pytest.raises(gr.Error):
        for out in lab.run_sweep([2], "hot", ["prompt-lookup"], ["code"], 1, 1, 8, "", "0",
                                 request=SimpleNamespace(session_hash="lab-refused"), **lab_form(model_dirs)):
            outputs.append(out)  # fmt: skip
    (uses, verdict, cells, curve, chart, categories, load_chart, load_rows, snippets, files, status, mark), = outputs
    assert (verdict, cells, curve, chart, categories, load_chart, load_rows, snippets, files) == \
        ("", [], None, None, [], None, [], "", None)  # fmt: skip
    assert plain(status) == "not started: check temperatures, as marked" and "write numbers separated by commas" in mark
    for backend, shown in (("vllm", True), ("transformers", False), ("llama.cpp", False)):
        assert [u["visible"] for u in lab.load_visible(backend)] == [shown, shown]
    with pytest.raises(Exception, match="batches requests"):
        lab.plan([2], "0", ["prompt-lookup"], ["code"], 1, 1, 8, "1,2", "0", lab_form(model_dirs, backend="llama.cpp"))


def test_a_dspark_head_exports_llama_cpp_with_its_confidence_stop_and_vllm_for_a_gpu():
    data = {"settings": {"target": "org/target", "draft": "/heads/dspark-head", "backend": "transformers"},
            "cells": [_cell("dspark", 4, 1.6) | {"p_min": 0.6}]}  # fmt: skip
    snippets = report.snippets(data)
    assert set(snippets) == {"vllm", "llama.cpp"}  # no SGLang line: not checked that it serves one
    assert '"method": "dspark"' in snippets["vllm"] and "CPU build refuses DSpark" in snippets["vllm"]
    assert snippets["llama.cpp"].endswith("--spec-type draft-dspark --spec-draft-n-max 4 --spec-draft-p-min 0.6")


def test_a_dflash2_head_exports_vllm_for_a_gpu_and_llama_cpp_from_its_flat_config():
    data = {"settings": {"target": "org/target", "draft": "/heads/dflash2-head", "backend": "transformers"},
            "cells": [_cell("dflash2", 3, 1.4)]}  # fmt: skip
    snippets = report.snippets(data)
    assert set(snippets) == {"vllm", "llama.cpp"}
    assert '"method": "dflash"' in snippets["vllm"] and "CPU build refuses DFlash2" in snippets["vllm"]
    assert "flat layout" in snippets["llama.cpp"] and snippets["llama.cpp"].endswith("--spec-type draft-dflash "
                                                                                     "--spec-draft-n-max 3")

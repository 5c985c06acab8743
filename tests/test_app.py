"""App handlers called directly on tiny models: streaming, rendering, escaping, stop, history."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import gradio as gr
import pytest

from app import charts, handlers, render
from engine.metrics import StepEvent


def ui_values(model_dirs, **over):
    values = dict(
        prompt="abc abc abc abc", target=model_dirs["target"], drafter="draft-model", draft=model_dirs["draft"],
        temperature=0, top_p=1, top_k=0, max_new_tokens=30, gamma=3, seed=0, chat=True, dtype="auto",
        ngram=3, alpha=0.8, adaptive=False, history=[],
    )  # fmt: skip
    values.update(over)
    return values


def run_handler(values, session="s1"):
    return list(handlers.compare(**values, request=SimpleNamespace(session_hash=session)))


def test_compare_streams_and_ends_with_a_lossless_result(model_dirs):
    outputs = run_handler(ui_values(model_dirs))
    assert len(outputs) > 3  # loading, warm-up, streaming updates, final
    result, status, base_pane, spec_pane, summary, chart, history, table, files = outputs[-1]
    assert result["identical"] is True
    assert result["baseline"]["text"] == result["speculative"]["text"]
    assert result["speculative"]["metrics"]["new_tokens"] == 30
    assert "sa-acc" in spec_pane and ("sa-cor" in spec_pane or "sa-bon" in spec_pane)
    assert "outputs identical" in summary
    assert len(history) == 1 and history[0][1] == model_dirs["target"]
    figure = json.loads(chart.plot)
    assert {t["type"] for t in figure["data"]} == {"scatter", "bar"}
    run_json, history_csv = files
    saved = json.loads(open(run_json).read())
    assert {"settings", "environment", "baseline", "speculative"} <= set(saved)
    assert saved["speculative"]["steps"] and saved["environment"]["torch"]
    assert open(history_csv).read().startswith("time,target,drafter")


def test_history_accumulates_across_runs(model_dirs):
    first = run_handler(ui_values(model_dirs, max_new_tokens=5))[-1][6]
    second = run_handler(ui_values(model_dirs, max_new_tokens=5, drafter="prompt-lookup", history=first))[-1][6]
    assert [row[2] for row in second] == ["draft-model", "prompt-lookup"]


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(prompt="  "), "prompt is empty"),
        (dict(gamma=0), "gamma 0 is out of range"),
        (dict(temperature=2.5), "temperature"),
        (dict(top_k=1.5), "not a whole number"),
        (dict(target="/no/such/dir"), "operator's models folder"),
        (dict(draft=""), "needs a draft model"),
    ],
)
def test_bad_input_raises_a_clear_gradio_error(model_dirs, over, message):
    with pytest.raises(gr.Error) as err:
        run_handler(ui_values(model_dirs, **over))
    assert message in str(err.value)


def test_mismatched_vocabulary_is_reported(model_dirs):
    with pytest.raises(gr.Error) as err:
        run_handler(ui_values(model_dirs, draft=model_dirs["other-vocab"]))
    assert "vocabulary" in str(err.value)


def test_stop_ends_this_session_only(model_dirs):
    values = ui_values(model_dirs, max_new_tokens=200, prompt="stop me")
    seen, done = [], threading.Event()

    def consume():
        for out in handlers.compare(**values, request=SimpleNamespace(session_hash="stopper")):
            seen.append(out)
            if "running baseline" in str(out[1]) and handlers.STOPS.stop("other-session") is False:
                handlers.STOPS.stop("stopper")
        done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert done.wait(120)
    result = seen[-1][0]
    assert result["baseline"]["metrics"]["finish_reason"] == "stopped"
    assert result["baseline"]["metrics"]["new_tokens"] < 200
    assert "stopped by user" in seen[-1][1]
    # the next run is unaffected
    assert run_handler(ui_values(model_dirs, max_new_tokens=4), "stopper")[-1][0]["identical"] is True


def test_model_output_is_escaped():
    evil = "<script>alert(1)</script>"
    step = StepEvent(1, "correction", [5, 6], ['<img src=x onerror="x">', evil], drafted=[5, 9], p=[0.9, 0.1],
                     q=[0.8, 0.7], accepted=1, rejected_pieces=["<b>"], token=6, token_p=0.5)  # fmt: skip
    html = render.speculative_tokens([step]) + render.baseline_tokens([step])
    assert "<script>" not in html and "<img" not in html and "<b>" not in html
    assert "&lt;script&gt;" in html and "sa-rej" in html


def test_colours_follow_token_origin():
    steps = [
        StepEvent(0, "prefill", [1], ["a"], token=1, token_p=0.9),
        StepEvent(1, "bonus", [2, 3, 4], ["b", "c", "d"], drafted=[2, 3], p=[0.9, 0.8], q=[1, 1], accepted=2,
                  token=4, token_p=0.7),
        StepEvent(2, "correction", [5], ["e"], drafted=[9, 9], p=[0.1, 0.2], q=[1, 1], accepted=0,
                  rejected_pieces=["x", "y"], token=5, token_p=0.6),
    ]  # fmt: skip
    html = render.speculative_tokens(steps)
    assert html.count("sa-acc") == 2 and html.count("sa-bon") == 1 and html.count("sa-cor") == 1
    assert html.count("sa-rej") == 2 and html.count("sa-tgt") == 1
    assert "p=0.900 q=1.000" in html


def test_clear_and_presets_and_memory_chart():
    assert handlers.clear()[0] == {}
    target, drafter, draft, gamma, dtype, alpha, note = handlers.apply_preset(
        "Qwen2.5-7B-Instruct + Qwen2.5-0.5B-Instruct (GPU)"
    )
    assert (target, drafter, draft) == ("Qwen/Qwen2.5-7B-Instruct", "draft-model", "Qwen/Qwen2.5-0.5B-Instruct")
    samples = [{"t": 0.0, "used_mb": 10.0}, {"t": 1.0, "used_mb": 12.0}]
    figure = charts.memory_figure(samples, "process RSS", {"bundled": 513.0})
    assert figure["data"][0]["y"] == [10.0, 12.0]
    assert figure["data"][1]["name"] == "weights: bundled" and figure["data"][1]["y"] == [513.0, 513.0]
    assert json.loads(handlers.memory_tick().plot)["layout"]["title"]["text"].startswith("memory")


def test_lab_sweep_handler_fills_tables_charts_and_report(model_dirs):
    from app import lab

    out = lab.run_sweep(
        model_dirs["target"], model_dirs["draft"], "auto", True, 3, 0.8, 1.0, 0, 0, [1, 2], "0, 0.5",
        ["draft-model", "prompt-lookup"], ["rewriting", "creative_writing"], 1, 1, 8,
        request=SimpleNamespace(session_hash="lab"), progress=lambda *a, **k: None,
    )  # fmt: skip
    verdicts, cells, curve, categories_chart, categories, snippets, files = out
    assert verdicts.count("- **") == 4  # a fit per drafter and temperature
    assert len(cells) == 2 * 2 * 2
    assert {row[0] for row in categories} == {"rewriting", "creative_writing"}
    assert len(curve.data) == 3 * 4 and len(categories_chart.data) == 2
    assert "## transformers" in snippets
    assert sorted(p.rsplit("/", 1)[1] for p in files) == ["charts.html", "report.csv", "report.json", "settings.md"]
    charts_html = open(next(p for p in files if p.endswith("charts.html"))).read()
    assert charts_html.count("Plotly.newPlot") == 2


def test_lab_sweep_reports_bad_settings(model_dirs):
    from app import lab

    with pytest.raises(gr.Error, match="temperatures"):
        lab.run_sweep(model_dirs["target"], "", "auto", True, 3, 0.8, 1.0, 0, 0, [1], "hot", ["prompt-lookup"],
                      ["code"], 1, 1, 8, request=SimpleNamespace(session_hash="lab"), progress=print)  # fmt: skip
    with pytest.raises(gr.Error, match="at least one"):
        lab.run_sweep(model_dirs["target"], "", "auto", True, 3, 0.8, 1.0, 0, 0, [], "0", ["prompt-lookup"],
                      ["code"], 1, 1, 8, request=SimpleNamespace(session_hash="lab"), progress=print)  # fmt: skip


def test_out_of_memory_in_generation_is_reported_and_the_next_run_works(model_dirs, monkeypatch):
    import torch

    import engine.speculative

    real = engine.speculative.forward
    calls = {"n": 0}

    def flaky(model, ids, cache, keep=0):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, ids, cache, keep)

    monkeypatch.setattr(engine.speculative, "forward", flaky)
    with pytest.raises(gr.Error) as err:
        run_handler(ui_values(model_dirs, max_new_tokens=10))
    assert "ran out of memory" in str(err.value) and "next run can go ahead" in str(err.value)
    assert run_handler(ui_values(model_dirs, max_new_tokens=6))[-1][0]["identical"] is True


def test_out_of_memory_while_loading_evicts_and_retries(model_dirs, monkeypatch):
    import engine.models as models
    from engine.errors import OutOfMemory

    cache = models.ModelCache(max_models=3)
    cache.get(model_dirs["draft"])
    real, calls = models._load, {"n": 0}

    def tight(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OutOfMemory("out of memory while loading: try a smaller dtype")
        return real(*args)

    monkeypatch.setattr(models, "_load", tight)
    loaded = cache.get(model_dirs["target"])
    assert loaded.params > 0 and [m.spec for m in cache.loaded()] == [model_dirs["target"]]


def test_model_cache_respects_its_memory_budget(model_dirs):
    from engine.models import ModelCache

    one = ModelCache(max_models=5).get(model_dirs["target"])
    budget_gb = 1.5 * one.params * 4 / 1024**3  # room for one float32 copy, not two
    cache = ModelCache(max_models=5, budget_gb=budget_gb)
    cache.get(model_dirs["target"])
    cache.get(model_dirs["draft"])
    assert [m.spec for m in cache.loaded()] == [model_dirs["draft"]]


def test_the_queue_polls_for_work_every_50_ms_not_every_millisecond():
    """The app sets Gradio's queue polling through attributes Gradio may rename; fail here if it does."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("entry", Path(__file__).resolve().parent.parent / "app.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)  # builds the page; launching is left to __main__
    queue = entry.demo._queue
    assert (queue.sleep_when_free, queue.progress_update_sleep_when_free) == (0.05, 0.1)

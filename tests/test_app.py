"""App handlers called directly on tiny models: streaming, rendering, escaping, stop, history."""

from __future__ import annotations

import html
import json
import re
import threading
from dataclasses import replace
from types import SimpleNamespace

import gradio as gr
import pytest

from app import charts, handlers, render
from engine.decoding.metrics import StepEvent
from engine.events import RunStarts, Status
from engine.settings import LABELS


def ui_values(model_dirs, **over):
    values = dict(
        prompt="abc abc abc abc", target=model_dirs["target"], drafter="draft-model", draft=model_dirs["draft"],
        temperature=0, top_p=1, top_k=0, max_new_tokens=30, gamma=3, seed=0, chat=True, dtype="auto",
        ngram=3, alpha=0.8, adaptive=False, history=[],
    )  # fmt: skip
    values.update(over)
    return values


FIELD_ERROR, AGAIN, SIDEBAR = 9, 10, 11  # positions in the handler's outputs (after result ... downloads)
SHOWN = SIDEBAR + 1 + len(handlers.GROUPS)  # the last: what the panes, summary and chart show at the run's end


def plain(html: str) -> str:
    """The text of a status line (HTML)."""
    return re.sub(r"<[^>]+>", "", html or "")


def run_handler(values, session="s1"):
    return list(handlers.compare(**values, request=SimpleNamespace(session_hash=session)))


def run_until_error(values, session="s1"):
    """The outputs the handler yielded before it raised, and the error."""
    outputs = []
    with pytest.raises(gr.Error) as err:
        for out in handlers.compare(**values, request=SimpleNamespace(session_hash=session)):
            outputs.append(out)
    return outputs, err.value


def test_settings_have_one_named_shape_across_form_api_and_cli():
    from engine.__main__ import parser, settings_from
    from engine.settings import Settings

    # the form and the API carry every setting but the operator's
    assert set(handlers.API_FIELDS) == set(Settings.names()) - {"device", "compile", "warmup"}
    args = parser().parse_args(["run", "--prompt", "x", "--gamma", "6", "--temperature", "0.5", "--seed", "3"])
    cli = settings_from(args)
    form = Settings.from_form(gamma=6.0, temperature=0.5, seed=3.0, draft=None, chat=None)
    assert cli == form  # the same Settings from command-line strings and from form floats


def test_compare_streams_and_ends_with_a_lossless_result(model_dirs):
    outputs = run_handler(ui_values(model_dirs))
    assert len(outputs) > 3  # loading, warm-up, streaming updates, final
    assert {len(out) for out in outputs} == {SHOWN + 1}  # one value per output, each time
    result, status, base_pane, spec_pane, summary, chart, history, table, files, error, again, *opens, shown = \
        outputs[-1]  # fmt: skip
    assert shown == (base_pane, spec_pane, summary, chart)  # what a refused press later puts back
    status = plain(status)
    assert result["identical"] is True and result["status"] == "done"
    assert result["baseline"]["text"] == result["speculative"]["text"]
    assert result["speculative"]["metrics"]["new_tokens"] == 30
    assert "sa-acc" in spec_pane and ("sa-cor" in spec_pane or "sa-bon" in spec_pane)
    assert "outputs identical" in summary
    # where it was measured, from the run's own environment: device, dtype, the linear forms that ran
    env = result["environment"]
    assert f"measured on {env['device_name']}" in summary and f"linears: {env['linear_forms']}" in summary
    # and which numerics: over our fused kernels every row rounds as a one-token pass, so strict mode pads nothing
    words = "strict mode not needed" if env["strict"].get("exact") else "strict mode off"
    assert words in summary, env["strict"]
    assert status.startswith("run 1 · done in ") and error == ""
    assert len(history) == 1 and history[0][1].startswith("done") and history[0][2] == model_dirs["target"]
    figure = json.loads(chart.plot)
    assert {t["type"] for t in figure["data"]} == {"scatter", "bar"}
    run_json, history_csv = files
    saved = json.loads(open(run_json).read())
    assert {"status", "settings", "prompt", "environment", "baseline", "speculative"} <= set(saved)
    assert saved["speculative"]["steps"] and saved["environment"]["torch"]
    assert open(history_csv).read().startswith("time,status,target,drafter")


def test_history_accumulates_across_runs(model_dirs):
    first = run_handler(ui_values(model_dirs, max_new_tokens=5))[-1][6]
    second = run_handler(ui_values(model_dirs, max_new_tokens=5, drafter="prompt-lookup", history=first))[-1]
    assert [row[3] for row in second[6]] == ["draft-model", "prompt-lookup"]
    assert plain(second[1]).startswith("run 2 · done")


@pytest.mark.parametrize(
    "over, field, message",
    [
        (dict(prompt="  "), "prompt", "prompt is empty"),
        (dict(gamma=0), "gamma", "gamma 0 is out of range"),
        (dict(temperature=2.5), "temperature", "temperature 2.5 is out of range"),
        (dict(temperature=None), "temperature", "temperature is empty"),
        (dict(top_k=1.5), "top_k", "not a whole number"),
        (dict(max_new_tokens=100000), "max_new_tokens", "max new tokens 100000 is out of range"),
        (dict(drafter="bogus"), "drafter", "'bogus' is unknown"),
        (dict(target="/no/such/dir"), "target", "operator's models folder"),
        (dict(draft=""), "draft", "draft model or head is empty"),
        (dict(alpha="lots"), "alpha", "is not a number"),
    ],
)
def test_bad_input_names_its_field_in_the_error_and_on_the_form(model_dirs, over, field, message):
    outputs, err = run_until_error(ui_values(model_dirs, **over))
    assert message in str(err) and f"(field: {field})" in str(err)
    marked = outputs[-1][FIELD_ERROR]  # the field-error output: the message on that field, and a red outline
    assert f'data-field="{field}"' in marked and f"#field-{field}" in marked and "outline" in marked
    # the message itself is page text (put under the field by render.FIELD_MESSAGES), not drawn by CSS
    assert message in html.unescape(marked) and "::after" not in marked and "content:" not in marked
    assert plain(outputs[-1][1]) == f"not started: check {LABELS[field]}, as marked"  # no run was counted; once
    opened = outputs[-1][SIDEBAR:SHOWN]  # the sidebar and the group that hold the field open, so its message shows
    if field != "prompt":
        assert opened[0]["open"] is True
        group = handlers.GROUP_OF.get(field)
        for name, update in zip(handlers.GROUPS, opened[1:]):
            assert (isinstance(update, dict) and update.get("open") is True) == (name == group), (name, update)


def test_a_value_refused_while_opening_the_pair_counts_no_run(model_dirs):
    """A prompt past the context is found once the pair is open: refused like any field, not counted as a run."""
    outputs, err = run_until_error(ui_values(model_dirs, prompt="x" * 300))  # past the tiny model's 256 tokens
    assert "context of 256 tokens" in str(err) and "(field: prompt)" in str(err)
    status, history, error = plain(outputs[-1][1]), outputs[-1][6], outputs[-1][FIELD_ERROR]
    assert status == "not started: check prompt, as marked" and 'data-field="prompt"' in error
    assert "context" not in status  # the message sits under the field only
    assert isinstance(history, type(gr.skip())) or history == []  # no row: nothing ran
    assert plain(run_handler(ui_values(model_dirs, max_new_tokens=4))[-1][1]).startswith("run 1 · done")


def test_a_value_refused_while_opening_the_pair_keeps_the_last_result(model_dirs):
    """Issue 57.5: a press refused once the pair has begun to open (here a prompt past the context) puts back what
    the panes, the summary and the chart showed, and leaves the chart alone while it opens; Clear forgets it."""
    shown = run_handler(ui_values(model_dirs, max_new_tokens=4))[-1][SHOWN]
    assert "outputs identical" in shown[2]
    outputs, _ = run_until_error(ui_values(model_dirs, prompt="x" * 300, shown=shown))
    base_pane, spec_pane, summary, chart = outputs[-1][2:6]
    assert (base_pane, spec_pane, summary, chart) == shown
    assert all(isinstance(out[5], type(gr.skip())) for out in outputs[:-1])  # no empty chart while it opened
    assert isinstance(outputs[-1][SHOWN], type(gr.skip()))  # and what it keeps is the same
    # refused before the pair opens: nothing of the last run is touched
    outputs, _ = run_until_error(ui_values(model_dirs, gamma=0, shown=shown))
    assert all(isinstance(v, type(gr.skip())) for v in outputs[-1][2:9] + (outputs[-1][SHOWN],))
    # without a last result (the first press, or after Clear) the panes say "not started"
    outputs, _ = run_until_error(ui_values(model_dirs, prompt="x" * 300, shown=handlers.clear()[-1]))
    assert "not started" in outputs[-1][2] and "Run a comparison" in outputs[-1][4]


def head_folder(root, name: str, kind: str = "eagle3", target: str | None = "bundled", when: float = 0.0):
    """A head's files as app.heads reads them (config.json, and forge-report.json where the forge wrote one)."""
    import os

    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": kind}))
    if target is not None:
        (folder / "forge-report.json").write_text(json.dumps({"target": target}))
    for path in folder.iterdir():
        os.utime(path, (when, when))
    return str(folder)


def test_heads_offered_are_those_for_this_target_and_drafter_newest_first(tmp_path):
    """Issue 57.6: forged heads for the target (by date, newest first), then the presets' heads for it."""
    from app import heads
    from engine.settings import BUNDLED

    old = head_folder(tmp_path, "old", when=1_700_000_000)
    new = head_folder(tmp_path, "new", target=BUNDLED, when=1_750_000_000)
    unknown = head_folder(tmp_path, "unknown", target=None, when=1_600_000_000)
    head_folder(tmp_path, "other-target", target="Qwen/Qwen2.5-7B-Instruct", when=1_760_000_000)
    head_folder(tmp_path, "a-dflash", kind="dflash", when=1_760_000_000)
    (tmp_path / "not-a-head").mkdir()
    (tmp_path / "not-a-head" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    found = heads.offered(BUNDLED, "eagle3", tmp_path)
    assert [h.spec for h in found] == [new, old, unknown]
    assert found[0].label.startswith("forged 2025-06-") and found[0].label.endswith(" · new")
    assert "target not recorded" in found[2].label
    assert [h.spec for h in heads.offered("bundled", "dflash", tmp_path)] == [str(tmp_path / "a-dflash")]
    assert heads.offered(BUNDLED, "prompt-lookup", tmp_path) == []
    llama = heads.offered("meta-llama/Llama-3.1-8B-Instruct", "eagle3", tmp_path / "none")
    assert [h.spec for h in llama] == ["yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                       "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"]  # fmt: skip
    assert all(h.label.startswith("preset · ") for h in llama)


def test_a_head_drafter_lists_the_heads_or_points_to_the_labs_forge(tmp_path, monkeypatch):
    from engine import policy

    monkeypatch.setattr(policy, "forged_heads", lambda: tmp_path)
    listed, note = handlers.offer_heads("prompt-lookup", "bundled")
    assert listed["visible"] is False and note == ""
    listed, note = handlers.offer_heads("eagle3", "bundled")
    assert listed["visible"] is False and listed["choices"] == []
    text = plain(note)
    assert "No EAGLE-3 head for this target yet" in text and "Lab" in text and "Forge a head" in text
    assert "python -m" not in text and "meta-llama/Llama-3.1-8B-Instruct" in text  # where the presets have one
    assert "Forge a head" in plain(handlers.offer_heads("dflash", "bundled")[1])  # the forge makes DFlash heads too
    assert "load a P-EAGLE head the speculators trainer made" in plain(handlers.offer_heads("peagle", "bundled")[1])
    assert "load a DSpark head the speculators trainer made" in plain(handlers.offer_heads("dspark", "bundled")[1])
    head = head_folder(tmp_path, "mine")
    listed, note = handlers.offer_heads("eagle3", "bundled")
    assert listed["visible"] is True and [v for _, v in listed["choices"]] == [head] and note == ""
    assert handlers.head_picked(head) == head and isinstance(handlers.head_picked(None), type(gr.skip()))


def test_a_run_that_fails_is_counted(model_dirs, monkeypatch):
    import engine.decoding.speculative

    def broken(*args, **kwargs):
        raise RuntimeError("a fault of ours")

    monkeypatch.setattr(engine.decoding.speculative, "forward", broken)
    outputs, err = run_until_error(ui_values(model_dirs, max_new_tokens=6))
    status, history = plain(outputs[-1][1]), outputs[-1][6]
    assert status.startswith("run 1 · failed: the run failed unexpectedly (RuntimeError: a fault of ours)")
    assert history[0][1] == "failed"
    monkeypatch.undo()
    # the next run counts on
    assert plain(run_handler(ui_values(model_dirs, max_new_tokens=4, history=history))[-1][1]).startswith(
        "run 2 · done")


def stop_when(model_dirs, phase: str, session: str) -> list:
    """A run that is stopped once `phase` shows in its status line; its outputs."""
    values = ui_values(model_dirs, max_new_tokens=200, prompt="stop me")
    seen, done = [], threading.Event()

    def consume():
        for out in handlers.compare(**values, request=SimpleNamespace(session_hash=session)):
            seen.append(out)
            if phase in str(out[1]) and handlers.STOPS.stop("other-session") is None:
                handlers.STOPS.stop(session)
        done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert done.wait(120)
    return seen


def test_stop_in_the_baseline_ends_the_comparison_there(model_dirs):
    seen = stop_when(model_dirs, "running baseline", "stopper")
    result, status, summary, history = seen[-1][0], seen[-1][1], seen[-1][4], seen[-1][6]
    assert result["status"] == "stopped" and result["speculative"] is None  # no speculative run after a stop
    assert result["baseline"]["metrics"]["finish_reason"] == "stopped"
    assert result["baseline"]["metrics"]["new_tokens"] < 200
    assert result["identical"] is None and result["speedup"] is None
    assert "stopped" in status and "not compared" in summary and "outputs differ" not in summary
    assert history[-1][1] == "stopped" and history[-1][8] is None  # no speedup recorded
    # the next run is unaffected
    assert run_handler(ui_values(model_dirs, max_new_tokens=4), "stopper")[-1][0]["identical"] is True


def test_stop_in_the_speculative_run_is_not_a_difference(model_dirs):
    seen = stop_when(model_dirs, "running speculative", "stopper2")
    result, spec_pane, summary = seen[-1][0], seen[-1][3], seen[-1][4]
    assert result["speculative"]["metrics"]["finish_reason"] == "stopped"
    assert result["speculative"]["metrics"]["new_tokens"] < result["baseline"]["metrics"]["new_tokens"]
    assert result["identical"] is None and result["speedup"] is None
    assert "outputs differ" not in spec_pane + summary and "not compared" in summary


def test_model_output_is_escaped():
    evil = "<script>alert(1)</script>"
    step = StepEvent(1, "correction", [5, 6], ['<img src=x onerror="x">', evil], drafted=[5, 9], p=[0.9, 0.1],
                     q=[0.8, 0.7], accepted=1, rejected_pieces=["<b>"], token=6, token_p=0.5)  # fmt: skip
    html = render.speculative_tokens([step]) + render.baseline_tokens([step])
    assert "<script>" not in html and "<img" not in html and "<b>" not in html
    assert "&lt;script&gt;" in html and "sa-rej" in html


def test_an_empty_pane_says_what_is_happening_until_its_first_token():
    """Between "running baseline" and the baseline's first token the pane names the phase, not "waiting"."""
    live = handlers.Live()
    for event in (Status("loading models"), RunStarts("baseline")):
        live.add(event)
        _, base, spec, *_ = live.outputs(chart=False)
        assert f"{event.message}…" in base and "waiting…" not in base, base
    assert "starts when the baseline ends…" in spec
    assert ">running<" in base and ">not started<" in spec  # the stats beside each title


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
    # only the first rejected draft token was tested; the one after it was never checked
    assert html.count("sa-unk") == 1 and html.count(": rejected,") == 1 and "not checked" in html
    # a token with no text (EOS at the end) gets no span, not an empty coloured blob
    eos = StepEvent(3, "bonus", [7, 1], ["f", ""], drafted=[7], p=[0.9], q=[1], accepted=1, token=1, token_p=0.8)
    assert render.speculative_tokens([eos]).count("<span") == 1


def test_clear_resets_every_output_and_presets_fill_the_form(model_dirs):
    cleared = handlers.clear()
    result, status, base_pane, spec_pane, summary, chart, error, again, shown = cleared
    assert result == {} and plain(status) == "" and error == "" and again["visible"] is False and shown is None
    assert "not started" in base_pane and "not started" in spec_pane and "Run a comparison" in summary
    assert json.loads(chart.plot)["data"] == []
    values = handlers.apply_preset("Qwen2.5-7B-Instruct + Qwen2.5-0.5B-Instruct (GPU)")
    assert dict(zip(handlers.PRESET_FIELDS, values)) | {} == {
        "target": "Qwen/Qwen2.5-7B-Instruct", "drafter": "draft-model", "draft": "Qwen/Qwen2.5-0.5B-Instruct",
        "gamma": values[3], "dtype": values[4], "alpha": values[5],
    }  # fmt: skip
    assert len(values) == len(handlers.PRESET_FIELDS) + 1 and "Measured on" in values[-1]


def test_memory_chart():
    samples = [{"t": 0.0, "used_mb": 10.0}, {"t": 1.0, "used_mb": 12.0}]
    figure = charts.memory_figure(samples, "process RSS", {"bundled": 513.0})
    assert figure["data"][0]["y"] == [10.0, 12.0]
    assert figure["data"][1]["name"] == "weights: bundled" and figure["data"][1]["y"] == [513.0, 513.0]
    assert json.loads(handlers.memory_tick().plot)["layout"]["title"]["text"].startswith("memory")


def lab_form(model_dirs, **over):
    form = {k: v for k, v in ui_values(model_dirs).items() if k not in ("prompt", "history")}
    return form | over


def test_lab_sweep_handler_fills_tables_charts_and_report(model_dirs):
    from app import lab

    outputs = list(lab.run_sweep(
        [1, 2], "0, 0.5", ["draft-model", "prompt-lookup"], ["rewriting", "creative_writing"], 1, 1, 8, "", "0, 0.06",
        request=SimpleNamespace(session_hash="lab"), **lab_form(model_dirs),
    ))  # fmt: skip
    uses, verdicts, cells, curve, categories_chart, categories, load_chart, load_rows, snippets, files, *rest = \
        outputs[-1]  # fmt: skip
    assert plain(rest[0]) == "done: the results are below" and rest[1] == ""  # status line, no field marked
    assert any("sweeping, " in plain(out[lab.OUTPUTS]) for out in outputs[1:-1])  # its progress, as it goes
    assert model_dirs["target"] in uses and "dtype auto" in uses and "seed 0" in uses
    assert "2 prompt(s) × 1 A/B pair(s) = 2 samples" in uses
    assert verdicts.count("- **") == 6  # a fit per drafter, temperature and (draft model) confidence stop
    assert verdicts.count("confidence stop 0.06") == 2
    # confidence stops are an axis of the draft model only
    assert sorted((row[0], row[3]) for row in cells if row[1] == 1 and row[2] == 0) == [
        ("draft-model", 0.0), ("draft-model", 0.06), ("prompt-lookup", 0.0)]
    assert len(cells) == 2 * 2 * 3 and {row[8] for row in cells} == {2}  # samples per cell
    assert {row[-1] for row in cells if row[2] == 0.5} == {"-"}  # sampled cells are not compared
    assert {row[-1] for row in cells if row[2] == 0} == {"identical"}
    assert {row[0] for row in categories} == {"rewriting", "creative_writing"}
    assert len(curve.data) == 3 * 6 and len(categories_chart.data) == 2
    assert categories_chart.data[1].yaxis == "y2"  # acceptance on its own axis
    assert "## transformers" in snippets
    assert load_chart is None and load_rows == []  # no load curve asked for
    assert sorted(p.rsplit("/", 1)[1] for p in files) == ["charts.html", "report.csv", "report.json", "settings.md"]
    charts_html = open(next(p for p in files if p.endswith("charts.html"))).read()
    assert charts_html.count("Plotly.newPlot") == 2


def refused_sweep(*args, **over):
    """A sweep the Lab refuses: (its status line, its field mark, the API caller's error)."""
    from app import lab

    outputs = []
    with pytest.raises(gr.Error) as err:
        for out in lab.run_sweep(*args, request=SimpleNamespace(session_hash="lab"), **over):
            outputs.append(out)
    return plain(outputs[-1][lab.OUTPUTS]), outputs[-1][lab.OUTPUTS + 1], str(err.value)


def test_lab_sweep_reports_bad_settings_under_their_fields(model_dirs):
    form = lab_form(model_dirs)
    status, mark, err = refused_sweep([1], "hot", ["prompt-lookup"], ["code"], 1, 1, 8, "", **form)
    assert "temperatures 'hot'" in err and "(field: temperatures)" in err
    assert status == "not started: check temperatures, as marked" and "#lab-field-temperatures" in mark
    assert "temperatures" in mark and "write numbers" not in status  # the message once, under the field
    status, mark, err = refused_sweep([], "0", ["prompt-lookup"], ["code"], 1, 1, 8, "", **form)
    assert "at least one" in err and "#lab-field-gammas" in mark
    status, mark, err = refused_sweep([1], "0", ["prompt-lookup"], ["code"], 1, 1, 8, "1,2", **form)
    assert "needs a serving backend" in err and "(field: backend)" in err
    assert status == "not started: check backend (in the settings), as marked" and "#field-backend" in mark
    status, mark, err = refused_sweep([1], "0", ["prompt-lookup"], ["code"], 1, 1, 8, "", "high", **form)
    assert "confidence stops" in err and "#lab-field-p_mins" in mark
    status, mark, err = refused_sweep([1], "0", ["draft-model"], ["code"], 1, 1, 8, "", "1.5", **form)
    assert "draft confidence stop 1.5 is out of range" in err and "#lab-field-p_mins" in mark
    status, mark, err = refused_sweep([1], "0", ["prompt-lookup"], ["code"], 1, 1, 8, "", **lab_form(model_dirs,
                                                                                                      top_p=3))
    assert "(field: top_p)" in err and "#field-top_p" in mark


def test_out_of_memory_in_generation_is_reported_and_the_next_run_works(model_dirs, monkeypatch):
    import torch

    import engine.decoding.speculative

    real = engine.decoding.speculative.forward
    calls = {"n": 0}

    def flaky(model, ids, cache, keep=0, width=0, layers=(), tree=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, ids, cache, keep, width, layers, tree)

    monkeypatch.setattr(engine.decoding.speculative, "forward", flaky)
    with pytest.raises(gr.Error) as err:
        run_handler(ui_values(model_dirs, max_new_tokens=10))
    assert "ran out of memory" in str(err.value) and "next run can go ahead" in str(err.value)
    assert run_handler(ui_values(model_dirs, max_new_tokens=6))[-1][0]["identical"] is True


def test_out_of_memory_while_loading_evicts_and_retries(model_dirs, monkeypatch):
    import engine.models.loading as models
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
    from engine.models.loading import ModelCache

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


def test_no_rendering_lands_in_the_next_runs_clocks(model_dirs, monkeypatch):
    """Between the runs the handler draws no charts, and a run's clocks start only after the page had SETTLE
    seconds to take what was rendered before it: the UI's times to first token are the engine's."""
    import time

    from engine.backends.transformers import Transformers

    started = {}
    for mode in ("baseline", "speculative"):
        real = getattr(Transformers, mode)

        def spy(self, *args, _real=real, _mode=mode, **kwargs):
            started[_mode] = time.monotonic()  # the last call: the timed run, after the warm-up
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Transformers, mode, spy)
    rendered = {}
    for out in handlers.compare(**ui_values(model_dirs, max_new_tokens=6), request=SimpleNamespace(session_hash="t")):
        status, chart = plain(out[1]), out[5]
        for mode in ("baseline", "speculative"):
            if status.endswith(f"running {mode}") and mode not in rendered:
                rendered[mode] = time.monotonic()
                assert isinstance(chart, type(gr.skip()))  # no chart redrawn right before a run
    for mode in ("baseline", "speculative"):
        assert started[mode] - rendered[mode] >= handlers.SETTLE


def test_on_zerogpu_the_comparison_and_the_sweep_ask_for_gpu_time_in_proportion(monkeypatch):
    """With the `spaces` package, the generator Gradio calls for a comparison and the sweep function are the ones
    decorated, each with a duration from its own arguments: loading, warm-up and both runs of max new tokens."""
    import importlib
    import sys

    import app.gpu
    import app.lab
    import app.layout

    asked = []

    class FakeSpaces:
        @staticmethod
        def GPU(duration):
            def decorate(fn):
                asked.append((fn, duration))
                return fn

            return decorate

    monkeypatch.setitem(sys.modules, "spaces", FakeSpaces)
    monkeypatch.delenv("SPECARENA_GPU_SECONDS", raising=False)
    try:
        importlib.reload(app.gpu)
        importlib.reload(app.lab)
        importlib.reload(app.layout)
        app.layout.build_demo()
        decorated = {fn.__name__: duration for fn, duration in asked}
        assert set(decorated) == {"compare", "run_sweep", "run_forge"}
        forge = decorated["run_forge"]  # the Lab's forge: its budget, loading and the final measurement
        assert forge("t", 30) > forge("t", 5) > 5 * 60 and forge("t", "soon") > 0
        seconds = decorated["compare"]
        assert seconds("a prompt", [], max_new_tokens=128) < seconds("a prompt", [], max_new_tokens=2048)
        assert seconds("a prompt", [], max_new_tokens=2048) >= 2 * 2048 * app.gpu.TOKEN_S  # both runs fit
        assert seconds("a prompt", [], max_new_tokens="not a number") > 0  # bad input gets its message later
        sweep = decorated["run_sweep"]
        small = sweep([1], "0", ["prompt-lookup"], ["code"], 1, 1, 48)
        assert sweep([1, 2, 4], "0, 0.7", ["prompt-lookup"], ["code"], 1, 2, 48) > small
        monkeypatch.setenv("SPECARENA_GPU_SECONDS", "200")
        assert seconds("p", [], max_new_tokens=5) == 200
    finally:
        monkeypatch.delitem(sys.modules, "spaces")
        importlib.reload(app.gpu)
        importlib.reload(app.lab)
        importlib.reload(app.layout)
    assert app.gpu.on_gpu(len) is len  # without the package, nothing is wrapped


def test_a_warm_up_is_reused_while_model_dtype_pass_sizes_and_cache_size_stay_the_same(model_dirs):
    """Issue 32.3: the second comparison on the same pair and sizes does not warm up again; a larger cache does."""
    from engine.compare import WARM_UPS, stream_compare
    from engine.settings import Settings

    WARM_UPS.clear()
    s = Settings(target=model_dirs["target"], drafter="prompt-lookup", max_new_tokens=8, gamma=3)

    def said(settings, prompt):
        events = list(stream_compare(settings, prompt))
        return [e.message for e in events if isinstance(e, Status)], events[-1].comparison.environment["warm_up"]

    first, how = said(s, "abc abc abc")
    assert how == "done" and any(m.startswith("warming up: 8 steps of each run, once") for m in first)
    again, how = said(s, "another prompt, another length")
    assert how == "reused" and not any("warming up" in m for m in again)
    bigger, how = said(replace(s, max_new_tokens=200), "abc abc abc")  # a cache of another size: warmed anew
    assert how == "done" and any("warming up" in m for m in bigger)
    _, how = said(replace(s, gamma=5), "abc abc abc")  # wider verify passes: warmed anew
    assert how == "done"


def test_verdict_says_when_a_sample_is_too_small_and_blames_no_alpha_of_one():
    from engine.measure.predict import verdict

    small = verdict(1.0, 0.0, {1: 1.05}, 1, {1: 0.41}, {"predicted": 1.9, "gamma": 1}, pairs=1, tested=4)
    assert "too low" not in small and "its drafting steps pay" in small and "Too few samples" in small
    enough = verdict(0.3, 0.1, {1: 1.2}, 1, {1: 0.8}, {"predicted": 0.9, "gamma": 1}, pairs=4, tested=40)
    assert "brings 1.30 tokens" in enough and "Too few samples" not in enough


def test_check_pair_marks_are_ones_every_text_font_has():
    assert render.text_marks("✅ same tokenizer\n⚠️ slow\nℹ️ note\n❌ no") == "✓ same tokenizer\n⚠ slow\nℹ note\n✗ no"

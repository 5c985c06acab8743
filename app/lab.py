"""The Lab tab: sweeps over gamma, temperature and drafter, the task suite, the predictor, reports.

It reuses the Playground's pair and sampling fields, so a pair tried there is tuned here. All
measuring is engine.measure.bench; this module lays out, wires and draws.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

from app import forge_panel, jobs, prompt_sets, render
from app.gpu import on_gpu, sweep_seconds
from app.handlers import RENDER_EVERY, STOPS, session_of, settings_from
from app.jobs import api_error, job_failure
from engine import presets
from engine.errors import UserError
from engine.measure import report
from engine.measure.bench import Stopped, sweep
from engine.measure.load import load_curve
from engine.measure.report import option_label
from engine.settings import HEADS, Settings
from engine.worker import ENGINE

GAMMAS = [1, 2, 3, 4, 5, 6, 8, 12, 16]
COLORS = ["#7c3aed", "#16a34a", "#f59e0b", "#2563eb", "#dc2626", "#0ea5e9"]

HELP = """Measure whether speculation pays for this pair **on this machine**: every cell is a set of A/B pairs
(baseline and speculative one after the other, order alternating, after a warm-up), reported as the median
with its min–max spread. The predictor fits α per draft position, the draft cost c and the verify cost from
these runs and draws the expected speedup over γ. Pick one γ, one temperature and one drafter with several
categories to run the task suite. With the draft model in the sweep, synthetic α cells run its passes too,
so they show what this draft would reach at that α. Suffix cells start with an empty session memory and
run the prompts in order, each seeing the earlier prompts' outputs. The camera icon on a chart saves it as PNG; the
report's charts.html holds both charts and opens offline."""

# "α": kept over checked draft tokens, the predictor's alpha and the one the verdicts quote; "acceptance": kept over
# drafted (tokens after a rejection, never checked, count as rejected)
CELL_COLUMNS = ["drafter", "γ", "temperature", "confidence stop", "tree top-k", "speedup ×", "min", "max", "samples",
                "α", "acceptance", "base tok/s", "spec tok/s", "lossless"]  # fmt: skip
LOAD_COLUMNS = ["at a time", "speedup ×", "base tok/s", "spec tok/s", "base p50 s", "base p99 s", "spec p50 s",
                "spec p99 s"]  # fmt: skip
# "usually": where speculation usually wins or loses on such tasks (presets), not what this sweep measured
CATEGORY_COLUMNS = ["category", "speedup ×", "min", "max", "samples", "acceptance", "usually"]


def build_layout() -> SimpleNamespace:
    ui = SimpleNamespace()
    gr.Markdown(HELP)
    ui.uses = gr.Markdown(elem_id="lab-uses")
    with gr.Row():
        ui.gammas = gr.CheckboxGroup(GAMMAS, value=[1, 2, 4, 8], label="γ values", elem_id=field_id("gammas"))
        ui.temperatures = gr.Textbox("0", label="temperatures", info="comma-separated, e.g. 0, 0.7",
                                     elem_id=field_id("temperatures"))
        ui.drafters = gr.CheckboxGroup(
            [("draft model", "draft-model"), ("prompt lookup", "prompt-lookup"), ("suffix", "suffix"),
             ("synthetic α", "synthetic"), ("EAGLE-3 head", "eagle3"), ("P-EAGLE head", "peagle"),
             ("DFlash head", "dflash"), ("DSpark head", "dspark"), ("DFlash2 head", "dflash2"),
             ("MTP head", "mtp-head"),
             ("n-gram mod (llama.cpp)", "ngram-mod"), ("n-gram map-k (llama.cpp)", "ngram-map-k")],
            value=["prompt-lookup"],
            label="drafters",
            elem_id=field_id("drafters"),
        )  # fmt: skip
        ui.p_mins = gr.Textbox("0", label="confidence stops (draft model)", info="comma-separated, e.g. 0, 0.5: "
                               "stop drafting below this top probability", elem_id=field_id("p_mins"))  # fmt: skip
        ui.topks = gr.Textbox("1", label="tree widths (EAGLE-3 head)", info="comma-separated, e.g. 1, 3: candidates "
                              "per position; above 1 the head drafts a tree", elem_id=field_id("topks"))  # fmt: skip
    with gr.Row():
        ui.categories = gr.Dropdown(presets.categories(), value=["rewriting", "creative_writing"], multiselect=True,
                                    label="task categories", elem_id=field_id("categories"))  # fmt: skip
        ui.per_category = gr.Slider(1, 20, value=1, step=1, label="prompts per category",
                                    elem_id=field_id("per_category"))
        ui.repeats = gr.Slider(1, 10, value=2, step=1, label="A/B repeats per prompt", elem_id=field_id("repeats"))
        ui.max_new_tokens = gr.Slider(8, 512, value=48, step=8, label="max new tokens",
                                      elem_id=field_id("max_new_tokens"))
        ui.concurrency = gr.Textbox("", label="concurrency (vLLM backend)", placeholder="e.g. 1,2,4,8",
                                    info="requests at a time: after the sweep, a load curve of its best setting",
                                    elem_id=field_id("concurrency"), visible=False)
    ui.prompt_set = prompt_sets.build_layout()
    for name in prompt_sets.FIELDS:  # marked like the Lab's other fields
        setattr(ui, name, getattr(ui.prompt_set, name))
    with gr.Row():
        ui.run = gr.Button("Run sweep", variant="primary", elem_id="lab-run")
        ui.stop = gr.Button("Stop", variant="stop", elem_id="lab-stop")
    ui.form_error = gr.HTML("", elem_id="lab-form-error", padding=False)
    ui.status = gr.HTML(render.status_line(""), elem_id="lab-status", padding=False)
    ui.verdict = gr.Markdown(elem_id="lab-verdict")
    ui.cells = gr.Dataframe(headers=CELL_COLUMNS, label="cells", interactive=False)
    with gr.Row():
        ui.curve = gr.Plot(label="predicted vs measured speedup over γ", elem_id="lab-curve")
        ui.category_chart = gr.Plot(label="by task category (best cell)", elem_id="lab-categories")
    ui.category_table = gr.Dataframe(headers=CATEGORY_COLUMNS, label="by task category (best cell)", interactive=False)
    # only vLLM batches requests: the in-process engine and llama-server (one slot) have no load axis to draw
    with gr.Row(visible=False, elem_id="lab-load-row") as ui.load_row:
        ui.load_chart = gr.Plot(label="under load: where speculation stops paying", elem_id="lab-load")
        ui.load_table = gr.Dataframe(headers=LOAD_COLUMNS, label="under load", interactive=False)
    ui.snippets = gr.Markdown(label="settings to take to production")
    ui.files = gr.File(label="report: JSON, CSV, settings", file_count="multiple", interactive=False)
    ui.forge = forge_panel.build_layout()
    return ui


def _r(value, digits=2):
    return None if value is None else round(value, digits)


def _identical(cell: dict):
    """Greedy cells give their worst pair's lossless verdict (identical, rounding, unjudged, differs); sampled
    cells are not compared ("-")."""
    return cell.get("lossless") or "-"


def cell_rows(data: dict) -> list[list]:
    return [
        [c["drafter"], c["gamma"], c["temperature"], c.get("p_min", 0.0), c.get("topk", 1), _r(c["speedup"]["median"]),
         _r(c["speedup"]["min"]), _r(c["speedup"]["max"]), c["speedup"]["n"], _r(c.get("alpha")),
         _r(c["acceptance_rate"]["median"]),
         _r(c["baseline_tps"]["median"], 1), _r(c["speculative_tps"]["median"], 1), _identical(c)]
        for c in data["cells"]
    ]  # fmt: skip


def uses_markdown(s: Settings, prompts: int = 0, repeats: int = 0) -> str:
    """What a sweep runs with: the Playground's pair and sampling settings, and how much each cell rests on."""
    draft = f", draft **{s.draft}**" if s.draft else ""
    seed = "random" if s.seed is None else s.seed
    line = f"Sweeping on target **{s.target}**{draft}, dtype {s.dtype}, seed {seed}, top-p {s.top_p}, top-k {s.top_k}"
    if prompts:
        line += f"; each cell rests on {prompts} prompt(s) × {repeats} A/B pair(s) = {prompts * repeats} samples"
    return line + ". Change the pair and sampling settings on the Playground tab."


def best_cell(data: dict) -> dict:
    """The best real drafter's cell (report.best_setting), or the best of all when only synthetic ones ran."""
    best = report.best_setting(data)
    keys = {"drafter": None, "gamma": None, "temperature": None, "p_min": 0.0, "topk": 1}  # key: its default
    matches = [c for c in data["cells"] if best and all(c.get(k, d) == best.get(k, d) for k, d in keys.items())]
    return matches[0] if matches else max(data["cells"], key=lambda c: c["speedup"]["median"] or 0)


def category_rows(data: dict) -> list[list]:
    expected = {name: info.get("expect", "") for name, info in presets.tasks()["categories"].items()}
    return [
        [name, _r(s["speedup"]["median"]), _r(s["speedup"]["min"]), _r(s["speedup"]["max"]), s["speedup"]["n"],
         _r(s["acceptance_rate"]["median"]), expected.get(name, "")]
        for name, s in best_cell(data)["by_category"].items()
    ]  # fmt: skip


def curve_figure(data: dict) -> go.Figure:
    fig = go.Figure()
    for i, fit in enumerate(data["fits"]):
        stop = (f" p≥{fit['p_min']:g}" if fit.get("p_min") else "") + (f" k{fit['topk']}" if fit.get("topk", 1) > 1
                                                                          else "")  # fmt: skip
        color, name = COLORS[i % len(COLORS)], f"{fit['drafter']} T={fit['temperature']}{stop}"
        curve = fit["curve"]
        gammas = [p["gamma"] for p in curve]
        predicted = dict(color=color)
        paper = dict(color=color, dash="dot")
        fig.add_trace(
            go.Scatter(x=gammas, y=[p["predicted"] for p in curve], name=f"{name}: predicted", line=predicted)
        )
        fig.add_trace(go.Scatter(x=gammas, y=[p["paper"] for p in curve], name=f"{name}: paper (V=1)", line=paper))
        measured = [p for p in curve if p["measured"] is not None]
        fig.add_trace(
            go.Scatter(
                x=[p["gamma"] for p in measured],
                y=[p["measured"] for p in measured],
                mode="markers",
                name=f"{name}: measured",
                marker=dict(color=color, size=10),
            )
        )
    fig.add_hline(y=1.0, line=dict(color="#9ca3af", dash="dash"))
    # scaled to what was measured and predicted: the paper's curve (verify costs one step) runs far above on a
    # CPU and would flatten the points; it leaves the chart at the top
    shown = [p[k] for f in data["fits"] for p in f["curve"] for k in ("measured", "predicted") if p[k] is not None]
    fig.update_yaxes(range=[0, max([1.2] + shown) * 1.15])
    fig.update_layout(
        xaxis_title="γ (draft tokens per step)",
        yaxis_title="speedup ×",
        height=420,
        margin=dict(l=50, r=20, t=30, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def category_figure(data: dict) -> go.Figure:
    rows = category_rows(data)
    names = [r[0] for r in rows]
    errors = dict(
        type="data", symmetric=False, array=[r[3] - r[1] for r in rows], arrayminus=[r[1] - r[2] for r in rows]
    )
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=[r[1] for r in rows], name="speedup × (left)", marker_color="#7c3aed",
                         error_y=errors, offsetgroup="speedup"))  # fmt: skip
    fig.add_trace(go.Bar(x=names, y=[r[5] or 0 for r in rows], name="acceptance (right)", marker_color="#16a34a",
                         yaxis="y2", offsetgroup="acceptance"))  # fmt: skip
    fig.add_hline(y=1.0, line=dict(color="#9ca3af", dash="dash"))
    fig.update_layout(
        barmode="group", height=420, margin=dict(l=50, r=50, t=30, b=80), legend=dict(orientation="h"),
        yaxis=dict(title=dict(text="speedup ×"), rangemode="tozero"),
        yaxis2=dict(title=dict(text="acceptance"), overlaying="y", side="right", range=[0, 1.05]),
    )  # fmt: skip
    return fig


def snippets_markdown(data: dict) -> str:
    return report.snippets_markdown(data).replace("# Best setting", "### Best setting")


# The Lab's own fields (elem ids lab-field-<name>); a Settings field the sweep sets from them is marked on them
LAB_FIELDS = {"gammas": "γ values", "temperatures": "temperatures", "drafters": "drafters",
              "p_mins": "confidence stops", "topks": "tree widths", "categories": "task categories",
              "per_category": "prompts per category",
              "repeats": "A/B repeats", "max_new_tokens": "max new tokens", "concurrency": "concurrency"}  # fmt: skip
LAB_FIELDS |= prompt_sets.FIELDS  # the prompt set's: a file, a dataset, the sample seed, the held-out share
SWEPT = {"gamma": "gammas", "temperature": "temperatures", "drafter": "drafters", "p_min": "p_mins", "topk": "topks",
         "max_new_tokens": "max_new_tokens"}  # fmt: skip
OUTPUTS = 10  # what it used, verdict, tables, charts, snippets, files: before the status line and field marks


def field_id(name: str) -> str:
    return f"lab-field-{name}"


def marked(exc: UserError) -> tuple[str, str]:
    """(status line, field mark) as the Playground shows a refused value: the message once, under the field at
    fault (the Lab's, or the sidebar's for the pair and sampling settings), the status line pointing at it."""
    return jobs.marked(exc, "sweep", LAB_FIELDS, field_id, SWEPT, sidebar=True)


def plan(gammas, temperatures, drafters, categories, per_category, repeats, sweep_max_new_tokens, concurrency,
         p_mins, form, prompt_set: dict | None = None, topks="1") -> tuple:  # fmt: skip
    """The sweep's values checked: (base settings, prompts, gammas, temperatures, (confidence stops, tree widths),
    load levels); a UserError that names the field at fault otherwise."""
    try:
        temps = [float(t) for t in str(temperatures or "").replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"temperatures {temperatures!r}: write numbers separated by commas, e.g. 0, 0.7.",
                        field="temperatures") from None  # fmt: skip
    try:
        stops = [float(p) for p in str(p_mins or "0").replace(" ", "").split(",") if p] or [0.0]
    except ValueError:
        raise UserError(f"confidence stops {p_mins!r}: write numbers from 0 to 1 separated by commas, e.g. "
                        "0, 0.5.", field="p_mins") from None  # fmt: skip
    try:
        widths = [int(k) for k in str(topks or "1").replace(" ", "").split(",") if k] or [1]
    except ValueError:
        raise UserError(f"tree widths {topks!r}: write whole numbers from 1 to 8 separated by commas, e.g. 1, 3.",
                        field="topks") from None  # fmt: skip
    missing = [name for name, v in (("gammas", gammas), ("temperatures", temps), ("drafters", drafters),
                                    ("categories", categories)) if not v]  # fmt: skip
    if missing:
        raise UserError("choose at least one γ, one temperature, one drafter and one task category.",
                        field=missing[0])  # fmt: skip
    named = [d for d in drafters if d in ("draft-model", *HEADS)]
    if len(named) > 1:
        raise UserError(f"{', '.join(named)} each need the Playground's draft field, which names one model or head: "
                        "sweep them one at a time.", field="drafters")  # fmt: skip
    first = named[0] if named else drafters[0]
    axes = dict(drafter=first, gamma=min(int(g) for g in gammas), temperature=temps[0],
                max_new_tokens=sweep_max_new_tokens, topk=widths[0] if first == "eagle3" else 1)  # fmt: skip
    base = settings_from(**(form | axes))
    prompts = prompt_sets.chosen(categories, per_category, **(prompt_set or {}))  # the task suite, a file, a dataset
    if not 1 <= int(repeats) <= 10:
        raise UserError(f"repeats {repeats} is out of range: use 1 to 10.", field="repeats")
    levels = _levels(concurrency)
    if levels and not has_load_axis(base.backend):
        raise UserError("a load curve needs a serving backend that batches requests: choose vLLM on the Playground "
                        "(llama-server here serves one request at a time), or leave concurrency empty.",
                        field="backend")  # fmt: skip
    return base, prompts, sorted(int(g) for g in gammas), temps, (stops, widths), levels


def has_load_axis(backend: str) -> bool:
    """Whether a backend serves several requests at once (vLLM); llama-server runs with one slot here."""
    return backend == "vllm"


def load_visible(backend):
    """The concurrency field and the "under load" chart and table, shown for a backend with a load axis only."""
    shown = has_load_axis(str(backend or ""))
    return gr.update(visible=shown), gr.update(visible=shown)


def cleared() -> tuple:
    """The results' components emptied (what it used stays): a sweep refused or started leaves no earlier verdict
    or table beside its own status line, to be read as this one's."""
    return (gr.skip(), "", [], None, None, [], None, [], "", None)


def with_progress(work):
    """work(report) in a thread of its own (its torch work goes to the engine thread, as every run's); yields a
    status line as it reports (report(done, total, what)), at most every RENDER_EVERY seconds, and returns its
    result or raises its error."""
    lines = jobs.follow(lambda put: work(lambda done, total, what: put((done, total, what))), "specarena-sweep",
                        every=RENDER_EVERY)  # fmt: skip
    while True:
        try:
            done, total, what = next(lines)
        except StopIteration as finished:
            return finished.value
        yield f"sweeping, {done} of {total} done: {what}"


def run_sweep(
    gammas, temperatures, drafters, categories, per_category, repeats, sweep_max_new_tokens, concurrency,
    p_mins="0", prompts_file=None, dataset="", sample_seed="", held_out=0, topks="1", request: gr.Request = None,
    **form,
):  # fmt: skip
    """Sweep the grid over the chosen task categories, on the Playground's pair and sampling settings (`form`;
    its drafter, γ, temperature and max new tokens give way to the sweep's own).
    Yields (what it used, verdict, tables, charts, snippets, files, status line, field mark): the progress in the
    status line, then the results. A refused value is marked under its field, as on the Playground."""
    keep = (gr.skip(),) * OUTPUTS
    try:
        base, prompts, gammas, temps, options, levels = plan(
            gammas, temperatures, drafters, categories, per_category, repeats, sweep_max_new_tokens, concurrency,
            p_mins, form, dict(file=prompts_file, dataset=dataset, seed=sample_seed, held_out=held_out), topks)
    except UserError as exc:
        yield (*cleared(), *marked(exc))
        raise api_error(exc) from None
    session = session_of(request, ":lab")
    stop = STOPS.start(session)
    yield (*cleared(), render.status_line("starting the sweep"), "")

    try:
        data = yield from _measure(base, prompts, gammas, temps, drafters, repeats, options, levels, stop)
    except Stopped:
        yield (*keep, render.status_line("stopped: nothing was saved; run again with fewer cells for a quicker "
                                         "answer"), "")  # fmt: skip
        return
    except Exception as exc:  # noqa: BLE001 - a mistake marked, a fault of ours logged: the app keeps serving
        status, mark, error = job_failure(exc, marked, "sweep")
        yield (*keep, status, mark)
        raise error from None
    finally:
        STOPS.finish(session, stop)
    yield (*results(data, base, prompts, repeats), render.status_line("done: the results are below"), "")


def _measure(base, prompts, gammas, temps, drafters, repeats, options, levels, stop):
    """The sweep, then the load curve of its best setting where levels were asked for; yields status lines."""
    stops, widths = options

    def work(say):
        data = ENGINE.call(sweep, base, prompts, gammas, temps, list(drafters), int(repeats), say, stop,
                           p_mins=stops, topks=widths)  # fmt: skip
        best = report.best_setting(data)
        if levels and best:
            under_load = replace(base, **{k: best[k] for k in ("drafter", "gamma", "temperature", "p_min", "topk")})
            flat = [p for ps in prompts.first_turns().values() for p in ps]
            data["load"] = load_curve(under_load, flat, levels, int(repeats), say)
        return data

    lines = with_progress(work)
    keep = (gr.skip(),) * OUTPUTS
    while True:
        try:
            line = next(lines)
        except StopIteration as done:
            return done.value
        yield (*keep, render.status_line(line), gr.skip())


def results(data: dict, base: Settings, prompts, repeats) -> tuple:
    """What it used, verdict, tables, charts, snippets and the report's files, from a sweep's data."""
    best = report.best_setting(data)
    folder = tempfile.mkdtemp(prefix="specarena-lab-")
    paths = list(report.write(data, folder).values())
    curve, categories = curve_figure(data), category_figure(data)
    paths.append(write_charts(folder, curve, categories))
    verdicts = "\n".join(f"- **{f['drafter']}, temperature {f['temperature']}"
                         + option_label(f.get("p_min", 0.0), f.get("topk", 1))
                         + f"**: {f['verdict']}" for f in data["fits"])  # fmt: skip
    verdicts += "".join(f"\n\n⚠ Best setting: {note}." for note in (best["notes"] if best else []))
    verdicts += f"\n\n{report.prompt_set_line(data)}" + timing_line(data)
    uses = uses_markdown(base, prompts.turns(), int(repeats))
    load = data.get("load")
    load_chart, load_rows = (load_figure(load), load_rows_of(load)) if load else (None, [])
    return (uses, verdicts, cell_rows(data), curve, categories, category_rows(data), load_chart, load_rows,
            snippets_markdown(data), [str(p) for p in paths])  # fmt: skip


def timing_line(data: dict) -> str:
    """How long the sweep took, per prompt (each turn of each cell, warm-ups and A/B pairs included)."""
    t = data.get("timing") or {}
    if not t.get("per_prompt_s"):
        return ""
    return f" The sweep took {t['wall_s']:.0f} s: {t['per_prompt_s']:.1f} s per prompt and cell."


def _levels(text) -> list[int]:
    levels = [int(x) for x in str(text or "").replace(" ", "").split(",") if x]
    if any(level < 1 or level > 64 for level in levels):
        raise UserError(f"concurrency {text!r}: use whole numbers from 1 to 64, e.g. 1,2,4,8.", field="concurrency")
    return levels


def load_rows_of(load: dict) -> list[list]:
    return [
        [r["concurrency"], _r(r["speedup"]), _r(b["tokens_per_s"], 1), _r(s["tokens_per_s"], 1),
         _r(b["latency_p50_s"]), _r(b["latency_p99_s"]), _r(s["latency_p50_s"]), _r(s["latency_p99_s"])]
        for r, b, s in ((r, r["baseline"], r["speculative"]) for r in load["levels"])
    ]  # fmt: skip


def load_figure(load: dict) -> go.Figure:
    """Total tokens/s of each side over concurrency (left axis) and their ratio (right axis)."""
    xs = [r["concurrency"] for r in load["levels"]]
    fig = go.Figure()
    for side, color in (("baseline", "#6b7280"), ("speculative", "#7c3aed")):
        fig.add_trace(go.Scatter(x=xs, y=[r[side]["tokens_per_s"] for r in load["levels"]], name=f"{side} tok/s",
                                 line=dict(color=color)))  # fmt: skip
    fig.add_trace(go.Scatter(x=xs, y=[r["speedup"] for r in load["levels"]], name="speedup × (right)", yaxis="y2",
                             line=dict(color="#16a34a", dash="dot")))  # fmt: skip
    fig.update_layout(
        height=380, margin=dict(l=50, r=50, t=30, b=40), legend=dict(orientation="h"),
        xaxis=dict(title=dict(text="requests at a time"), type="log", tickvals=xs),
        yaxis=dict(title=dict(text="total tokens/s"), rangemode="tozero"),
        yaxis2=dict(title=dict(text="speedup ×"), overlaying="y", side="right", rangemode="tozero"),
    )  # fmt: skip
    return fig


def write_charts(folder: str, *figures: go.Figure) -> Path:
    """The charts in one HTML file that opens offline (plotly.js is embedded once)."""
    parts = [fig.to_html(full_html=False, include_plotlyjs=i == 0) for i, fig in enumerate(figures)]
    path = Path(folder) / "charts.html"
    path.write_text('<!doctype html><meta charset="utf-8"><title>SpecArena report charts</title>' + "".join(parts))
    return path


def stop(request: gr.Request) -> str:
    if STOPS.stop(session_of(request, ":lab")):
        return render.status_line("stopping after the current A/B pair…")
    return render.status_line("nothing is running")


def wire(ui: SimpleNamespace, play: SimpleNamespace) -> None:
    inputs = [ui.gammas, ui.temperatures, ui.drafters, ui.categories, ui.per_category, ui.repeats, ui.max_new_tokens,
              ui.concurrency, ui.p_mins, ui.prompts_file, ui.dataset, ui.sample_seed, ui.held_out,
              ui.topks]  # fmt: skip
    outputs = [ui.uses, ui.verdict, ui.cells, ui.curve, ui.category_chart, ui.category_table, ui.load_chart,
               ui.load_table, ui.snippets, ui.files, ui.status, ui.form_error]  # fmt: skip
    # as the Playground: messages in the Lab's status line and under the fields, no progress overlay or toast
    ui.run.click(on_gpu(run_sweep, sweep_seconds), inputs=inputs, inputs_kwargs=play.form, outputs=outputs,
                 preprocess=False, api_name="sweep", concurrency_limit=1, concurrency_id="device",
                 show_progress="hidden")  # fmt: skip
    ui.stop.click(stop, outputs=[ui.status], queue=False, api_visibility="private")
    prompt_sets.wire(ui.prompt_set, ui.categories, ui.form_error)
    backend = play.form["backend"]
    ui.concurrency.visible = ui.load_row.visible = has_load_axis(backend.value)
    backend.change(load_visible, inputs=[backend], outputs=[ui.concurrency, ui.load_row], queue=False,
                   api_visibility="private")  # fmt: skip
    forge_panel.wire(ui.forge, ui, play)
    # editing the marked field takes its mark away (the Lab's own fields, and the sidebar's it may mark)
    for name, component in [*((field_id(n), getattr(ui, n)) for n in LAB_FIELDS),
                            *((render.field_id(n), c) for n, c in play.form.items())]:  # fmt: skip
        render.unmark_when_edited(component, ui.form_error, ui.status, f'data-where="{name}"')
    # what the sweep will use, kept in step with the Playground's fields
    ui.uses.value = show_uses(**{name: component.value for name, component in play.form.items()})
    for component in play.form.values():
        component.change(show_uses, inputs_kwargs=play.form, outputs=[ui.uses], preprocess=False, queue=False,
                         api_visibility="private", show_progress="hidden")  # fmt: skip


def show_uses(**form) -> str:
    try:
        return uses_markdown(Settings.from_form(**form))
    except UserError as exc:
        return f"The Playground's settings need a fix first: {exc}"

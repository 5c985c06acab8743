"""The Lab tab: sweeps over gamma, temperature and drafter, the task suite, the predictor, reports.

It reuses the Playground's pair and sampling fields, so a pair tried there is tuned here. All
measuring is engine.measure.bench; this module lays out, wires and draws.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

from app.gpu import on_gpu, sweep_seconds
from app.handlers import STOPS, session_of, settings_from
from engine import presets
from engine.errors import UserError
from engine.measure import report
from engine.measure.bench import Stopped, sweep
from engine.measure.load import load_curve
from engine.settings import Settings
from engine.worker import ENGINE

log = logging.getLogger("specarena")
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

CELL_COLUMNS = ["drafter", "γ", "temperature", "confidence stop", "speedup ×", "min", "max", "samples", "acceptance",
                "base tok/s", "spec tok/s", "lossless"]  # fmt: skip
LOAD_COLUMNS = ["at a time", "speedup ×", "base tok/s", "spec tok/s", "base p50 s", "base p99 s", "spec p50 s",
                "spec p99 s"]  # fmt: skip
CATEGORY_COLUMNS = ["category", "speedup ×", "min", "max", "samples", "acceptance", "expected"]


def build_layout() -> SimpleNamespace:
    ui = SimpleNamespace()
    gr.Markdown(HELP)
    ui.uses = gr.Markdown(elem_id="lab-uses")
    with gr.Row():
        ui.gammas = gr.CheckboxGroup(GAMMAS, value=[1, 2, 4, 8], label="γ values")
        ui.temperatures = gr.Textbox("0", label="temperatures", info="comma-separated, e.g. 0, 0.7")
        ui.drafters = gr.CheckboxGroup(
            [("draft model", "draft-model"), ("prompt lookup", "prompt-lookup"), ("suffix", "suffix"),
             ("synthetic α", "synthetic"),
             ("n-gram mod (llama.cpp)", "ngram-mod"), ("n-gram map-k (llama.cpp)", "ngram-map-k")],
            value=["prompt-lookup"],
            label="drafters",
        )  # fmt: skip
        ui.p_mins = gr.Textbox("0", label="confidence stops (draft model)", info="comma-separated, e.g. 0, 0.5: "
                               "stop drafting below this top probability")  # fmt: skip
    with gr.Row():
        ui.categories = gr.Dropdown(presets.categories(), value=["rewriting", "creative_writing"], multiselect=True,
                                    label="task categories")  # fmt: skip
        ui.per_category = gr.Slider(1, 5, value=1, step=1, label="prompts per category")
        ui.repeats = gr.Slider(1, 10, value=2, step=1, label="A/B repeats per prompt")
        ui.max_new_tokens = gr.Slider(8, 512, value=48, step=8, label="max new tokens")
        ui.concurrency = gr.Textbox("", label="concurrency (vLLM backend)", placeholder="e.g. 1,2,4,8",
                                    info="requests at a time: after the sweep, a load curve of its best setting")
    with gr.Row():
        ui.run = gr.Button("Run sweep", variant="primary", elem_id="lab-run")
        ui.stop = gr.Button("Stop", variant="stop", elem_id="lab-stop")
    ui.verdict = gr.Markdown(elem_id="lab-verdict")
    ui.cells = gr.Dataframe(headers=CELL_COLUMNS, label="cells", interactive=False)
    with gr.Row():
        ui.curve = gr.Plot(label="predicted vs measured speedup over γ", elem_id="lab-curve")
        ui.category_chart = gr.Plot(label="by task category (best cell)", elem_id="lab-categories")
    ui.category_table = gr.Dataframe(headers=CATEGORY_COLUMNS, label="by task category (best cell)", interactive=False)
    with gr.Row():
        ui.load_chart = gr.Plot(label="under load: where speculation stops paying", elem_id="lab-load")
        ui.load_table = gr.Dataframe(headers=LOAD_COLUMNS, label="under load", interactive=False)
    ui.snippets = gr.Markdown(label="settings to take to production")
    ui.files = gr.File(label="report: JSON, CSV, settings", file_count="multiple", interactive=False)
    return ui


def _r(value, digits=2):
    return None if value is None else round(value, digits)


def _identical(cell: dict):
    """Greedy cells give their worst pair's lossless verdict (identical, rounding, unjudged, differs); sampled
    cells are not compared ("-")."""
    return cell.get("lossless") or "-"


def cell_rows(data: dict) -> list[list]:
    return [
        [c["drafter"], c["gamma"], c["temperature"], c.get("p_min", 0.0), _r(c["speedup"]["median"]),
         _r(c["speedup"]["min"]), _r(c["speedup"]["max"]), c["speedup"]["n"], _r(c["acceptance_rate"]["median"]),
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
    keys = ("drafter", "gamma", "temperature")
    matches = [c for c in data["cells"] if best and all(c[k] == best[k] for k in keys)]
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
        stop = f" p≥{fit['p_min']:g}" if fit.get("p_min") else ""
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


def run_sweep(
    gammas, temperatures, drafters, categories, per_category, repeats, sweep_max_new_tokens, concurrency,
    p_mins="0", request: gr.Request = None, progress=gr.Progress(), **form,
):  # fmt: skip
    """Sweep the grid over the chosen task categories, on the Playground's pair and sampling settings (`form`;
    its drafter, γ, temperature and max new tokens give way to the sweep's own).
    Returns what it used, verdict, tables, charts, snippets, files."""
    try:
        temps = [float(t) for t in str(temperatures or "").replace(" ", "").split(",") if t]
        try:
            stops = [float(p) for p in str(p_mins or "0").replace(" ", "").split(",") if p] or [0.0]
        except ValueError:
            raise UserError(f"confidence stops {p_mins!r}: write numbers from 0 to 1 separated by commas, e.g. "
                            "0, 0.5.") from None  # fmt: skip
        if not gammas or not drafters or not categories or not temps:
            raise UserError("choose at least one γ, one temperature, one drafter and one task category.")
        first = "draft-model" if "draft-model" in drafters else drafters[0]
        axes = dict(drafter=first, gamma=min(int(g) for g in gammas), temperature=temps[0],
                    max_new_tokens=sweep_max_new_tokens)  # fmt: skip
        base = settings_from(**(form | axes))
        prompts = presets.suite(list(categories), int(per_category))
        if not 1 <= int(repeats) <= 10:
            raise UserError(f"repeats {repeats} is out of range: use 1 to 10.", field="repeats")
        levels = _levels(concurrency)
        if levels and base.backend == "transformers":
            raise UserError("a load curve needs a serving backend: choose vLLM on the Playground, or leave "
                            "concurrency empty.", field="backend")  # fmt: skip
    except ValueError:
        raise gr.Error(f"temperatures {temperatures!r}: write numbers separated by commas, e.g. 0, 0.7.") from None
    except UserError as exc:
        raise gr.Error(f"{exc}" + (f" (field: {exc.field})" if exc.field else "")) from None
    session = session_of(request, ":lab")
    stop = STOPS.start(session)
    try:
        report_progress = lambda done, total, what: progress((done, total), desc=what)  # noqa: E731
        data = ENGINE.call(sweep, base, prompts, sorted(int(g) for g in gammas), temps, list(drafters),
                           int(repeats), report_progress, stop, p_mins=stops)  # fmt: skip
        best = report.best_setting(data)
        if levels and best:
            under_load = replace(base, **{k: best[k] for k in ("drafter", "gamma", "temperature", "p_min")})
            flat = [p for ps in prompts.values() for p in ps]
            data["load"] = load_curve(under_load, flat, levels, int(repeats), report_progress)
    except Stopped:
        raise gr.Error("sweep stopped: nothing was saved; run again with fewer cells for a quicker answer.") from None
    except UserError as exc:
        raise gr.Error(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the app keeps serving
        log.exception("sweep failed")
        raise gr.Error(f"the sweep failed unexpectedly ({type(exc).__name__}: {exc}); the app is still running.")
    finally:
        STOPS.finish(session, stop)
    folder = tempfile.mkdtemp(prefix="specarena-lab-")
    paths = list(report.write(data, folder).values())
    curve, categories = curve_figure(data), category_figure(data)
    paths.append(write_charts(folder, curve, categories))
    verdicts = "\n".join(f"- **{f['drafter']}, temperature {f['temperature']}"
                         + (f", confidence stop {f['p_min']:g}" if f.get("p_min") else "")
                         + f"**: {f['verdict']}" for f in data["fits"])  # fmt: skip
    verdicts += "".join(f"\n\n⚠ Best setting: {note}." for note in (best["notes"] if best else []))
    uses = uses_markdown(base, sum(len(p) for p in prompts.values()), int(repeats))
    load = data.get("load")
    load_chart, load_rows = (load_figure(load), load_rows_of(load)) if load else (None, [])
    return (uses, verdicts, cell_rows(data), curve, categories, category_rows(data), load_chart, load_rows,
            snippets_markdown(data), [str(p) for p in paths])  # fmt: skip


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


def stop(request: gr.Request) -> None:
    STOPS.stop(session_of(request, ":lab"))


def wire(ui: SimpleNamespace, play: SimpleNamespace) -> None:
    inputs = [ui.gammas, ui.temperatures, ui.drafters, ui.categories, ui.per_category, ui.repeats, ui.max_new_tokens,
              ui.concurrency, ui.p_mins]  # fmt: skip
    outputs = [ui.uses, ui.verdict, ui.cells, ui.curve, ui.category_chart, ui.category_table, ui.load_chart,
               ui.load_table, ui.snippets, ui.files]  # fmt: skip
    ui.run.click(on_gpu(run_sweep, sweep_seconds), inputs=inputs, inputs_kwargs=play.form, outputs=outputs,
                 preprocess=False, api_name="sweep", concurrency_limit=1, concurrency_id="device")  # fmt: skip
    ui.stop.click(stop, queue=False, api_visibility="private")
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

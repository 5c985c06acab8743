"""The Lab tab: sweeps over gamma, temperature and drafter, the task suite, the predictor, reports.

It reuses the Playground's pair and sampling fields, so a pair tried there is tuned here. All
measuring is engine.bench; this module lays out, wires and draws.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

from app.gpu import on_gpu
from app.handlers import STOPS, build_request, session_of
from engine import presets, report
from engine.bench import Stopped, sweep
from engine.errors import UserError

log = logging.getLogger("specarena")
GAMMAS = [1, 2, 3, 4, 5, 6, 8, 12, 16]
COLORS = ["#7c3aed", "#16a34a", "#f59e0b", "#2563eb", "#dc2626", "#0ea5e9"]

HELP = """Measure whether speculation pays for this pair **on this machine**: every cell is a set of A/B pairs
(baseline and speculative one after the other, order alternating, after a warm-up), reported as the median
with its min–max spread. The predictor fits α per draft position, the draft cost c and the verify cost from
these runs and draws the expected speedup over γ. Pick one γ, one temperature and one drafter with several
categories to run the task suite. With the draft model in the sweep, synthetic α cells run its passes too,
so they show what this draft would reach at that α. The camera icon on a chart saves it as PNG; the
report's charts.html holds both charts and opens offline."""

CELL_COLUMNS = ["drafter", "γ", "temperature", "speedup", "min", "max", "acceptance", "tok/s base", "tok/s spec",
                "identical"]  # fmt: skip
CATEGORY_COLUMNS = ["category", "speedup", "min", "max", "acceptance", "expected"]


def build_layout() -> SimpleNamespace:
    ui = SimpleNamespace()
    gr.Markdown(HELP)
    with gr.Row():
        ui.gammas = gr.CheckboxGroup(GAMMAS, value=[1, 2, 4, 8], label="γ values")
        ui.temperatures = gr.Textbox("0", label="temperatures", info="comma-separated, e.g. 0, 0.7")
        ui.drafters = gr.CheckboxGroup(
            [("draft model", "draft-model"), ("prompt lookup", "prompt-lookup"), ("synthetic α", "synthetic")],
            value=["prompt-lookup"],
            label="drafters",
        )
    with gr.Row():
        ui.categories = gr.Dropdown(presets.categories(), value=["rewriting", "creative_writing"], multiselect=True,
                                    label="task categories")  # fmt: skip
        ui.per_category = gr.Slider(1, 5, value=1, step=1, label="prompts per category")
        ui.repeats = gr.Slider(1, 10, value=2, step=1, label="A/B repeats per prompt")
        ui.max_new_tokens = gr.Slider(8, 512, value=48, step=8, label="max new tokens")
    with gr.Row():
        ui.run = gr.Button("Run sweep", variant="primary", elem_id="lab-run")
        ui.stop = gr.Button("Stop", variant="stop", elem_id="lab-stop")
    ui.verdict = gr.Markdown(elem_id="lab-verdict")
    ui.cells = gr.Dataframe(headers=CELL_COLUMNS, label="cells", interactive=False)
    with gr.Row():
        ui.curve = gr.Plot(label="predicted vs measured speedup over γ", elem_id="lab-curve")
        ui.category_chart = gr.Plot(label="by task category (best cell)", elem_id="lab-categories")
    ui.category_table = gr.Dataframe(headers=CATEGORY_COLUMNS, label="by task category (best cell)", interactive=False)
    ui.snippets = gr.Markdown(label="settings to take to production")
    ui.files = gr.File(label="report: JSON, CSV, settings", file_count="multiple", interactive=False)
    return ui


def _r(value, digits=2):
    return None if value is None else round(value, digits)


def cell_rows(data: dict) -> list[list]:
    return [
        [c["drafter"], c["gamma"], c["temperature"], _r(c["speedup"]["median"]), _r(c["speedup"]["min"]),
         _r(c["speedup"]["max"]), _r(c["acceptance_rate"]["median"]), _r(c["baseline_tps"]["median"], 1),
         _r(c["speculative_tps"]["median"], 1), c["all_identical"]]
        for c in data["cells"]
    ]  # fmt: skip


def best_cell(data: dict) -> dict:
    return max(data["cells"], key=lambda c: c["speedup"]["median"] or 0)


def category_rows(data: dict) -> list[list]:
    expected = {name: info.get("expect", "") for name, info in presets.tasks()["categories"].items()}
    return [
        [name, _r(s["speedup"]["median"]), _r(s["speedup"]["min"]), _r(s["speedup"]["max"]),
         _r(s["acceptance_rate"]["median"]), expected.get(name, "")]
        for name, s in best_cell(data)["by_category"].items()
    ]  # fmt: skip


def curve_figure(data: dict) -> go.Figure:
    fig = go.Figure()
    for i, fit in enumerate(data["fits"]):
        color, name = COLORS[i % len(COLORS)], f"{fit['drafter']} T={fit['temperature']}"
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
    fig.add_trace(go.Bar(x=names, y=[r[1] for r in rows], name="speedup ×", marker_color="#7c3aed", error_y=errors))
    fig.add_trace(go.Bar(x=names, y=[r[4] or 0 for r in rows], name="acceptance", marker_color="#16a34a"))
    fig.add_hline(y=1.0, line=dict(color="#9ca3af", dash="dash"))
    fig.update_layout(barmode="group", height=420, margin=dict(l=50, r=20, t=30, b=80), legend=dict(orientation="h"))
    return fig


def snippets_markdown(data: dict) -> str:
    return report.snippets_markdown(data).replace("# Best setting", "### Best setting")


def run_sweep(
    target, draft, dtype, chat, ngram, alpha, top_p, top_k, seed, gammas, temperatures, drafters, categories,
    per_category, repeats, max_new_tokens, request: gr.Request, progress=gr.Progress(),
):  # fmt: skip
    """Sweep the grid over the chosen task categories; returns verdict, tables, charts, snippets, files."""
    try:
        temps = [float(t) for t in str(temperatures).replace(" ", "").split(",") if t]
        if not gammas or not drafters or not categories or not temps:
            raise UserError("choose at least one γ, one temperature, one drafter and one task category.")
        first = "draft-model" if "draft-model" in drafters else drafters[0]
        base = build_request("-", target, first, draft, temps[0], top_p, top_k, max_new_tokens, min(gammas), seed,
                             chat, dtype, ngram, alpha)  # fmt: skip
        prompts = presets.suite(list(categories), int(per_category))
    except ValueError:
        raise gr.Error(f"temperatures {temperatures!r}: write numbers separated by commas, e.g. 0, 0.7.") from None
    except UserError as exc:
        raise gr.Error(str(exc)) from None
    session = session_of(request, ":lab")
    stop = STOPS.start(session)
    try:
        data = sweep(base, prompts, sorted(int(g) for g in gammas), temps, list(drafters), int(repeats),
                     lambda done, total, what: progress((done, total), desc=what), stop)  # fmt: skip
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
    verdicts = "\n".join(f"- **{f['drafter']}, temperature {f['temperature']}**: {f['verdict']}" for f in data["fits"])
    return (verdicts, cell_rows(data), curve, categories, category_rows(data), snippets_markdown(data),
            [str(p) for p in paths])  # fmt: skip


def write_charts(folder: str, *figures: go.Figure) -> Path:
    """The charts in one HTML file that opens offline (plotly.js is embedded once)."""
    parts = [fig.to_html(full_html=False, include_plotlyjs=i == 0) for i, fig in enumerate(figures)]
    path = Path(folder) / "charts.html"
    path.write_text('<!doctype html><meta charset="utf-8"><title>SpecArena report charts</title>' + "".join(parts))
    return path


def stop(request: gr.Request) -> None:
    STOPS.stop(session_of(request, ":lab"))


def wire(ui: SimpleNamespace, play: SimpleNamespace) -> None:
    inputs = [play.target, play.draft, play.dtype, play.chat, play.ngram, play.alpha, play.top_p, play.top_k,
              play.seed, ui.gammas, ui.temperatures, ui.drafters, ui.categories, ui.per_category, ui.repeats,
              ui.max_new_tokens]  # fmt: skip
    outputs = [ui.verdict, ui.cells, ui.curve, ui.category_chart, ui.category_table, ui.snippets, ui.files]
    ui.run.click(on_gpu(run_sweep), inputs=inputs, outputs=outputs, api_name="sweep", concurrency_limit=1,
                 concurrency_id="device")  # fmt: skip
    ui.stop.click(stop, queue=False, api_visibility="private")

"""Plotly figures as JSON dicts: one live dashboard for the runs and one memory chart.

Only basic traces (scatter, bar): Gradio's front end bundles its own plotly.js, and these render the
same in every version. `as_plot` wraps a dict for gr.Plot without building a plotly Figure.
"""

from __future__ import annotations

import json
from functools import lru_cache

from gradio.components.plot import PlotData
from plotly.subplots import make_subplots
from plotly.utils import PlotlyJSONEncoder

from engine.decoding.metrics import RunResult

BASE, SPEC = "#6b7280", "#7c3aed"
DRAFT, VERIFY, OVERHEAD, PREFILL = "#f59e0b", "#7c3aed", "#9ca3af", "#0ea5e9"
ROLLING = 8


def _cumulative(run: RunResult) -> tuple[list[float], list[int]]:
    xs, ys, total = [0.0], [0], 0
    for s in run.steps:
        total += len(s.tokens)
        xs.append(s.elapsed_s)
        ys.append(total)
    return xs, ys


def _rolling_acceptance(run: RunResult) -> tuple[list[int], list[float]]:
    xs, ys, window = [], [], []
    for s in run.steps[1:]:
        if s.drafted:
            window = (window + [(s.accepted, len(s.drafted))])[-ROLLING:]
            xs.append(s.step)
            ys.append(sum(a for a, _ in window) / sum(d for _, d in window))
    return xs, ys


def _axes(row: int, col: int) -> dict:
    k = (row - 1) * 2 + col
    return {"xaxis": f"x{k}" if k > 1 else "x", "yaxis": f"y{k}" if k > 1 else "y"}


@lru_cache(maxsize=1)
def _live_layout() -> str:
    """The dashboard's layout, built once with plotly (slow) and reused as JSON (fast)."""
    # three rows of two: short titles that fit side by side down to a phone's width
    fig = make_subplots(
        rows=3,
        cols=2,
        subplot_titles=(
            "tokens vs time (s)",
            f"acceptance, rolling {ROLLING} steps",
            "draft tokens kept per step",
            "acceptance by draft position",
            "where the time went (s)",
            "decode tokens/s",
        ),
        vertical_spacing=0.13,
        horizontal_spacing=0.12,
    )
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=2, col=2)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_xaxes(type="category", tickangle=0, tickfont_size=10, row=2, col=1)
    fig.update_xaxes(title_text="position", dtick=1, row=2, col=2)
    fig.update_layout(barmode="stack", height=760, margin=dict(l=40, r=10, t=50, b=40), legend=dict(orientation="h"))
    fig.update_annotations(font_size=12)
    return json.dumps(fig.to_plotly_json()["layout"], cls=PlotlyJSONEncoder)


def _scatter(x, y, name, color, cell, **extra) -> dict:
    return {"type": "scatter", "mode": "lines", "x": x, "y": y, "name": name, "line": {"color": color},
            **_axes(*cell), **extra}  # fmt: skip


def _bar(x, y, name, color, cell, **extra) -> dict:
    return {"type": "bar", "x": x, "y": y, "name": name, "marker": {"color": color}, **_axes(*cell), **extra}


def live_figure(base: RunResult | None, spec: RunResult | None) -> dict:
    """The live dashboard as a plotly JSON dict. Built by hand: it is redrawn while tokens stream, and a
    plotly Figure with subplots takes ~100 ms to build, CPU stolen from the model on a CPU machine."""
    traces: list[dict] = []
    for run, name, color in ((base, "baseline", BASE), (spec, "speculative", SPEC)):
        if run is None:
            continue
        xs, ys = _cumulative(run)
        m = run.metrics
        traces.append(_scatter(xs, ys, name, color, (1, 1)))
        traces.append(_bar([name], [m.tokens_per_s], name, color, (3, 2), showlegend=False))
        for part, value, c in (("prefill", m.prefill_s, PREFILL), ("draft", m.draft_s, DRAFT),
                               ("verify", m.verify_s, VERIFY), ("overhead", m.overhead_s, OVERHEAD)):  # fmt: skip
            first = run is base or base is None
            traces.append(_bar([name], [value], part, c, (3, 1), legendgroup=part, showlegend=first))
    if spec is not None:
        xs, ys = _rolling_acceptance(spec)
        traces.append(_scatter(xs, ys, "acceptance", SPEC, (1, 2), showlegend=False))
        # steps where nothing was drafted apart from drafts rejected at once
        m = spec.metrics
        names = ["no draft"] + [str(k) for k in range(len(m.accepted_length_hist))]
        traces.append(_bar(names, [m.no_draft_steps] + m.accepted_length_hist, "steps", SPEC, (2, 1),
                           showlegend=False))  # fmt: skip
        rates = [r or 0 for r in m.per_position_acceptance]
        traces.append(_bar(list(range(1, len(rates) + 1)), rates, "acceptance", SPEC, (2, 2), showlegend=False))
    return {"data": traces, "layout": json.loads(_live_layout())}


def memory_figure(samples: list[dict], source: str, models: dict[str, float] | None = None) -> dict:
    """Memory over time: GPU used/total (NVML) and torch-allocated, or the process RSS on CPU; plus the
    weights of each loaded model as a flat line, so one can see which model holds what."""
    traces = []
    if samples:
        t0 = samples[0]["t"]
        xs = [round(s["t"] - t0, 2) for s in samples]
        for key, name, dash in (("used_mb", "used", "solid"), ("torch_mb", "torch allocated", "dot"),
                                ("total_mb", "total", "dash")):  # fmt: skip
            ys = [s.get(key) for s in samples]
            if any(y is not None for y in ys):
                traces.append({"type": "scatter", "mode": "lines", "x": xs, "y": ys, "name": name,
                               "line": {"dash": dash}})  # fmt: skip
        for spec, mib in (models or {}).items():
            traces.append({"type": "scatter", "mode": "lines", "x": [xs[0], xs[-1]], "y": [mib, mib],
                           "name": f"weights: {spec}", "line": {"dash": "dashdot", "width": 1}})  # fmt: skip
    layout = {
        "title": {"text": f"memory (MiB): {source}", "font": {"size": 13}},
        "height": 300,
        "margin": {"l": 50, "r": 20, "t": 40, "b": 70},
        "legend": {"orientation": "h", "y": -0.3},
        "xaxis": {"title": {"text": "seconds", "standoff": 4}},
    }
    return {"data": traces, "layout": layout}


def as_plot(figure: dict) -> PlotData:
    return PlotData(type="plotly", plot=json.dumps(figure, cls=PlotlyJSONEncoder))

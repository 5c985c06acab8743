"""Event handlers: turn UI values into an engine Request, and engine Updates into component values.

The engine does all the work and all the timing; this module only adapts (after smolagents'
gradio_ui): it keeps the events of the current run, renders them at most every RENDER_EVERY
seconds, and keeps the session's history.
"""

from __future__ import annotations

import csv
import json
import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from app import charts, render
from app.memory import SAMPLER
from engine import policy, presets
from engine.compare import TAKES_DRAFT, Comparison, Request, Update, stream_compare
from engine.errors import UserError
from engine.metrics import RunResult, summarise
from engine.models import MODELS
from engine.sampling import SamplingConfig

log = logging.getLogger("specarena")
# Each refresh costs the server (rendering, diffing, streaming) and the browser CPU that, on a CPU machine,
# the model would otherwise use: text twice a second, charts every two seconds, everything at phase ends.
RENDER_EVERY = 0.5
CHART_EVERY = 2.0

HISTORY_COLUMNS = [
    "time", "target", "drafter", "draft", "gamma", "temperature", "max new", "speedup",
    "acceptance", "tok/s base", "tok/s spec", "identical",
]  # fmt: skip


class StopFlags:
    """One stop flag per browser session, so a Stop from one user never stops another's run."""

    def __init__(self):
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def start(self, session: str) -> threading.Event:
        with self._lock:
            flag = self._flags[session] = threading.Event()
            return flag

    def stop(self, session: str) -> bool:
        with self._lock:
            flag = self._flags.get(session)
        if flag is None:
            return False
        flag.set()
        return True

    def finish(self, session: str, flag: threading.Event) -> None:
        with self._lock:
            if self._flags.get(session) is flag:
                del self._flags[session]


STOPS = StopFlags()


def session_of(request, suffix: str = "") -> str:
    """The browser session's key for stop flags (API calls without a session share one)."""
    return (getattr(request, "session_hash", None) or "anonymous") + suffix


def build_request(
    prompt, target, drafter, draft, temperature, top_p, top_k, max_new_tokens, gamma, seed, chat, dtype, ngram, alpha,
    adaptive=False,
) -> Request:  # fmt: skip
    """UI values (floats from sliders, None from empty numbers) -> a validated engine Request."""

    def whole(value, name):
        if value is None or value == "":
            raise UserError(f"{name} is empty: enter a whole number.")
        if float(value) != int(float(value)):
            raise UserError(f"{name} {value} is not a whole number.")
        return int(float(value))

    seed = None if seed in (None, "") or float(seed) < 0 else whole(seed, "seed")
    sampling = SamplingConfig(float(temperature), whole(top_k, "top-k"), float(top_p), seed)
    uses_draft = drafter in TAKES_DRAFT and (draft or "").strip()
    return Request(
        prompt=prompt or "",
        target=policy.app_model(target),
        draft=policy.app_model(draft) if uses_draft else None,
        drafter=drafter,
        gamma=whole(gamma, "gamma"),
        max_new_tokens=whole(max_new_tokens, "max new tokens"),
        sampling=sampling,
        chat=bool(chat),
        dtype=dtype or "auto",
        ngram=whole(ngram, "n-gram size"),
        alpha=float(alpha),
        adaptive=bool(adaptive),
    ).validate()


FIELD_WORDS = ["prompt", "target", "drafter", "draft", "temperature", "top-p", "top-k", "max new tokens", "gamma",
               "seed", "chat", "dtype", "n-gram", "alpha", "adaptive"]  # fmt: skip


def validate(*values):
    """Gradio validator for `compare`: the same checks as the engine, shown on the offending field at once."""
    inputs = values[:15]
    try:
        build_request(*inputs)
        problem, message = None, ""
    except UserError as exc:
        message = str(exc)
        head = message.split(":")[0].lower()
        problem = next((w for w in sorted(FIELD_WORDS, key=len, reverse=True) if w in head), "prompt")
    marks = [gr.validate(word != problem, message if word == problem else "") for word in FIELD_WORDS]
    return marks + [gr.validate(True, "")] * (len(values) - len(marks))


@dataclass
class Live:
    """Everything seen so far in one comparison, ready to render."""

    steps: dict[str, list] = field(default_factory=lambda: {"baseline": [], "speculative": []})
    results: dict[str, RunResult] = field(default_factory=dict)
    status: list[str] = field(default_factory=list)
    comparison: Comparison | None = None
    running: str | None = None
    number: int = 0  # this session's run number, shown in the status line

    def add(self, update: Update) -> None:
        if update.phase == "status":
            self.status.append(update.message)
        elif update.phase == "done":
            self.comparison = update.result
            self.running = None
        elif update.event is not None:
            self.running = update.phase
            self.steps[update.phase].append(update.event)
        else:
            self.results[update.phase] = update.result

    def run(self, mode: str) -> RunResult | None:
        if mode in self.results:
            return self.results[mode]
        return summarise(mode, self.steps[mode], "") if self.steps[mode] else None

    def outputs(self, chart: bool = True) -> tuple:
        """(status, baseline pane, speculative pane, summary, chart); chart=False leaves the chart as it is."""
        base, spec = self.run("baseline"), self.run("speculative")
        done = self.comparison
        identical = done.identical if done else None
        hint = render.identical_badge(identical) if done else ""
        base_pane = render.pane(
            "Baseline (target alone)",
            render.baseline_tokens(self.steps["baseline"]),
            render.stats_line(base.metrics if base else None, self.running == "baseline"),
        )
        spec_pane = render.pane(
            "Speculative (draft + target)",
            render.speculative_tokens(self.steps["speculative"]),
            render.stats_line(spec.metrics if spec else None, self.running == "speculative"),
            hint,
        )
        summary = render.summary(
            base.metrics if base else None,
            spec.metrics if spec and not self.running else None,
            identical,
            done.speedup if done else None,
        )
        status = " · ".join(([f"run {self.number}"] if self.number else []) + self.status[-3:])
        figure = charts.as_plot(charts.live_figure(base, spec)) if chart else gr.skip()
        return status, base_pane, spec_pane, summary, figure


def history_row(c: Comparison) -> list:
    s, b = c.speculative.metrics, c.baseline.metrics
    return [
        time.strftime("%H:%M:%S"), c.request.target, c.request.drafter, c.request.draft or "", c.request.gamma,
        c.request.sampling.temperature, c.request.max_new_tokens, round(c.speedup or 0, 3),
        None if s.acceptance_rate is None else round(s.acceptance_rate, 3),
        round(b.tokens_per_s, 2), round(s.tokens_per_s, 2), c.identical,
    ]  # fmt: skip


def write_downloads(c: Comparison, history: list[list]) -> list[str]:
    """The last run as JSON (settings, versions, device, metrics, per-step trace) and the history as CSV."""
    folder = Path(tempfile.mkdtemp(prefix="specarena-"))
    run_path = folder / "specarena-run.json"
    run_path.write_text(json.dumps(c.to_dict(), indent=1))
    csv_path = folder / "specarena-history.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HISTORY_COLUMNS)
        writer.writerows(history)
    return [str(run_path), str(csv_path)]


def api_result(c: Comparison | None) -> dict:
    """What an API client most wants: both texts, the key metrics, the losslessness verdict."""
    if c is None:
        return {}
    data = c.to_dict(with_steps=False)
    keys = ("baseline", "speculative", "identical", "speedup", "settings", "environment", "started_at", "finished_at")
    return {k: data[k] for k in keys}


def compare(
    prompt, target, drafter, draft, temperature, top_p, top_k, max_new_tokens, gamma, seed, chat, dtype,
    ngram, alpha, adaptive, history, request: gr.Request,
):  # fmt: skip
    """Run baseline then speculative and stream both. Yields (result, status, panes, summary, chart, history...)."""
    try:
        req = build_request(
            prompt, target, drafter, draft, temperature, top_p, top_k, max_new_tokens, gamma, seed, chat, dtype,
            ngram, alpha, adaptive,
        )  # fmt: skip
    except UserError as exc:
        raise gr.Error(str(exc)) from None
    session = session_of(request)
    stop = STOPS.start(session)
    history = list(history or [])
    live, last_text, last_chart = Live(number=len(history) + 1), 0.0, 0.0
    try:
        for update in stream_compare(req, stop):
            live.add(update)
            now = time.monotonic()
            streaming = update.event is not None
            if not streaming or now - last_text >= RENDER_EVERY:
                chart = not streaming or now - last_chart >= CHART_EVERY
                last_text, last_chart = now, now if chart else last_chart
                yield (gr.skip(), *live.outputs(chart), gr.skip(), gr.skip(), gr.skip())
    except UserError as exc:
        raise gr.Error(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the app must keep serving
        log.exception("comparison failed")
        raise gr.Error(f"the run failed unexpectedly ({type(exc).__name__}: {exc}); the app is still running.")
    finally:
        STOPS.finish(session, stop)
    c = live.comparison
    if c is not None:
        history = history + [history_row(c)]
        if stop.is_set():
            live.status.append("stopped by user: partial results shown")
        yield (api_result(c), *live.outputs(), history, history, write_downloads(c, history))


def stop(request: gr.Request) -> str:
    stopped = STOPS.stop(session_of(request))
    return "stopping after the current step…" if stopped else "nothing is running"


def clear():
    live = Live()
    return ({}, "", *live.outputs()[1:])


def apply_preset(name: str):
    """Preset -> target, drafter, draft, gamma, dtype, alpha, and the note shown under the dropdown."""
    p = presets.pair(name)
    note = f"{p['note']}  \n*Measured on:* {p['measured_on']}"
    return p["target"], p["drafter"], p.get("draft", ""), p["gamma"], p.get("dtype", "auto"), p.get("alpha", 0.8), note


def check_pair(target, drafter, draft, dtype, max_new_tokens):
    """The pair doctor's report as Markdown, before any weights load."""
    from engine.doctor import diagnose, markdown

    try:
        use_draft = drafter in TAKES_DRAFT and (draft or "").strip()
        spec_t = policy.app_model(target)
        spec_d = policy.app_model(draft) if use_draft else None
        return markdown(diagnose(spec_t, spec_d, dtype or "auto", tokens=int(max_new_tokens) + 1024))
    except UserError as exc:
        return f"❌ {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken config must not take the app down
        log.exception("pair check failed")
        return f"❌ the pair check failed ({type(exc).__name__}: {exc})."


def memory_tick():
    SAMPLER.start()
    weights = {m.spec: m.weight_bytes / 2**20 for m in MODELS.loaded()}
    return charts.as_plot(charts.memory_figure(SAMPLER.snapshot(), SAMPLER.source, weights))

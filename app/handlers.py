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
from dataclasses import dataclass, field, replace
from pathlib import Path

import gradio as gr

from app import charts, heads, render
from app.jobs import api_error
from app.memory import SAMPLER
from engine import policy, presets
from engine.compare import stream_compare
from engine.decoding.metrics import RunResult, summarise
from engine.decoding.suffix import memory_for
from engine.errors import UserError, blame
from engine.events import Comparison, Done, Event, RunDone, RunStarts, Status, Step
from engine.models.loading import MODELS
from engine.settings import HEAD_NAMES, LABELS, TAKES_DRAFT, Settings, check_prompt

log = logging.getLogger("specarena")
# Each refresh costs the server (rendering, diffing, streaming) and the browser CPU that, on a CPU machine,
# the model would otherwise use: text twice a second, charts every two seconds, everything at phase ends.
RENDER_EVERY = 0.5
CHART_EVERY = 2.0
# Before a timed run starts, the server sends what was rendered and the browser draws it (on a CPU machine,
# on the same cores as the model): wait that long, outside the engine's clocks, so that no rendering of
# one run lands in the other's time to first token. Charts are drawn at the end of the comparison, not
# between the runs.
SETTLE = 0.4

# Settings a caller of the app may set: every Settings field but those the operator decides for the machine
# (device, compile) and warm-up (always on: numbers without it are not honest).
API_FIELDS = [name for name in Settings.names() if name not in ("device", "compile", "warmup")]

HISTORY_COLUMNS = [
    "time", "status", "target", "drafter", "draft", "γ", "temperature", "max new", "speedup ×", "acceptance",
    "base tok/s", "spec tok/s", "lossless",
]  # fmt: skip


class StopFlags:
    """One stop flag per browser session, so a Stop from one user never stops another's run. A press of Run
    reserves the session's flag before its run waits for the device (`reserve`), so that Stop also reaches a run
    that has not started yet."""

    def __init__(self):
        self._flags: dict[str, threading.Event] = {}
        self._started: set[str] = set()
        self._lock = threading.Lock()

    def reserve(self, session: str) -> None:
        with self._lock:
            if session not in self._started:
                self._flags[session] = threading.Event()

    def start(self, session: str) -> threading.Event:
        """The session's flag for a run that starts now: the reserved one (perhaps already set: stopped while it
        waited), or a new one."""
        with self._lock:
            flag = self._flags.get(session) if session not in self._started else None
            flag = self._flags[session] = flag or threading.Event()
            self._started.add(session)
            return flag

    def running(self, session: str) -> bool:
        with self._lock:
            return session in self._started

    def stop(self, session: str) -> str | None:
        """Set the session's flag; "running", "waiting" (reserved, not started) or None (nothing to stop)."""
        with self._lock:
            flag = self._flags.get(session)
            started = session in self._started
        if flag is None:
            return None
        flag.set()
        return "running" if started else "waiting"

    def finish(self, session: str, flag: threading.Event) -> None:
        with self._lock:
            if self._flags.get(session) is flag:
                del self._flags[session]
                self._started.discard(session)


STOPS = StopFlags()


def session_of(request, suffix: str = "") -> str:
    """The browser session's key for stop flags (API calls without a session share one)."""
    return (getattr(request, "session_hash", None) or "anonymous") + suffix


def settings_from(**form) -> Settings:
    """Form or API values -> validated Settings; model names pass the operator's policy."""
    s = Settings.from_form(**form).validate()
    for name in ("target", "draft"):
        if name == "target" or (s.drafter in TAKES_DRAFT and s.draft):
            with blame(name):
                s = replace(s, **{name: policy.app_model(getattr(s, name))})
    return s


@dataclass
class Live:
    """Everything seen so far in one comparison, ready to render."""

    steps: dict[str, list] = field(default_factory=lambda: {"baseline": [], "speculative": []})
    results: dict[str, RunResult] = field(default_factory=dict)
    status: str = ""
    comparison: Comparison | None = None
    running: str | None = None
    number: int = 0  # this session's run number, shown in the status line
    error: UserError | None = None  # what made the run fail, if it did
    started: float = field(default_factory=time.monotonic)
    begun: bool = False  # a timed run has started (before: loading and warming up)

    def add(self, event: Event) -> None:
        if isinstance(event, (Status, RunStarts)):
            self.status = event.message
            self.begun = self.begun or isinstance(event, RunStarts)
            if isinstance(event, RunStarts):  # its stats say "running" before its first token
                self.running = event.mode
        elif isinstance(event, Step):
            self.running = event.mode
            self.steps[event.mode].append(event.event)
        elif isinstance(event, RunDone):
            self.results[event.mode] = event.result
        elif isinstance(event, Done):
            self.comparison, self.running = event.comparison, None
            took = time.monotonic() - self.started
            self.status = f"stopped after {took:.1f} s: partial runs, not compared" if event.comparison.stopped \
                else f"done in {took:.1f} s"

    def run(self, mode: str) -> RunResult | None:
        if mode in self.results:
            return self.results[mode]
        return summarise(mode, self.steps[mode], "") if self.steps[mode] else None

    def status_line(self) -> str:
        """The one-line status as HTML; a failure's detail (a server's log) folded under it."""
        text = " · ".join(part for part in (f"run {self.number}" if self.number else "", self.status) if part)
        error = self.error
        return render.status_line(text, error.detail if error else "", error=error is not None)

    def outputs(self, chart: bool = True) -> tuple:
        """(status, baseline pane, speculative pane, summary, chart); chart=False leaves the chart as it is."""
        base, spec = self.run("baseline"), self.run("speculative")
        done = self.comparison
        hint = render.verdict_badge(done.verdict, done.stopped) if done else ""
        engine = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}.get(done.environment.get("backend")) if done else None
        if engine:
            hint += render.unreported(engine)
        # an empty pane says what is happening (on a phone the status line may be out of view)
        before = f"{self.status}…" if self.status and not self.begun else "waiting…"
        base_pane = render.pane(
            "Baseline (target alone)",
            render.baseline_tokens(self.steps["baseline"]),
            render.stats_line(base.metrics if base else None, self.running == "baseline"),
            # until its first token, even once its timed run began ("running baseline…")
            waiting=f"{self.status}…" if self.status and not done else "waiting…",
        )
        spec_pane = render.pane(
            "Speculative (draft + target)",
            render.speculative_tokens(self.steps["speculative"]),
            render.stats_line(spec.metrics if spec else None, self.running == "speculative"),
            hint,
            waiting=before if not self.begun else "not run: the baseline was stopped" if done else
            "starts when the baseline ends…",
        )
        summary = render.summary(
            base.metrics if base else None,
            spec.metrics if spec and not self.running else None,
            done.verdict if done else None,
            done.speedup if done else None,
            stopped=bool(done and done.stopped),
            suspect=done.suspect if done else None,
            environment=done.environment if done else None,
            explanation=done.explanation if done else "",
        )
        figure = charts.as_plot(charts.live_figure(base, spec)) if chart else gr.skip()
        return self.status_line(), base_pane, spec_pane, summary, figure


def history_row(s: Settings, status: str, c: Comparison | None = None) -> list:
    """One row per run, whatever its end: done, stopped, or failed (with what failed)."""
    row = [time.strftime("%H:%M:%S"), status, s.target, s.drafter, s.draft, s.gamma, s.temperature,
           s.max_new_tokens]  # fmt: skip
    if c is None or c.speedup is None:
        return row + [None, None, None, None, None]  # failed or stopped: nothing measured, nothing compared
    sm, b = c.speculative.metrics, c.baseline.metrics
    acceptance = None if sm.acceptance_rate is None else round(sm.acceptance_rate, 3)
    return row + [round(c.speedup, 3), acceptance, round(b.tokens_per_s, 2), round(sm.tokens_per_s, 2),
                  c.verdict.kind if c.verdict else None]  # fmt: skip


def write_downloads(c: Comparison | None, history: list[list]) -> list[str]:
    """The last run as JSON (settings, versions, device, metrics, per-step trace) and the history as CSV."""
    folder = Path(tempfile.mkdtemp(prefix="specarena-"))
    paths = []
    if c is not None:
        paths.append(folder / "specarena-run.json")
        paths[-1].write_text(json.dumps(c.to_dict(), indent=1))
    paths.append(folder / "specarena-history.csv")
    with paths[-1].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HISTORY_COLUMNS)
        writer.writerows(history)
    return [str(p) for p in paths]


def api_result(c: Comparison | None) -> dict:
    """What an API client most wants: both texts, the key metrics, the losslessness verdict, and why speculation
    lost or won under its prediction."""
    if c is None:
        return {}
    data = c.to_dict(with_steps=False)
    keys = ("status", "baseline", "speculative", "identical", "verdict", "speedup", "suspect", "explanation",
            "settings", "environment", "started_at", "finished_at")  # fmt: skip
    return {k: data[k] for k in keys}


# Where each setting sits in the sidebar (fields not named here sit at its top, always in view); a field error
# opens the sidebar and the field's group, so that the message under the field is seen.
GROUPS = ("speculation", "sampling", "numerics")
GROUP_OF = {"gamma": "speculation", "adaptive": "speculation", "ngram": "speculation", "p_min": "speculation",
            "draft_min": "speculation", "topk": "speculation", "alpha": "speculation", "max_new_tokens": "sampling",
            "temperature": "sampling", "top_p": "sampling", "top_k": "sampling", "seed": "sampling",
            "dtype": "numerics", "strict": "numerics", "chat": "numerics"}  # fmt: skip


def reveal(field: str | None) -> tuple:
    """Updates for (the sidebar, each group): open those that hold `field`, leave the rest as they are."""
    group = GROUP_OF.get(field or "")
    sidebar = gr.update(open=True) if field and field != "prompt" else gr.skip()
    return (sidebar, *(gr.update(open=True) if g == group else gr.skip() for g in GROUPS))


def refused(exc: UserError) -> tuple:
    """(status, field error, sidebar, groups) for a value refused before any run started: the message once,
    under the field at fault, which is opened into view; the status line only points at it; no run counted.
    The server log gets one line, not a traceback (it is the user's to fix, not a fault of ours)."""
    label = LABELS.get(exc.field, exc.field) if exc.field else ""
    log.warning("refused: %s%s", exc, f" (field: {exc.field})" if exc.field else "")
    text = f"not started: check {label}, as marked" if label else f"not started: {exc}"
    return render.status_line(text, error=True), render.field_error(exc), *reveal(exc.field)


def compare(prompt, history, shown=None, request: gr.Request = None, **form):
    """Run baseline then speculative and stream both. Yields (result, status, panes, summary, chart, history,
    history table, downloads, field error, run-again button, sidebar, groups, shown). `shown`: what the panes, the
    summary and the chart showed when the last run ended (a session's state), put back where a value is refused
    once the pair has begun to open, so that a refused press never wipes a result."""
    history = list(history or [])
    skip = (gr.skip(),) * 7
    keep = (gr.skip(),) * (2 + len(GROUPS))  # run-again button, sidebar, groups: as they are
    session = session_of(request)
    stop = STOPS.start(session)
    try:
        if stop.is_set():  # Stop was pressed while this run waited for the device
            yield (gr.skip(), render.status_line("not started: stopped while it waited for the device"), *skip, "",
                   *keep, gr.skip())  # fmt: skip
            return
        try:
            check_prompt(prompt)
            s = settings_from(**form)
        except UserError as exc:  # nothing ran: mark the field (the message sits under it), count no run
            status, error, *opened = refused(exc)
            yield (gr.skip(), status, *skip, error, gr.skip(), *opened, gr.skip())
            raise api_error(exc) from None
        RUNNING[session] = {"prompt": prompt, **form}
        yield from _stream(s, prompt, history, session, stop, shown)
    finally:
        RUNNING.pop(session, None)
        STOPS.finish(session, stop)


def _stream(s: Settings, prompt: str, history: list, session: str, stop: threading.Event, shown=None):
    skip = (gr.skip(),) * 7
    keep = (gr.skip(),) * (2 + len(GROUPS))
    live, last_text, last_chart = Live(number=len(history) + 1), 0.0, 0.0
    live.status = "starting"
    yield (gr.skip(), *live.outputs(chart=False), *skip[:3], "", gr.update(visible=False), *keep[1:], gr.skip())
    try:
        for event in stream_compare(s, prompt, stop, memory=memory_for(session)):
            live.add(event)
            now = time.monotonic()
            streaming = isinstance(event, Step)
            if not streaming or now - last_text >= RENDER_EVERY:
                # the chart is left as it is until a timed run begins: loading and warming up have nothing to chart,
                # and a value refused while the pair opens leaves the last run's chart in place
                chart = live.begun and (now - last_chart >= CHART_EVERY if streaming else
                                        not isinstance(event, (RunStarts, RunDone)))  # fmt: skip
                last_text, last_chart = now, now if chart else last_chart
                yield (gr.skip(), *live.outputs(chart), *skip[:4], *keep, gr.skip())
            if isinstance(event, RunStarts):
                time.sleep(SETTLE)  # the run's clocks start when the next event is asked for
    except Exception as exc:  # noqa: BLE001 - the app must keep serving
        if isinstance(exc, UserError) and exc.field and not live.begun:
            # a value the pair refused while opening (an unknown Hub id, a head that is missing, a prompt past the
            # context): as a refused field, not a run; the panes, summary and chart go back to the last run's
            status, error, *opened = refused(exc)
            yield (gr.skip(), status, *(shown or Live().outputs()[1:]), *skip[:3], error, gr.skip(), *opened,
                   gr.skip())  # fmt: skip
            raise api_error(exc) from None
        if not isinstance(exc, UserError):
            log.exception("comparison failed")
            exc = UserError(f"the run failed unexpectedly ({type(exc).__name__}: {exc}); the app is still running.")
        else:
            log.warning("run %d failed: %s", live.number, exc)
        live.status, live.error = f"failed: {exc}", exc
        history.append(history_row(s, "failed"))
        status, *now = live.outputs()
        yield (gr.skip(), status, *now, history, history, write_downloads(None, history),
               render.field_error(exc) if exc.field else "", gr.skip(), *reveal(exc.field), tuple(now))  # fmt: skip
        raise api_error(exc) from None
    c = live.comparison
    history.append(history_row(s, c.status + (" (suspect)" if c.suspect else ""), c))
    status, *now = live.outputs()
    yield (api_result(c), status, *now, history, history, write_downloads(c, history), "",
           gr.update(visible=bool(c.suspect)), *keep[1:], tuple(now))  # fmt: skip


# What each session's running comparison was started with (the prompt and the form, as sent): a field changed
# since then applies to the next run, and the page says so.
RUNNING: dict[str, dict] = {}


def changed_since_run(prompt, request: gr.Request, **form) -> str:
    """The note under the status line while a run goes: which settings now differ from the running ones."""
    started = RUNNING.get(session_of(request))
    if not started:
        return ""
    now = {"prompt": prompt, **form}
    names = [LABELS.get(name, name) for name in now if name in started and now[name] != started[name]]
    return render.next_run_note(names)


def announce(request: gr.Request) -> tuple:
    """At the press of Run, before the run waits for the device: (Run button, status line, note). Run says that
    it runs; where another run holds the device, the status line says this one waits, and its place in line."""
    session = session_of(request)
    if STOPS.running(session):  # Enter in the prompt during this session's run: it runs next
        return gr.skip(), gr.skip(), render.next_run_note([], queued=True)
    STOPS.reserve(session)
    ahead = device_jobs(request)
    status = "starting" if not ahead else \
        f"queued, {ordinal(ahead + 1)} in line: another session's run holds the device; this one starts after"
    return gr.update(value="running…", interactive=False), render.status_line(status), gr.skip()


def settle() -> tuple:
    """After a run, however it ended: (Run button, note) as before it."""
    return gr.update(value="Run", interactive=True), ""


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def device_jobs(request) -> int:
    """Runs and sweeps that hold the device or wait for it (Gradio's queue for concurrency id "device");
    0 where the queue cannot be read."""
    try:
        queue = request.request.app.get_blocks()._queue
        jobs = queue.event_queue_per_concurrency_id["device"]
        return jobs.current_concurrency + len(jobs.queue)
    except (AttributeError, KeyError, TypeError):
        return 0


def stop(request: gr.Request) -> tuple:
    """(status, Run button): a running run stops after its current step, a waiting one never starts."""
    state = STOPS.stop(session_of(request))
    if state == "running":
        return render.status_line("stopping after the current step…"), gr.update(value="stopping…")
    if state == "waiting":
        return render.status_line("stopped: the run waiting for the device will not start"), gr.skip()
    return render.status_line("nothing is running"), gr.skip()


def forget(request: gr.Request) -> str:
    """Empty this session's suffix memory: the suffix drafter starts again from the current prompt alone."""
    memory = memory_for(session_of(request))
    tokens = len(memory)
    memory.clear()
    return render.status_line(f"suffix memory cleared: {tokens} tokens of earlier runs forgotten")


def clear():
    """Empty panes, summary, chart, status and field marks, and hide run-again, and forget what they showed (a
    refused run then puts back empty panes); the prompt and the history stay."""
    return ({}, *Live().outputs(), "", gr.update(visible=False), None)


def offer_heads(drafter, target) -> tuple:
    """(the heads list, the line under it) for the drafter and target in the form. A head drafter lists the heads
    there are for this target: forged ones (newest first), then the presets'; picking one fills the draft field.
    With none, the line says where one comes from: the Lab's forge (EAGLE-3), or the presets' other targets."""
    if drafter not in HEAD_NAMES:
        return gr.update(choices=[], value=None, visible=False), ""
    found = heads.offered(target, drafter)
    if found:
        return gr.update(choices=[(h.label, h.spec) for h in found], value=None, visible=True), ""
    name, others = HEAD_NAMES[drafter], ", ".join(heads.elsewhere(drafter))
    where = "forge one for it in the Lab tab's \"Forge a head\" section" if drafter in ("eagle3", "dflash") else \
        f"the Lab's forge trains EAGLE-3 and DFlash heads; load a {name} the speculators trainer made"
    presets_too = f"; the presets have one for {others}" if others else ""
    return gr.update(choices=[], value=None, visible=False), render.hint(f"No {name} for this target yet: {where}"
                                                                          f"{presets_too}.")


def head_picked(spec):
    """The draft field for a head picked from the list (as it is when the list is emptied)."""
    return spec if spec else gr.skip()


PRESET_FIELDS = ("target", "drafter", "draft", "gamma", "dtype", "alpha")


def apply_preset(name: str):
    """Preset -> its PRESET_FIELDS (defaults where it names none), and the note shown under the dropdown."""
    p = presets.pair(name)
    note = f"{p['note']}  \n*Measured on:* {p['measured_on']}"
    return (*(p.get(f, getattr(Settings, f)) for f in PRESET_FIELDS), note)


def check_pair(**form):
    """The pair doctor's report as Markdown, before any weights load."""
    from engine.models.doctor import diagnose, markdown

    try:
        s = settings_from(**form)
        draft = s.draft if s.uses_draft else None
        if s.backend == "llama.cpp":
            from engine.backends import llamacpp

            return render.text_marks(markdown(llamacpp.doctor(s, gamma=s.gamma)))
        return render.text_marks(markdown(diagnose(s.target, draft, s.dtype, tokens=s.max_new_tokens + 1024,
                                                   head=s.uses_head, gamma=s.gamma)))  # fmt: skip
    except UserError as exc:
        return render.text_marks(f"❌ {exc}")
    except Exception as exc:  # noqa: BLE001 - a broken config must not take the app down
        log.exception("pair check failed")
        return render.text_marks(f"❌ the pair check failed ({type(exc).__name__}: {exc}).")


def memory_tick():
    SAMPLER.start()
    weights = {m.spec: m.weight_bytes / 2**20 for m in MODELS.loaded()}
    return charts.as_plot(charts.memory_figure(SAMPLER.snapshot(), SAMPLER.source, weights))

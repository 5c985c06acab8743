"""The page's long jobs (the Lab's sweep, the Forge): one bridge from a job's thread to the page, one way to mark a
refused value under its field, one way to say a failure.

A job's torch work runs on the engine thread (engine.worker); its generator of page updates runs in Gradio's worker
thread and must stay free to yield, so the job runs in a thread of its own and hands what it reports over a queue
(`follow`). A job's fields are its own table ({name: label}); `marked` puts a refused value's message under the field
at fault once, and the status line only points at it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import gradio as gr

from app import render
from engine.errors import UserError
from engine.settings import LABELS

log = logging.getLogger("specarena")

_END = object()  # the job's thread is done: its result (or error) is in the future


def follow(work: Callable, name: str, every: float = 0.0) -> Iterator:
    """work(report) in a thread named `name`; yields what it reports (report(item)), as it reports it, and returns
    its result or raises its error. With `every` above 0, only the latest item is yielded, at most every `every`
    seconds (a progress line, where a newer one makes the older one moot); one held back is yielded once its time
    comes, so a long step after it does not hide it."""
    items: queue.SimpleQueue = queue.SimpleQueue()
    future: Future = Future()

    def target():
        try:
            future.set_result(work(items.put))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller below
            future.set_exception(exc)
        finally:
            items.put(_END)

    threading.Thread(target=target, name=name, daemon=True).start()
    latest, shown, ended = _END, 0.0, False
    while not ended:
        try:
            item = items.get(timeout=max(every, 0.05)) if every else items.get()
        except queue.Empty:
            item = None  # nothing new: a held-back item may be due
        else:
            if item is _END:
                ended = True
            elif not every:
                yield item
            else:
                latest = item
        if every and latest is not _END and (ended or time.monotonic() - shown >= every):
            yield latest
            latest, shown = _END, time.monotonic()
    return future.result()


def api_error(exc: UserError) -> gr.Error:
    """The message for an API caller. The page shows it once, where it belongs (under the field at fault, or in
    the status line), so no toast repeats it."""
    where = f" (field: {exc.field})" if exc.field else ""
    return gr.Error(f"{exc}{where}", visible=False, print_exception=False)


def marked(exc: UserError, job: str, fields: dict[str, str], element: Callable[[str], str],
           aliases: dict[str, str] | None = None, sidebar: bool = False) -> tuple[str, str]:  # fmt: skip
    """(status line, field mark) for a value the job refused: the message once, under the field at fault, the status
    line pointing at it; the server log gets one line. `fields` is the job's own {name: label} (its elements:
    element(name)); `aliases` maps the engine's name for a value to the job's field (the forge's `target` is its own
    target box); with `sidebar`, a field the job does not own is the sidebar's (the Playground's pair and sampling
    settings). Anything else is said in the status line alone."""
    log.warning("%s refused: %s%s", job, exc, f" (field: {exc.field})" if exc.field else "")
    exc.field = (aliases or {}).get(exc.field, exc.field)  # the API caller's error names the job's field too
    if exc.field in fields:
        where, label = element(exc.field), fields[exc.field]
    elif exc.field and sidebar:
        where, label = render.field_id(exc.field), f"{LABELS.get(exc.field, exc.field)} (in the settings)"
    else:
        return render.status_line(f"not started: {exc}", error=True), ""
    return render.status_line(f"not started: check {label}, as marked", error=True), render.field_error(exc, where)


def job_failure(exc: Exception, marked: Callable, what: str) -> tuple[str, str, gr.Error]:
    """A job (a sweep, a forge) that failed: (status line, field mark, the error for API callers). A user's mistake
    is marked under its field by `marked` (the job's own, over its field table); a fault of ours is logged with its
    traceback and said in one sentence, and the app keeps serving. Call it inside the `except`."""
    if isinstance(exc, UserError):
        status, mark = marked(exc)
        status = status.replace("not started", "failed") if mark else render.status_line(f"failed: {exc}", error=True)
        return status, mark, api_error(exc)
    log.exception("%s failed", what)
    exc = UserError(f"the {what} failed unexpectedly ({type(exc).__name__}: {exc}); the app is still running.")
    return render.status_line(f"failed: {exc}", error=True), "", api_error(exc)

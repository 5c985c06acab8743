"""The forge from a waiting thread (the CLI's): the work runs on the engine thread, this one waits and takes Ctrl-C.

All of the engine's torch work runs on one thread (engine.worker): two threads' OpenMP teams on a 2-core CPU slow
each other up to 2x. So `forge` hands the engine thread one step of the forge's events at a time and waits in short
slices, which leaves the waiting thread free to take a Ctrl-C: a first one stops the forge as the Lab's Stop does
(the best state is written), a second one leaves at once.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Iterator

from engine.forge.pipeline import ForgeConfig, ForgeEvent, forge_events


def forge(cfg: ForgeConfig, progress=lambda event: None, stop: threading.Event | None = None) -> dict:
    """Run the forge to the end on the engine thread; `progress` gets every ForgeEvent. Returns the summary
    (forge-report.json), empty when the forge made no head."""
    from engine.worker import ENGINE

    stop = stop or threading.Event()
    events = forge_events(cfg, stop, progress)
    result: dict = {}
    try:
        with CtrlC(stop) as ctrl_c:
            while (event := _next_on_engine(events, ctrl_c, progress)) is not None:
                progress(event)
                if event.phase == "done":
                    result = event.metrics.get("result", {})
    except KeyboardInterrupt:  # the second: the engine thread still runs its step, and the process leaves
        raise
    except BaseException:
        ENGINE.call(events.close)  # its clean-up (the thread count) where it ran
        raise
    return result


class CtrlC:
    """While the forge runs from the main thread: a first Ctrl-C (SIGINT) sets its stop flag wherever the thread is
    (printing a line, handing the engine its next step), and a second raises KeyboardInterrupt. Python's own handler
    raises at the first, on whatever line the thread is: one that landed while a progress line was printed left the
    forge there, without its head. Elsewhere (another thread; SIGINT ignored or handled by the caller) it stays out
    of the way."""

    def __init__(self, stop: threading.Event):
        self.stop, self.pressed, self.told, self.previous = stop, False, False, None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # fmt: skip
            self.previous = signal.signal(signal.SIGINT, self._pressed)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _pressed(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True  # the handler runs on the main thread, as does tell()
        self.stop.set()

    def tell(self, progress) -> None:
        """The stop event, once, from the waiting loop (not from the handler, which may interrupt a print)."""
        if self.pressed and not self.told:
            self.told = True
            progress(ForgeEvent("stop", "stopping at the next batch; the best state so far is kept (Ctrl-C again "
                                "to leave now)", 0.0))  # fmt: skip


def _next_on_engine(events: Iterator[ForgeEvent], ctrl_c: CtrlC, progress) -> ForgeEvent | None:
    from engine.worker import ENGINE

    step = ENGINE.submit(next, events, None)
    while True:
        try:
            # a short wait, again and again: a SIGINT the kernel hands to the busy engine thread only marks Python's
            # handler as due, and a main thread blocked in one long wait would not run it until the step ended
            event = step.result(timeout=0.2)
        except FutureTimeout:
            ctrl_c.tell(progress)
            continue
        ctrl_c.tell(progress)
        return event

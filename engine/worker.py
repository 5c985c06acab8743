"""All of the engine's torch work on one long-lived thread.

PyTorch's CPU kernels run on an OpenMP team, and every thread that runs torch work gets a team of its own.
Two teams on the same few cores fight: on a 2-core Xeon a 1x576 by 576x1536 product took 67 us in the main
thread and 224 us in a worker thread started after the main thread had run torch work, and a comparison ran
at 15.5-18.4 tok/s in the main thread and 9.7-10.1 tok/s in a thread started after it. A web server runs
each request, even each step of a streamed one, on whichever of its worker threads is free, so without care
every thread of its pool ends up with a team.

So loading, warming up, decoding, timing passes and Hugging Face's `generate()` all run here, on ENGINE:
`call` runs a function on it and returns its result, `iterate` advances a generator on it one item per
`next()` (the decoding loops keep their lock-step with the consumer: a loop's clocks stop while the
consumer renders), `submit` starts a function there and returns at once. Called from the engine thread
itself, each runs inline. Jobs run one at a time, in the order they come, which is also what a device
wants: two generations at once would each slow the other. A job may say what it is doing (`note`); a caller
whose job waits behind it is told (`in_thread`), so that a first click during the start-up's model load reads
what the engine does, not a bare "loading".
"""

from __future__ import annotations

import contextvars
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Generator, Iterable, Iterator, TypeVar

from engine.events import Status

T = TypeVar("T")


class EngineThread:
    def __init__(self, name: str = "specarena-engine"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.doing = ""  # what the job now running last said it does (note); "" between jobs

    def note(self, message: str) -> None:
        """Say what the running job is doing, for callers waiting behind it."""
        self.doing = message

    def on_it(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) on the engine thread, in the caller's context (Gradio reaches its progress
        bars through context variables); the Future holds its result or its error."""
        future: Future = Future()
        context = contextvars.copy_context()
        if self.on_it():
            _fulfil(future, lambda: context.run(fn, *args, **kwargs))
            return future
        self._start()
        self._jobs.put((future, lambda: context.run(fn, *args, **kwargs)))
        return future

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return self.submit(fn, *args, **kwargs).result()

    def iterate(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, each next() run on the engine thread. A consumer that stops early closes the generator
        there too, so its `finally` blocks and context managers also run on the engine thread."""
        it = iter(items)
        if self.on_it():
            yield from it
            return
        try:
            while True:
                try:
                    value = self.call(next, it)
                except StopIteration:
                    return
                yield value
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                self.call(close)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            future, job = self._jobs.get()
            if future.set_running_or_notify_cancel():
                _fulfil(future, job)
            self.doing = ""


def _fulfil(future: Future, job: Callable) -> None:
    try:
        future.set_result(job())
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(exc)


ENGINE = EngineThread()


def in_thread(work) -> Generator[Status, None, object]:
    """Run work(say) on the engine thread (engine.worker), yielding what it says as Status events while it runs,
    and return its result (or raise its error here). Loading a model or starting a server takes a while, and
    what it reports (a download's progress, a server's log) should reach the caller as it happens. On the
    engine thread itself (a benchmark runs whole there) the work runs inline and its messages follow it."""
    if ENGINE.on_it():
        said: list[str] = []
        value = work(said.append)
        for message in said:
            yield Status(message)
        return value
    messages: queue.Queue = queue.Queue()
    job = ENGINE.submit(work, messages.put)
    job.add_done_callback(lambda _: messages.put(None))
    relayed = ""
    while True:
        try:
            message = messages.get(timeout=0.5)
        except queue.Empty:  # still waiting behind another job: say what that one does, once per message
            doing = ENGINE.doing
            if not job.running() and not job.done() and doing and doing != relayed:
                relayed = doing
                yield Status(f"waiting for the engine: {doing}")
            continue
        if message is None:
            break
        yield Status(message)
    return job.result()

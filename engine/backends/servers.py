"""Engine servers that SpecArena starts and stops itself (vLLM, llama-server): one process each, on loopback
and a free port, with its log in a file.

A server is reused while its command line is unchanged and stopped when the app exits. It runs in its own
process group and dies with its parent (PR_SET_PDEATHSIG on Linux), so not even a crash of the app leaves
one behind. A server that fails to start is reported with the last lines of its log.

A start takes minutes on a CPU (vLLM compiles its model), and so do llama.cpp's conversion and build: while one
runs, its log is read for the phase it has reached (`log_phase`, with each program's own marker lines), and the
caller is told that phase and the time so far, so that a long wait reads as progress rather than a hang. On a CPU
machine the idle servers of another backend are stopped before a comparison (`make_room`): two idle vLLM servers
beside two busy llama-servers are four engines on two cores.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine.errors import UserError

LOG_LINES = 15  # of a failed server's log, shown to the user
TICK = 5.0  # seconds between two progress lines of an unchanged phase
NAMES = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}  # backends as the page writes them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GUARD = Path(__file__).with_name("guard.py")


def http_json(url: str, payload: dict | None = None, timeout: float = 10, headers: dict | None = None):
    """GET (or POST `payload`) and parse the JSON answer; urllib errors propagate."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def remote_urls(engine: str) -> tuple[str, str] | None:
    """SPECARENA_<ENGINE>_BASELINE_URL and _SPECULATIVE_URL: running servers to compare on, or None."""
    names = [f"SPECARENA_{engine}_{role}_URL" for role in ("BASELINE", "SPECULATIVE")]
    base, spec = (os.environ.get(name) for name in names)
    if bool(base) != bool(spec):
        raise UserError(f"set both {names[0]} and {names[1]}, or neither.")
    return (base.rstrip("/"), spec.rstrip("/")) if base else None


def failure(engine: str, role: str, url: str | None, exc: Exception) -> UserError:
    """What went wrong with a server's request, in words: refused, died (with its log), or silent."""
    server = POOL.find(url or "")
    if isinstance(exc, urllib.error.HTTPError):
        body = exc.read().decode(errors="replace")[:500]
        return UserError(f"the {engine} {role} server refused the request ({exc.code}: {body}).")
    if server is not None and not server.alive():
        return server.died(f"the {engine} {role} server died during the run")
    return UserError(f"the {engine} {role} server at {url} stopped answering ({exc}).")


def exit_words(code: int | None) -> str:
    """A process's end in words: a signal by its name (the guardian exits 128 + N for signal N, as shells do)."""
    if code is None:
        return "is still running"
    number = -code if code < 0 else code - 128 if code > 128 else 0
    if number:
        try:
            return f"was killed by signal {number} ({signal.Signals(number).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def last_error(log: str) -> str:
    """The line of a log most likely to say why a server stopped: a Python exception's last line (vLLM), else the
    first error line (llama.cpp logs its cause, then the consequences), else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    errors = [line for line in lines if re.search(r" E |error|fatal|failed|couldn't|cannot", line, re.IGNORECASE)]
    return (raised[-1:] or errors[:1] or lines[-1:] or [""])[0][:300]


def sse(response, last, fail):
    """The JSON chunks of a server-sent event stream until `last(data, chunk)` says the stream is complete
    (chunk is None for a non-JSON data line such as [DONE]). A stream that ends before that, or breaks, is
    the server's failure (`fail(exc)` makes the error), never a short answer."""
    try:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            chunk = None if data == "[DONE]" else json.loads(data)
            if chunk is not None:
                yield chunk
            if last(data, chunk):
                return
    except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as exc:
        raise fail(exc) from None
    raise fail(EOFError("the stream ended before its last event"))


# --- progress read from a log ---------------------------------------------------------------------------------


def log_phase(text: str, phases: list[tuple[str, str]]) -> str | None:
    """The phase a log has reached: the label of the pattern that its last matching line matches (`phases`:
    (regex, label) pairs; a label may take the match's groups, as "compiling, {0}% done"), or None where no line
    matches. Carriage returns end lines too: progress bars redraw one line with them."""
    for line in reversed(text.replace("\r", "\n").splitlines()):
        for pattern, label in phases:
            found = re.search(pattern, line)
            if found:
                return label.format(*found.groups())
    return None


def took(seconds: float) -> str:
    """A wait in words: seconds up to two minutes, then minutes and seconds."""
    seconds = int(seconds)
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60:02d} s"


class Watch:
    """A process's progress, read from its log as it grows: only the bytes added since the last look are read
    (a vLLM log runs to thousands of lines), and the phase is the last one they show. `news` says when there is
    something to tell: a new phase, or TICK seconds more of the same one (a line that never changes reads as a
    hang)."""

    def __init__(self, log_path: Path, phases: list[tuple[str, str]], first: str = "starting"):
        self.log_path, self.phases = log_path, phases
        self.phase, self.started = first, time.monotonic()
        self._read, self._rest, self._told = 0, "", (None, 0.0)

    def look(self) -> str:
        """The phase now."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._read)
                added = log.read()
        except OSError:
            return self.phase
        self._read += len(added)
        text = self._rest + added.decode(errors="replace")
        lines = text.replace("\r", "\n").rsplit("\n", 1)
        self._rest = lines[1] if len(lines) > 1 else text  # a line still being written waits for its end
        self.phase = log_phase(lines[0] if len(lines) > 1 else "", self.phases) or self.phase
        return self.phase

    def elapsed(self) -> str:
        return took(time.monotonic() - self.started)

    def news(self, phase: str) -> bool:
        """Whether `phase` (one phase, or several servers' phases in a line) is worth a line now; if so, it counts
        as told."""
        last, at = self._told
        now = time.monotonic()
        if phase == last and now - at < TICK:
            return False
        self._told = (phase, now)
        return True


def run_watched(command: list[str], what: str, phases: list[tuple[str, str]], progress=lambda message: None,
                env: dict | None = None) -> tuple[int, str]:  # fmt: skip
    """Run `command` to its end, its output in a log file, telling `progress` "`what`: phase (elapsed; log: ...)"
    as it goes: llama.cpp's conversion of a model and its build take minutes. (exit code, the log's text)."""
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")[:40]
    handle, name = tempfile.mkstemp(prefix=f"{slug}-", suffix=".log", dir=log_folder())
    os.close(handle)
    log_path = Path(name)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    watch = Watch(log_path, phases)
    try:
        while True:
            try:
                process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                phase = watch.look()
                if watch.news(phase):
                    progress(f"{what}: {phase} ({watch.elapsed()}; log: {log_path})")
    finally:
        if process.poll() is None:  # interrupted: the command does not outlive the wait for it
            process.kill()
            process.wait()
    return process.returncode, log_path.read_text(errors="replace")


_LOGS: list[Path] = []


def log_folder() -> Path:
    """One folder for this process's server and build logs, so that a line can point at all of them at once."""
    if not _LOGS or not _LOGS[0].is_dir():
        _LOGS[:] = [Path(tempfile.mkdtemp(prefix="specarena-logs-"))]
    return _LOGS[0]


# --- servers ---------------------------------------------------------------------------------------------------


class Server:
    """One engine server process: `command` must listen on `port`; `ready` is its health URL path. `explain`,
    given the exit code and the log of a server that ended, names the likely cause and the fix where the
    engine knows one (None where it does not). `phases` read its log while it starts (log_phase); `backend`,
    `model` and `role` say what it serves, for the list of servers up (Pool.up)."""

    def __init__(self, name: str, command: list[str], port: int, ready: str, env: dict | None = None,
                 explain=lambda code, log: None, phases: list[tuple[str, str]] = (), backend: str = "",
                 model: str = "", role: str = ""):  # fmt: skip
        self.name, self.command, self.port, self.ready = name, command, port, ready
        self.env = env or {}
        self.explain = explain
        self.phases, self.backend, self.model, self.role = list(phases), backend, model, role
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_folder() / f"{name}-{port}.log"
        self.process: subprocess.Popen | None = None
        self.since = 0.0  # wall clock of its launch
        self.watch = Watch(self.log_path, self.phases)

    def start(self, timeout: float, progress=lambda message: None) -> "Server":
        return self.launch().wait(timeout, progress)

    def launch(self) -> "Server":
        """Start the process and return at once (`wait` then waits for it to answer)."""
        log = self.log_path.open("wb")
        self._launched, self.since = time.monotonic(), time.time()
        self.watch = Watch(self.log_path, self.phases)
        try:
            self.process = subprocess.Popen(
                [sys.executable, str(GUARD), str(os.getpid()), "--", *self.command], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise UserError(f"could not start {self.name} ({exc}): check the path in {self.command[0]!r}.") from None
        return self

    def wait(self, timeout: float, progress=lambda message: None) -> "Server":
        """Wait until the launched server answers on its health path, at most `timeout` seconds from its launch."""
        wait_all([self], timeout, progress)
        return self

    def up_yet(self, timeout: float) -> bool:
        """Whether the launched server answers; a UserError if it ended, or has not answered `timeout` seconds
        after its launch."""
        if self.process.poll() is not None:
            raise self.died(f"{self.name} {exit_words(self.process.returncode)} while starting")
        if self.healthy():
            return True
        if time.monotonic() > self._launched + timeout:
            self.stop()
            raise UserError(f"{self.name} did not answer within {timeout:.0f} s, still {self.watch.phase} when it "
                            f"was stopped (its log: {self.log_path}).", detail=self.tail())  # fmt: skip
        return False

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready, timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def died(self, what: str) -> UserError:
        """A server that ended, in one sentence: what happened, why (the engine's explanation where it has one,
        else its log's last error line) and where the log is; the end of the log as the detail."""
        log = self.tail(200)
        code = self.process.returncode if self.process is not None else None
        cause = self.explain(code, log) or (f"it said: {last_error(log)}" if last_error(log) else "its log is empty")
        if code is not None and what.endswith("during the run"):
            what += f" ({exit_words(code)})"
        return UserError(f"{what}; {cause} (its log: {self.log_path}).", detail=self.tail())

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, lines: int = LOG_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").replace("\r", "\n")
        except OSError:
            return "(no log)"
        return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(20)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def wait_all(servers: list[Server], timeout: float, progress=lambda message: None) -> None:
    """Wait until every launched server answers (see Server.up_yet), telling `progress` each one's phase and the
    time since the first launch, in one line, whenever a phase changes and every TICK seconds."""
    pending, first = list(servers), servers[0]
    while True:
        pending = [server for server in pending if not server.up_yet(timeout)]
        if not pending:
            return
        line = starting_line(servers, pending)
        if first.watch.news(line):
            progress(f"{line} ({first.watch.elapsed()}; {where(servers)})")
        time.sleep(0.5)


def starting_line(servers: list[Server], pending: list[Server]) -> str:
    """ "starting vLLM baseline: compiling, vLLM speculative: up": each server's phase, read from its log."""
    return "starting " + ", ".join(f"{s.name}: {s.watch.look() if s in pending else 'up'}" for s in servers)


def where(servers: list[Server]) -> str:
    """Where the logs of `servers` are: the file of one, the folder of several."""
    if len(servers) == 1:
        return f"log: {servers[0].log_path}"
    return f"logs in {servers[0].log_path.parent}"


class Pool:
    """Running servers by their configuration: reused while it is unchanged, all stopped at exit."""

    def __init__(self):
        self._servers: dict[tuple, Server] = {}
        self._busy: dict[str, int] = {}  # url -> requests in flight there (in_use)
        self._lock = threading.Lock()
        atexit.register(self.stop_all)

    def get(self, key: tuple, make, timeout: float, progress=lambda message: None) -> Server:
        return self.get_many({key: make}, timeout, progress)[key]

    def get_many(self, wanted: dict, timeout: float, progress=lambda message: None,
                 together: bool = True) -> dict[tuple, Server]:  # fmt: skip
        """A server for each key of `wanted` (key -> make): reused where one runs and answers, else made and started,
        all the missing ones at once when `together` (a server on a CPU spends most of its start importing and
        loading on one core: two vLLM servers started together were up in about the time of one, 2-core CPU).
        If one fails to start, the others started with it are stopped."""
        with self._lock:
            found, starting = {}, []
            for key, make in wanted.items():
                server = self._servers.get(key)
                if server is not None and server.alive() and server.healthy():
                    found[key] = server
                    continue
                if server is not None:
                    server.stop()
                    del self._servers[key]
                starting.append((key, make()))
            try:
                if together and starting:
                    wait_all([server.launch() for _, server in starting], timeout, progress)
                for key, server in starting:
                    found[key] = server if together else server.start(timeout, progress)
            except BaseException:
                for _, server in starting:
                    server.stop()
                raise
            self._servers.update((key, server) for key, server in starting)
            return {key: found[key] for key in wanted}

    def stop_where(self, keep, backend: str | None = None) -> None:
        """Stop the servers (of `backend`, or all) whose key `keep(key)` rejects (e.g. another model's), to free
        their memory."""
        with self._lock:
            for key in [k for k, s in self._servers.items() if not keep(k) and backend in (None, s.backend)]:
                self._servers.pop(key).stop()

    @contextlib.contextmanager
    def in_use(self, url: str):
        """Mark the server at `url` busy while a request runs there, so that make_room never stops it."""
        with self._lock:
            self._busy[url] = self._busy.get(url, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._busy[url] -= 1

    def stop_idle(self, keep_backend: str) -> list[Server]:
        """Stop the servers of the other backends that no request is using; those stopped."""
        with self._lock:
            idle = [k for k, s in self._servers.items()
                    if s.backend and s.backend != keep_backend and not self._busy.get(s.url)]  # fmt: skip
            stopped = [self._servers.pop(key) for key in idle]
        for server in stopped:
            server.stop()
        return stopped

    def up(self) -> list[dict]:
        """The servers running now, for the page and a run's record: backend, model, role, port, since (wall
        clock)."""
        with self._lock:
            servers = [s for s in self._servers.values() if s.alive()]
        return [{"backend": s.backend, "model": s.model, "role": s.role, "port": s.port, "since": s.since}
                for s in servers]  # fmt: skip

    def stop_all(self) -> None:
        with self._lock:
            for server in self._servers.values():
                server.stop()
            self._servers.clear()

    def find(self, url: str) -> Server | None:
        """The server started at `url`, alive or not."""
        return next((server for server in self._servers.values() if server.url == url), None)

    def running(self) -> list[Server]:
        return [s for s in self._servers.values() if s.alive()]


POOL = Pool()


def servers_up() -> list[dict]:
    """The managed servers running now (Pool.up), e.g. for a run's environment."""
    return POOL.up()


def make_room(backend: str, need=lambda: 0, gpu: tuple[int, int] | None = None) -> str | None:
    """Before a comparison on `backend`, stop the idle managed servers of the other backend where they compete with
    it: on a CPU machine always (their threads and memory share the cores that the timed runs need), on a GPU only
    when less GPU memory is free than `need()` bytes (asked only there; `gpu`: (free, total) bytes, read from CUDA
    when not given). A line for the status, or None when nothing was stopped."""
    gpu = gpu if gpu is not None else gpu_memory()
    if gpu is not None and gpu[0] >= need():
        return None
    stopped = POOL.stop_idle(backend)
    if not stopped:
        return None
    names = sorted({NAMES.get(s.backend, s.backend) for s in stopped})
    what = "GPU memory" if gpu is not None else "the CPUs"
    count = f"{len(stopped)} idle server" + ("s" if len(stopped) > 1 else "")
    return f"stopped {' and '.join(names)}'s {count} to free {what} for {NAMES.get(backend, backend)}"


def gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the GPU, None on a machine without CUDA."""
    import torch

    return torch.cuda.mem_get_info() if torch.cuda.is_available() else None

"""Engine servers that SpecArena starts and stops itself (vLLM, llama-server): one process each, on loopback
and a free port, with its log in a file.

A server is reused while its command line is unchanged and stopped when the app exits. It runs in its own
process group and dies with its parent (PR_SET_PDEATHSIG on Linux), so not even a crash of the app leaves
one behind. A server that fails to start is reported with the last lines of its log.
"""

from __future__ import annotations

import atexit
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


class Server:
    """One engine server process: `command` must listen on `port`; `ready` is its health URL path. `explain`,
    given the exit code and the log of a server that ended, names the likely cause and the fix where the
    engine knows one (None where it does not)."""

    def __init__(self, name: str, command: list[str], port: int, ready: str, env: dict | None = None,
                 explain=lambda code, log: None):  # fmt: skip
        self.name, self.command, self.port, self.ready = name, command, port, ready
        self.env = env or {}
        self.explain = explain
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="specarena-server-")) / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float, progress=lambda message: None) -> "Server":
        return self.launch().wait(timeout, progress)

    def launch(self) -> "Server":
        """Start the process and return at once (`wait` then waits for it to answer)."""
        log = self.log_path.open("wb")
        self._launched = time.monotonic()
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
        deadline, said = self._launched + timeout, 0.0
        while True:
            if self.process.poll() is not None:
                raise self.died(f"{self.name} {exit_words(self.process.returncode)} while starting")
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise UserError(f"{self.name} did not answer within {timeout:.0f} s (its log: {self.log_path}).",
                                detail=self.tail())  # fmt: skip
            if time.monotonic() - said > 5:
                said = time.monotonic()
                progress(f"starting {self.name} (log: {self.log_path})")
            time.sleep(0.5)

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


class Pool:
    """Running servers by their configuration: reused while it is unchanged, all stopped at exit."""

    def __init__(self):
        self._servers: dict[tuple, Server] = {}
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
                if together:
                    for _, server in starting:
                        server.launch()
                for key, server in starting:
                    found[key] = (server.wait if together else server.start)(timeout, progress)
            except BaseException:
                for _, server in starting:
                    server.stop()
                raise
            self._servers.update((key, server) for key, server in starting)
            return {key: found[key] for key in wanted}

    def stop_where(self, keep) -> None:
        """Stop the servers whose key `keep(key)` rejects (e.g. another model's), to free their memory."""
        with self._lock:
            for key in [k for k in self._servers if not keep(k)]:
                self._servers.pop(key).stop()

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

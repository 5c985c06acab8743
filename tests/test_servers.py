"""Engine servers: started under a guardian, reused, stopped, and never left behind (with a plain HTTP
server standing in for an engine: what is tested here is the process handling, not vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from engine.backends.servers import Pool, Server, free_port
from engine.errors import UserError


def http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
        return True
    except OSError:
        return False


def test_a_server_is_reused_while_its_configuration_holds_and_stopped_at_the_end(tmp_path):
    pool, port = Pool(), free_port()
    first = pool.get(("a",), lambda: Server("web", http_server(port), port, "/"), timeout=30)
    assert answers(port) and pool.get(("a",), lambda: pytest.fail("not reused"), timeout=30) is first
    pool.stop_all()
    assert not first.alive() and not answers(port)


def waits_for(flag, port: int) -> list[str]:
    """A server that starts listening only once `flag` exists."""
    code = (f"import pathlib, time\nwhile not pathlib.Path({str(flag)!r}).exists(): time.sleep(0.1)\n"
            f"import http.server\nhttp.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, "
            f"port={port}, bind='127.0.0.1')")  # fmt: skip
    return [sys.executable, "-c", code]


def test_the_missing_servers_start_together_and_fail_together(tmp_path):
    """Two servers a run needs start at once (the first listens only after the second has started; one after the
    other, the first would never answer); a running one is reused; when one fails, the one started with it stops."""
    pool, flag = Pool(), tmp_path / "second-started"
    a, b = free_port(), free_port()
    second = [sys.executable, "-c", f"import pathlib, runpy, sys; pathlib.Path({str(flag)!r}).touch(); "
              f"sys.argv = ['http.server', '{b}', '--bind', '127.0.0.1']; runpy.run_module('http.server', "
              "run_name='__main__')"]  # fmt: skip
    servers = pool.get_many({("a",): lambda: Server("first", waits_for(flag, a), a, "/"),
                             ("b",): lambda: Server("second", second, b, "/")}, timeout=30)  # fmt: skip
    assert answers(a) and answers(b) and list(servers) == [("a",), ("b",)]
    c = free_port()
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(UserError, match="exited with code 3"):
        pool.get_many({("a",): lambda: pytest.fail("not reused"),
                       ("c",): lambda: Server("third", http_server(c), c, "/"),
                       ("d",): lambda: Server("broken", failing, free_port(), "/")}, timeout=30)  # fmt: skip
    assert not answers(c) and answers(a)  # the third was stopped with the broken one; the first still serves
    assert [s.name for s in pool.running()] == ["first", "second"]
    pool.stop_all()
    assert not answers(a) and not answers(b)


def test_a_server_that_fails_to_start_shows_the_end_of_its_log():
    command = [sys.executable, "-c", "print('loading weights'); print('boom: no such model'); raise SystemExit(3)"]
    with pytest.raises(UserError, match="(?s)exited with code 3 while starting.*boom: no such model"):
        Server("engine", command, free_port(), "/").start(timeout=30)


def test_a_crashed_app_leaves_no_server_behind(tmp_path):
    """kill -9 of the app: the guardian sees it gone and stops the server."""
    port = free_port()
    app = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from engine.backends.servers import Server
        Server("web", {http_server(port)!r}, {port}, "/").start(timeout=30)
        print("up", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", app], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up" and answers(port)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while answers(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not answers(port)
    finally:
        proc.kill()


def test_a_server_killed_by_a_signal_is_reported_by_its_name_in_one_line():
    """The guardian exits 128 + N for a command killed by signal N, as shells do (a negative code used to reach
    the app as 256 - N: 'code 245' for a SIGSEGV)."""
    command = [sys.executable, "-c", "import os, signal; print('warming up'); os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(UserError) as err:
        Server("engine", command, free_port(), "/").start(timeout=30)
    message = str(err.value)
    assert message.startswith("engine was killed by signal 11 (SIGSEGV) while starting; it said: warming up (its log")
    assert "\n" not in message and "warming up" in err.value.detail


def tagged(backend: str, role: str, model: str = "bundled") -> Server:
    port = free_port()
    return Server(f"{backend} {role}", http_server(port), port, "/", backend=backend, model=model, role=role)


@pytest.fixture
def two_backends(monkeypatch):
    """The engine's pool with vLLM's two servers up and llama.cpp's baseline: what switching backends leaves."""
    from engine.backends import servers

    pool = Pool()
    monkeypatch.setattr(servers, "POOL", pool)
    up = pool.get_many({("v", "b"): lambda: tagged("vllm", "baseline"),
                        ("v", "s"): lambda: tagged("vllm", "speculative"),
                        ("l", "b"): lambda: tagged("llama.cpp", "baseline", "model.gguf")}, timeout=30)  # fmt: skip
    yield pool, up
    pool.stop_all()


def test_on_a_cpu_a_comparison_stops_the_other_backends_idle_servers_and_says_so(two_backends):
    from engine.backends.servers import make_room, servers_up

    pool, up = two_backends
    listed = servers_up()
    assert [(s["backend"], s["role"], s["model"]) for s in listed] == [
        ("vllm", "baseline", "bundled"), ("vllm", "speculative", "bundled"), ("llama.cpp", "baseline", "model.gguf")]
    assert all(s["port"] == up[key].port and 0 < s["since"] <= time.time() for s, key in zip(listed, up))
    said = make_room("llama.cpp", gpu=None)
    assert said == "stopped vLLM's 2 idle servers to free the CPUs for llama.cpp"
    assert [s["backend"] for s in servers_up()] == ["llama.cpp"]  # its own backend's server stays
    assert not answers(up[("v", "b")].port) and answers(up[("l", "b")].port)
    assert make_room("llama.cpp", gpu=None) is None  # nothing left to stop: nothing said


def test_a_server_answering_a_request_is_never_stopped_for_another_backend(two_backends):
    from engine.backends.servers import make_room

    pool, up = two_backends
    with pool.in_use(up[("v", "s")].url):
        said = make_room("llama.cpp", gpu=None)
    assert said == "stopped vLLM's 1 idle server to free the CPUs for llama.cpp"
    assert answers(up[("v", "s")].port) and not answers(up[("v", "b")].port)


def test_on_a_gpu_the_other_backends_servers_stay_while_memory_allows(two_backends):
    from engine.backends.servers import make_room

    pool, up = two_backends
    gib = 2**30
    assert make_room("vllm", lambda: 30 * gib, gpu=(60 * gib, 80 * gib)) is None
    assert len(pool.running()) == 3
    said = make_room("vllm", lambda: 64 * gib, gpu=(60 * gib, 80 * gib))
    assert said == "stopped llama.cpp's 1 idle server to free GPU memory for vLLM"
    assert [s.backend for s in pool.running()] == ["vllm", "vllm"]

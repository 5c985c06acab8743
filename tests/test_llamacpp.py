"""The llama.cpp backend against a real llama-server (built from llama.cpp's sources by tests/run.sh and cached
outside the checkout), serving the bundled GGUF as it ships: baseline and speculative servers started and
stopped by SpecArena."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from types import SimpleNamespace

import pytest

from engine.backends import llamacpp
from engine.backends.servers import POOL, Server, free_port
from engine.compare import compare, open_backend
from engine.errors import UserError
from engine.settings import Settings

pytestmark = pytest.mark.llamacpp

REWRITE = "Fix the spelling and repeat the text: The quick brown fox jumpd over the lazzy dog. It was a sunny day."


@pytest.fixture(scope="module")
def server_binary():
    path = llamacpp.binary()
    if path is None or not path.is_file():
        pytest.fail("no llama-server: run tests/run.sh, which builds one (python -m engine build-llama-server)")
    yield path
    POOL.stop_all()


def settings(**over) -> Settings:
    return Settings(**({"backend": "llama.cpp", "drafter": "prompt-lookup", "gamma": 4, "max_new_tokens": 40,
                        "seed": 0} | over))  # fmt: skip


def our_servers() -> list[str]:
    """llama-servers this test process started, each under its guardian (an app under test, also our child,
    runs its own: those are not ours)."""
    import psutil

    found = []
    for child in psutil.Process().children():
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "guard.py" in command and "llama-server" in command and child.is_running():
            found.append(command)
    return found


def answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "/health", timeout=2).status == 200
    except OSError:
        return False


@pytest.mark.parametrize("drafter", ["prompt-lookup", "ngram-map-k", "ngram-mod", "draft-model"])
def test_greedy_speculation_on_llama_cpp_is_lossless_and_its_counts_add_up(server_binary, drafter):
    draft = "bundled" if drafter == "draft-model" else ""  # the same model drafting: every token holds
    s = settings(drafter=drafter, draft=draft, max_new_tokens=48)
    c = compare(s, REWRITE)
    env = c.environment
    assert env["backend"] == "llama.cpp" and env["llama_cpp"] == f"b{llamacpp.BUILD}"
    assert llamacpp.SPEC_TYPES[drafter] in env["spec_flags"]
    assert c.identical is True and c.baseline.text == c.speculative.text and c.speculative.metrics.new_tokens > 8
    assert c.verdict.kind == "identical"
    assert "<|im_end|>" not in c.speculative.text  # the end-of-turn token is an id, not text
    spec, decode = c.speculative, c.speculative.steps[1:]
    # each step: the drafts the target kept, then its own token; the totals are the server's own
    assert sum(len(x.tokens) for x in spec.steps) == spec.metrics.new_tokens
    assert all(len(x.tokens) == x.accepted + 1 for x in decode[:-1])
    assert len(decode[-1].tokens) <= decode[-1].accepted + 1
    timings = env["server_timings"]["speculative"]
    assert spec.metrics.drafted_tokens == sum(len(x.drafted) for x in decode) == timings.get("draft_n", 0)
    assert spec.metrics.accepted_tokens == sum(x.accepted for x in decode) == timings.get("draft_n_accepted", 0)
    if drafter == "draft-model":
        assert all(x.kind == "bonus" for x in decode[:-1])  # drafts past the end of the answer may miss
    if drafter in ("prompt-lookup", "draft-model"):
        assert spec.metrics.target_passes < c.baseline.metrics.target_passes
    assert len(POOL.running()) == 2


def test_sampled_runs_and_a_confidence_stop_run_on_llama_cpp(server_binary):
    c = compare(settings(drafter="draft-model", draft="bundled", temperature=0.8, p_min=0.5, draft_min=1), REWRITE)
    assert c.identical is None and c.speculative.metrics.new_tokens > 0
    assert c.environment["spec_flags"][-8:-4] == ["--spec-draft-p-min", "0.5", "--spec-draft-sampling",
                                                    "probabilistic"]  # fmt: skip


def test_a_comparison_on_llama_cpp_stops_vllms_idle_servers_shows_its_start_and_lists_the_servers_up(server_binary):
    """Switching from vLLM to llama.cpp on a CPU machine used to leave vLLM's two servers beside llama.cpp's: four
    engines on two cores. (Two plain HTTP servers stand in for vLLM's: what is tested is the policy.)"""
    from engine.compare import stream_compare
    from engine.events import Done, Status

    POOL.stop_all()
    stand_ins = {}
    for role in ("baseline", "speculative"):
        port = free_port()
        command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        stand_ins[("vllm", role)] = lambda c=command, p=port, r=role: Server(f"vLLM {r}", c, p, "/", backend="vllm",
                                                                            model="bundled", role=r)  # fmt: skip
    vllm_servers = POOL.get_many(stand_ins, timeout=30)
    events = list(stream_compare(settings(max_new_tokens=16), REWRITE))
    said = [e.message for e in events if isinstance(e, Status)]
    assert said[0] == "stopped vLLM's 2 idle servers to free the CPUs for llama.cpp"
    assert not any(s.alive() for s in vllm_servers.values())
    # the start's progress: both servers in one line, each with its phase, the time so far and where the logs are
    starting = [m for m in said if m.startswith("starting llama-server baseline: ")]
    assert starting and all(", llama-server speculative: " in m and "; logs in " in m for m in starting)
    up = [e for e in events if isinstance(e, Done)][-1].comparison.environment["servers_up"]
    assert sorted((s["backend"], s["role"]) for s in up) == [("llama.cpp", "baseline"), ("llama.cpp", "speculative")]
    assert all(s["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and s["since"] <= time.time() for s in up)


def test_the_app_runs_a_comparison_on_llama_cpp_and_says_what_it_does_not_report(server_binary):
    from app import handlers

    values = dict(prompt=REWRITE, backend="llama.cpp", target="bundled:smollm2-135m-instruct", drafter="ngram-map-k",
                  draft="", temperature=0, top_p=1, top_k=0, max_new_tokens=32, gamma=4, seed=0, chat=True,
                  dtype="auto", ngram=3, alpha=0.8, adaptive=False, p_min=0, draft_min=0, history=[])  # fmt: skip
    out = list(handlers.compare(**values, request=SimpleNamespace(session_hash="llama")))[-1]
    result, spec_pane = out[0], out[3]
    assert result["identical"] is True and result["environment"]["backend"] == "llama.cpp"
    assert "llama.cpp: rejected drafts counted, not shown" in spec_pane
    assert handlers.check_pair(**{k: v for k, v in values.items() if k not in ("prompt", "history")} |
                               {"drafter": "draft-model", "draft": "bundled"}).count("✓") >= 3  # fmt: skip


def test_the_lab_export_is_the_measured_command_and_it_starts_as_written(server_binary, tmp_path, capsys):
    from engine.__main__ import main

    args = ["bench", "--backend", "llama.cpp", "--prompt", REWRITE, "--drafters", "prompt-lookup,ngram-map-k",
            "--gamma", "2,4", "--repeats", "1", "--seed", "0", "--max-new-tokens", "24", "--report", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"llama.cpp b{llamacpp.BUILD}" in out and "ngram-map-k" in out
    report = json.loads((tmp_path / "report.json").read_text())
    best = max((c for c in report["cells"]), key=lambda c: c["speedup"]["median"])
    command = report["snippets"]["llama.cpp"]
    assert command == best["server_command"] and command in (tmp_path / "settings.md").read_text()
    words = shlex.split(command)
    assert f"--spec-ngram-{'simple' if best['drafter'] == 'prompt-lookup' else 'map-k'}-size-m" in words
    assert words[words.index("--spec-ngram-simple-size-m" if best["drafter"] == "prompt-lookup" else
                             "--spec-ngram-map-k-size-m") + 1] == str(best["gamma"])  # fmt: skip
    POOL.stop_all()  # the measured port is free again: start the exported command exactly as written
    port = words[words.index("--port") + 1]
    process = subprocess.Popen(words, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                props = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=2).read())
                break
            except OSError:
                assert process.poll() is None, "the exported command exited"
                time.sleep(0.3)
        else:
            pytest.fail("the exported command did not start a server")
        assert props["model_path"].endswith(".gguf")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(20)


def test_remote_servers_are_read_and_must_serve_the_same_model(server_binary, monkeypatch, tmp_path):
    running = open_backend(settings())
    monkeypatch.setenv("SPECARENA_LLAMA_BASELINE_URL", running.urls["baseline"])
    monkeypatch.setenv("SPECARENA_LLAMA_SPECULATIVE_URL", running.urls["speculative"])
    c = compare(settings(max_new_tokens=16), REWRITE)
    assert c.identical is True and c.environment["remote"] is True
    monkeypatch.setenv("SPECARENA_LLAMA_SPECULATIVE_URL", "http://127.0.0.1:9")
    with pytest.raises(UserError, match="did not answer as llama-server does"):
        open_backend(settings())
    other = tmp_path / "other.gguf"
    shutil.copy(llamacpp.gguf_path("bundled"), other)
    port = free_port()
    second = Server("other", llamacpp.server_command(server_binary, other, [], port), port, "/health").start(60)
    try:
        monkeypatch.setenv("SPECARENA_LLAMA_SPECULATIVE_URL", second.url)
        with pytest.raises(UserError, match="serve different models"):
            open_backend(settings())
    finally:
        second.stop()


def test_a_server_that_dies_mid_run_is_reported(server_binary):
    from engine.compare import stream_compare
    from engine.events import Step

    events = stream_compare(settings(max_new_tokens=1500, drafter="draft-model", draft="bundled"),
                            "Write a long story about the sea, with many chapters.")  # fmt: skip
    with pytest.raises(UserError, match="llama-server speculative server died during the run .*its log: ") as err:
        for event in events:
            if isinstance(event, Step) and event.mode == "speculative" and event.event.step == 2:
                server = next(x for x in POOL.running() if x.name == "llama-server speculative")
                os.killpg(server.process.pid, signal.SIGKILL)
    assert err.value.detail  # the end of its log, for those who want it


def test_bad_setups_get_clear_messages_and_leave_nothing_running(server_binary, monkeypatch, tmp_path):
    with pytest.raises(UserError, match="adaptive") as err:
        open_backend(settings(adaptive=True))
    assert err.value.field == "adaptive"
    with pytest.raises(UserError, match="runs on the llama.cpp backend only"):
        open_backend(Settings(drafter="ngram-mod"))
    with pytest.raises(UserError, match="llama.cpp has no drafter 'synthetic'"):
        open_backend(settings(drafter="synthetic"))
    with pytest.raises(UserError, match="name 'org/name' as org/repo/file.gguf"):
        open_backend(settings(target="org/name"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UserError, match=r"exited with code .* while starting; it said: .*\(its log: ") as err:
        open_backend(settings(target=str(broken)))
    assert "\n" not in str(err.value) and err.value.detail  # one line, the log folded into the detail
    # a binary too old for today's flags
    old = tmp_path / "llama-server"
    old.write_text("#!/bin/sh\necho '--draft-max N  number of tokens to draft'\necho 'version: 4000 (abc)' >&2\n")
    old.chmod(0o755)
    monkeypatch.setenv("SPECARENA_LLAMA_SERVER", str(old))
    with pytest.raises(UserError, match="too old for SpecArena: it has no --spec-type flag") as err:
        open_backend(settings())
    assert err.value.field == "backend"
    monkeypatch.setenv("SPECARENA_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="llama-server not found at .*build-llama-server"):
        open_backend(settings())
    monkeypatch.delenv("SPECARENA_LLAMA_SERVER")
    # a port taken between choosing it and the server binding it
    taken = free_port()
    holder = __import__("socket").socket()
    holder.bind(("127.0.0.1", taken))
    holder.listen()
    monkeypatch.setattr(llamacpp, "free_port", lambda: taken)
    try:
        with pytest.raises(UserError, match="(?s)exited with code .* while starting.*(bind|address)"):
            open_backend(settings(gamma=3))
    finally:
        holder.close()
    POOL.stop_all()
    assert our_servers() == []


def test_a_crashed_app_leaves_no_llama_server_behind(server_binary):
    """kill -9 of an app holding both servers: the guardian stops them."""
    app = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from engine.compare import open_backend
        from engine.settings import Settings
        backend = open_backend(Settings(backend="llama.cpp", gamma=5))
        print(" ".join(backend.urls.values()), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", app], stdout=subprocess.PIPE, text=True)
    try:
        urls = proc.stdout.readline().split()
        assert len(urls) == 2 and all(answers(u) for u in urls)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(answers(u) for u in urls) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(answers(u) for u in urls)
    finally:
        proc.kill()


CRASHING = """#!/bin/sh
case "$1" in
  --help) for flag in {flags}; do echo "$flag N"; done; exit 0;;
  --version) echo "version: {build} (fake)"; exit 0;;
esac
echo "load_model: loading model"
echo "init: llama threadpool init, n_threads = 2"
kill -SEGV $$
"""


@pytest.fixture
def crashing_binary(tmp_path, monkeypatch):
    """A llama-server that dies as llama.cpp's AMX kernels do on the AMX Xeons seen here: SIGSEGV right after its
    thread pool starts, on a CPU that has AMX."""
    from engine.models import cpu

    path = tmp_path / "llama-server"
    path.write_text(CRASHING.format(flags=" ".join(llamacpp.NEEDED_FLAGS), build=llamacpp.BUILD))
    path.chmod(0o755)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "avx512f", "amx_tile", "amx_int8"})
    monkeypatch.setenv("SPECARENA_CACHE", str(tmp_path / "cache"))
    return path


def test_a_build_that_cannot_generate_is_refused_and_not_cached(crashing_binary):
    with pytest.raises(UserError, match=r"cannot generate on this CPU, so it was not cached: llama-server was killed "
                       r"by signal 11 \(SIGSEGV\) while starting; .*AMX kernels.*--no-repack") as err:  # fmt: skip
        llamacpp.install(crashing_binary, progress=lambda message: None)
    assert "threadpool init" in err.value.detail
    assert not llamacpp.cached_binary().exists() and not llamacpp.cached_binary().parent.exists()


def test_a_named_binary_that_crashes_at_start_gets_the_cause_and_the_fix(crashing_binary, monkeypatch):
    monkeypatch.setenv("SPECARENA_LLAMA_SERVER", str(crashing_binary))
    # both servers start at once and both crash: the message names the one that was seen first
    with pytest.raises(UserError, match=r"llama-server (baseline|speculative) was killed by signal 11 \(SIGSEGV\) "
                       r"while starting; "
                       r"it crashed at its first matrix product.*issue 20824.*build-llama-server.*--no-repack"):
        open_backend(settings())
    assert our_servers() == []


def test_a_crash_on_a_cpu_without_amx_is_not_blamed_on_amx(crashing_binary, monkeypatch):
    from engine.models import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2"})
    assert llamacpp.crash_cause(128 + 11, "init: llama threadpool init, n_threads = 2") is None
    assert llamacpp.crash_cause(1, "error: failed to load model") is None
    monkeypatch.setenv("SPECARENA_LLAMA_SERVER", str(crashing_binary))
    with pytest.raises(UserError, match=r"killed by signal 11 \(SIGSEGV\) while starting; it said: .*threadpool init"):
        open_backend(settings())


def test_a_path_that_is_neither_a_gguf_nor_a_model_folder_is_refused_in_one_sentence(tmp_path):
    """A folder is converted only when it holds a model (its config.json); anything else is named and refused."""
    with pytest.raises(UserError, match="neither a .gguf file nor a model folder with a config.json"):
        llamacpp.model_gguf(str(tmp_path), "float32")
    with pytest.raises(UserError, match="local .gguf file or model folder"):
        llamacpp.model_gguf("some-org/some-model", "auto")

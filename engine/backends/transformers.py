"""The in-process backend: the pair loaded by engine.models on this machine's CPU or GPU, the loops of
engine.decoding.baseline and engine.decoding.speculative run on the engine thread (engine.worker). It also
decides strict mode (one pass width for both runs) and compiles what a run needs before it is timed.
"""

from __future__ import annotations

import os
import platform
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generator, Iterator

import torch

from engine.decoding.baseline import baseline_decode
from engine.decoding.drafters import Drafter, DraftModel, PromptLookup, Synthetic
from engine.decoding.metrics import StepEvent
from engine.decoding.runtime import capacity, encode_prompt, eos_ids, precompile
from engine.decoding.sampling import SamplingConfig
from engine.decoding.speculative import speculative_decode
from engine.errors import OutOfMemory, UserError, blame
from engine.events import Status
from engine.models.bandwidth import limit
from engine.models.cpu import device_name
from engine.models.loading import MODELS, LoadedModel, free_memory, resolve_device
from engine.settings import HEAD_NAMES, MAX_GAMMA, Settings
from engine.worker import ENGINE, in_thread

STRICT_MARGIN = 0.05  # strict mode is on by default where it costs a one-token pass no more than this


def widest_pass(s: Settings) -> int:
    """The most tokens a target pass of these settings takes: the last token and the longest draft."""
    return (MAX_GAMMA if s.adaptive else s.gamma) + 1


@dataclass
class Pair:
    target: LoadedModel
    draft: LoadedModel | None
    same_ids: bool = True  # False: another tokenizer, drafts go through text (engine.decoding.crosstok)
    head: object = None  # a draft head (engine.decoding.heads.Head) over the target's hidden states
    head_spec: str = ""


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


def _load(spec: str, s: Settings, loaded: list[str]) -> Generator[Status, None, LoadedModel]:
    """MODELS.get in a worker thread (in_thread); a model that was not in memory yet is added to `loaded`."""
    if not MODELS.has(spec, s.dtype, s.device, compile=s.compile):
        loaded.append(spec)
    return (yield from in_thread(lambda say: MODELS.get(spec, s.dtype, s.device, progress=say, compile=s.compile)))


class Transformers:
    """The in-process engine on this machine's CPU or GPU."""

    name = "transformers"

    def __init__(self):
        from engine.decoding.suffix import memory_for

        self.pair: Pair | None = None
        self.loaded: list[str] = []  # models that open() had to load (not already in memory)
        self.memory = memory_for("default")  # what the suffix drafter has seen: the caller's session's

    def open(self, s: Settings) -> Iterator[Status]:
        """Load target then draft (the model cache keeps recent ones), reporting each."""
        if s.compile and resolve_device(s.device).type != "cuda":
            raise UserError(
                "compile needs a CUDA GPU: it replays decode and verify passes as CUDA graphs. On a CPU, run "
                "without it (the packed linear layers are the CPU's fast path).",
                field="compile",
            )
        yield Status(f"loading target {s.target}")
        with blame("target"):
            target = yield from _load(s.target, s, self.loaded)
        yield Status("target " + target.describe())
        draft = head = None
        if s.uses_head:
            from engine.backends.heads import same_kind
            from engine.models.heads import HEADS, describe

            yield Status(f"loading the {HEAD_NAMES[s.drafter]} {s.draft}")
            with blame("draft"):
                head = yield from in_thread(lambda say: HEADS.get(s.draft, target.model, say))
            same_kind(head.config, s)  # the head's kind, not the drafter picked, would decide what runs
            yield Status("head " + describe(head))
        elif s.uses_draft:
            yield Status(f"loading draft {s.draft}")
            with blame("draft"):
                draft = yield from _load(s.draft, s, self.loaded)
            yield Status("draft " + draft.describe())
        self.pair = Pair(target, draft, self._same_ids(target, draft), head, s.draft if head is not None else "")
        if not self.pair.same_ids:
            yield Status("the draft has another tokenizer: its drafts are re-encoded into the target's tokens")

    def serves(self, s: Settings) -> bool:
        """Whether runs with `s` need nothing this pair lacks (the draft is loaded when a cell first needs it)."""
        if s.uses_head:
            return self.pair.head_spec == s.draft and self.pair.head.config.kind == s.drafter
        return not s.uses_draft or self.pair.draft is not None

    @staticmethod
    def _same_ids(target: LoadedModel, draft: LoadedModel | None) -> bool:
        """Speculation verifies token ids: a draft with another tokenizer drafts through text instead."""
        from engine.models.doctor import same_ids, vocab_check

        return draft is None or same_ids(vocab_check(target.tokenizer, draft.tokenizer))

    @property
    def environment(self) -> dict:
        import transformers

        target = self.pair.target
        device = target.device
        return {
            "backend": self.name,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "device": str(device),
            "device_name": device_name(device),
            "cpu_threads": ENGINE.call(torch.get_num_threads),  # the engine thread's OpenMP team
            "dtype": str(target.dtype).replace("torch.", ""),
            "forward": "lean" if target.lean else "transformers",  # engine.decoding.lean
            "linear_forms": target.linear_forms,
            "draft_tokenizer": None if self.pair.draft is None else "same ids" if self.pair.same_ids else
            "another: drafts re-encoded through text",
            "step_s_at_load": target.step_s,
            **ENGINE.call(limit, target.token_bytes, device),  # the bandwidth bound beside the measured tok/s
            "strict": getattr(self, "strict", None),
        }

    def encode(self, prompt: str | list[dict], s: Settings) -> list[int]:
        """The prompt's ids (chat template applied as asked), checked against the pair's context."""
        pair = self.pair
        chat = pair.target.has_chat_template if s.chat is None else s.chat
        ids = encode_prompt(pair.target.tokenizer, prompt, chat)
        limits = [m.context_length for m in (pair.target, pair.draft) if m is not None and m.context_length]
        if limits and len(ids) + s.max_new_tokens > min(limits):
            raise UserError(
                f"the prompt has {len(ids)} tokens and {s.max_new_tokens} new tokens were asked for, more than the "
                f"context of {min(limits)} tokens: shorten the prompt or lower max new tokens.",
                field="prompt",
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.pair.target.tokenizer.decode(ids, skip_special_tokens=True)

    def strict_width(self, s: Settings) -> int:
        """The width every target pass of both runs takes in strict mode, 0 when it is off. Auto turns it on in
        16-bit dtypes (float32 passes of any width have given the same ids everywhere so far) where a pass that
        wide costs a one-token pass no more than STRICT_MARGIN (measured once per model and width): on a GPU,
        whose small passes are bandwidth-bound, nearly always; on a CPU, as measured. Where every pass up to that
        width runs our fused kernels (engine.decoding.lean.rounds_alike), each row already rounds as a one-token
        pass does: no width is needed, whatever the setting, and `exact` says so (a run that parts is then a bug)."""
        width = widest_pass(s)
        lean = getattr(self.pair.target.model, "lean", None)
        if lean is not None and ENGINE.call(lean.rounds_alike, width):  # our fused kernels: alike by construction
            self.strict = {"setting": s.strict, "width": 0, "cost": None, "exact": True}
            return 0
        # a draft tree's passes cannot be padded to one width: auto leaves strict mode off for one (on is refused)
        wanted = s.strict == "on" or (s.strict == "auto" and self.pair.target.dtype != torch.float32 and s.topk == 1)
        cost = ENGINE.call(self.pair.target.strict_cost, width) if wanted else None
        on = s.strict == "on" or (wanted and cost <= 1 + STRICT_MARGIN)
        self.strict = {"setting": s.strict, "width": width if on else 0, "cost": cost}
        return width if on else 0

    def prepare(self, ids: list[int], s: Settings) -> Iterator[Status]:
        """Before a warm-up: compile (and record as CUDA graphs) every pass size the runs will make, on the caches
        they will use, saying what each cost; nothing to do for a model that is not compiled."""
        return ENGINE.iterate(self._prepare(ids, s))

    def _prepare(self, ids: list[int], s: Settings) -> Iterator[Status]:
        width = self.strict_width(s)
        draft = self.pair.draft if s.uses_draft and not s.uses_head else None
        plans = [("target", self.pair.target, "run", [width] if width else range(1, widest_pass(s) + 1))]
        if draft is not None:
            plans.append(("draft", draft, "draft", [width] if width else [1, 2]))
        for name, loaded, role, rows in plans:
            if getattr(loaded.model, "compiled_step", None) is None:
                continue
            yield Status(f"compiling the {name}'s passes (cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}: "
                         "a minute or more the first time, seconds after)")  # fmt: skip
            with torch.inference_mode():
                for size, took in precompile(loaded.model, rows, capacity(len(ids), s.max_new_tokens), role,
                                             static=width > 0):  # fmt: skip
                    yield Status(f"compiled the {name}'s {size}-token passes in {took:.1f} s")

    def baseline(self, ids: list[int], s: Settings, stop: threading.Event | None = None) -> Iterator[StepEvent]:
        """The loop runs on the engine thread (engine.worker), one step per next()."""
        model, tok = self.pair.target.model, self.pair.target.tokenizer
        return ENGINE.iterate(baseline_decode(model, tok, ids, s.sampling, s.max_new_tokens, eos_ids(model, tok),
                                              stop, self.strict_width(s)))  # fmt: skip

    def speculative(
        self, ids: list[int], s: Settings, reference: list[int], stop: threading.Event | None = None
    ) -> Iterator[StepEvent]:
        """`reference` is the target's own continuation, used only by the synthetic drafter. The drafter is made
        and the loop runs on the engine thread (making one may time verify passes)."""
        return ENGINE.iterate(self._speculative(ids, s, reference, stop))

    def _speculative(self, ids, s: Settings, reference, stop) -> Iterator[StepEvent]:
        model, tok = self.pair.target.model, self.pair.target.tokenizer
        width = self.strict_width(s)
        drafter = self.drafter(s, ids, reference)
        drafter.min_tokens = s.draft_min
        yield from speculative_decode(model, tok, ids, drafter, s.sampling, s.max_new_tokens, eos_ids(model, tok),
                                      stop, width)  # fmt: skip

    def greedy(self, ids: list[int], n: int, width: int = 0) -> list[int]:
        """The target's next `n` greedy tokens after `ids`, decoded one pass at a time as the baseline does (no
        clocks, no EOS): the synthetic drafter's reference where a run leaves the baseline's text."""
        model, cfg = self.pair.target.model, SamplingConfig()
        steps = baseline_decode(model, self.pair.target.tokenizer, ids, cfg, n, set(), width=width)
        return [t for step in steps for t in step.tokens]

    def drafter(self, s: Settings, ids: list[int], reference: list[int]) -> Drafter:
        pair = self.pair
        if s.drafter == "draft-model" and not pair.same_ids:
            from engine.decoding.crosstok import CrossTokenizerDraft

            room = 4 * capacity(len(ids), s.max_new_tokens)  # its own tokens: up to a few per target token
            return CrossTokenizerDraft(pair.draft.model, pair.draft.tokenizer, pair.target.tokenizer, room,
                                       s.gamma, s.adaptive, s.p_min)  # fmt: skip
        if s.drafter == "draft-model":
            return DraftModel(pair.draft.model, pair.target.vocab_size, gamma=s.gamma, adaptive=s.adaptive,
                              p_min=s.p_min)  # fmt: skip
        if s.uses_head:
            from engine.models.heads import drafter_for

            costs = pair.target.verify_costs if s.topk > 1 else None  # a tree keeps the nodes that pay for their rows
            return drafter_for(pair.head, pair.target.vocab_size, s.gamma, s.adaptive, s.topk, costs, s.p_min)
        if s.drafter == "prompt-lookup":
            costs = pair.target.verify_costs if s.adaptive else None
            return PromptLookup(max_ngram=s.ngram, costs=costs, gamma=s.gamma)
        if s.drafter == "suffix":
            from engine.decoding.suffix import SuffixDrafter

            return SuffixDrafter(self.memory, s.gamma, pair.target.verify_costs if s.adaptive else None)
        pace = DraftModel(pair.draft.model, pair.target.vocab_size, gamma=MAX_GAMMA) if s.uses_draft else None
        seed = s.seed or 0
        return Synthetic(len(ids), reference, s.alpha, pair.target.vocab_size, seed, pace, s.gamma, s.adaptive,
                         regenerate=lambda at, n: self.greedy(at, n, self.strict["width"]))  # fmt: skip

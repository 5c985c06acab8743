"""Settings: the one named shape of everything a comparison runs with, except the prompt.

The Playground form, the `compare` API, the Lab, the CLI and every report use these field names, so
that a new setting is one field here (plus its widget). `Settings.from_form` takes loosely typed
values as a form or an API client sends them (floats from sliders, None or "" from empty boxes) and
returns typed settings; `validate` checks ranges. Every error names the field at fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from engine.decoding.sampling import SamplingConfig
from engine.errors import UserError

BUNDLED = "bundled:smollm2-135m-instruct"
MAX_GAMMA = 16  # the longest draft: the UI's bound, adaptive gamma's ceiling, the predictor's range
HEADS = ("eagle3", "peagle", "dflash", "dspark", "dflash2", "mtp-head")  # over the target's states (decoding.heads)
NOT_SERVED = {  # backend -> the heads it cannot run, and why: said before anything starts
    "llama.cpp": {"peagle": "llama.cpp b11434 has no P-EAGLE drafting (no --spec-type for it, and its converter "
                            "refuses PEagleDraftModel)",
                  "mtp-head": "llama.cpp b11434 drafts MTP (draft-mtp) only from layers inside the target's own GGUF, "
                              "for the architectures that ship them, never from a head folder"},
    "vllm": {"dspark": "vLLM 0.32 runs DSpark heads on GPUs only (its CPU build has no Triton, and the model runner it "
                       "falls back to refuses DSpark)",
             "dflash2": "vLLM 0.32 runs DFlash2 heads on GPUs only (its CPU build has no Triton, and the model runner "
                        "it falls back to refuses DFlash candidate-head drafts)",
             "mtp-head": "vLLM 0.32 serves MTP only from layers inside the target's own checkpoint (the mtp drafter), "
                         "not an MTP layer in speculators' layout (its speculators adapter refuses mtp)"},
}  # fmt: skip
VLLM_ONLY = ("mtp",)  # methods vLLM ships and the in-process engine lacks
LLAMA_ONLY = ("ngram-mod", "ngram-map-k")  # llama.cpp's own n-gram drafters
DRAFTERS = ("draft-model", "prompt-lookup", "suffix", "synthetic") + HEADS + VLLM_ONLY + LLAMA_ONLY
TAKES_DRAFT = ("draft-model", "synthetic") + HEADS  # use a named draft model or head (synthetic: for its cost)
HEAD_NAMES = {"eagle3": "EAGLE-3 head", "peagle": "P-EAGLE head", "dflash": "DFlash head", "dspark": "DSpark head",
              "dflash2": "DFlash2 head", "mtp-head": "MTP head"}
BACKENDS = ("transformers", "vllm", "llama.cpp")
DTYPES = ("auto", "float32", "bfloat16", "float16")
STRICT = ("auto", "on", "off")  # strict mode: every target pass at one width (engine.decoding.runtime.forward)

LABELS = {  # field -> the words a person sees next to it (messages use these)
    "prompt": "prompt", "target": "target model", "drafter": "drafter", "draft": "draft model or head",
    "gamma": "gamma", "max_new_tokens": "max new tokens", "temperature": "temperature", "top_p": "top-p",
    "top_k": "top-k", "seed": "seed", "chat": "chat template", "dtype": "dtype", "device": "device",
    "ngram": "n-gram size", "alpha": "synthetic alpha", "adaptive": "adaptive gamma", "compile": "compile",
    "warmup": "warm-up", "backend": "backend", "p_min": "draft confidence stop", "draft_min": "shortest draft",
    "strict": "strict mode", "topk": "tree: candidates per position",
}  # fmt: skip
MAX_TOPK = 8  # the widest draft tree: candidates per position (EAGLE-2's top-k)


def cache_dir() -> Path:
    """Where SpecArena keeps what it makes once (converted models, CPU measurements, a llama-server build, compiled
    graphs): $SPECARENA_CACHE, else ~/.cache/specarena."""
    return Path(os.environ.get("SPECARENA_CACHE", Path.home() / ".cache" / "specarena"))


def read_kept(path: Path) -> dict:
    """A JSON file of the cache folder's (measurements kept per CPU), {} where it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_kept(path: Path, data: dict) -> None:
    """Write a cache folder's JSON file whole (a temporary file renamed over it: readers never see half of it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a measurement per load


def max_new_tokens_cap() -> int:
    """Operator-set ceiling on max_new_tokens (SPECARENA_MAX_NEW_TOKENS), 2048 by default."""
    return int(os.environ.get("SPECARENA_MAX_NEW_TOKENS", "2048"))


@dataclass(frozen=True)
class Settings:
    target: str = BUNDLED
    drafter: str = "prompt-lookup"
    draft: str = ""  # the draft-model drafter's model, a head's folder or Hub id, or the synthetic drafter's pace
    gamma: int = 4  # draft tokens per step; with `adaptive`, the draft model's first length
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = a fresh random seed per run
    chat: bool | None = None  # None: use the chat template when the target has one
    dtype: str = "auto"
    device: str = "auto"
    ngram: int = 3  # prompt lookup: longest n-gram matched
    alpha: float = 0.8  # synthetic drafter: probability of proposing the target's own token
    adaptive: bool = False  # the drafter sizes each draft, up to MAX_GAMMA (engine.decoding.drafters)
    compile: bool = False  # CUDA only: torch.compile with CUDA graphs over a static KV cache
    warmup: bool = True
    backend: str = "transformers"  # where the comparison runs: this process, vLLM or llama.cpp servers
    p_min: float = 0.0  # draft model: stop drafting when its top probability falls below this (0 = never); DSpark
    # head: when its confidence head's does
    draft_min: int = 0  # a draft shorter than this is not verified (0 = any length)
    strict: str = "auto"  # every target pass of both runs at one width, so 16-bit greedy ids are bit-identical:
    # on, off, or auto (on where it costs a one-token pass no more than the noise, measured per model)
    topk: int = 1  # EAGLE-3 head: candidates per draft position; above 1 the head drafts a tree (EAGLE-2), gamma deep

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def uses_draft(self) -> bool:
        """A draft model or head is loaded: to draft, or to pace the synthetic drafter at its real cost."""
        return self.drafter in TAKES_DRAFT and bool(self.draft.strip())

    @property
    def uses_head(self) -> bool:
        """The draft is a head over the target's hidden states (engine.decoding.heads), not a model of its own."""
        return self.drafter in HEADS and bool(self.draft.strip())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_form(cls, **values) -> "Settings":
        """Typed settings from form or API values; names not given keep their defaults."""
        unknown = set(values) - set(cls.names())
        if unknown:
            raise UserError(f"unknown settings {sorted(unknown)}: use {', '.join(cls.names())}.")
        typed = {}
        for f in fields(cls):
            if f.name in values:
                typed[f.name] = _coerce(f.name, values[f.name], getattr(cls, f.name))
        return cls(**typed)

    def validate(self) -> "Settings":
        def bad(name: str, message: str):
            raise UserError(f"{LABELS[name]} {message}", field=name)

        if self.drafter not in DRAFTERS:
            bad("drafter", f"{self.drafter!r} is unknown: use one of {', '.join(DRAFTERS)}.")
        if not self.target.strip():
            bad("target", "is empty: name a Hub id (org/name), a local folder, or " + BUNDLED + ".")
        if self.drafter == "draft-model" and not self.draft.strip():
            bad("draft", "is empty, and the draft-model drafter needs one: name it, or pick prompt lookup.")
        if self.drafter in HEADS and not self.draft.strip():
            forge = ("one made by the speculators trainer (the forge makes EAGLE-3 and DFlash heads)"
                     if self.drafter in ("peagle", "dspark", "dflash2", "mtp-head")
                     else "forge one in the Lab tab's Forge (`python -m engine forge` on the command line)")
            raise UserError(f"the {HEAD_NAMES[self.drafter]} drafter needs a head: name its folder or Hub id in the "
                            "draft field (a preset, or the page's list of heads for this target, fills it), or "
                            f"{forge}.", field="draft")  # fmt: skip
        if not 1 <= self.gamma <= MAX_GAMMA:
            bad("gamma", f"{self.gamma} is out of range: use a whole number from 1 to {MAX_GAMMA}.")
        cap = max_new_tokens_cap()
        if not 1 <= self.max_new_tokens <= cap:
            bad("max_new_tokens", f"{self.max_new_tokens} is out of range: use 1 to {cap}.")
        if not 1 <= self.ngram <= 8:
            bad("ngram", f"{self.ngram} is out of range: use 1 to 8.")
        if not 0 <= self.alpha <= 1:
            bad("alpha", f"{self.alpha} is out of range: use 0 to 1.")
        if self.dtype not in DTYPES:
            bad("dtype", f"{self.dtype!r} is unknown: use {', '.join(DTYPES)}.")
        if self.backend not in BACKENDS:
            bad("backend", f"{self.backend!r} is unknown: use {', '.join(BACKENDS)}.")
        if self.drafter in VLLM_ONLY and self.backend != "vllm":
            bad("drafter", f"{self.drafter!r} runs on the vLLM backend only: choose backend vllm, or another drafter.")
        why = NOT_SERVED.get(self.backend, {}).get(self.drafter)
        if why:
            others = " or ".join({"vllm": "vLLM"}.get(b, b) for b in BACKENDS
                                 if b != self.backend and self.drafter not in NOT_SERVED.get(b, {}))  # fmt: skip
            bad("drafter", f"{why}: run the {HEAD_NAMES[self.drafter]} on the {others} backend.")
        if self.drafter in LLAMA_ONLY and self.backend != "llama.cpp":
            bad("drafter", f"{self.drafter!r} runs on the llama.cpp backend only: choose backend llama.cpp, or "
                "another drafter.")
        if not 0 <= self.p_min < 1:
            bad("p_min", f"{self.p_min} is out of range: use 0 (off) up to, not including, 1.")
        if self.strict not in STRICT:
            bad("strict", f"{self.strict!r} is unknown: use {', '.join(STRICT)}.")
        if self.strict == "on" and self.backend != "transformers":
            bad("strict", "runs on the transformers backend only (vLLM and llama.cpp choose their own kernels): "
                "set it to auto or off.")
        if not 1 <= self.topk <= MAX_TOPK:
            bad("topk", f"{self.topk} is out of range: use 1 (a chain) to {MAX_TOPK}.")
        if self.topk > 1:
            self._check_tree(bad)
        if not 0 <= self.draft_min <= self.gamma:
            bad("draft_min", f"{self.draft_min} is out of range: use 0 (any) up to gamma ({self.gamma}).")
        self.sampling.validate()
        return self


    def _check_tree(self, bad) -> None:
        """A draft tree (topk > 1) runs where its passes can: an EAGLE-3 head in this process, over a growing cache."""
        if self.drafter != "eagle3":
            bad("topk", f"{self.topk} makes a tree, which only the EAGLE-3 head drafts: pick the eagle3 drafter, or "
                "set it to 1.")
        if self.backend != "transformers":
            bad("topk", f"{self.topk} makes a tree, which runs on the transformers backend only ({self.backend} "
                "verifies chains here): set it to 1, or choose backend transformers.")
        if self.strict == "on":
            bad("topk", f"{self.topk} makes a tree, whose verify passes strict mode cannot pad to one width: set it "
                "to 1, or strict mode to auto (16-bit ids may then part by rounding, which the verdict tells from a "
                "bug).")
        if self.compile:
            bad("topk", f"{self.topk} makes a tree, which compiled passes (a static cache) do not run: set it to 1, "
                "or turn compile off.")


def check_prompt(prompt) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError("the prompt is empty: type something for the models to continue.", field="prompt")
    return prompt


def _coerce(name: str, value, default):
    """One form value to the type of its field's default; "" and None mean "not set" where that makes sense."""
    label = LABELS[name]
    if isinstance(default, bool) or name == "chat":
        if value is None and name == "chat":
            return None
        if isinstance(value, bool):
            return value
        raise UserError(f"{label} must be true or false, not {value!r}.", field=name)
    if isinstance(default, str):
        if value is None:
            return ""
        if not isinstance(value, str):
            raise UserError(f"{label} must be text, not {value!r}.", field=name)
        return value.strip()
    if value is None or value == "":
        if name == "seed":
            return None
        raise UserError(f"{label} is empty: enter a number.", field=name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{label} {value!r} is not a number.", field=name) from None
    if number != number or number in (float("inf"), float("-inf")):
        raise UserError(f"{label} {value!r} is not a finite number.", field=name)
    if isinstance(default, float):
        return number
    if number != int(number):
        raise UserError(f"{label} {value!r} is not a whole number.", field=name)
    if name == "seed" and number < 0:
        return None  # -1 in the form: a random seed
    return int(number)

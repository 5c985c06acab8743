"""Pair doctor: can these two models speculate together, and will they fit? Checked before any weights load.

From configs and tokenizers only: the vocabularies (speculation compares token ids, so both models must
mean the same thing by every id a draft can propose), special tokens, probe texts, chat templates,
context lengths, the parameter ratio, and weights + KV cache against the device's free memory.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.models import random_shapes as random_models
from engine.models import sizing
from engine.models.loading import hub_folder, load_tokenizer, resolve, resolve_device, resolve_dtype, trust_remote_code
from engine.models.sizing import context_length, kv_bytes_per_token

PROBES = ["Hello, world! 123", "def f(x):\n    return x * 2", "Ünïcödé — 日本語 🙂"]
RANK = {"ok": 0, "note": 1, "warn": 2, "fail": 3}


@dataclass
class Check:
    name: str
    status: str  # ok | note | warn | fail
    detail: str


def _config(spec: str):
    from transformers import AutoConfig

    source = resolve(spec)
    if source.shape:
        return random_models.config(source.shape)
    location = hub_folder(source, weights=False) if source.repo_id else source.location
    return AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code())


def vocab_check(target_tok, draft_tok) -> Check:
    """Same ids for the same tokens (drafts are verified id by id), or another tokenizer (drafts are re-encoded
    into the target's ids at every step: engine.decoding.crosstok)."""
    t, d = target_tok.get_vocab(), draft_tok.get_vocab()
    if t == d:
        return Check("vocabulary", "ok", f"identical ({len(t)} tokens)")
    shared = t.keys() & d.keys()
    agree = sum(t[k] == d[k] for k in shared)
    smaller = min(len(t), len(d))
    if agree == len(shared) == smaller:
        return Check("vocabulary", "note", f"the same {smaller} tokens with the same ids; one side adds "
                     f"{abs(len(t) - len(d))} extra ids that the other never produces")  # fmt: skip
    return Check(
        "vocabulary", "warn",
        f"another tokenizer: {len(shared)} of the target's {len(t)} tokens are also the draft's ({agree} with the "
        "same id). The draft's text is re-encoded into the target's tokens at every step (universal assisted "
        "generation): lossless, but each draft costs a re-encoding, and text that tokenizes differently at "
        "the boundary drafts nothing. A draft of the target's family (same tokenizer) is faster.",
    )  # fmt: skip


def same_ids(check: Check) -> bool:
    """Whether drafts can be verified id by id (else they go through the text: engine.decoding.crosstok)."""
    return check.status in ("ok", "note")


def tokenizer_checks(target_tok, draft_tok) -> list[Check]:
    checks = [vocab_check(target_tok, draft_tok)]
    if not same_ids(checks[0]):
        return checks
    differ = [name for name in ("eos_token_id", "bos_token_id", "pad_token_id")
              if getattr(target_tok, name, None) != getattr(draft_tok, name, None)]  # fmt: skip
    special = f"differ: {', '.join(differ)} (the target's are used)" if differ else "same EOS/BOS/PAD"
    checks.append(Check("special tokens", "note" if differ else "ok", special))
    mismatched = [p for p in PROBES if target_tok(p)["input_ids"] != draft_tok(p)["input_ids"]]
    checks.append(Check("probe texts", "warn" if mismatched else "ok",
                        f"{len(mismatched)} of {len(PROBES)} probes tokenize differently" if mismatched
                        else f"{len(PROBES)} probes tokenize identically"))  # fmt: skip
    same_template = getattr(target_tok, "chat_template", None) == getattr(draft_tok, "chat_template", None)
    checks.append(Check("chat template", "ok" if same_template else "note",
                        "same" if same_template else "differs: the draft reads the target's template"))  # fmt: skip
    return checks


def diagnose(target: str, draft: str | None = None, dtype: str = "auto", device: str = "auto",
             tokens: int = 2048, head: bool = False, gamma: int | None = None) -> dict:  # fmt: skip
    """All checks for a pair (or a target alone); `tokens` sizes the KV cache (prompt + new tokens). With `head`,
    the draft is a draft head (engine.models.heads) checked against the target's config (and the run's `gamma`
    against the draft length it proposes)."""
    if head and draft:
        return _diagnose_head(target, draft, dtype, device, tokens, gamma)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    specs = {"target": target} | ({"draft": draft} if draft else {})
    configs = {role: _config(spec) for role, spec in specs.items()}
    checks: list[Check] = []
    if draft:
        checks += tokenizer_checks(load_tokenizer(target), load_tokenizer(draft))
    contexts = {role: context_length(cfg) for role, cfg in configs.items()}
    known = [c for c in contexts.values() if c]
    shorter = draft and contexts.get("draft") and contexts.get("target") and contexts["draft"] < contexts["target"]
    checks.append(Check("context length", "note" if shorter else "ok",
                        ", ".join(f"{r} {c or 'unknown'}" for r, c in contexts.items())
                        + (f"; runs are limited to {min(known)} tokens" if known else "")))  # fmt: skip
    params = {role: sizing.count_params(cfg, trust_remote_code()) for role, cfg in configs.items()}
    if draft:
        ratio = params["target"] / max(params["draft"], 1)
        status = "ok" if ratio >= 4 else "warn"
        advice = (
            "a draft pays off when it is roughly 10-50x smaller yet agrees often; below ~4x drafting costs too much"
        )
        checks.append(Check("size ratio", status, f"target/draft = {ratio:.1f}x parameters; {advice}"))
    width = torch.finfo(dt).bits // 8
    kv = sum(kv_bytes_per_token(cfg, dt) for cfg in configs.values()) * tokens
    memory = {"parts": [["weights", sum(params.values()) * width], [f"KV cache for {tokens} tokens", kv]],
              "free": sizing.free_memory_bytes(dev), "where": str(dev), "width": width, "worst": "fail",
              "advice": "choose a smaller dtype (bfloat16/float16), fewer tokens, or a smaller pair"}  # fmt: skip
    checks.append(memory_check(memory))
    worst = max((c.status for c in checks), key=RANK.get)
    return {
        "target": target,
        "draft": draft,
        "dtype": str(dt).replace("torch.", ""),
        "device": str(dev),
        "params": params,
        "verdict": {"ok": "ok", "note": "ok", "warn": "warn", "fail": "fail"}[worst],
        "checks": [asdict(c) for c in checks],
        "memory": memory,
    }


def memory_check(m: dict) -> Check:
    """What the weights and caches need (m["parts"]: name, bytes) against the free memory: ok below 80% of it, else
    `worst` (fail where the pair cannot load; llama.cpp pages its files in, so it only warns)."""
    gib = 1024**3
    need = sum(size for _, size in m["parts"])
    parts = " + ".join(f"{name} {size / gib:.2f} GiB" for name, size in m["parts"])
    status = "ok" if need < 0.8 * m["free"] else "warn" if need < m["free"] or m["worst"] == "warn" else "fail"
    detail = f"{parts} = {need / gib:.2f} GiB of {m['free'] / gib:.1f} GiB free on {m['where']}"
    if status == "fail":
        detail += f": {m['advice']}"
    return Check("memory", status, detail)


def _diagnose_head(target: str, head: str, dtype: str, device: str, tokens: int, gamma: int | None = None) -> dict:
    """The target's checks, then the head's: its features, vocabulary and layers against the target's config."""
    from engine.models.heads import doctor_checks

    report = diagnose(target, None, dtype, device, tokens)
    return with_head(report, head, *doctor_checks(head, target, _config(target), gamma))


def with_head(report: dict, head: str, found: list[tuple[str, str, str]], params: int,
              width: float | None = None) -> dict:  # fmt: skip
    """A target's report with a head's checks (engine.models.heads.doctor_checks) added, its weights (`width` bytes a
    parameter, the target's by default) counted in the memory check, and the verdict again."""
    m = report["memory"]
    memory = m | {"parts": m["parts"][:1] + [["head", params * (width or m["width"])]] + m["parts"][1:]}
    checks = [memory_check(memory) if c["name"] == "memory" else Check(**c) for c in report["checks"]]
    checks += [Check(*c) for c in found]
    worst = max((c.status for c in checks), key=RANK.get)
    return report | {"draft": head, "params": report["params"] | {"draft": params}, "memory": memory,
                     "verdict": {"ok": "ok", "note": "ok", "warn": "warn", "fail": "fail"}[worst],
                     "checks": [asdict(c) for c in checks]}  # fmt: skip


@functools.lru_cache(maxsize=8)
def _gguf_facts(path: str, mtime: float) -> dict:
    """What a GGUF file says of itself, read without loading weights (mtime: a changed file is read again)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key, default=None):
        field = reader.fields.get(key)
        return field.contents() if field is not None else default

    arch = value("general.architecture", "?")
    return {
        "tokens": value("tokenizer.ggml.tokens") or [],
        "special": {name: value(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "bos")},
        "template": value("tokenizer.chat_template"),
        "context": value(f"{arch}.context_length"),
        "params": sum(int(t.n_elements) for t in reader.tensors),
        "bytes": Path(path).stat().st_size,
        "kind": value("general.file_type"),
    }


def gguf_facts(path: Path) -> dict:
    return _gguf_facts(str(path), path.stat().st_mtime)


def gguf_vocab_check(target: dict, draft: dict) -> Check:
    """A GGUF pair's vocabularies, token by token: llama.cpp verifies ids, as we do."""
    t, d = target["tokens"], draft["tokens"]
    if not t:
        return Check("vocabulary", "fail", "the target GGUF carries no tokenizer: it is not a language model file.")
    if t == d:
        return Check("vocabulary", "ok", f"identical ({len(t)} tokens)")
    agree = sum(a == b for a, b in zip(t, d))
    if agree == min(len(t), len(d)):
        return Check("vocabulary", "note", f"the same {agree} tokens with the same ids; one side adds "
                     f"{abs(len(t) - len(d))} extra ids")  # fmt: skip
    return Check("vocabulary", "fail", f"only {agree} of {len(t)} token ids agree ({len(d)} in the draft): pick a "
                 "draft GGUF of the target's model family, or an n-gram drafter.")  # fmt: skip


def diagnose_gguf(target: str, draft: str | None = None, path=None, weights: str = "as the GGUF stores it") -> dict:
    """The pair doctor for llama.cpp: GGUF files (the bundled model as it ships, a local or Hub .gguf), each found by
    `path(spec)` (the llama.cpp backend's own choice, which converts model folders; loading.gguf_path by default)."""
    from engine.models.loading import gguf_path
    from engine.models.sizing import free_memory_bytes

    specs = {"target": target} | ({"draft": draft} if draft else {})
    facts = {role: gguf_facts((path or gguf_path)(spec)) for role, spec in specs.items()}
    checks: list[Check] = []
    if draft:
        checks.append(gguf_vocab_check(facts["target"], facts["draft"]))
        if checks[0].status != "fail":
            differ = [k for k in ("eos", "bos") if facts["target"]["special"][k] != facts["draft"]["special"][k]]
            checks.append(Check("special tokens", "note" if differ else "ok",
                                f"differ: {', '.join(differ)}" if differ else "same EOS/BOS"))  # fmt: skip
        ratio = facts["target"]["params"] / max(facts["draft"]["params"], 1)
        checks.append(Check("size ratio", "ok" if ratio >= 4 else "warn", f"target/draft = {ratio:.1f}x parameters; "
                            "below ~4x drafting costs about as much as it saves"))  # fmt: skip
    contexts = {role: f["context"] for role, f in facts.items()}
    checks.append(Check("context length", "ok", ", ".join(f"{r} {c or 'unknown'}" for r, c in contexts.items())))
    # the baseline and speculative servers each map the target's file, the speculative one the draft's
    t = facts["target"]
    parts = [["target GGUF x 2 servers", 2 * t["bytes"]]] + ([["draft GGUF", facts["draft"]["bytes"]]] if draft else [])
    memory = {"parts": parts, "free": free_memory_bytes(torch.device("cpu")), "where": "this machine",
              "worst": "warn", "advice": ""}  # a head's width is its GGUF's: with_head(width=...)
    checks.append(memory_check(memory))
    worst = max((c.status for c in checks), key=RANK.get)
    return {"target": target, "draft": draft, "dtype": weights, "device": "llama.cpp",
            "params": {role: f["params"] for role, f in facts.items()},
            "verdict": {"ok": "ok", "note": "ok", "warn": "warn", "fail": "fail"}[worst],
            "checks": [asdict(c) for c in checks], "memory": memory}  # fmt: skip


def markdown(report: dict) -> str:
    icons = {"ok": "✅", "note": "ℹ️", "warn": "⚠️", "fail": "❌"}
    lines = [f"**Pair check: {report['verdict']}** ({report['dtype']} on {report['device']})", ""]
    lines += [f"- {icons[c['status']]} **{c['name']}**: {c['detail']}" for c in report["checks"]]
    return "\n".join(lines)

"""Our engine against Hugging Face `generate()`, on the same pair, prompts and settings, in one process.

Four contenders per prompt and repeat, their order rotating between repeats after a warm-up of each:
HF plain generate, HF assisted generation (a draft model with a constant `num_assistant_tokens` and no
confidence cut-off, or `prompt_lookup_num_tokens`), our baseline, our speculative loop. Speeds are
end to end (new tokens / wall time including the prefill), since `generate()` reports nothing finer.

HF runs the models as `from_pretrained` returns them, as its users would; ours runs them as SpecArena
loads them, which on CPU includes the lean forward pass (engine.decoding.lean) and the linear layers' weight
layouts (engine.models.cpu). SPECARENA_LEAN=0 SPECARENA_CPU_PACK=0 makes both sides run the model's own
forward on stock layers, to compare the decoding loops alone.
"""

from __future__ import annotations

import statistics

import torch

from engine.decoding.runtime import Clock, eos_ids
from engine.errors import UserError
from engine.measure.bench import Progress, Session, _quiet, spread
from engine.measure.predict import expected_tokens
from engine.models.loading import MODELS
from engine.settings import Settings
from engine.worker import ENGINE

CONTENDERS = ("hf_generate", "hf_assisted", "ours_baseline", "ours_speculative")


def _hf_kwargs(session: Session, req: Settings) -> dict:
    target = session.backend.pair.target
    eos = sorted(eos_ids(target.model, target.tokenizer))
    # a model without an end token (every random: shape) generates exactly max_new_tokens, as ours does
    kwargs = dict(max_new_tokens=req.max_new_tokens, eos_token_id=eos or None)
    pad = target.tokenizer.pad_token_id
    kwargs["pad_token_id"] = pad if pad is not None else eos[0] if eos else 0
    if req.sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        s = req.sampling
        kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
    return kwargs


def _plain(spec: str, req: Settings):
    return MODELS.get(spec, req.dtype, req.device, pack=False).model


def _assisted_kwargs(req: Settings) -> dict:
    if req.drafter == "prompt-lookup":
        return dict(prompt_lookup_num_tokens=req.gamma, max_matching_ngram_size=req.ngram)
    draft = _plain(req.draft, req)
    # HF reads these from the assistant's generation config; fixed gamma, no early stop, as ours
    draft.generation_config.num_assistant_tokens = req.gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return dict(assistant_model=draft)


class ForwardClock:
    """Seconds spent inside a model's forward, by hooks on it, so a run's time splits into the model's and the
    decoding loop's own (sampling, cache bookkeeping, detokenising, Python): the part where loops differ."""

    def __init__(self, model):
        self.seconds, self.passes, self._began = 0.0, 0, 0.0
        self.clock = Clock(model.device)
        runs = getattr(model, "lean", None) or model  # ours may run the lean forward (engine.decoding.lean)
        self._hooks = [runs.register_forward_pre_hook(self._pre), runs.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._began = self.clock.now()

    def _post(self, *_):
        self.seconds += self.clock.now() - self._began
        self.passes += 1

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _hf_run(req: Settings, ids: list[int], kwargs: dict) -> tuple[float, list[int], None, float]:
    """One `generate()` on the engine thread, where our own runs go too: the same OpenMP team for both."""
    return ENGINE.call(_generate, req, ids, kwargs)


def _generate(req: Settings, ids: list[int], kwargs: dict) -> tuple[float, list[int], None, float]:
    model = _plain(req.target, req)
    inputs = torch.tensor([ids], device=model.device)
    clock, inside = Clock(model.device), ForwardClock(model)
    try:
        with torch.inference_mode():
            start = clock.now()
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
            elapsed = clock.now() - start
    finally:
        inside.close()
    new = out[0, len(ids) :].tolist()
    return len(new) / elapsed, new, None, (elapsed - inside.seconds) / max(len(new), 1)


def _ours(model, run) -> tuple[float, list[int], object, float]:
    inside = ForwardClock(model)
    try:
        result = run()
    finally:
        inside.close()
    m = result.metrics
    return m.new_tokens / m.total_s, result.token_ids, result, (m.total_s - inside.seconds) / max(m.new_tokens, 1)


def compare_hf(base: Settings, prompts: list[str], repeats: int = 3, progress: Progress = _quiet, stop=None) -> dict:
    """Speeds of the four contenders, their ratios (median, min, max) and ours measured vs predicted."""
    if base.drafter == "synthetic":
        raise UserError("HF has no synthetic drafter: compare with --drafter prompt-lookup or a --draft model.")
    req = base.validate()
    session = Session(req, progress, stop)
    rows, total = [], len(prompts) * repeats
    target = session.backend.pair.target.model
    for i, prompt in enumerate(prompts):
        ids = session.backend.encode(prompt, req)
        runners = {
            "hf_generate": lambda: _hf_run(req, ids, _hf_kwargs(session, req)),
            "hf_assisted": lambda: _hf_run(req, ids, _hf_kwargs(session, req) | _assisted_kwargs(req)),
            "ours_baseline": lambda: _ours(target, lambda: session.baseline(ids, req)),
            "ours_speculative": lambda: _ours(target, lambda: session.speculative(ids, req, [])),
        }
        for name in CONTENDERS:  # warm-up
            runners[name]()
        for r in range(repeats):
            session.check_stop()
            session.progress(i * repeats + r, total, f"prompt {i + 1}, repeat {r + 1}")
            order = CONTENDERS[r % 4 :] + CONTENDERS[: r % 4]
            got = {name: runners[name]() for name in order}
            rows.append(_row(i, r, order, got))
    progress(total, total, "done")
    return {
        "kind": "compare_hf",
        "settings": base.to_dict() | {"prompts": prompts, "repeats": repeats},
        "environment": session.environment,
        "ratios": {key: spread([row[key] for row in rows]) for key in RATIOS},
        "speeds": {name: spread([row[name]["tokens_per_s"] for row in rows]) for name in CONTENDERS},
        "outside_forward_s": {name: spread([row[name]["outside_forward_s"] for row in rows]) for name in CONTENDERS},
        "runs": rows,
    }


RATIOS = {
    "ours_spec_over_hf_assisted": ("ours_speculative", "hf_assisted"),
    "ours_base_over_hf_generate": ("ours_baseline", "hf_generate"),
    "ours_speedup": ("ours_speculative", "ours_baseline"),
    "hf_speedup": ("hf_assisted", "hf_generate"),
}


# which outputs must be equal (each engine's speculative run and its own baseline: lossless) and which may part
# (the two engines' kernels sum in different orders, so where two tokens are near-tied, above all in 16 bits, their
# greedy ids can differ without a bug in either)
PAIRS = {
    "ours speculative = ours baseline": ("ours_speculative", "ours_baseline"),
    "HF assisted = HF generate()": ("hf_assisted", "hf_generate"),
    "ours baseline = HF generate()": ("ours_baseline", "hf_generate"),
}


def _row(prompt: int, repeat: int, order: tuple, got: dict) -> dict:
    row = {"prompt": prompt, "repeat": repeat, "order": list(order)}
    for name, value in got.items():
        row[name] = {"tokens_per_s": value[0], "new_tokens": len(value[1]), "outside_forward_s": value[3]}
    for key, (a, b) in RATIOS.items():
        row[key] = got[a][0] / got[b][0]
    row["speedup_ratio_ours_over_hf"] = row["ours_speedup"] / row["hf_speedup"]
    ids = {name: tuple(value[1]) for name, value in got.items()}
    row["all_identical"] = len(set(ids.values())) == 1
    row["identical"] = {pair: ids[a] == ids[b] for pair, (a, b) in PAIRS.items()}
    row["ours_predicted_speedup"] = _predicted(got["ours_speculative"][2], got["ours_baseline"][2])
    row["ours_measured_over_predicted"] = (
        row["ours_speedup"] / row["ours_predicted_speedup"] if row["ours_predicted_speedup"] else None
    )
    return row


def _predicted(spec, base) -> float | None:
    """Leviathan's prediction from this run's own alpha per position, c and verify cost, end to end.

    Per step, E(gamma_s) tokens for gamma_s * c + V target-step costs (V: mean verify pass over a baseline
    step). What the loop spends beyond drafting and verifying is not in it, so measured / predicted
    shows how close the loop runs to the model's own costs.
    """
    m, b = spec.metrics, base.metrics
    if not m.drafted_tokens or not b.tokens_per_s:
        return None
    step = 1 / b.tokens_per_s
    decode = spec.steps[1:]
    c = (m.draft_s / m.drafted_tokens) / step
    v = (m.verify_s / len(decode)) / step
    alphas = [a for a in m.per_position_acceptance if a is not None]
    tokens = sum(expected_tokens(alphas, m.alpha or 0.0, len(s.drafted)) for s in decode)
    cost = sum(len(s.drafted) * c + v for s in decode)
    decode_speedup = tokens / cost
    # end to end: the prefill costs both sides the same, the gain applies to the decode part only
    spec_total = b.ttft_s + (b.total_s - b.ttft_s) / decode_speedup
    return b.total_s / spec_total if spec_total > 0 else None


def median_of(report: dict, key: str) -> float | None:
    values = [row[key] for row in report["runs"] if row.get(key) is not None]
    return statistics.median(values) if values else None

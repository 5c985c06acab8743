"""One-shot diagnosis of the GPU path: `python -m engine gpu-check --full [--json PATH]`.

Everything a machine with a GPU needs to say whether SpecArena runs there as fast as the engine can, with
nothing but the project and its requirements, in a few minutes. One line per check, PASS, FAIL or SKIP
with its figure; the whole as JSON. Random weights in real shapes (engine.models.random_shapes: Llama-3.1-8B as the
target, Llama-3.2-1B's passes paced as the draft), bfloat16, the synthetic drafter at alpha 0.8, gamma 5:

  repeats     the same comparison four times in one process: each run's tokens/s, every one within 10% of
              the median and the first timed run as fast as the rest; with each run's counts (CUDA
              allocator: device mallocs and retries; Python's garbage collections) to rule causes in or out,
              and a profile of the slowest and the fastest baseline when they differ
  lossless    the verdict of every run (engine.decoding.lossless): identical, or rounding; never a bug
  alpha       the synthetic drafter's measured alpha over all runs, within 0.05 of the 0.8 asked
  app         the app's /compare against the engine on the same settings (app.measure): tokens/s >= 0.95
  compile     a cold and a warm compile in fresh processes sharing one compile cache: <= 120 s and <= 30 s
  bound       the compiled baseline's tokens/s as a share of the card's memory-bandwidth bound: >= 70%
  speedup     the compiled speculative run over the compiled baseline: >= 2.0x
  nvml        what NVML saw (device, driver, memory used at peak)

Without a GPU it runs repeats, lossless, alpha and app on a CPU-sized shape and says what it skipped.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch

from engine.settings import Settings

# bytes per second each card's memory moves, by name (NVML's clocks do not give HBM's rate reliably)
BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
             "GH200": 4.0e12, "B200": 8.0e12, "A100-SXM4-80GB": 2.04e12, "A100 80GB PCIe": 1.94e12,
             "A100": 1.56e12, "L40S": 0.864e12, "L40": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12,
             "T4": 0.32e12, "RTX 4090": 1.008e12, "RTX 3090": 0.936e12, "A6000": 0.768e12}  # fmt: skip
PROMPT = "Explain, step by step, how a lighthouse keeper of the nineteenth century kept the light burning."
GOALS = {"repeat_spread": 0.10, "app_ratio": 0.95, "cold_s": 120.0, "warm_s": 30.0, "bound_share": 0.70,
         "speedup": 2.0, "alpha_error": 0.05}  # fmt: skip


@dataclass
class Check:
    name: str
    status: str  # "PASS" | "FAIL" | "SKIP"
    figure: str
    data: dict

    def line(self) -> str:
        return f"{self.status:4}  {self.name:9} {self.figure}"


def settings_for(gpu: bool, **over) -> Settings:
    """The diagnosis's comparison: real shapes on a GPU, the CPU-sized one elsewhere."""
    if gpu:
        shape = dict(target="random:llama-3.1-8b", draft="random:llama-3.2-1b", max_new_tokens=128, device="cuda")
    else:
        shape = dict(target="random:smollm2-135m", draft="random:smollm2-135m", max_new_tokens=32, device="cpu")
    return Settings(drafter="synthetic", alpha=0.8, gamma=5, dtype="bfloat16", seed=0, **(shape | over))


def bandwidth(name: str) -> float | None:
    for key, value in BANDWIDTH.items():  # within a family the longer names come first
        if key in name:
            return value
    return None


class Counts:
    """What a run did besides computing: CUDA allocator calls and Python garbage collections."""

    def __init__(self):
        self.collections = 0
        gc.callbacks.append(self._on_gc)
        self.cuda = torch.cuda.is_available()
        self.start = torch.cuda.memory_stats() if self.cuda else {}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.collections += 1

    def stop(self) -> dict:
        gc.callbacks.remove(self._on_gc)
        out = {"gc_collections": self.collections}
        if self.cuda:
            end = torch.cuda.memory_stats()
            for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams"):
                out[key] = end.get(key, 0) - self.start.get(key, 0)
        return out


def run_repeats(s: Settings, times: int = 4) -> list[dict]:
    """The same comparison `times` times in this process: speeds, verdicts, alpha counts and counts per run."""
    from engine.compare import compare
    from engine.decoding.metrics import position_counts

    runs = []
    for _ in range(times):
        counts = Counts()
        c = compare(s, PROMPT)
        tested = position_counts(c.speculative.steps[1:])
        runs.append({"baseline_tps": c.baseline.metrics.tokens_per_s,
                     "speculative_tps": c.speculative.metrics.tokens_per_s, "speedup": c.speedup,
                     "verdict": c.verdict.kind, "verdict_message": c.verdict.message,
                     "tested": sum(r for r, _ in tested), "kept": sum(k for _, k in tested),
                     "strict": c.environment.get("strict"), **counts.stop()})  # fmt: skip
    return runs


def check_repeats(runs: list[dict]) -> Check:
    speeds = [r["baseline_tps"] for r in runs]
    median = statistics.median(speeds)
    worst = max(abs(v / median - 1) for v in speeds)
    first = speeds[0] / statistics.median(speeds[1:]) if len(speeds) > 1 else 1.0
    ok = worst <= GOALS["repeat_spread"] and first >= 1 - GOALS["repeat_spread"]
    spec = ", ".join(f"{r['speculative_tps']:.1f}" for r in runs)
    figure = (f"baseline tok/s {', '.join(f'{v:.1f}' for v in speeds)} (largest spread {worst:.0%}, first/rest "
              f"{first:.2f}); speculative {spec}")
    return Check("repeats", "PASS" if ok else "FAIL", figure, {"runs": runs})


def check_lossless(runs: list[dict]) -> Check:
    kinds = [r["verdict"] for r in runs]
    ok = all(k in ("identical", "rounding") for k in kinds)
    detail = next((r["verdict_message"] for r in runs if r["verdict"] not in ("identical",)), "")
    return Check("lossless", "PASS" if ok else "FAIL", ", ".join(kinds) + (f": {detail}" if detail else ""),
                 {"verdicts": kinds})


def check_alpha(runs: list[dict], asked: float) -> Check:
    tested, kept = sum(r["tested"] for r in runs), sum(r["kept"] for r in runs)
    alpha = kept / tested if tested else 0.0
    ok = tested > 0 and abs(alpha - asked) <= GOALS["alpha_error"]
    return Check("alpha", "PASS" if ok else "FAIL", f"measured {alpha:.3f} over {tested} drafted tokens, asked "
                 f"{asked}", {"alpha": alpha, "tested": tested})  # fmt: skip


def profile_runs(s: Settings, times: int = 2) -> list[dict]:
    """A profile of `times` baselines in a row (slow and fast ones alternated once): the top CUDA kernels and the
    counts of the calls that stall a GPU (mallocs, synchronisations)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.compare import compare

    out = []
    for _ in range(times):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            c = compare(replace(s, warmup=False), PROMPT)
        events = prof.key_averages()
        calls = {e.key: e.count for e in events if any(w in e.key for w in ("cudaMalloc", "cudaFree", "Synchronize"))}
        top = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:10]
        out.append({"baseline_tps": c.baseline.metrics.tokens_per_s, "stalling_calls": calls,
                    "top_kernels": [{"name": e.key[:80], "count": e.count,
                                     "ms": getattr(e, "self_device_time_total", 0) / 1000} for e in top]})  # fmt: skip
    return out


def check_app(s: Settings, repeats: int = 4) -> Check:
    """The app's /compare against the engine, both on these settings, through app.measure (a program of its own:
    the engine never imports the web app)."""
    if importlib.util.find_spec("gradio") is None:  # asked, not imported: the engine never loads the web app
        return Check("app", "SKIP", "gradio is not installed here: the app cannot run", {})
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    command = [sys.executable, "-m", "app.measure", "--repeats", str(repeats), "--json", out, "--settings",
               json.dumps(s.to_dict()), "--prompt", PROMPT]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return Check("app", "FAIL", "app.measure did not finish in 600 s", {})
    if done.returncode:
        return Check("app", "FAIL", f"app.measure failed: {(done.stderr or done.stdout)[-300:]}", {})
    data = json.loads(open(out).read())
    ratios = {side: statistics.median(v) for side, v in data["ratios"].items()}
    ok = min(ratios.values()) >= GOALS["app_ratio"]
    return Check("app", "PASS" if ok else "FAIL", "app / engine tokens/s: " + ", ".join(
        f"{side} {value:.2f}" for side, value in ratios.items()), data)  # fmt: skip


def compile_probe(s: Settings) -> dict:
    """In this fresh process: load the pair compiled, warm up (compiling), run one comparison; the times."""
    from engine.compare import compare

    start = time.perf_counter()
    c = compare(replace(s, compile=True), PROMPT)
    total = time.perf_counter() - start
    return {"total_s": total, "baseline_tps": c.baseline.metrics.tokens_per_s,
            "speculative_tps": c.speculative.metrics.tokens_per_s, "speedup": c.speedup, "verdict": c.verdict.kind,
            "strict": c.environment.get("strict")}  # fmt: skip


def check_compile(s: Settings) -> tuple[Check, dict | None]:
    """A cold and a warm compile, each a fresh process, sharing one empty compile cache."""
    cache = tempfile.mkdtemp(prefix="specarena-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    probes = {}
    for phase, limit in (("cold", 420), ("warm", 240)):
        command = [sys.executable, "-m", "engine", "gpu-check", "--compile-probe", "--settings",
                   json.dumps(s.to_dict())]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env)
        except subprocess.TimeoutExpired:
            return Check("compile", "FAIL", f"the {phase} compile did not finish in {limit} s", probes), None
        if done.returncode:
            return Check("compile", "FAIL", f"the {phase} probe failed: {done.stderr[-300:]}", probes), None
        probes[phase] = json.loads(done.stdout.strip().splitlines()[-1])
    cold, warm = probes["cold"]["total_s"], probes["warm"]["total_s"]
    ok = cold <= GOALS["cold_s"] and warm <= GOALS["warm_s"]
    return Check("compile", "PASS" if ok else "FAIL", f"cold {cold:.0f} s, warm {warm:.0f} s (load, compile, warm-up "
                 "and one comparison)", probes), probes["warm"]  # fmt: skip


def check_bound(s: Settings, warm: dict | None) -> Check:
    from engine.models import random_shapes as random_models
    from engine.models.sizing import count_params

    name = torch.cuda.get_device_name()
    rate = bandwidth(name)
    if warm is None or rate is None:
        return Check("bound", "SKIP", f"no compiled run or no known bandwidth for {name}", {})
    weights = count_params(random_models.config(random_models.shape_of(s.target))) * 2  # bfloat16
    bound = rate / weights
    share = warm["baseline_tps"] / bound
    return Check("bound", "PASS" if share >= GOALS["bound_share"] else "FAIL",
                 f"compiled baseline {warm['baseline_tps']:.0f} tok/s = {share:.0%} of {bound:.0f} tok/s "
                 f"({rate / 1e12:.2f} TB/s over {weights / 1e9:.1f} GB of weights)",
                 {"bound_tps": bound, "share": share})  # fmt: skip


def check_speedup(warm: dict | None) -> Check:
    if warm is None:
        return Check("speedup", "SKIP", "no compiled run", {})
    ok = (warm["speedup"] or 0) >= GOALS["speedup"]
    return Check("speedup", "PASS" if ok else "FAIL", f"compiled {warm['speculative_tps']:.0f} vs "
                 f"{warm['baseline_tps']:.0f} tok/s: {warm['speedup']:.2f}x (alpha 0.8, gamma 5, draft passes)",
                 warm)  # fmt: skip


def check_nvml() -> Check:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        data = {"device": pynvml.nvmlDeviceGetName(handle), "driver": pynvml.nvmlSystemGetDriverVersion(),
                "used_gb": info.used / 1e9, "total_gb": info.total / 1e9,
                "torch_peak_gb": torch.cuda.max_memory_allocated() / 1e9}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any NVML failure is what this check reports
        return Check("nvml", "FAIL", f"NVML unreadable ({type(exc).__name__}: {exc})", {})
    return Check("nvml", "PASS", f"{data['device']}, driver {data['driver']}, {data['used_gb']:.1f} of "
                 f"{data['total_gb']:.0f} GB used, torch peak {data['torch_peak_gb']:.1f} GB", data)  # fmt: skip


def diagnose(say=print) -> list[Check]:
    """Every check in turn, each said as it is done."""
    gpu = torch.cuda.is_available()
    s = settings_for(gpu)
    checks: list[Check] = []

    def done(check: Check) -> None:
        checks.append(check)
        say(check.line())

    say(f"SpecArena GPU check on {torch.cuda.get_device_name() if gpu else 'a CPU (no CUDA GPU)'}: {s.target} with "
        f"{s.draft}'s passes, {s.dtype}, synthetic alpha {s.alpha}, gamma {s.gamma}, {s.max_new_tokens} tokens")
    runs = run_repeats(s)
    repeats = check_repeats(runs)
    if gpu and repeats.status == "FAIL":
        repeats.data["profiles"] = profile_runs(s)
    for check in (repeats, check_lossless(runs), check_alpha(runs, s.alpha), check_app(s)):
        done(check)
    if not gpu:
        for name in ("compile", "bound", "speedup", "nvml"):
            done(Check(name, "SKIP", "needs a CUDA GPU", {}))
        return checks
    compiled, warm = check_compile(s)
    for check in (compiled, check_bound(s, warm), check_speedup(warm), check_nvml()):
        done(check)
    return checks


def report(checks: list[Check]) -> dict:
    import transformers

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "goals": GOALS,
            "checks": [asdict(c) for c in checks]}  # fmt: skip

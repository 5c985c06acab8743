"""Command line: `python -m engine run|bench|doctor`.

`run` warms up, runs baseline then speculative on one prompt and prints a summary (or one JSON
object with --json). Errors a user can cause end with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.errors import UserError
from engine.models import BUNDLED


def add_pair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=BUNDLED, help=f"Hub id, local folder or {BUNDLED} (default)")
    p.add_argument("--draft", help="draft model (same vocabulary as the target); implies --drafter draft-model")
    p.add_argument("--drafter", choices=["draft-model", "prompt-lookup", "synthetic"], help="default: prompt-lookup")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template")
    p.add_argument("--ngram", type=int, default=3, help="prompt lookup: longest n-gram to match")
    p.add_argument("--alpha", type=float, default=0.8, help="synthetic drafter: acceptance probability")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m engine", description="SpecArena speculative decoding engine")
    sub = top.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="baseline vs speculative on one prompt")
    add_pair_args(run)
    add_sampling_args(run)
    run.add_argument("--prompt", required=True)
    run.add_argument("--gamma", type=int, default=4, help="draft tokens per step (1-16)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    return top


def request_from(args: argparse.Namespace, **overrides):
    from engine.compare import Request
    from engine.sampling import SamplingConfig

    drafter = args.drafter or ("draft-model" if args.draft else "prompt-lookup")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    fields = dict(
        prompt=getattr(args, "prompt", "") or "",
        target=args.target,
        draft=args.draft,
        drafter=drafter,
        gamma=getattr(args, "gamma", 4),
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        chat=args.chat,
        dtype=args.dtype,
        device=args.device,
        ngram=args.ngram,
        alpha=args.alpha,
    )
    fields.update(overrides)
    return Request(**fields)


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summary(result) -> str:
    """A short table for people; the JSON carries everything."""
    req, b, s = result.request, result.baseline.metrics, result.speculative.metrics
    env = result.environment
    sampling = "greedy" if req.sampling.greedy else f"temperature {req.sampling.temperature}"
    lines = [
        f"target {req.target} on {env['device']} ({env['dtype']}), drafter {req.drafter}"
        + (f" {req.draft}" if req.draft else "")
        + f", gamma {req.gamma}, {sampling}",
        f"{'':22}{'baseline':>12}{'speculative':>14}",
        f"{'tokens/s':22}{b.tokens_per_s:12.1f}{s.tokens_per_s:14.1f}",
        f"{'time to first token':22}{b.ttft_s * 1000:10.0f}ms{s.ttft_s * 1000:12.0f}ms",
        f"{'new tokens':22}{b.new_tokens:12d}{s.new_tokens:14d}",
        f"{'target passes':22}{b.target_passes:12d}{s.target_passes:14d}",
        f"speedup {_fmt(result.speedup)}x (predicted {_fmt(s.predicted_speedup)}x), "
        f"acceptance {_fmt(s.acceptance_rate, '.1%')}, {s.mean_accepted_length:.2f} tokens per target pass, "
        f"c = {_fmt(s.cost_ratio_c, '.3f')}",
    ]
    if result.identical is not None:
        lines.append("outputs identical: " + ("yes" if result.identical else "NO - this is a bug, please report it"))
    lines.append("")
    lines.append(result.speculative.text)
    return "\n".join(lines)


def cmd_run(args) -> int:
    from engine.compare import compare

    result = compare(request_from(args))
    print(json.dumps(result.to_dict()) if args.json else summary(result))
    return 0


COMMANDS = {"run": cmd_run}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

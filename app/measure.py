"""How much serving costs: the same comparison through the app's `compare` API and through the engine.

    python -m app.measure [--repeats 16] [--max-new-tokens 64]

Starts `python app.py` on a free loopback port (as a user would), then alternates engine-alone runs in
this process and API runs of the same request (bundled model, prompt lookup, greedy) and prints the median
ratio of speculative and baseline tokens/s, API over engine. The engine's clocks exclude the UI's time by
construction; what this shows is whether rendering and streaming steal CPU from the model while it runs.
On a shared 2-core VM single pairs range ±30%: fewer than ~16 pairs cannot tell 0.95 from 1.0.

It also prints what is not a timed run: each call's wall time over its two runs' time, through the API and in
the engine alone (docs/running.md, "where a comparison's time goes", says where the difference goes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gradio_client import Client

from app.handlers import API_FIELDS
from engine import presets
from engine.backends.servers import free_port
from engine.compare import compare
from engine.settings import Settings

SIDES = ("speculative", "baseline")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m app.measure")
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--settings", help="the comparison's settings as JSON (default: the bundled model, prompt "
                        "lookup, gamma 4, greedy)")
    parser.add_argument("--prompt", help="default: the first rewriting prompt of the task suite")
    parser.add_argument("--json", metavar="PATH", help="write every pair's ratios as JSON")
    args = parser.parse_args()
    prompt = args.prompt or presets.tasks()["categories"]["rewriting"]["prompts"][0]
    if args.settings:
        settings = Settings(**json.loads(args.settings))
    else:
        settings = Settings(drafter="prompt-lookup", gamma=4, max_new_tokens=args.max_new_tokens, seed=0, chat=True)
    port = free_port()
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port))
    server = subprocess.Popen([sys.executable, "app.py"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ratios = measure(f"http://127.0.0.1:{port}/", settings, prompt, args.repeats)
    finally:
        server.terminate()
    for side, values in ((side, ratios[side]) for side in SIDES):
        print(f"{side} tokens/s, API / engine: median {statistics.median(values):.3f} "
              f"(min {min(values):.3f}, max {max(values):.3f}, {len(values)} pairs)")  # fmt: skip
    for path in ("api", "engine"):
        walls, runs = ratios[f"{path} wall s"], ratios[f"{path} runs s"]
        print(f"{path}: a call takes {statistics.median(w / r for w, r in zip(walls, runs)):.2f}x its runs' time "
              f"(median; {statistics.median(w - r for w, r in zip(walls, runs)):.2f} s outside them)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings.to_dict(), "prompt": prompt, "ratios": ratios}))


def measure(url: str, settings: Settings, prompt: str, repeats: int) -> dict[str, list[float]]:
    """Pairs of the same comparison, through the engine in this process and through the app's API, their order
    alternating; the API / engine tokens/s of each side per pair, and each call's wall time and its two runs' time
    ("api wall s", "api runs s", ...). The device and compile stay the app's."""
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    client = Client(url, verbose=False)
    api_args = {"prompt": prompt} | {name: getattr(settings, name) for name in API_FIELDS}
    ratios: dict[str, list[float]] = {"speculative": [], "baseline": []}
    ratios |= {f"{path} {what} s": [] for path in ("api", "engine") for what in ("wall", "runs")}
    for r in range(repeats):
        done = {}
        for first in ("engine", "api") if r % 2 == 0 else ("api", "engine"):
            started = time.perf_counter()
            if first == "engine":
                done[first] = compare(settings, prompt).to_dict(with_steps=False)
            else:
                done[first] = client.predict(**api_args, api_name="/compare")[0]
            ratios[f"{first} wall s"].append(time.perf_counter() - started)
            ratios[f"{first} runs s"].append(sum(done[first][side]["metrics"]["total_s"] for side in SIDES))
        for side in SIDES:
            ratios[side].append(done["api"][side]["metrics"]["tokens_per_s"] /
                                done["engine"][side]["metrics"]["tokens_per_s"])  # fmt: skip
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()))
    return ratios


if __name__ == "__main__":
    main()

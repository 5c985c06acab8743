"""Reports of sweeps and suites: JSON with everything, CSV of the cells, settings ready to paste.

The JSON is the record (settings, library versions, device, every A/B pair); the CSV is for
spreadsheets; the snippets carry the best gamma found into transformers, vLLM and llama.cpp. Each names the
prompt set it was measured on (file hash or dataset revision, sample and split), so a result can be reproduced.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
from pathlib import Path

from engine.settings import BUNDLED, HEADS

CSV_COLUMNS = [
    "drafter", "gamma", "temperature", "category", "speedup_median", "speedup_min", "speedup_max",
    "acceptance_median", "mean_accepted_length", "baseline_tps", "speculative_tps", "all_identical", "lossless",
    "pairs",
]  # fmt: skip


# What the bundled model is on the Hub: an engine elsewhere loads it by that name, not by ours.
HUB_NAMES = {BUNDLED: "HuggingFaceTB/SmolLM2-135M-Instruct", "bundled": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def best_setting(report: dict) -> dict | None:
    """The fastest measured cell of a real drafter: drafter, gamma, temperature, speedup. Synthetic cells are
    a measuring tool (the target's own tokens, replayed), never a setting to deploy."""
    cells = [c for c in report.get("cells", []) if c["speedup"]["median"] is not None and c["drafter"] != "synthetic"]
    if not cells:
        return None
    ranked = sorted(cells, key=lambda c: c["speedup"]["median"], reverse=True)
    best = ranked[0]
    return {k: best[k] for k in ("drafter", "gamma", "temperature")} | {
        "p_min": best.get("p_min", 0.0),
        "topk": best.get("topk", 1),
        "tree_nodes": (best.get("tree_nodes") or {}).get("median"),
        "server_command": best.get("server_command", ""),
        "speedup": best["speedup"]["median"],
        "samples": best["speedup"].get("n"),
        "notes": trust_notes(best, ranked[1] if len(ranked) > 1 else None),
    }


def trust_notes(best: dict, runner_up: dict | None) -> list[str]:
    """How much the choice of the best cell rests on: one sample, or a runner-up inside its spread."""
    notes = []
    if best["speedup"].get("n") == 1:
        notes.append("one sample decides this: measure more repeats or prompts before trusting it")
    if runner_up is not None:
        b, r = best["speedup"], runner_up["speedup"]
        r_max, b_min = r.get("max"), b.get("min")
        if r_max is not None and b_min is not None and r_max >= b["median"] and b_min <= r["median"]:
            notes.append(
                f"the runner-up ({runner_up['drafter']}, gamma {runner_up['gamma']}, temperature "
                f"{runner_up['temperature']}{option_label(runner_up.get('p_min', 0.0), runner_up.get('topk', 1))}: "
                f"{r['median']:.2f}x) lies within this cell's spread: these samples "
                "do not tell the two apart"
            )
    return notes


def option_label(p_min: float = 0.0, topk: int = 1) -> str:
    """A cell's drafter options in words, for progress lines and reports ("" when it has none)."""
    return (f", confidence stop {p_min:g}" if p_min else "") + (f", tree top-{topk}" if topk > 1 else "")


def hub_name(spec: str) -> str:
    return HUB_NAMES.get(spec, spec)


def snippets(report: dict) -> dict[str, str]:
    """How to run the best setting elsewhere, with the measured pair, gamma and n-gram size. Prompt lookup and
    a draft model map to different options; llama.cpp wants GGUF files, named after the models."""
    best = best_setting(report)
    if best is None:
        return {}
    s = report["settings"]
    target, gamma, ngram = hub_name(s["target"]), best["gamma"], s.get("ngram", 3)
    if s.get("backend") == "vllm":
        return {"vllm": vllm_serve(s, best)}
    if s.get("backend") == "llama.cpp" and best["server_command"]:
        return {"llama.cpp": best["server_command"]}
    if best["drafter"] in HEADS:
        return head_snippets(s, best)
    if best["drafter"] == "suffix":  # vLLM's suffix decoding (arctic-inference); transformers and llama.cpp have none
        return {"vllm": vllm_serve(s, best)}
    if best["drafter"] == "prompt-lookup":
        return {
            "transformers": f"model.generate(**inputs, prompt_lookup_num_tokens={gamma}, "
            f"max_matching_ngram_size={ngram})",
            "vllm": f'LLM(model="{target}", speculative_config={{"method": "ngram", '
            f'"num_speculative_tokens": {gamma}, "prompt_lookup_max": {ngram}, "prompt_lookup_min": 1}})',
            "llama.cpp": llama_server(s, best),
        }
    draft = hub_name(s["draft"])
    return {
        "transformers": f'draft = AutoModelForCausalLM.from_pretrained("{draft}")\n'
        f"model.generate(**inputs, assistant_model=draft, num_assistant_tokens={gamma}, "
        f'num_assistant_tokens_schedule="constant", assistant_confidence_threshold={best["p_min"]:g})',
        "vllm": f'LLM(model="{target}", speculative_config={{"model": "{draft}", "num_speculative_tokens": {gamma}}})',
        "llama.cpp": llama_server(s, best),
    }


def head_snippets(settings: dict, best: dict) -> dict[str, str]:
    """A draft head on the engines that serve one, at the measured gamma: vLLM and SGLang load the head's folder or
    Hub id as it is; llama.cpp converts it with its own converter first (which reads the target's HF folder). A
    P-EAGLE head is vLLM's eagle3 with parallel drafting; SGLang and llama.cpp have no P-EAGLE. A DSpark head: vLLM on
    a GPU, llama.cpp with its confidence stop (no SGLang line: not checked that it serves one); a DFlash2 head: vLLM for
    a GPU, llama.cpp from the flat config its converter reads."""
    target, head, gamma, method = hub_name(settings["target"]), settings["draft"], best["gamma"], best["drafter"]
    if method == "peagle":
        config = {"method": "eagle3", "model": head, "num_speculative_tokens": gamma, "parallel_drafting": True}
        return {"vllm": f"vllm serve {target} --speculative-config '{json.dumps(config)}'"}
    config = {"method": method, "model": head, "num_speculative_tokens": gamma}
    name = Path(head.rstrip("/")).name
    llama = (f"python convert_hf_to_gguf.py {shlex.quote(head)} --target-model-dir TARGET_HF_FOLDER --outfile "
             f"{name}.gguf\nllama-server -m {target.split('/')[-1]}.gguf -md {name}.gguf --spec-type draft-{method} "
             f"--spec-draft-n-max {gamma}")  # fmt: skip
    if method == "dspark":  # vLLM runs DSpark on GPUs (its model runner V2); llama.cpp stops at the confidence too
        return {"vllm": f"vllm serve {target} --speculative-config '{json.dumps(config)}'  # a GPU: vLLM 0.32's CPU "
                "build refuses DSpark", "llama.cpp": llama + f" --spec-draft-p-min {best.get('p_min', 0.0):g}"}
    if method == "mtp-head":  # served by neither: vLLM and llama.cpp run MTP from inside a target's own checkpoint
        return {}
    if method == "dflash2":  # vLLM reads the speculators folder (as its dflash method); llama.cpp's converter does not
        flat = ("# llama.cpp's converter reads DFlash2 in z-lab's flat layout only: the config SpecArena's llama.cpp "
                "backend writes (engine/backends/heads.py, llama_config)\n")
        return {"vllm": f"vllm serve {target} --speculative-config '{json.dumps(config | {'method': 'dflash'})}'  "
                "# a GPU: vLLM 0.32's CPU build refuses DFlash2", "llama.cpp": flat + llama.replace("draft-dflash2",
                                                                                                  "draft-dflash")}
    algorithm = "EAGLE3" if method == "eagle3" else "DFLASH"
    topk, verified = best.get("topk", 1), gamma + 1
    if topk > 1 and best.get("tree_nodes"):  # SGLang grows EAGLE-2 trees too; vLLM and llama.cpp verify the chain
        verified = round(best["tree_nodes"]) + 1
    chain = f" --speculative-num-steps {gamma} --speculative-eagle-topk {topk}" if method == "eagle3" else ""
    return {
        "vllm": f"vllm serve {target} --speculative-config '{json.dumps(config)}'",
        "sglang": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {head}{chain} --speculative-num-draft-tokens {verified}",
        "llama.cpp": llama,
    }


def _cell(settings: dict, best: dict):
    """The Settings the best cell ran with."""
    from engine.settings import Settings

    known = {k: v for k, v in settings.items() if k in Settings.names()}
    return Settings(**known | {k: best[k] for k in ("drafter", "gamma", "temperature", "p_min", "topk")})


def llama_server(settings: dict, best: dict) -> str:
    """llama-server with the flags the llama.cpp backend would start for the best cell (engine.backends.llamacpp builds
    both), its GGUF files named after the models. llama.cpp sizes no draft adaptively: the best gamma is its
    most."""
    from dataclasses import replace

    from engine.backends.llamacpp import spec_flags

    cell = _cell(settings, best)
    cell = replace(cell, adaptive=False, draft_min=min(cell.draft_min, cell.gamma))
    gguf = lambda spec: Path(f"{hub_name(spec).split('/')[-1]}.gguf")  # noqa: E731
    draft = gguf(cell.draft) if cell.drafter == "draft-model" else None
    return shlex.join(["llama-server", "-m", str(gguf(cell.target)), *spec_flags(cell, draft)])


def vllm_serve(settings: dict, best: dict) -> str:
    """The vLLM command with exactly the speculative_config the best cell was measured with (built by the same
    function that configured the server), its models named by their Hub ids."""
    from engine.backends.vllm import draft_location, speculative_config

    cell = _cell(settings, best)
    config = speculative_config(cell, draft_location(cell))
    if "model" in config:
        config["model"] = hub_name(cell.draft)
    return f"vllm serve {hub_name(cell.target)} --speculative-config '{json.dumps(config)}'"


def _csv_row(cell: dict, category: str, stats: dict) -> list:
    return [
        cell["drafter"], cell["gamma"], cell["temperature"], category, stats["speedup"]["median"],
        stats["speedup"]["min"], stats["speedup"]["max"], stats["acceptance_rate"]["median"],
        stats["mean_accepted_length"]["median"], stats["baseline_tps"]["median"],
        stats["speculative_tps"]["median"], stats["all_identical"], stats["lossless"], stats["speedup"]["n"],
    ]  # fmt: skip


def to_csv(report: dict) -> str:
    """One row per cell (category "all") and one per cell and category."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for cell in report.get("cells", []):
        writer.writerow(_csv_row(cell, "all", cell))
        for category, stats in cell.get("by_category", {}).items():
            writer.writerow(_csv_row(cell, category, stats))
    return out.getvalue()


def prompt_set_line(report: dict) -> str:
    """Which prompts a report rests on, in one line: name, fingerprint, how many, how they were chosen."""
    p = report.get("prompt_set")
    if not p:
        return "Prompt set: not recorded."
    sel = p.get("selection", {})
    how = []
    if sel.get("per_category"):
        drawn = f" drawn with seed {sel['seed']}" if sel.get("seed") is not None else " (the first)"
        how.append(f"{sel['per_category']} per category{drawn}")
    if sel.get("held_out"):
        how.append(f"the {sel.get('part', 'held-out')} part of a {sel['held_out']:g} held-out split "
                   f"(seed {sel.get('split_seed', 0)})")  # fmt: skip
    if sel.get("categories"):
        how.append("categories " + ", ".join(sel["categories"]))
    said = [f"{k['where']}: {k['why'] if len(k['why']) <= 80 else k['why'][:79] + '…'}" for k in p.get("skipped", [])]
    skipped = f"; {len(said)} skipped ({'; '.join(said[:3])}{'; …' if len(said) > 3 else ''})" if said else ""
    return (f"Prompt set: {p['name']} ({p['fingerprint']}), {p['items']} prompt(s), {p['turns']} turn(s) in "
            f"{len(p['categories'])} categories" + (f"; {'; '.join(how)}" if how else "") + skipped + ".")


def snippets_markdown(report: dict) -> str:
    best = best_setting(report)
    if best is None:
        return ("No setting to take elsewhere: only synthetic cells (a measuring tool) were measured.\n\n"
                + prompt_set_line(report) + "\n")  # fmt: skip
    stop = option_label(best["p_min"], best["topk"])
    lines = [f"# Best setting: {best['drafter']}, gamma {best['gamma']}, temperature {best['temperature']}{stop}: "
             f"{best['speedup']:.2f}x measured over {best['samples']} samples\n", prompt_set_line(report) + "\n"]
    lines += [f"> Note: {note}." for note in best["notes"]]
    for fit in report.get("fits", []):
        stop = option_label(fit.get("p_min", 0.0), fit.get("topk", 1))
        lines.append(f"- {fit['drafter']} at temperature {fit['temperature']}{stop}: {fit['verdict']}")
    for name, code in snippets(report).items():
        lines += ["", f"## {name}", "", "```", code, "```"]
    return "\n".join(lines) + "\n"


def write(report: dict, folder: str | Path) -> dict[str, Path]:
    """report.json, report.csv and settings.md in `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "report.json", "csv": folder / "report.csv", "settings": folder / "settings.md"}
    paths["json"].write_text(json.dumps(report | {"snippets": snippets(report)}, indent=1))
    paths["csv"].write_text(to_csv(report))
    paths["settings"].write_text(snippets_markdown(report))
    return paths


def read(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    data.pop("snippets", None)
    return data

"""The Lab's Forge panel: `python -m engine forge` on the page. Train an EAGLE-3 or DFlash head for a target on this
machine within a time budget, watch its validation acceptance per draft position grow, stop it (the best checkpoint is
written), see whether it pays against prompt lookup, suffix and the target alone, and hand it to the Playground.

All the work is engine.forge (forge_events on the engine thread); this module checks the fields, lays out, wires and
draws. The app writes heads only under the SpecArena cache (engine.policy.forged_heads), and reads them back from
there.
"""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

from app import gpu, jobs, prompt_sets, render
from app.handlers import RENDER_EVERY, STOPS, session_of
from app.jobs import api_error, job_failure
from engine import policy
from engine.errors import UserError, blame
from engine.forge import DATA_DTYPES, KINDS
from engine.measure import promptsets
from engine.settings import HEAD_NAMES

HELP = """Train an **EAGLE-3** or a **DFlash head** for the target on this machine, from the target's own answers to
the prompts below (the prompt set above when one is loaded, else the chosen task categories; its held-out share,
0.2 when none is set, is never trained on and measures the head at the end). The time budget covers the whole forge:
loading, data, training, export and the final measurement (planned once the target is loaded; the status line then
says how the minutes are shared). **Stop** ends the forge and still writes the best checkpoint. Heads are written
under the SpecArena cache; naming an existing forge folder resumes it. The same as `python -m engine forge`."""

FIELDS = {"forge_target": "target", "forge_minutes": "minutes", "forge_out": "output folder",
          "forge_pays": "measure whether it pays", "forge_data": "data passes in", "forge_general": "general prompts",
          "forge_hold_all": "measure on every prompt", "forge_kind": "head kind"}  # fmt: skip
# the head kinds (ForgeConfig.kind) as the choice shows them (the Playground's drafter names them: HEAD_NAMES)
KIND_LABELS = {"eagle3": "EAGLE-3: a chain, one one-layer step a token",
               "dflash": "DFlash: a block of drafts in one pass"}  # fmt: skip
# the data passes' dtype (ForgeConfig.data_dtype, engine.forge.pipeline.DATA_DTYPES) as the dropdown shows them
DATA_LABELS = {"target": "the target's own dtype", "bfloat16": "bfloat16 (a copy)", "float16": "float16 (a copy)"}
# the Lab's fields the forge reads (its prompt set and task categories): marked under them, as the sweep does
SHARED = prompt_sets.FIELDS | {"categories": "task categories"}
MIN_MINUTES, MAX_MINUTES = 1.0, 60.0
HELD_OUT = 0.2  # the forge's held-out share when the Lab's prompt set sets none
OPTIONS: dict = {}  # further ForgeConfig fields (an operator's, or a test's small batches); none by default
PAYS_COLUMNS = ["drafter", "γ", "predicted ×", "measured ×", "accepted length", "acceptance", "lossless"]
COLORS = ["#7c3aed", "#16a34a", "#f59e0b", "#2563eb", "#dc2626", "#0ea5e9", "#6b7280", "#db2777"]
OUTPUTS = 6  # progress table, chart, verdict, does-it-pay table, "use this head", the head: then status, mark


def field_id(name: str) -> str:
    return prompt_sets.field_id(name)  # the Lab's form: lab-field-<name>


def most_minutes() -> float:
    """The longest forge this app runs (the operator may cap it, or turn forging off: engine.policy)."""
    try:
        return policy.forge_minutes(MAX_MINUTES)
    except UserError:
        return 0.0  # a cap nobody can read turns forging off rather than leaving it unbounded


OFF = ("forging is off on this app (its operator set SPECARENA_FORGE): run `python -m engine forge` on your own "
       "machine and load the head's folder where local folders are allowed.")


def build_layout() -> SimpleNamespace:
    """The forge's fields, buttons, status line, progress and result, in an accordion of the Lab."""
    f = SimpleNamespace()
    most = most_minutes()
    with gr.Accordion("Forge a head: train an EAGLE-3 or DFlash draft for the target, on this machine", open=False,
                      elem_id="lab-forge"):  # fmt: skip
        gr.Markdown(HELP if most else f"{HELP}\n\n**{OFF[0].upper()}{OFF[1:]}**")
        with gr.Row():
            f.target = gr.Textbox("", label="target", info="the Playground's target unless you change it",
                                  elem_id=field_id("forge_target"))  # fmt: skip
            f.minutes = gr.Number(min(15, most) if most else 15, label="minutes",
                                  info=f"the budget, {MIN_MINUTES:g} to {max(most, MIN_MINUTES):g}",
                                  elem_id=field_id("forge_minutes"))  # fmt: skip
            f.out = gr.Textbox("", label="output folder", placeholder="empty: a new folder under the cache",
                               info=f"inside {heads_root()}", elem_id=field_id("forge_out"))  # fmt: skip
            f.pays = gr.Checkbox(True, label="measure whether it pays", info="on the held-out prompts, at the end",
                                 elem_id=field_id("forge_pays"))  # fmt: skip
        with gr.Row():
            f.data = gr.Dropdown([(DATA_LABELS[d], d) for d in DATA_DTYPES], value="target", label="data passes in",
                                 info="a 16-bit copy of a float32 target makes ~2x the data where the CPU has "
                                 "bfloat16 units", elem_id=field_id("forge_data"))  # fmt: skip
            f.general = gr.Checkbox(True, label="general prompts", info="the forge's own, of the kinds the prompts "
                                    "below ask for (a head learns the target, not their subjects)",
                                    elem_id=field_id("forge_general"))  # fmt: skip
            f.hold_all = gr.Checkbox(False, label="measure on every prompt", info="train on general prompts alone; "
                                     "all of the prompts below measure the head", elem_id=field_id("forge_hold_all"))
            f.kind = gr.Radio([(KIND_LABELS[k], k) for k in KINDS], value="eagle3", label="head kind",
                              info="DFlash drafts γ tokens in one pass of its layers, which may pay better on a CPU "
                              "than a chain", elem_id=field_id("forge_kind"))  # fmt: skip
        f.prompts = gr.Markdown(elem_id="lab-forge-prompts")
        with gr.Row():
            f.run = gr.Button("Forge", variant="primary", elem_id="lab-forge-run", interactive=bool(most))
            f.stop = gr.Button("Stop", variant="stop", elem_id="lab-forge-stop")
        f.form_error = gr.HTML("", elem_id="lab-forge-form-error", padding=False)
        f.status = gr.HTML(render.status_line(""), elem_id="lab-forge-status", padding=False)
        with gr.Row():
            f.chart = gr.Plot(label="validation acceptance per draft position over training", elem_id="lab-forge-chart")
            f.progress = gr.Dataframe(headers=progress_headers(0), label="training", interactive=False)
        f.verdict = gr.Markdown(elem_id="lab-forge-verdict")
        f.pays_table = gr.Dataframe(headers=PAYS_COLUMNS, label="does it pay (held-out prompts)", interactive=False)
        f.use = gr.Button("Use this head on the Playground", visible=False, elem_id="lab-forge-use")
        f.head = gr.State({})
    return f


# --- the fields checked -------------------------------------------------------------------------------------------


def heads_root() -> Path:
    return policy.forged_heads()


def _name(target: str) -> str:
    """A folder name from a target spec: its last part, safe characters only."""
    last = target.rstrip("/").replace(":", "/").split("/")[-1] or "target"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.") or "target"


def out_folder(text, target: str) -> Path:
    """The head's folder: inside the cache's heads folder (a bare name is taken there); a new one when empty."""
    root = heads_root().expanduser().resolve()
    text = str(text or "").strip()
    if not text:
        return root / f"{_name(target)}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(text).expanduser()
    path = (path if path.is_absolute() else root / path).resolve()
    if root not in path.parents:
        raise UserError(f"output folder {text!r} is outside {root}: this app writes heads only there; give a name "
                        "or leave it empty.", field="forge_out")  # fmt: skip
    if path.is_file() or (path.is_dir() and any(path.iterdir()) and not (path / "forge-state.json").is_file()):
        raise UserError(f"output folder {path.name!r} holds something other than a forge: choose another name.",
                        field="forge_out")  # fmt: skip
    return path


def minutes_of(value) -> float:
    most = policy.forge_minutes(MAX_MINUTES)
    if not most:
        raise UserError(OFF)
    try:
        minutes = float(value)
    except (TypeError, ValueError):
        minutes = math.nan
    if not math.isfinite(minutes) or not MIN_MINUTES <= minutes <= most:
        capped = " (this app's operator caps forges there)" if most < MAX_MINUTES else ""
        raise UserError(f"minutes {value!r}: give the forge {MIN_MINUTES:g} to {most:g} minutes{capped}.",
                        field="forge_minutes")  # fmt: skip
    return minutes


def suite_of(categories, file, dataset) -> str:
    """What the forge trains on, as `--prompts`/`--suite` name it: the Lab's prompts file, else its Hub dataset,
    else its task categories."""
    path = getattr(file, "path", file)
    path = path.get("path") if isinstance(path, dict) else path
    if path:
        prompt_sets.source(file, "")  # a file that cannot be read is marked now, before loading anything
        return str(path)
    if str(dataset or "").strip():
        spec = str(dataset).strip()
        if not promptsets.is_dataset_id(spec):
            raise UserError(f"dataset {spec!r}: name a Hub dataset as org/name, optionally @revision and :split or "
                            "file.", field="dataset")  # fmt: skip
        return spec
    if not categories:
        raise UserError("choose at least one task category to forge on, or load a prompt set.", field="categories")
    return ",".join(categories)


def plan(target, minutes, out, pays, categories, file=None, dataset="", seed="", held_out=0, data_dtype="target",
         general=True, hold_all=False, kind="eagle3"):  # fmt: skip
    """The fields as a ForgeConfig, or a UserError naming the field at fault."""
    from engine.forge import ForgeConfig

    if not policy.forge_minutes(MAX_MINUTES):
        raise UserError(OFF)
    target = str(target or "").strip()
    if not target:
        raise UserError("target is empty: name a Hub id (org/name), a local folder, or the bundled model.",
                        field="forge_target")  # fmt: skip
    with blame("forge_target"):
        target = policy.app_model(target)
    minutes = minutes_of(minutes)
    folder = out_folder(out, target)
    suite = suite_of(categories, file, dataset)
    share = float(held_out or 0) or HELD_OUT
    with blame("held_out"):
        promptsets.check_share(share)
    data_dtype = str(data_dtype or "target")
    if data_dtype not in DATA_DTYPES:
        raise UserError(f"data passes in {data_dtype!r}: choose {', '.join(DATA_DTYPES)}.", field="forge_data")
    kind = str(kind or "eagle3")
    if kind not in KINDS:
        raise UserError(f"head kind {kind!r}: choose {' or '.join(KINDS)}.", field="forge_kind")
    if hold_all and not general:
        raise UserError("measuring on every prompt leaves nothing to train on without general prompts: tick general "
                        "prompts, or untick measure on every prompt.", field="forge_general")  # fmt: skip
    return ForgeConfig(**({"target": target, "out": str(folder), "suite": suite, "minutes": minutes,
                           "held_out": 1.0 if hold_all else share, "seed": prompt_sets.seed_of(seed) or 0,
                           "pays": bool(pays), "data_dtype": data_dtype, "general": bool(general),
                           "kind": kind} | OPTIONS))


def marked(exc: UserError) -> tuple[str, str]:
    """(status line, field mark): the message once, under the field at fault, as the Lab marks its own; the forge's
    `target` (its --target) is the forge's target box here."""
    return jobs.marked(exc, "forge", FIELDS | SHARED, field_id, {"target": "forge_target"})


def forge_seconds(target=None, minutes=15, *args, **kwargs) -> int:
    """GPU time for a forge (ZeroGPU): its budget, loading, and the final measurement."""
    try:
        budget = float(minutes) * 60
    except (TypeError, ValueError):
        budget = 15 * 60
    return int(gpu.LOAD_S + budget * 1.3)


# --- the forge as page updates ------------------------------------------------------------------------------------


def events(cfg, stop: threading.Event):
    """The forge's events, from a thread of its own (each step on the engine thread, engine.worker), with the final
    measurement's progress (`notify`) among them; an error raised here."""
    from engine.forge import forge_events
    from engine.worker import ENGINE

    def work(put):
        for event in ENGINE.iterate(forge_events(cfg, stop, notify=put)):
            put(event)

    return jobs.follow(work, "specarena-forge")


def status_text(event) -> str:
    eta = ""
    if event.eta_s is not None and event.phase not in ("pays", "done"):
        eta = f", {int(event.eta_s) // 60}:{int(event.eta_s) % 60:02d} of the budget left"
    return f"forging: {event.phase} {event.done:.0%}{eta} · {event.message}"


def progress_headers(steps: int) -> list[str]:
    return ["step", "seconds", "train loss", "expected length"] + [f"position {k + 1}" for k in range(steps)]


def _r(value, digits=3):
    return None if value is None else round(value, digits)


def progress_table(records: list[dict]) -> dict:
    steps = max((len(r.get("val_acceptance") or []) for r in records), default=0)
    rows = [[r.get("step"), r.get("seconds"), _r(r.get("train_loss")), _r(r.get("val_expected_length")),
             *[_r(a) for a in r.get("val_acceptance") or []]] for r in records]  # fmt: skip
    return {"headers": progress_headers(steps), "data": rows}


def progress_figure(records: list[dict]) -> go.Figure:
    """Validation acceptance at each draft position over training steps."""
    fig = go.Figure()
    steps = max((len(r.get("val_acceptance") or []) for r in records), default=0)
    for k in range(steps):
        points = [(r["step"], r["val_acceptance"][k]) for r in records if len(r.get("val_acceptance") or []) > k]
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                                 name=f"position {k + 1}", line=dict(color=COLORS[k % len(COLORS)])))  # fmt: skip
    fig.update_layout(xaxis_title="training step", yaxis_title="validation acceptance", height=340,
                      yaxis=dict(range=[0, 1.02]), margin=dict(l=50, r=20, t=30, b=40),
                      legend=dict(orientation="h", y=-0.3))  # fmt: skip
    return fig


def pays_rows(pays: dict | None) -> list[list]:
    names = {"eagle3": "forged head", "dflash": "forged head", "prompt-lookup": "prompt lookup", "suffix": "suffix"}
    return [[names.get(r["drafter"], r["drafter"]) + (f", tree top-{r['topk']}" if r.get("topk", 1) > 1 else ""),
             r["gamma"] or "-", _r(r.get("predicted"), 2),
             _r(r.get("speedup"), 2), _r(r.get("mean_accepted_length"), 2), _r(r.get("acceptance_rate"), 2),
             r["lossless"] or "-"]
            for r in (pays or {}).get("rows", [])]  # fmt: skip


def head_of(summary: dict, folder: str) -> dict:
    """What "use this head" fills in: the target, the head's kind (the Playground's drafter) and folder, and the draft
    length (and tree width) measured fastest; `config_gamma` is the chain's its config proposes to every engine."""
    from engine.forge.export import proposed_gamma, proposed_setting

    best = proposed_setting(summary)
    return {"target": summary.get("target"), "kind": summary.get("kind") or "eagle3", "folder": folder,
            "gamma": best["gamma"], "topk": best["topk"],
            "config_gamma": proposed_gamma(summary)}  # fmt: skip


def verdict_markdown(summary: dict, folder: str, stopped: bool) -> str:
    training = summary.get("training") or {}
    per = ", ".join(f"{a:.2f}" for a in training.get("val_acceptance") or [])
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in (summary.get("timing") or {}).items())
    pays = summary.get("pays")
    lines = [f"**Forged** `{folder}` in {summary.get('wall_s', 0):.0f} s ({timing})"
             + (", stopped early: the best checkpoint so far" if stopped else "") + ".",
             f"Validation acceptance per draft position (prompts never trained on"
             f"{'; the table below measures the held-out ones' if pays else ''}): {per or '-'}; expected "
             f"accepted length {training.get('val_expected_length') or 0:.2f} (best at step "
             f"{training.get('best_step')})."]  # fmt: skip
    served = training.get("val_per_pass") or []
    if served:
        lines[-1] += (" Replayed through the greedy loop, as the engine counts: " + ", ".join(
            f"{x:.2f} tokens per verify pass at γ = {g}" for g, x in enumerate(served, 1)) + ".")  # fmt: skip
    head = head_of(summary, folder)
    if head["config_gamma"]:
        lines.append(f"The head's config proposes γ = {head['config_gamma']} (a chain, as every engine runs it)"
                     + (f"; here it runs fastest as a tree of its top {head['topk']} candidates at γ = {head['gamma']}"
                        if head["topk"] > 1 else "") + ".")  # fmt: skip
    held = (summary.get("prompts") or {}).get("held_out") or 0
    if held and not pays:
        gammas = ",".join(str(g) for g in range(1, len(training.get("val_acceptance") or [0, 0]) + 1))
        lines.append(f"Its {held} held-out prompt{'s were' if held > 1 else ' was'} not measured; this command "
                     f"measures {'them' if held > 1 else 'it'}: `python -m engine bench --drafter {head['kind']} "
                     f"--draft {folder} --gamma {gammas} --suite {folder}/held-out.jsonl`")  # fmt: skip
    if pays:
        lines.append(f"Does it pay: {pays['verdict']}")
    lines.append(f"Take it to the Playground with the button below (drafter {HEAD_NAMES[head['kind']]}, draft = this "
                 "folder).")
    return "\n\n".join(lines)


def run_forge(target, minutes, out, pays, categories=(), prompts_file=None, dataset="", sample_seed="", held_out=0,
              data_dtype="target", general=True, hold_all=False, kind="eagle3",
              request: gr.Request = None):  # fmt: skip
    """Forge a head from the panel's fields and the Lab's prompt set. Yields (progress table, chart, verdict, pays
    table, "use this head" button, the head, status line, field mark): the phase, percent and ETA in the status
    line as it goes, the acceptance per draft position at each evaluation, the result at the end."""
    keep = (gr.skip(),) * OUTPUTS
    try:
        cfg = plan(target, minutes, out, pays, categories, prompts_file, dataset, sample_seed, held_out, data_dtype,
                   general, hold_all, kind)  # fmt: skip
    except UserError as exc:
        yield (*keep, *marked(exc))
        raise api_error(exc) from None
    session = session_of(request, ":forge")
    stop = STOPS.start(session)
    yield ({"headers": progress_headers(0), "data": []}, None, "", [], gr.update(visible=False), {},
           render.status_line(f"forging into {cfg.out}: starting"), "")  # fmt: skip
    records: list[dict] = []
    summary, shown = {}, 0.0
    try:
        for event in events(cfg, stop):
            if event.phase == "train" and "val_acceptance" in event.metrics:
                records.append(event.metrics)
                yield (progress_table(records), progress_figure(records), *(gr.skip(),) * 4,
                       render.status_line(status_text(event)), "")  # fmt: skip
                shown = time.monotonic()
            elif event.phase == "done":
                summary = event.metrics.get("result") or {}
                if not summary:  # no data within the budget: nothing was written
                    yield (*keep, render.status_line(f"failed: {event.message}", error=True), "")
                    return
            elif time.monotonic() - shown >= RENDER_EVERY or event.done >= 1.0:
                yield (*keep, render.status_line(status_text(event)), "")
                shown = time.monotonic()
        stopped = stop.is_set()
    except Exception as exc:  # noqa: BLE001 - a mistake marked, a fault of ours logged: the app keeps serving
        status, mark, error = job_failure(exc, marked, "forge")
        yield (*keep, status, mark)
        raise error from None
    finally:
        stop.set()  # a forge left behind (the page closed) ends at its next batch, its best state written
        STOPS.finish(session, stop)
    history = summary.get("training", {}).get("history") or records
    yield (progress_table(history), progress_figure(history), verdict_markdown(summary, cfg.out, stopped),
           pays_rows(summary.get("pays")), gr.update(visible=True), head_of(summary, cfg.out),
           render.status_line(f"done: the head is in {cfg.out}"), "")  # fmt: skip


def stop(request: gr.Request) -> str:
    if STOPS.stop(session_of(request, ":forge")):
        return render.status_line("stopping: the forge writes its best checkpoint so far…")
    return render.status_line("nothing is being forged")


def use_head(head: dict):
    """The Playground's target, drafter, draft, γ and tree width for the forged head, and a line on the Playground
    saying what was filled (the page then goes to the Playground: TO_PLAYGROUND)."""
    if not head or not head.get("folder"):
        return (*(gr.skip(),) * 5, render.status_line("no head yet: forge one first", error=True))
    gamma, topk = head.get("gamma"), head.get("topk") or 1
    return (head.get("target") or gr.skip(), head.get("kind") or "eagle3", head["folder"],
            gamma if gamma else gr.skip(), topk, render.status_line(filled_note(head)))  # fmt: skip


def filled_note(head: dict) -> str:
    """What "use this head" filled in, in one line on the Playground."""
    gamma = f", γ {head['gamma']}" if head.get("gamma") else ""
    tree = f", tree width {head.get('topk') or 1}"
    target = f"target {head['target']}, " if head.get("target") else ""
    return (f"filled from the forged head: {target}drafter {HEAD_NAMES[head.get('kind') or 'eagle3']}, draft "
            f"{head['folder']}{gamma}{tree}; press "
            "Run to try it.")  # fmt: skip


# the Playground's tab, selected in the browser after "use this head" filled its fields (no round trip)
TO_PLAYGROUND = """() => { const tab = [...document.querySelectorAll('button[role="tab"]')]
    .find(b => b.textContent.trim() === 'Playground'); if (tab) tab.click(); }"""


def describe_prompts(categories, file, dataset) -> str:
    """Which prompts the forge would use: the Lab's prompt set or its task categories."""
    try:
        suite = suite_of(categories, file, dataset)
    except UserError as exc:  # a prompt set's own error is said under its field (app.prompt_sets.described)
        where = prompt_sets.FIELDS.get(exc.field) or SHARED.get(exc.field)
        return f"Prompts: ⚠ check {where} above." if where else f"Prompts: ⚠ {exc}"
    if suite == ",".join(categories or []):
        return f"Prompts: the task suite's categories {', '.join(categories)} (chosen above)."
    name = (file.get("orig_name") if isinstance(file, dict) else None) or Path(suite).name if file else suite
    return f"Prompts: the Lab's prompt set, {name}."


def wire(f: SimpleNamespace, lab: SimpleNamespace, play: SimpleNamespace) -> None:
    """The forge's events; `lab` gives the prompt set and categories it reads, `play` the target and the fields
    "use this head" fills."""
    shared = [lab.categories, lab.prompts_file, lab.dataset, lab.sample_seed, lab.held_out]
    outputs = [f.progress, f.chart, f.verdict, f.pays_table, f.use, f.head, f.status, f.form_error]
    # the device is held as a run holds it: one at a time with comparisons and sweeps
    f.run.click(gpu.on_gpu(run_forge, forge_seconds), inputs=[f.target, f.minutes, f.out, f.pays, *shared, f.data,
                                                               f.general, f.hold_all, f.kind],
                outputs=outputs, preprocess=False, api_name="forge", concurrency_limit=1, concurrency_id="device",
                show_progress="hidden")  # fmt: skip
    f.stop.click(stop, outputs=[f.status], queue=False, api_visibility="private")
    fills = [play.form[n] for n in ("target", "drafter", "draft", "gamma", "topk")]
    f.use.click(use_head, inputs=[f.head], outputs=[*fills, play.status], queue=False,
                api_visibility="private").then(None, js=TO_PLAYGROUND, queue=False)  # fmt: skip
    # the target follows the Playground's until the user types another
    target = play.form["target"]
    f.target.value = target.value
    target.change(lambda value: value, inputs=[target], outputs=[f.target], queue=False, api_visibility="private")
    f.prompts.value = describe_prompts(lab.categories.value, None, "")
    for component in shared[:3]:
        component.change(describe_prompts, inputs=shared[:3], outputs=[f.prompts], queue=False,
                         api_visibility="private")  # fmt: skip
    for name, component in [*((n, getattr(f, n.removeprefix("forge_"))) for n in FIELDS),
                            *((n, getattr(lab, n)) for n in SHARED)]:  # fmt: skip
        render.unmark_when_edited(component, f.form_error, f.status, f'data-where="{field_id(name)}"')

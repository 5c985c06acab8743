"""The Lab's prompt set: SpecArena's task suite, an uploaded file or a Hub dataset; what was found in it, what was
skipped and why, N per category drawn with a seed, and the held-out share.

All reading, sampling and splitting is engine.measure.promptsets; this module lays out and describes.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import gradio as gr

from app import render
from engine import presets
from engine.errors import UserError, blame
from engine.measure import promptsets

# the Lab marks a refused value under its field (elem id lab-field-<name>), as it does its other fields
FIELDS = {"prompts_file": "prompts file", "dataset": "Hub dataset", "sample_seed": "sample seed",
          "held_out": "held-out share"}  # fmt: skip
FILE_TYPES = [".jsonl", ".json", ".csv", ".txt", ".parquet"]
SUITE_DEFAULT = ["rewriting", "creative_writing"]
FORMATS = ("JSON lines or JSON with `prompt`, `text`, `question` or `instruction`, chat `messages`, MT-Bench / "
           "Spec-Bench `turns` (with `category`), ShareGPT `conversations`; CSV with a prompt column; text, one "
           "prompt a line.")  # fmt: skip


def build_layout() -> SimpleNamespace:
    """The prompt set's fields, in a closed accordion: the task suite is what a first visit measures."""
    p = SimpleNamespace()
    with gr.Accordion("prompt set: the task suite, your own file, or a Hub dataset", open=False,
                      elem_id="lab-prompt-set"):  # fmt: skip
        with gr.Row():
            p.prompts_file = gr.File(label="prompts file", file_types=FILE_TYPES, type="filepath",
                                     elem_id=field_id("prompts_file"))  # fmt: skip
            with gr.Column():
                p.dataset = gr.Textbox("", label="or a Hub dataset", placeholder="org/name[@revision][:split or file]",
                                       elem_id=field_id("dataset"), info="read from the Hub, or its local cache "
                                       "offline")  # fmt: skip
                with gr.Row():
                    p.sample_seed = gr.Textbox("", label="sample seed", placeholder="empty: the first prompts",
                                               info="N per category drawn at random with this seed",
                                               elem_id=field_id("sample_seed"))  # fmt: skip
                    p.held_out = gr.Slider(0, 0.5, value=0, step=0.05, label="held-out share",
                                           info="the sweep measures only this share; a forge trains on the rest",
                                           elem_id=field_id("held_out"))  # fmt: skip
        gr.Markdown(f"Formats: {FORMATS} Multi-turn questions run turn by turn after the model's own answers; "
                    "each turn is a sample.")  # fmt: skip
        p.found = gr.Markdown(describe(None, "", "", 0), elem_id="lab-prompts-found")
    return p


def field_id(name: str) -> str:
    return f"lab-field-{name}"  # app.lab.field_id's form


def seed_of(text) -> int | None:
    text = str(text if text is not None else "").strip()
    if not text:
        return None
    try:
        return int(float(text))
    except ValueError:
        raise UserError(f"sample seed {text!r}: write a whole number, or leave it empty for the first prompts.",
                        field="sample_seed") from None  # fmt: skip


def source(file, dataset) -> promptsets.PromptSet:
    """The whole set named: an uploaded file, else a Hub dataset, else the task suite."""
    path = getattr(file, "path", file)  # preprocess=False hands a FileData dict or object, a filepath otherwise
    path = path.get("path") if isinstance(path, dict) else path
    if path:
        with blame("prompts_file"):
            found = promptsets.read_file(path)
        name = (file.get("orig_name") if isinstance(file, dict) else None) or getattr(file, "orig_name", None)
        return found if not name else replace(found, name=name)
    if str(dataset or "").strip():
        spec = str(dataset).strip()
        if not promptsets.is_dataset_id(spec):
            raise UserError(f"dataset {spec!r}: name a Hub dataset as org/name, optionally @revision and :split or "
                            "file.", field="dataset")  # fmt: skip
        with blame("dataset"):
            return promptsets.read_hub(spec)
    return promptsets.task_suite()


def chosen(categories, per_category, file=None, dataset="", seed="", held_out=0) -> promptsets.PromptSet:
    """What the sweep measures: the set's chosen categories (a file's all when none of them is chosen), its
    held-out share when one is set, N per category."""
    found = source(file, dataset)
    wanted = [c for c in (categories or []) if c in found.categories()]
    if categories and not wanted and found.name == "task suite":
        wanted = list(categories)  # unknown task categories: only() names them
    with blame("held_out"):
        promptsets.check_share(float(held_out or 0))
    return promptsets.select(found, wanted or None, int(per_category), seed_of(seed), float(held_out or 0))


def described(file, dataset, seed, held_out) -> tuple[str, str]:
    """(what the set holds, field mark): a set that cannot be used is said once, under the field at fault (the Lab's
    form mark, where a sweep refused for it puts the same message), and the line here only points at it. A usable
    set leaves the mark as it is (editing a marked field takes its own mark away in the browser)."""
    try:
        return describe(file, dataset, seed, held_out, strict=True), gr.skip()
    except UserError as exc:
        if exc.field not in FIELDS:
            return f"⚠ {exc}", gr.skip()
        return f"⚠ check {FIELDS[exc.field]}, as marked.", render.field_error(exc, field_id(exc.field))


def describe(file, dataset, seed, held_out, strict: bool = False) -> str:
    """What the set holds: prompts, turns, categories, skipped lines and why, and the held-out split's sizes (a set
    that cannot be used: its error, or raised with `strict`)."""
    try:
        found = source(file, dataset)
        text = found.summary()
        if float(held_out or 0):
            train, out = found.split(float(held_out), seed_of(seed))
            text += (f" Held out at share {float(held_out):g} (seed {seed_of(seed) or 0}): {len(out)} prompt(s), "
                     f"measured; {len(train)} left to train on.")  # fmt: skip
        return text
    except UserError as exc:
        if strict:
            raise
        return f"⚠ {exc}"


def inspect(file, dataset, seed, held_out):
    """(what was found, the categories field, field mark): a file's or dataset's categories, all chosen; the task
    suite's default choice when neither is given; a set that cannot be used marked under its field (described)."""
    text, mark = described(file, dataset, seed, held_out)
    try:
        found = source(file, dataset)
    except UserError:
        return text, gr.update(), mark
    if found.name == "task suite":
        return text, gr.update(choices=presets.categories(), value=SUITE_DEFAULT), mark
    names = list(found.categories())
    return text, gr.update(choices=names, value=names), mark


def wire(p: SimpleNamespace, categories: gr.Dropdown, form_error: gr.HTML) -> None:
    """What a set holds, as its fields change; `form_error`: the Lab's field mark, where a set's error is said."""
    fields = [p.prompts_file, p.dataset, p.sample_seed, p.held_out]
    for event in (p.prompts_file.change, p.dataset.submit, p.dataset.blur):
        event(inspect, fields, [p.found, categories, form_error], queue=False, api_visibility="private")
    for event in (p.sample_seed.blur, p.held_out.release):
        event(described, fields, [p.found, form_error], queue=False, api_visibility="private")

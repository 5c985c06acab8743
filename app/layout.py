"""The page: layout in `build_layout`, event wiring in `wire`, both called by `build_demo`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from app import handlers, render
from app.gpu import on_gpu
from engine import presets
from engine.settings import BUNDLED, DTYPES, MAX_GAMMA, STRICT, max_new_tokens_cap

log = logging.getLogger("specarena")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "style.css").read_text()
THEME = gr.themes.Soft(primary_hue="violet", secondary_hue="emerald")
DRAFTERS = [("draft model", "draft-model"), ("prompt lookup (no model)", "prompt-lookup"),
            ("suffix (this session's outputs)", "suffix"), ("synthetic α (measurement tool)", "synthetic"),
            ("EAGLE-3 (vLLM)", "eagle3"),
            ("MTP (vLLM)", "mtp"), ("n-gram mod (llama.cpp)", "ngram-mod"),
            ("n-gram map-k (llama.cpp)", "ngram-map-k")]  # fmt: skip
BACKENDS = [("transformers (this process)", "transformers"), ("vLLM (its servers)", "vllm"),
            ("llama.cpp (llama-server)", "llama.cpp")]  # fmt: skip
EXAMPLES = [  # (category, index, label): where speculation wins and where it loses
    ("rewriting", 0, "wins · correct the spelling of given text"),
    ("summarisation", 0, "wins · summarise given text"),
    ("code", 1, "wins · edit given code"),
    ("data_formatting", 0, "wins · text to JSON"),
    ("creative_writing", 0, "loses · a poem"),
    ("math_reasoning", 0, "loses · step-by-step arithmetic"),
]

def target_info() -> str:
    """What the target box accepts here: local folders only where the operator allows them."""
    folder = os.environ.get("SPECARENA_MODELS_DIR")
    where = f", a model folder in {folder}" if folder else ""
    return f"Hub id (org/name[@rev]){where}, {BUNDLED} or random:<shape>; llama.cpp: org/repo/file.gguf"


INTRO = """# SpecArena
**Speculative decoding, side by side.** A draft proposes γ tokens, the target checks them all in one pass.
It is *lossless*: with greedy decoding both panes must show the same text; with sampling the speculative
text follows exactly the target's distribution. Only the time changes. Baseline and speculative run one
after the other on the same device, after a warm-up, so the numbers are honest."""


def build_layout() -> SimpleNamespace:
    """The Playground. `ui.form` holds one widget per setting a user may set, keyed by its Settings name."""
    ui = SimpleNamespace()
    default = presets.pairs()[0]
    gr.Markdown(INTRO)
    form: dict[str, gr.components.Component] = {}

    def widget(name: str, component):
        form[name] = component
        return component

    with gr.Row(equal_height=False, elem_id="play-row"):
        with gr.Column(scale=1, min_width=300, elem_id="form-col"):
            ui.preset = gr.Dropdown([p["name"] for p in presets.pairs()], value=default["name"], label="preset")
            ui.preset_note = gr.Markdown(f"{default['note']}  \n*Measured on:* {default['measured_on']}")
            widget("backend", gr.Radio(BACKENDS, value="transformers", label="backend",
                                       info="where both runs happen; vLLM needs SPECARENA_VLLM_PYTHON or its URLs, "
                                       "llama.cpp a llama-server (README)"))
            widget("target", gr.Textbox(BUNDLED, label="target model", info=target_info()))
            widget("drafter", gr.Radio(DRAFTERS, value=default["drafter"], label="drafter"))
            widget("draft", gr.Textbox(
                default["draft"], label="draft model",
                info="best with the target's tokenizer; another one works through text (Check pair says); with "
                "synthetic α, its passes run for their cost",
            ))  # fmt: skip
            with gr.Row():
                ui.check = gr.Button("Check pair", size="sm", elem_id="check-pair")
                ui.forget = gr.Button("Clear suffix memory", size="sm", elem_id="forget")
            ui.doctor = gr.Markdown(elem_id="doctor")
            with gr.Accordion("parameters", open=False, elem_id="parameters"):
                widget("temperature", gr.Slider(0, 2, value=0, step=0.05, label="temperature", info="0 = greedy"))
                widget("top_p", gr.Slider(0.01, 1, value=1, step=0.01, label="top-p"))
                widget("top_k", gr.Number(0, precision=0, minimum=0, label="top-k (0 = off)"))
                widget("max_new_tokens", gr.Slider(1, max_new_tokens_cap(), value=128, step=1, label="max new tokens"))
                gamma = gr.Slider(1, MAX_GAMMA, value=default["gamma"], step=1, label="γ: draft tokens per step")
                widget("gamma", gamma)
                widget("adaptive", gr.Checkbox(
                    False,
                    label="adaptive γ (up to 16)",
                    info="prompt lookup sizes each draft from the measured cost of a verify pass and what held so "
                    "far; a draft model starts at γ and goes +2 after a fully accepted draft, -1 after a miss",
                ))  # fmt: skip
                widget("p_min", gr.Slider(0, 0.95, value=0, step=0.05, label="draft model: confidence stop",
                                          info="stop drafting where the draft's top probability falls below this "
                                          "(0 = off)"))  # fmt: skip
                widget("draft_min", gr.Slider(0, MAX_GAMMA, value=0, step=1, label="shortest draft",
                                              info="drafts shorter than this are not verified (0 = any)"))  # fmt: skip
                widget("seed", gr.Number(0, precision=0, label="seed (-1 = random)"))
                widget("chat", gr.Checkbox(True, label="chat template (when the target has one)"))
                widget("dtype", gr.Dropdown(list(DTYPES), value="auto", label="dtype"))
                widget("strict", gr.Radio(list(STRICT), value="auto", label="strict mode",
                                          info="every target pass of both runs at one width, so that even 16-bit "
                                          "greedy ids are bit-identical; auto: on in 16 bits where it costs a "
                                          "one-token pass no more than the noise (measured)"))  # fmt: skip
                widget("ngram", gr.Slider(1, 8, value=3, step=1, label="prompt lookup: longest n-gram"))
                widget("alpha", gr.Slider(0, 1, value=0.8, step=0.05, label="synthetic drafter: α"))
        with gr.Column(scale=2, min_width=300, elem_id="prompt-col"):
            default_prompt = presets.tasks()["categories"]["rewriting"]["prompts"][0]
            ui.prompt = gr.Textbox(default_prompt, lines=5, label="prompt", elem_id=render.field_id("prompt"))
            with gr.Row(elem_id="run-row"):
                ui.run = gr.Button("Run", variant="primary", elem_id="run", min_width=80)
                ui.stop = gr.Button("Stop", variant="stop", elem_id="stop", min_width=80)
                ui.clear = gr.Button("Clear", elem_id="clear", min_width=80)
            ui.form_error = gr.HTML("", elem_id="form-error", padding=False)
            ui.status = gr.Markdown("", label="status", elem_id="status")
            gr.Examples(
                [[presets.tasks()["categories"][c]["prompts"][i]] for c, i, _ in EXAMPLES],
                inputs=[ui.prompt],
                example_labels=[label for _, _, label in EXAMPLES],
                label="examples",
            )
    for name, component in form.items():
        component.elem_id = render.field_id(name)
    ui.form = form
    with gr.Row():
        ui.legend = gr.HTML(render.LEGEND)
        ui.show_rejected = gr.Checkbox(False, label="show rejected drafts", elem_id="show-rejected")
    with gr.Row(equal_height=True, elem_id="panes"):
        ui.baseline = gr.HTML(
            render.pane("Baseline (target alone)", "", "not started"), label="baseline", elem_id="baseline-pane",
            min_width=320,
        )  # fmt: skip
        ui.speculative = gr.HTML(
            render.pane("Speculative (draft + target)", "", "not started"), label="speculative", elem_id="spec-pane",
            min_width=320,
        )  # fmt: skip
    ui.summary = gr.HTML(render.summary(None, None, None, None), label="summary", elem_id="summary")
    ui.chart = gr.Plot(label="live charts", elem_id="live-chart")
    ui.memory = gr.Plot(label="memory", elem_id="memory-chart")
    ui.timer = gr.Timer(2.0)
    with gr.Accordion("history and downloads", open=False, elem_id="history"):
        ui.history = gr.State([])
        ui.history_table = gr.Dataframe(headers=handlers.HISTORY_COLUMNS, label="history (every run, newest last)",
                                        interactive=False, wrap=False, elem_id="history-table")  # fmt: skip
        ui.files = gr.File(label="downloads", file_count="multiple", interactive=False)
    ui.result = gr.JSON(label="result", visible=False)
    return ui


def wire(ui: SimpleNamespace) -> None:
    if sorted(ui.form) != sorted(handlers.API_FIELDS):
        raise RuntimeError(f"the form's fields {sorted(ui.form)} are not the API's {sorted(handlers.API_FIELDS)}")
    outputs = [ui.result, ui.status, ui.baseline, ui.speculative, ui.summary, ui.chart, ui.history,
               ui.history_table, ui.files, ui.form_error]  # fmt: skip
    # Values reach the handler as sent (preprocess=False): our checks name the field and say what to do, where
    # Gradio's bounds would answer an API caller with a bare HTTP 400. No progress overlay: its animation alone
    # costs a CPU machine a good share of the model's speed.
    run_args = dict(
        inputs=[ui.prompt, ui.history], inputs_kwargs=ui.form, outputs=outputs, preprocess=False,
        concurrency_limit=1, concurrency_id="device", show_progress="hidden",
    )  # fmt: skip
    compare = on_gpu(handlers.compare)
    ui.run.click(compare, api_name="compare", **run_args)
    ui.prompt.submit(compare, api_visibility="private", **run_args)
    ui.stop.click(handlers.stop, outputs=[ui.status], queue=False, api_visibility="private")
    ui.forget.click(handlers.forget, outputs=[ui.status], queue=False, api_visibility="private")
    ui.clear.click(
        handlers.clear,
        outputs=[ui.result, ui.status, ui.baseline, ui.speculative, ui.summary, ui.chart, ui.form_error],
        queue=False,
        api_visibility="private",
    )
    # a field's error mark goes when that field is edited (in the browser: no round trip)
    for name, component in {"prompt": ui.prompt, **ui.form}.items():
        unmark = f"(html) => (html || '').includes('data-field=\"{name}\"') ? '' : html"
        component.input(None, ui.form_error, ui.form_error, js=unmark)
    ui.preset.change(
        handlers.apply_preset,
        inputs=[ui.preset],
        outputs=[ui.form[n] for n in handlers.PRESET_FIELDS] + [ui.preset_note],
        api_visibility="private",
    )
    ui.check.click(
        handlers.check_pair, inputs_kwargs=ui.form, outputs=[ui.doctor], preprocess=False, api_name="doctor",
        concurrency_id="device",
    )  # fmt: skip
    ui.timer.tick(handlers.memory_tick, outputs=[ui.memory], queue=False, api_visibility="private",
                  show_progress="hidden")  # fmt: skip


def quiet_queue(demo: gr.Blocks) -> None:
    """Poll Gradio's queue as it does on Windows: every 50 ms, not every 1 ms.

    On Linux the queue's loop wakes every millisecond whether or not there is work (and its progress loop
    every 10 ms): ~8% of a core on an idle server, taken from the model on a CPU machine. Streamed output is
    not polled, so the cost is at most 50 ms before a run starts.
    """
    queue = demo._queue
    for name, seconds in (("sleep_when_free", 0.05), ("progress_update_sleep_when_free", 0.1)):
        if hasattr(queue, name):
            setattr(queue, name, seconds)
        else:
            log.warning("this Gradio's queue has no %s; it polls at its own rate", name)


def build_demo() -> gr.Blocks:
    from app import lab

    with gr.Blocks(title="SpecArena") as demo:
        with gr.Tab("Playground"):
            play = build_layout()
            wire(play)
        with gr.Tab("Lab"):
            lab.wire(lab.build_layout(), play)
    return demo

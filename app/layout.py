"""The page: the settings sidebar (`build_settings`), the Playground (`build_playground`), event wiring (`wire`),
all called by `build_demo`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from app import handlers, render
from app.gpu import on_gpu
from engine import presets
from engine.settings import BUNDLED, DTYPES, MAX_GAMMA, MAX_TOPK, STRICT, max_new_tokens_cap

log = logging.getLogger("specarena")
ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS = (ASSETS / "style.css").read_text()
# The Soft theme with its text at a contrast of 4.5:1 or more (WCAG AA): block labels, hints and the footer's links,
# white on the primary buttons and ticked choices, the selected tab.
THEME = gr.themes.Soft(primary_hue="violet", secondary_hue="emerald").set(
    block_label_text_color="*primary_700", block_title_text_color="*primary_700",
    body_text_color_subdued="*neutral_600",
    button_primary_background_fill="*primary_600", button_primary_background_fill_hover="*primary_700",
    checkbox_label_background_fill_selected="*primary_600", color_accent="*primary_600",
)
DRAFTERS = [("draft model", "draft-model"), ("prompt lookup (no model)", "prompt-lookup"),
            ("suffix (this session's outputs)", "suffix"), ("synthetic α (measurement tool)", "synthetic"),
            ("EAGLE-3 head (target's hidden states)", "eagle3"), ("P-EAGLE head (drafts in one pass)", "peagle"),
            ("DFlash head (block of drafts)", "dflash"),
            ("DSpark head (block, Markov bias, confidence stop)", "dspark"),
            ("DFlash2 head (block, convolutions, candidate selector)", "dflash2"),
            ("MTP head (speculators layout, one layer per draft)", "mtp-head"),
            ("MTP in the target (vLLM)", "mtp"), ("n-gram mod (llama.cpp)", "ngram-mod"),
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

# The prompt the page opens on: one the bundled 135M model answers correctly (greedy, float32: the table with every
# item and price, nothing added) and whose answer copies from the prompt, so that prompt lookup's drafts are kept.
# Its spelling-correction prompt came back uncorrected; lists, CSV and notes to reformat were answered with code,
# prose or the list unchanged (docs/running.md#the-prompt-it-opens-on).
FIRST_PROMPT = ("Turn this list into a Markdown table with columns Item and Price: apples 1.20, bread 2.50, "
                "milk 0.99, eggs 3.10, cheese 4.75.")


def target_info() -> str:
    """What the target box accepts here: local folders only where the operator allows them."""
    folder = os.environ.get("SPECARENA_MODELS_DIR")
    where = f", a model folder in {folder}" if folder else ""
    return f"Hub id (org/name[@rev]){where}, {BUNDLED} or random:<shape>; llama.cpp: org/repo/file.gguf"


INTRO = """<div id="intro"><h1>SpecArena</h1> · speculative decoding, side by side: a draft proposes γ tokens, the
target checks them all in one pass. <i>Lossless</i>: greedy panes must match token for token; only the time
changes. Both runs take turns on one device after a warm-up. The settings are in the sidebar.</div>"""


def number(value, label: str, info: str = "", **extra) -> gr.Number:
    """A number field without bounds of its own: a value out of range reaches the same check the API makes and
    is refused under the field with its message (a slider would change it without a word)."""
    return gr.Number(value, label=label, info=info or None, **extra)


def build_settings(ui: SimpleNamespace) -> None:
    """The sidebar: preset, the pair, and the parameters in groups, the common ones open. `ui.form` holds one
    widget per setting a user may set, keyed by its Settings name; handlers.GROUP_OF says which group holds it."""
    default = presets.pairs()[0]
    form: dict[str, gr.components.Component] = {}

    def widget(name: str, component, group: str = "pair"):
        if handlers.GROUP_OF.get(name, "pair") != group:
            raise RuntimeError(f"{name} is laid out in {group}, but handlers.GROUP_OF says otherwise")
        form[name] = component
        return component

    ui.preset = gr.Dropdown([p["name"] for p in presets.pairs()], value=default["name"], label="preset",
                            elem_id="preset")
    ui.preset_note = gr.Markdown(f"{default['note']}  \n*Measured on:* {default['measured_on']}",
                                 elem_id="preset-note")  # fmt: skip
    widget("backend", gr.Dropdown(BACKENDS, value="transformers", label="backend",
                                  info="vLLM needs SPECARENA_VLLM_PYTHON or its URLs, llama.cpp a llama-server"))
    widget("target", gr.Textbox(BUNDLED, label="target model", info=target_info()))
    widget("drafter", gr.Dropdown(DRAFTERS, value=default["drafter"], label="drafter"))
    widget("draft", gr.Textbox(default["draft"], label="draft model or head", info="a model: best with the target's "
                               "tokenizer (another works through text); EAGLE-3 / DFlash: the head's folder or Hub id; "
                               "synthetic α runs its passes for their cost"))  # fmt: skip
    # where a head is picked, the heads there are for this target (app.heads), or where one comes from
    ui.heads = gr.Dropdown([], value=None, label="heads for this target", visible=False, elem_id="heads",
                           info="forged in the Lab (newest first), then the presets'; picking one fills the box above")
    ui.heads_note = gr.HTML("", elem_id="heads-note", padding=False)
    with gr.Row():
        ui.check = gr.Button("Check pair", size="sm", elem_id="check-pair")
        ui.forget = gr.Button("Clear suffix memory", size="sm", elem_id="forget")
    ui.doctor = gr.Markdown(elem_id="doctor")
    ui.accordions = {}
    with gr.Accordion("speculation", open=True, elem_id="group-speculation") as ui.accordions["speculation"]:
        widget("gamma", number(default["gamma"], f"γ: draft tokens per step (1-{MAX_GAMMA})", precision=0),
               "speculation")  # fmt: skip
        widget("adaptive", gr.Checkbox(False, label=f"adaptive γ (up to {MAX_GAMMA})", info="prompt lookup sizes "
                                       "each draft from the measured verify cost; a draft model goes +2 after a "
                                       "fully accepted draft, -1 after a miss"), "speculation")  # fmt: skip
        widget("ngram", number(3, "prompt lookup: longest n-gram (1-8)", precision=0), "speculation")
        widget("p_min", number(0, "draft model or DSpark head: confidence stop (0 = off, below 1)",
                               "stop drafting where the draft's top probability (a DSpark head's confidence) falls "
                               "below this"),
               "speculation")  # fmt: skip
        widget("draft_min", number(0, "shortest draft (0 = any, up to γ)", precision=0), "speculation")
        widget("topk", number(1, f"EAGLE-3 tree: candidates per position (1 = a chain, up to {MAX_TOPK})",
                              "above 1 the head drafts a tree γ deep and the target verifies the nodes that pay "
                              "for their rows on this machine (EAGLE-2)", precision=0), "speculation")  # fmt: skip
        widget("alpha", number(0.8, "synthetic drafter: α (0-1)"), "speculation")
    with gr.Accordion("sampling and length", open=True, elem_id="group-sampling") as ui.accordions["sampling"]:
        widget("max_new_tokens", number(128, f"max new tokens (1-{max_new_tokens_cap()})", precision=0),
               "sampling")  # fmt: skip
        widget("temperature", number(0, "temperature (0 = greedy, up to 2)"), "sampling")
        widget("top_p", number(1, "top-p (1 = off)"), "sampling")
        widget("top_k", number(0, "top-k (0 = off)", precision=0), "sampling")
        widget("seed", number(0, "seed (-1 = random)", precision=0), "sampling")
    with gr.Accordion("numerics and template", open=False, elem_id="group-numerics") as ui.accordions["numerics"]:
        widget("dtype", gr.Dropdown(list(DTYPES), value="auto", label="dtype"), "numerics")
        widget("strict", gr.Radio(list(STRICT), value="auto", label="strict mode", info="every target pass of both "
                                  "runs at one width, so even 16-bit greedy ids are bit-identical; auto: on in 16 "
                                  "bits where it costs a plain step no more than the noise (measured)"), "numerics")
        widget("chat", gr.Checkbox(True, label="chat template (when the target has one)"), "numerics")
    for name, component in form.items():
        component.elem_id = render.field_id(name)
    ui.form = form


def build_playground(ui: SimpleNamespace) -> None:
    """The comparison on the first screen: prompt, Run / Stop / Clear, a one-line status, the two panes, the
    summary; charts, examples and history below."""
    ui.prompt = gr.Textbox(FIRST_PROMPT, lines=3, max_lines=8, label="prompt", elem_id=render.field_id("prompt"))
    with gr.Row(elem_id="run-row"):
        ui.run = gr.Button("Run", variant="primary", elem_id="run", min_width=80, scale=2)
        ui.stop = gr.Button("Stop", variant="stop", elem_id="stop", min_width=70)
        ui.clear = gr.Button("Clear", elem_id="clear", min_width=70)
        ui.show_rejected = gr.Checkbox(False, label="show rejected drafts", elem_id="show-rejected", min_width=150)
    ui.form_error = gr.HTML("", elem_id="form-error", padding=False)
    ui.status = gr.HTML(render.status_line(""), elem_id="status", padding=False)
    ui.next_note = gr.HTML("", elem_id="next-note", padding=False)
    with gr.Row(equal_height=True, elem_id="panes"):
        ui.baseline = gr.HTML(
            render.pane("Baseline (target alone)", "", "not started"), label="baseline", elem_id="baseline-pane",
            min_width=300,
        )  # fmt: skip
        ui.speculative = gr.HTML(
            render.pane("Speculative (draft + target)", "", "not started"), label="speculative", elem_id="spec-pane",
            min_width=300,
        )  # fmt: skip
    ui.legend = gr.HTML(render.LEGEND, padding=False)
    ui.again = gr.Button("Run again for a trustworthy number", visible=False, elem_id="again", size="sm")
    ui.summary = gr.HTML(render.summary(None, None, None, None), label="summary", elem_id="summary")
    with gr.Accordion("example prompts: where speculation wins and where it loses", open=False, elem_id="examples"):
        gr.Examples(
            [[presets.tasks()["categories"][c]["prompts"][i]] for c, i, _ in EXAMPLES],
            inputs=[ui.prompt],
            example_labels=[label for _, _, label in EXAMPLES],
            label="",
        )
    ui.shown = gr.State(None)  # what panes, summary and chart showed when the last run ended (handlers.compare)
    ui.chart = gr.Plot(label="live charts", elem_id="live-chart")
    ui.memory = gr.Plot(label="memory", elem_id="memory-chart")
    ui.timer = gr.Timer(2.0)
    with gr.Accordion("history and downloads", open=False, elem_id="history"):
        ui.history = gr.State([])
        ui.history_table = gr.Dataframe(headers=handlers.HISTORY_COLUMNS, label="history (every run, newest last)",
                                        interactive=False, wrap=False, elem_id="history-table")  # fmt: skip
        ui.files = gr.File(label="downloads", file_count="multiple", interactive=False)
    ui.result = gr.JSON(label="result", visible=False)


# On a phone the sidebar would cover the page: it starts closed there (Gradio opens it everywhere or nowhere).
CLOSE_ON_PHONES = """() => { if (window.innerWidth < 768) {
    const bar = document.querySelector('#settings');
    if (bar && bar.classList.contains('open')) bar.querySelector('.toggle-button')?.click(); } }"""
# Two things Gradio draws that an accessibility audit (axe-core) flags, mended in the page as they appear: an empty
# plot's placeholder carries an aria-label but no role (aria-prohibited-attr), and a table's scrolling viewport
# cannot be reached from the keyboard (scrollable-region-focusable).
MEND_GRADIO = """() => {
    const mend = () => {
        document.querySelectorAll('.empty[aria-label]:not([role])').forEach(e => e.setAttribute('role', 'img'));
        // a table's first header cell is in the tab order (a grid's cells may be; its scrolling box may not), from
        // where the arrow keys move through the table as Gradio has them do
        document.querySelectorAll('.virtual-table-viewport th[role=columnheader]:first-child').forEach(cell => {
            if (cell.getAttribute('tabindex') !== '0') cell.setAttribute('tabindex', '0'); });
    };
    new MutationObserver(mend).observe(document.body, {childList: true, subtree: true});
    mend();
}"""
# On a phone the panes sit below the prompt: Run scrolls the prompt to the top of the view, so that what
# follows it is in view together: a message under the prompt, Run, the status line and the panes.
# It runs as the event's own js, before the values go to the server (a js-only listener beside it waits for the
# run to end), and hands the values on unchanged.
SHOW_RUN = """(...values) => { if (window.innerWidth < 768) {
    document.querySelector('#field-prompt')?.scrollIntoView({behavior: 'smooth', block: 'start'}); }
    return values; }"""

# On a phone the summary sits under two stacked panes: when a run ends, the summary is scrolled into view, its
# bottom at the view's bottom (as much of the panes above it as fits), or its top at the view's top where it is
# taller than the view, so that the speedup and acceptance cards are seen without scrolling.
SHOW_SUMMARY = """(...values) => { if (window.innerWidth < 768) {
    const summary = document.querySelector('#summary');
    if (summary) summary.scrollIntoView({block: summary.offsetHeight < window.innerHeight ? 'end' : 'start'}); }
    return values; }"""


def wire(ui: SimpleNamespace) -> None:
    if sorted(ui.form) != sorted(handlers.API_FIELDS):
        raise RuntimeError(f"the form's fields {sorted(ui.form)} are not the API's {sorted(handlers.API_FIELDS)}")
    outputs = [ui.result, ui.status, ui.baseline, ui.speculative, ui.summary, ui.chart, ui.history,
               ui.history_table, ui.files, ui.form_error, ui.again, ui.sidebar,
               *(ui.accordions[g] for g in handlers.GROUPS), ui.shown]  # fmt: skip
    # Values reach the handler as sent (preprocess=False): our checks name the field and say what to do, where
    # Gradio's bounds would answer an API caller with a bare HTTP 400. No progress overlay: its animation alone
    # costs a CPU machine a good share of the model's speed.
    run_args = dict(
        inputs=[ui.prompt, ui.history, ui.shown], inputs_kwargs=ui.form, outputs=outputs, preprocess=False,
        concurrency_limit=1, concurrency_id="device", show_progress="hidden",
    )  # fmt: skip
    compare = on_gpu(handlers.compare)
    # A press of Run is never lost: Run says at once that it runs (or where it waits in line) and stays disabled
    # until the run ends, however it ends; a press meanwhile (Enter in the prompt) runs next.
    quick = dict(queue=False, api_visibility="private", show_progress="hidden")
    for trigger, api in ((ui.run.click, dict(api_name="compare")), (ui.again.click, dict(api_visibility="private")),
                         (ui.prompt.submit, dict(api_visibility="private"))):  # fmt: skip
        announced = trigger(handlers.announce, outputs=[ui.run, ui.status, ui.next_note], js=SHOW_RUN,
                            trigger_mode="multiple", **quick)  # fmt: skip
        ran = announced.then(compare, **api, **run_args)
        # Gradio runs .then only after a success: a run that ended brings its summary into view on a phone; a
        # refused or failed one leaves the view on its message
        ran.then(handlers.settle, outputs=[ui.run, ui.next_note], js=SHOW_SUMMARY, **quick)
        ran.failure(handlers.settle, outputs=[ui.run, ui.next_note], **quick)
    ui.stop.click(handlers.stop, outputs=[ui.status, ui.run], queue=False, api_visibility="private")
    ui.forget.click(handlers.forget, outputs=[ui.status], queue=False, api_visibility="private")
    ui.clear.click(
        handlers.clear,
        outputs=[ui.result, ui.status, ui.baseline, ui.speculative, ui.summary, ui.chart, ui.form_error, ui.again,
                 ui.shown],
        queue=False,
        api_visibility="private",
    )
    for name, component in {"prompt": ui.prompt, **ui.form}.items():
        render.unmark_when_edited(component, ui.form_error, ui.status, f'data-field="{name}"')
        # during a run: which settings now apply to the next one (a preset changes several at once)
        component.change(handlers.changed_since_run, inputs=[ui.prompt], inputs_kwargs=ui.form,
                         outputs=[ui.next_note], preprocess=False, **quick)  # fmt: skip
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
    for field in (ui.form["drafter"], ui.form["target"]):  # the heads offered follow the drafter and the target
        field.change(handlers.offer_heads, inputs=[ui.form["drafter"], ui.form["target"]],
                     outputs=[ui.heads, ui.heads_note], **quick)  # fmt: skip
    ui.heads.input(handlers.head_picked, inputs=[ui.heads], outputs=[ui.form["draft"]], **quick)
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
    """The sidebar of settings (shared by both tabs: the Lab measures the pair the Playground shows), then the
    Playground and the Lab."""
    from app import lab

    with gr.Blocks(title="SpecArena") as demo:
        play = SimpleNamespace()
        with gr.Sidebar(open=True, width=340, elem_id="settings") as play.sidebar:
            build_settings(play)
        gr.HTML(INTRO, padding=False)
        with gr.Tab("Playground"):
            build_playground(play)
            wire(play)
        with gr.Tab("Lab"):
            lab.wire(lab.build_layout(), play)
        demo.load(None, js=f"() => {{ ({CLOSE_ON_PHONES})(); ({render.FIELD_MESSAGES})(); ({MEND_GRADIO})(); }}")
    return demo

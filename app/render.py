"""HTML for the two text panes and the summary. Model output is always escaped here.

Speculative tokens are coloured by origin: accepted draft token, the target's correction, the bonus
token after a fully accepted draft, or a plain target token (prefill, or a step without a draft).
Rejected draft proposals are always in the HTML, struck through, and shown only when the
"show rejected drafts" box is ticked (pure CSS, so toggling needs no re-render). Only the first of them
was tested and rejected; the ones after it were never checked, and are labelled so. A draft tree's rejected tokens
are the candidates the target turned down at one position, each tested.
"""

from __future__ import annotations

import time
from html import escape

from engine.backends.servers import NAMES
from engine.decoding.metrics import Metrics, StepEvent
from engine.errors import UserError
from engine.models.bandwidth import words as limit_words

KINDS = {  # CSS class suffix -> legend label; the colours live in assets/style.css
    "acc": "accepted draft",
    "cor": "target correction",
    "bon": "bonus token",
    "tgt": "target token",
    "rej": "rejected draft",
    "unk": "not checked (after a rejection)",
}

LEGEND = (
    '<div class="sa-legend">'
    + "".join(f'<span class="sa-tok sa-{k}">{escape(label)}</span>' for k, label in KINDS.items())
    + "</div>"
)


def _span(kind: str, piece: str, title: str) -> str:
    return f'<span class="sa-tok sa-{kind}" title="{escape(title, quote=True)}">{escape(piece)}</span>'


def _prob(label: str, value: float | None) -> str:
    return f"{label}={value:.3f}" if value is not None else ""


def _probs(s: StepEvent, i: int) -> str:
    """p and q of draft position i, where the backend reports them (vLLM does not)."""
    if i >= len(s.p):
        return "p and q not reported by this backend"
    return f"{_prob('p', s.p[i])} {_prob('q', s.q[i])}"


def _rejected(s: StepEvent) -> str:
    """The draft tokens the target did not keep: the first was tested and rejected, the rest never checked; a tree's
    are the candidates for one position, all tested."""
    out = []
    for j, piece in enumerate(s.rejected_pieces):
        k = s.accepted + j
        if s.tree:
            many = len(s.rejected_pieces)
            kind, title = "rej", (f"step {s.step}, draft position {s.accepted + 1}: tree candidate {j + 1} of {many}, "
                                  f"rejected, {_probs(s, k)}")  # fmt: skip
        elif j == 0:
            kind, title = "rej", f"step {s.step}, draft position {k + 1}: rejected, {_probs(s, k)}"
        else:
            kind, title = "unk", f"step {s.step}, draft position {k + 1}: not checked (a draft token before it failed)"
        classes = "sa-tok sa-rej" + (" sa-unk" if kind == "unk" else "")
        out.append(f'<s class="{classes}" title="{escape(title, quote=True)}">{escape(piece)}</s>')
    return "".join(out)


def speculative_tokens(steps: list[StepEvent]) -> str:
    """Every emitted token as a coloured span; hover shows the target p and the draft q. Tokens with no text
    (an end-of-sequence token, a byte that starts a character) get no span: an empty one shows as a blob."""
    out: list[str] = []
    for s in steps:
        for i, (token, piece) in enumerate(zip(s.tokens, s.pieces)):
            if i < s.accepted:
                title = f"step {s.step}, draft position {i + 1}: accepted, {_probs(s, i)}"
                title += f" · {s.draft_note}" if s.draft_note else ""
                if piece:
                    out.append(_span("acc", piece, title))
                continue
            out.append(_rejected(s))
            if not piece:
                continue
            kind = {"correction": "cor", "bonus": "bon"}.get(s.kind, "tgt")
            what = {"cor": "target's correction", "bon": "bonus token (all drafts accepted)"}.get(kind, "target token")
            note = f" · {s.draft_note}" if s.draft_note else ""
            out.append(_span(kind, piece, f"step {s.step}: {what}, {_prob('p', s.token_p)}{note}"))
    return "".join(out)


def baseline_tokens(steps: list[StepEvent]) -> str:
    return "".join(escape(piece) for s in steps for piece in s.pieces)


def pane(title: str, body: str, stats: str, identical_hint: str = "", waiting: str = "waiting…") -> str:
    """A text pane; `waiting`: what it says while it has no text yet (loading, warming up, after the baseline)."""
    empty = f'<span class="sa-empty">{escape(waiting)}</span>'
    return (
        f'<div class="sa-pane"><div class="sa-pane-head"><b>{escape(title)}</b>'
        f'<span class="sa-stats">{escape(stats)}</span>{identical_hint}</div>'
        f'<div class="sa-text">{body or empty}</div></div>'
    )


def hint(text: str) -> str:
    """A quiet line under a field that says what to do (such as where a head comes from)."""
    return f'<div class="sa-hint">{escape(text)}</div>'


def next_run_note(names: list[str], queued: bool = False) -> str:
    """The note under the status line while a run goes: settings changed since it started apply to the next
    run (the panes keep showing the one that runs), or a press of Run that waits for it."""
    if queued:
        text = "Run pressed again: that run starts when this one ends."
    elif names:
        text = f"changed since this run started, applies to the next run: {', '.join(names)}"
    else:
        return ""
    return f'<div class="sa-next" role="status">{escape(text)}</div>'


# Emoji that many systems draw as empty boxes (no emoji font), as marks every text font has
TEXT_MARKS = {"✅": "✓", "❌": "✗", "⚠️": "⚠", "ℹ️": "ℹ", "\ufe0f": ""}


def text_marks(text: str) -> str:
    for emoji, mark in TEXT_MARKS.items():
        text = text.replace(emoji, mark)
    return text


def stats_line(m: Metrics | None, running: bool) -> str:
    if m is None:
        return "running" if running else "not started"
    state = "running" if running else (m.finish_reason or "done")
    return f"{m.tokens_per_s:.1f} tok/s · {m.new_tokens} tokens · {m.total_s:.2f} s · {state}"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def _card(label: str, value: str, hint: str = "") -> str:
    return (
        f'<div class="sa-card"><div class="sa-card-v">{escape(value)}</div>'
        f'<div class="sa-card-l">{escape(label)}</div><div class="sa-card-h">{escape(hint)}</div></div>'
    )


def unreported(engine: str) -> str:
    """The badge of a server backend: it reports how much each step drafted and kept, not the rest."""
    return (
        f'<span class="sa-badge sa-info" title="{escape(engine)} reports how many draft tokens each step proposed '
        f'and kept, not which ones it rejected or their probabilities.">{escape(engine)}: rejected drafts '
        "counted, not shown</span>"
    )


def verdict_badge(verdict=None, stopped: bool = False) -> str:
    """The lossless verdict (engine.decoding.lossless.Judgement) as a badge; its whole sentence on hover. Rounding in 16
    bits is not the bug colour: both runs chose the target's greedy token within rounding."""
    kind = "stopped" if stopped else getattr(verdict, "kind", None) or "sampled"
    message = getattr(verdict, "message", "")
    badges = {
        "stopped": ("sa-warn", "stopped: partial runs, not compared", "A stopped comparison has runs of different "
                    "lengths: they are not compared and no speedup is computed."),
        "sampled": ("sa-info", "sampled: same distribution, not same text", "Sampled runs differ token by token; "
                    "rejection sampling keeps the distribution of the target."),
        "identical": ("sa-ok", "✓ outputs identical (lossless)", "Greedy decoding: the speculative ids equal the "
                      "baseline's, token for token."),
        "rounding": ("sa-round", f"≈ identical for {getattr(verdict, 'agreed', 0)} tokens, then 16-bit rounding",
                     f"{message}. Strict mode (parameters) runs every pass at one width, so the ids are identical."),
        "unjudged": ("sa-warn", f"outputs part at token {(getattr(verdict, 'position', None) or 0) + 1}: cause "
                     "unknown", message),
        "differs": ("sa-bad", "✗ outputs differ beyond rounding: this is a bug, please report it with the "
                    "downloaded run JSON", message),
    }  # fmt: skip
    css, text, title = badges[kind]
    return f'<span class="sa-badge {css}" title="{escape(title, quote=True)}">{escape(text)}</span>'


def strict_line(env: dict | None) -> str:
    """Which numerics ran: strict mode's width and cost, where the in-process engine decided."""
    strict = (env or {}).get("strict") or {}
    cost = strict.get("cost")
    costs = f", measured {cost:.2f}x a plain baseline step here" if cost else ""
    if strict.get("exact"):
        return "strict mode not needed: every target pass runs our fused kernels, each row rounded as a one-token pass"
    if strict.get("width"):
        return f"strict mode: every target pass {strict['width']} rows over a fixed-size cache{costs}"
    if strict:
        why = {"off": "off", "auto": f"off (auto{costs})", "on": "on"}[strict.get("setting", "off")]
        return f"strict mode {why}"
    return ""


def environment_line(env: dict | None) -> str:
    """Where the numbers were measured, in one line: the device, threads, dtype, which linear-layer forms ran
    (engine.models.cpu) and the software. Numbers from another machine or form are other numbers."""
    if not env:
        return ""
    threads = env.get("cpu_threads") or env.get("threads")
    parts = [
        env.get("device_name", "") + (f", {threads} threads" if threads and env.get("device") != "cuda" else ""),
        env.get("dtype", ""),
        limit_words(env),
        "lean forward" if env.get("forward") == "lean" else "",
        f"linears: {env['linear_forms']}" if env.get("linear_forms") else "",
        strict_line(env),
        *(f"{name} {env[key]}" for key, name in (("torch", "torch"), ("transformers", "transformers"),
                                                 ("vllm", "vLLM"), ("llama_cpp", "llama.cpp build")) if env.get(key)),
    ]  # fmt: skip
    return f'<div class="sa-env">measured on {escape(" · ".join(p for p in parts if p))}</div>'


def servers_line(env: dict | None) -> str:
    """Which engine servers SpecArena runs beside this one (env["servers_up"], engine.backends.servers.Pool.up):
    they share the machine with the runs, and a CPU machine has room for few."""
    up = (env or {}).get("servers_up") or []
    if not up:
        return ""
    groups: dict[tuple, list[dict]] = {}
    for server in up:
        groups.setdefault((server["backend"], server["model"]), []).append(server)
    parts = []
    for (backend, model), servers in groups.items():
        roles = " and ".join(f"{s['role'] or 'server'} :{s['port']}" for s in servers)
        since = time.strftime("%H:%M", time.localtime(min(s["since"] for s in servers)))
        parts.append(f"{NAMES.get(backend, backend)} {roles} ({model}, up since {since})")
    return f'<div class="sa-env sa-servers">servers up: {escape(" · ".join(parts))}</div>'


def summary(
    base: Metrics | None, spec: Metrics | None, verdict, speedup: float | None, stopped: bool = False,
    suspect: list[str] | None = None, environment: dict | None = None, explanation: str = "",
) -> str:  # fmt: skip
    """The verdict badge, the cards, why speculation lost or won under its prediction (`explanation`, from
    engine.measure.explain) and where they were measured. A suspect run shows why instead of its speedup."""
    if stopped:
        return f'<div class="sa-summary">{verdict_badge(None, stopped=True)}</div>'
    if base is None or spec is None:
        return '<div class="sa-summary sa-empty">Run a comparison to see the summary.</div>'
    saved = base.target_passes - spec.target_passes
    predicted = f"predicted {_fmt(spec.predicted_speedup, '.2f', '×')}"
    cards = [
        _card("speedup, not trusted yet", f"{_fmt(speedup, '.2f', '×')} ?", f"{predicted}; see why above")
        if suspect
        else _card("speedup", _fmt(speedup, ".2f", "×"), predicted),
        _card(
            "acceptance rate",
            _fmt(spec.acceptance_rate, ".1%"),
            f"{spec.accepted_tokens}/{spec.drafted_tokens} drafted · α per tested token {_fmt(spec.alpha, '.2f')}",
        ),
        _card("tokens per target pass", f"{spec.mean_accepted_length:.2f}",
              "baseline: 1.00" + (f" · {spec.tree_nodes:.1f} tree nodes verified" if spec.tree_nodes else "")),
        _card("tokens/s", f"{spec.tokens_per_s:.1f}", f"baseline {base.tokens_per_s:.1f}"),
        _card("time to first token", f"{spec.ttft_s * 1000:.0f} ms", f"baseline {base.ttft_s * 1000:.0f} ms"),
        _card("target passes saved", str(saved), f"{spec.target_passes} vs {base.target_passes}"),
        _card("cost ratio c", _fmt(spec.cost_ratio_c, ".3f"),
              ("drafter pass" if spec.tree_nodes else "draft token") + " / verify pass"),
    ]
    doubt = ""
    if suspect:
        doubt = (
            '<div class="sa-suspect" role="note">⚠ <b>Not a trustworthy speedup yet</b>: '
            + escape("; ".join(suspect)) + ".</div>"
        )
    cards_html = "".join(cards)
    why = f'<div class="sa-why" role="note">{escape(explanation)}</div>' if explanation else ""
    return (
        f'<div class="sa-summary">{verdict_badge(verdict)}{doubt}<div class="sa-cards">{cards_html}</div>'
        f"{why}{environment_line(environment)}{servers_line(environment)}</div>"
    )


def field_id(name: str) -> str:
    """The elem_id of the form field for a Settings field (or the prompt)."""
    return f"field-{name}"


def field_error(exc: UserError, elem_id: str | None = None) -> str:
    """A red outline and the message under the field at fault (`elem_id`, else the form's field of that name), and
    nowhere else (the status line only points at the field). Stays until the user edits that field or runs again.

    The message is page text, not CSS, so that it can be read aloud, selected and found: this mark carries it
    hidden, and FIELD_MESSAGES (run in the page) puts it under the field as `<p id="err-FIELD" role="alert">`, with
    `aria-invalid` and `aria-describedby` on the field's input, and takes them away when the mark goes. A Gradio
    component cannot be given another component's DOM from the server, hence the script."""
    if not exc.field:
        return ""
    elem_id = elem_id or field_id(exc.field)
    style = f"<style>#{elem_id} {{ outline: 2px solid #dc2626; outline-offset: 2px; border-radius: 8px; }}</style>"
    return (f'<div class="sa-form-error" data-field="{escape(exc.field, quote=True)}" '
            f'data-where="{escape(elem_id, quote=True)}">{style}<span class="sa-form-error-text" hidden>'
            f"{escape(str(exc))}</span></div>")


# Each field error's message, under its field (see field_error): kept in step with the marks on the page by one
# observer, so that a mark Gradio adds, replaces or empties (a run, an edit, Clear) moves the message with it.
FIELD_MESSAGES = """() => {
    const unmark = (p) => {
        const id = p.id;
        document.querySelectorAll(`[aria-describedby~="${id}"]`).forEach(i => {
            const rest = i.getAttribute('aria-describedby').split(' ').filter(t => t && t !== id).join(' ');
            rest ? i.setAttribute('aria-describedby', rest) : i.removeAttribute('aria-describedby');
            i.removeAttribute('aria-invalid');
        });
        p.remove();
    };
    const mark = (where, text) => {
        const field = document.getElementById(where);
        if (!field) return;
        const id = 'err-' + where;
        let p = document.getElementById(id);
        if (p && p.parentElement !== field) { unmark(p); p = null; }
        if (!p) {
            p = document.createElement('p');
            p.id = id; p.className = 'sa-field-message'; p.dataset.for = where; p.setAttribute('role', 'alert');
            p.textContent = text;
            field.appendChild(p);
        } else if (p.textContent !== text) p.textContent = text;
        field.querySelectorAll('input, textarea, select').forEach(i => {
            if (i.getAttribute('aria-invalid') !== 'true') i.setAttribute('aria-invalid', 'true');
            const ids = (i.getAttribute('aria-describedby') || '').split(' ').filter(Boolean);
            if (!ids.includes(id)) i.setAttribute('aria-describedby', [...ids, id].join(' '));
        });
    };
    const sync = () => {
        const wanted = new Map();
        document.querySelectorAll('.sa-form-error[data-where]').forEach(e =>
            wanted.set(e.dataset.where, e.querySelector('.sa-form-error-text')?.textContent || ''));
        document.querySelectorAll('p.sa-field-message').forEach(p => { if (!wanted.has(p.dataset.for)) unmark(p); });
        wanted.forEach((text, where) => mark(where, text));
    };
    new MutationObserver(sync).observe(document.body, {childList: true, subtree: true, characterData: true});
    sync();
}"""


# Editing a field takes its error mark away, and a status that reported a failure with it (in the browser: no
# round trip): the status follows the form rather than keeping an error the user has already acted on.
UNMARK = """(html, status) => {
    const marked = (html || '').includes('data-field="NAME"');
    const failed = (status || '').includes('sa-status-error');
    return [marked ? '' : html, (marked || (failed && !(html || '').includes('data-field='))) ? EMPTY : status];
}"""


def unmark_when_edited(component, form_error, status, mark: str) -> None:
    """Editing a field takes its error mark (`mark`: the attribute the error carries, data-field="..." or
    data-where="...", as field_error writes them) away, in the browser. On change, not input: Gradio's textboxes
    report input for keys typed only, so a value pasted or dropped in left the message under a field already
    mended."""
    js = UNMARK.replace('data-field="NAME"', mark).replace("EMPTY", repr(status_line("")))
    component.change(None, [form_error, status], [form_error, status], js=js, queue=False,
                     api_visibility="private")  # fmt: skip


def status_line(text: str, detail: str = "", error: bool = False) -> str:
    """The one-line status. A failure is one sentence (what failed, the likely cause, what to do); what a reader
    may want besides, such as the end of a crashed server's log, is folded under it."""
    if not text:
        return '<div class="sa-status"></div>'
    # the log scrolls within its box: tabindex lets a keyboard reach and scroll it
    fold = (f'<details class="sa-detail"><summary>show the log</summary><pre tabindex="0">{escape(detail)}</pre>'
            "</details>" if detail else "")  # fmt: skip
    css = "sa-status sa-status-error" if error else "sa-status"
    return f'<div class="{css}" role="status">{escape(text)}{fold}</div>'

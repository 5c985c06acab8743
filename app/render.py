"""HTML for the two text panes and the summary. Model output is always escaped here.

Speculative tokens are coloured by origin: accepted draft token, the target's correction, the bonus
token after a fully accepted draft, or a plain target token (prefill, or a step without a draft).
Rejected draft proposals are always in the HTML, struck through, and shown only when the
"show rejected drafts" box is ticked (pure CSS, so toggling needs no re-render).
"""

from __future__ import annotations

from html import escape

from engine.metrics import Metrics, StepEvent

KINDS = {  # CSS class suffix -> legend label; the colours live in assets/style.css
    "acc": "accepted draft",
    "cor": "target correction",
    "bon": "bonus token",
    "tgt": "target token",
    "rej": "rejected draft",
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


def speculative_tokens(steps: list[StepEvent]) -> str:
    """Every emitted token as a coloured span; hover shows the target p and the draft q."""
    out: list[str] = []
    for s in steps:
        for i, (token, piece) in enumerate(zip(s.tokens, s.pieces)):
            if i < s.accepted:
                title = f"step {s.step}, draft position {i + 1}: accepted, {_prob('p', s.p[i])} {_prob('q', s.q[i])}"
                out.append(_span("acc", piece, title))
                continue
            for j, rejected in enumerate(s.rejected_pieces):
                k = s.accepted + j
                title = f"step {s.step}, draft position {k + 1}: rejected, {_prob('p', s.p[k])} {_prob('q', s.q[k])}"
                out.append(f'<s class="sa-tok sa-rej" title="{escape(title, quote=True)}">{escape(rejected)}</s>')
            kind = {"correction": "cor", "bonus": "bon"}.get(s.kind, "tgt")
            what = {"cor": "target's correction", "bon": "bonus token (all drafts accepted)"}.get(kind, "target token")
            out.append(_span(kind, piece, f"step {s.step}: {what}, {_prob('p', s.token_p)}"))
    return "".join(out)


def baseline_tokens(steps: list[StepEvent]) -> str:
    return "".join(escape(piece) for s in steps for piece in s.pieces)


def pane(title: str, body: str, stats: str, identical_hint: str = "") -> str:
    return (
        f'<div class="sa-pane"><div class="sa-pane-head"><b>{escape(title)}</b>'
        f'<span class="sa-stats">{escape(stats)}</span>{identical_hint}</div>'
        f'<div class="sa-text">{body or "<span class=sa-empty>waiting…</span>"}</div></div>'
    )


def stats_line(m: Metrics | None, running: bool) -> str:
    if m is None:
        return "not started"
    state = "running" if running else (m.finish_reason or "done")
    return f"{m.tokens_per_s:.1f} tok/s · {m.new_tokens} tokens · {m.total_s:.2f} s · {state}"


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, spec) + suffix


def _card(label: str, value: str, hint: str = "") -> str:
    return (
        f'<div class="sa-card"><div class="sa-card-v">{escape(value)}</div>'
        f'<div class="sa-card-l">{escape(label)}</div><div class="sa-card-h">{escape(hint)}</div></div>'
    )


def identical_badge(identical: bool | None) -> str:
    if identical is None:
        return (
            '<span class="sa-badge sa-info" title="Sampled runs differ token by token; rejection sampling keeps '
            'the distribution of the target.">sampled: same distribution, not same text</span>'
        )
    if identical:
        return '<span class="sa-badge sa-ok">✓ outputs identical (lossless)</span>'
    return (
        '<span class="sa-badge sa-bad">✗ outputs differ under greedy decoding: this is a bug, '
        "please report it with the downloaded run JSON</span>"
    )


def summary(base: Metrics | None, spec: Metrics | None, identical: bool | None, speedup: float | None) -> str:
    if base is None or spec is None:
        return '<div class="sa-summary sa-empty">Run a comparison to see the summary.</div>'
    saved = base.target_passes - spec.target_passes
    cards = [
        _card("speedup", _fmt(speedup, ".2f", "×"), f"predicted {_fmt(spec.predicted_speedup, '.2f', '×')}"),
        _card(
            "acceptance rate",
            _fmt(spec.acceptance_rate, ".1%"),
            f"{spec.accepted_tokens}/{spec.drafted_tokens} drafted · α per tested token {_fmt(spec.alpha, '.2f')}",
        ),
        _card("tokens per target pass", f"{spec.mean_accepted_length:.2f}", "baseline: 1.00"),
        _card("tokens/s", f"{spec.tokens_per_s:.1f}", f"baseline {base.tokens_per_s:.1f}"),
        _card("time to first token", f"{spec.ttft_s * 1000:.0f} ms", f"baseline {base.ttft_s * 1000:.0f} ms"),
        _card("target passes saved", str(saved), f"{spec.target_passes} vs {base.target_passes}"),
        _card("cost ratio c", _fmt(spec.cost_ratio_c, ".3f"), "draft token / verify pass"),
    ]
    return f'<div class="sa-summary">{identical_badge(identical)}<div class="sa-cards">{"".join(cards)}</div></div>'

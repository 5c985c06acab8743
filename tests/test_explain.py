"""Why speculation lost, or won under its prediction, said with the run's own numbers: on the Comparison, in the API
result, in the Playground's summary and in the CLI's (issue 57, item 2)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from app import render
from app.handlers import api_result
from engine.decoding.metrics import StepEvent, summarise
from engine.events import Comparison
from engine.measure.explain import alpha_to_pay, explain, tokens_at
from engine.settings import Settings


def run(mode: str, verify: float, draft: float = 0.0, other: float = 0.0, gamma: int = 0, kept: int = 0,
        steps: int = 20):  # fmt: skip
    """A run whose decode steps each draft `gamma` tokens, keep `kept` of them, and take the given seconds."""
    events, clock = [StepEvent(0, "prefill", [1], ["a"], elapsed_s=0.1, verify_s=0.1)], 0.1
    for i in range(1, steps):
        clock += verify + draft + other
        events.append(StepEvent(i, "correction" if gamma else "target", [5] * (kept + 1), ["b"] * (kept + 1),
                                drafted=[2] * gamma, accepted=kept, p=[0.9] * gamma, q=[1.0] * gamma,
                                elapsed_s=clock, verify_s=verify, draft_s=draft, other_s=other))  # fmt: skip
    return summarise(mode, events, "")


def comparison(spec, backend: str = "transformers") -> Comparison:
    """Against a baseline of 10 ms a token."""
    base = run("baseline", 0.01, steps=40)
    return Comparison(replace(Settings(), backend=backend), "p", base, spec, {"device": "cpu"})


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


def test_a_loss_is_explained_with_numbers_that_add_up():
    # verify 20 ms, drafting 4 tokens 16 ms, 1 ms around: 3.7 baseline steps for 2 tokens
    c = comparison(run("speculative", 0.020, 0.016, 0.001, gamma=4, kept=1))
    why = explain(c)
    assert why.startswith(f"Speculation lost here ({c.speedup:.2f}x; this run's acceptance and c predict "
                          f"{c.speculative.metrics.predicted_speedup:.2f}x")  # fmt: skip
    step, verify, draft, c_ratio, rest, kept = numbers(why.split("took ")[1])[:6]
    assert (step, verify, draft, rest, kept) == (3.70, 2.00, 1.60, 0.10, 2.00)
    assert abs(verify + draft + rest - step) < 0.02 and abs(kept / step - c.speedup) < 0.01  # speedup = L / S
    assert c_ratio == round(c.speculative.metrics.cost_ratio_c, 3)
    need = float(re.search(r"needs alpha above (\d\.\d+)", why).group(1))
    assert abs(tokens_at(need, 4) - step) < 0.02  # the break-even: a step would keep what it costs
    assert "(it had 0.50)" in why
    assert re.search(r"gamma 1 would do about 1\.\d\dx", why)  # the predictor's better gamma, above 1x


def test_a_draft_that_costs_more_than_any_draft_can_bring_names_the_drafter():
    """A draft model as slow as the target: even a draft that is always right cannot pay."""
    c = comparison(run("speculative", 0.012, 0.060, 0.0005, gamma=4, kept=3))
    why = explain(c)
    assert "At gamma 4 even a draft that is always right keeps 5 tokens, under the 7.25 a step costs" in why
    assert "try a cheaper drafter (drafting cost 6.00 of a step's 7.25)" in why
    assert alpha_to_pay(7.25, 4) is None and alpha_to_pay(1.0, 4) == pytest.approx(0.0, abs=1e-6)


def test_a_drafter_that_found_nothing_says_so():
    why = explain(comparison(run("speculative", 0.012, 0.0, 0.0005)))
    assert why.startswith("Speculation lost here (0.80x): ")
    assert "The drafter proposed nothing in any of the 19 steps" in why


def test_a_win_as_predicted_needs_no_words_and_a_short_win_says_why():
    assert explain(comparison(run("speculative", 0.013, 0.002, 0.0005, gamma=4, kept=2))) == ""  # 1.94x of 2.26x
    short = comparison(run("speculative", 0.025, 0.002, 0.001, gamma=4, kept=3))  # 1.43x of 2.82x predicted
    why = explain(short)
    assert why.startswith("Speculation won 1.43x where this run's acceptance and c predict 2.82x, counting a verify "
                          "pass as one step: a speculative step took 2.80 baseline steps' time (verifying 2.50")
    assert why.endswith("With this acceptance and these costs gamma 3 would do about 1.68x.")
    stopped = comparison(run("speculative", 0.1, gamma=4))
    stopped.speculative.metrics.finish_reason = "stopped"
    assert explain(stopped) == ""


@pytest.mark.parametrize("backend, engine, clock", [("vllm", "vLLM", "the client's clock"),
                                                    ("llama.cpp", "llama.cpp", "the server's own clock")])  # fmt: skip
def test_a_server_backend_says_what_its_engine_reports_and_what_it_does_not(backend, engine, clock):
    # a server times whole steps: no draft time apart, so no c either
    c = comparison(run("speculative", 0.030, gamma=4, kept=1), backend)
    why = explain(c)
    assert why.startswith(f"Speculation lost here (0.67x): {engine} reports 2.00 tokens kept per step (19 of 76 draft "
                          f"tokens accepted) and a speculative step took 3.00 baseline steps' time by {clock}")
    assert (f"{engine} does not report how that time splits between the verify pass and drafting, nor the draft's "
            "probabilities, so the verify cost and c could not be measured there") in why
    assert "verifying" not in why.split(".")[0]  # no split it could not measure


def test_the_explanation_travels_to_the_api_result_and_the_summary():
    c = comparison(run("speculative", 0.020, 0.016, 0.001, gamma=4, kept=1))
    c.explanation = explain(c)
    assert c.to_dict()["explanation"] == c.explanation != ""
    assert api_result(c)["explanation"] == c.explanation
    html = render.summary(c.baseline.metrics, c.speculative.metrics, c.judge(), c.speedup,
                          explanation=c.explanation)  # fmt: skip
    assert f'<div class="sa-why" role="note">{c.explanation.replace(chr(39), "&#x27;")}</div>' in html
    plain = render.summary(c.baseline.metrics, c.speculative.metrics, c.judge(), c.speedup)
    assert "sa-why" not in plain


@pytest.fixture(scope="module")
def losing(model_dirs):
    """A draft model as big as the target (the tiny pair: the target with noise): drafting 8 tokens costs about 8
    target passes, more than any 9 tokens a step could keep."""
    return dict(target=model_dirs["target"], draft=model_dirs["draft"], drafter="draft-model", gamma=8,
                max_new_tokens=24)  # fmt: skip


def test_a_real_losing_run_carries_its_explanation(losing):
    from engine.compare import compare

    c = compare(Settings(**losing), "abc abc abc")
    assert c.speedup < 1 and c.explanation.startswith(f"Speculation lost here ({c.speedup:.2f}x")
    assert c.to_dict(with_steps=False)["explanation"] == c.explanation == api_result(c)["explanation"]


def test_the_cli_summary_prints_why_a_run_lost(losing, capsys):
    from engine.__main__ import main

    args = ["run", "--target", losing["target"], "--draft", losing["draft"], "--gamma", "8", "--prompt",
            "abc abc abc", "--max-new-tokens", "24"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^Speculation lost here \(0\.\d\dx.*baseline steps' time \(verifying", out, re.M)

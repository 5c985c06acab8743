"""Runs that look off are flagged with reasons, not shown as results; reports say what a best cell rests on."""

from __future__ import annotations

from dataclasses import replace

from app import render
from engine.decoding.metrics import StepEvent, summarise
from engine.events import Comparison
from engine.measure import report
from engine.measure.trust import OtherLoad, RecentSpeeds, suspicions
from engine.settings import Settings


def run(mode: str, tokens: int, seconds: float, predicted_alpha: bool = False):
    """A run of `tokens` one-token steps over `seconds`, after a 0.1 s prefill."""
    steps = [StepEvent(0, "prefill", [1], ["a"], elapsed_s=0.1, verify_s=0.1)]
    for i in range(1, tokens):
        drafted = [2, 3] if predicted_alpha else []
        steps.append(StepEvent(i, "correction" if drafted else "target", [5], ["b"], drafted=drafted, p=[0.9, 0.1],
                               q=[1, 1], accepted=0, elapsed_s=0.1 + seconds * i / (tokens - 1),
                               verify_s=seconds / (tokens - 1), draft_s=1e-4))  # fmt: skip
    return summarise(mode, steps, "")


def comparison(base_s: float, spec_s: float, **extra) -> Comparison:
    base, spec = run("baseline", 20, base_s), run("speculative", 20, spec_s, predicted_alpha=True)
    return Comparison(Settings(), "p", base, spec, {"device": "cpu"}, **extra)


def test_a_speedup_far_from_its_prediction_is_suspect():
    c = comparison(1.0, 0.1, loaded_models=["bundled:smollm2-135m-instruct"])  # 10x measured, ~1x predicted
    reasons = suspicions(c, RecentSpeeds())
    assert any("far from the" in r and "predict" in r for r in reasons)
    assert any("first run after loading bundled:smollm2-135m-instruct" in r for r in reasons)
    fair = comparison(1.0, 1.0)
    assert suspicions(fair, RecentSpeeds()) == []  # measured ~ predicted, nothing known to compare with


def test_a_side_far_from_its_recent_runs_is_suspect():
    recent = RecentSpeeds()
    for _ in range(3):
        assert suspicions(comparison(1.0, 1.0), recent) == []
    slow = comparison(10.0, 10.0)  # both sides ten times slower than their recent runs
    reasons = suspicions(slow, recent)
    assert any(r.startswith("the baseline ran at 1.9 tok/s where its recent runs") for r in reasons)
    assert any(r.startswith("the speculative ran at") for r in reasons)


def test_a_busy_machine_is_named_and_stopped_runs_are_not_judged():
    busy = comparison(1.0, 1.0, other_load=0.6)
    assert suspicions(busy, RecentSpeeds()) == ["other processes used 60% of the CPUs during the runs: the machine "
                                                "was busy"]  # fmt: skip
    stopped = replace(comparison(1.0, 0.1), speculative=None)
    assert suspicions(stopped, RecentSpeeds()) == []
    assert 0.0 <= OtherLoad().share() <= 1.0


def test_other_load_stays_a_share_over_short_windows():
    """CPU times move in 10 ms ticks: over a window of microseconds, with a process spinning beside us, one
    tick of other work read as up to 10x every CPU (CI once failed on 2.1)."""
    import subprocess
    import sys

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        shares = [OtherLoad().share() for _ in range(3000)]
    finally:
        spinner.kill()
        spinner.wait()
    assert all(0.0 <= share <= 1.0 for share in shares)


def test_a_suspect_run_shows_why_instead_of_its_speedup():
    c = comparison(1.0, 0.1)
    verdict = c.judge()
    html = render.summary(c.baseline.metrics, c.speculative.metrics, verdict, c.speedup, suspect=["odd"])
    assert "Not a trustworthy speedup yet</b>: odd." in html and "Run again</b>" in html
    assert "speedup, not trusted yet" in html and "10.00× ?" in html  # the number, marked as not to be trusted
    plain = render.summary(c.baseline.metrics, c.speculative.metrics, verdict, c.speedup)
    assert "trustworthy" not in plain and "10.00×" in plain


def cell(drafter, gamma, median, low, high, n):
    return {"drafter": drafter, "gamma": gamma, "temperature": 0.0,
            "speedup": {"median": median, "min": low, "max": high, "n": n}}  # fmt: skip


def test_the_best_setting_says_what_it_rests_on():
    lone = report.best_setting({"cells": [cell("prompt-lookup", 4, 2.0, 2.0, 2.0, 1)]})
    assert lone["samples"] == 1 and any("one sample decides" in n for n in lone["notes"])
    close = report.best_setting({"cells": [cell("prompt-lookup", 4, 2.0, 1.5, 2.5, 6),
                                           cell("prompt-lookup", 8, 1.9, 1.6, 2.4, 6)]})  # fmt: skip
    assert any("gamma 8" in n and "do not tell the two apart" in n for n in close["notes"])
    clear = report.best_setting({"cells": [cell("prompt-lookup", 4, 2.0, 1.9, 2.1, 6),
                                           cell("prompt-lookup", 8, 1.2, 1.1, 1.3, 6)]})  # fmt: skip
    assert clear["notes"] == []


def test_a_baseline_far_slower_than_the_pass_timed_at_load_is_suspect():
    slow = comparison(1.0, 1.0)  # the baseline runs at ~19 tok/s
    slow.environment = {"device": "cpu", "step_s_at_load": 0.005}  # 5 ms a token when the model was loaded
    reasons = suspicions(slow, RecentSpeeds())
    assert any("timed when it was loaded, took 5 ms (about 200 tok/s)" in r for r in reasons)
    usual = comparison(1.0, 1.0)
    usual.environment = {"device": "cpu", "step_s_at_load": 0.045}
    assert suspicions(usual, RecentSpeeds()) == []


def test_loading_times_a_one_token_pass(model_dirs):
    from engine.models.loading import ModelCache

    loaded = ModelCache(max_models=1).get(model_dirs["target"])
    assert loaded.step_s is not None and 0 < loaded.step_s < 5


def test_processes_we_started_are_not_other_load():
    """A server backend's engine runs in processes we started: their CPU time is the run's own work."""
    import subprocess
    import sys
    import time

    burn = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    load = OtherLoad()
    subprocess.run([sys.executable, "-c", burn], check=True)  # our child: ours
    ours = load.share()
    load = OtherLoad()
    # the same work in a process that is not ours (its parent exits at once: it is re-parented, as a stranger)
    stranger = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}])"
    subprocess.run([sys.executable, "-c", stranger], check=True)
    time.sleep(1.6)
    other = load.share()
    assert ours < 0.25 < other

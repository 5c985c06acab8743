"""The GPU diagnosis (engine.measure.gpucheck): its verdicts on given figures, and its run without a GPU."""

from __future__ import annotations

import json

from engine.__main__ import main, off_cells
from engine.measure import gpucheck


def run(tps: float, verdict: str = "identical", tested: int = 50, kept: int = 40) -> dict:
    return {"baseline_tps": tps, "speculative_tps": 2 * tps, "speedup": 2.0, "verdict": verdict,
            "verdict_message": f"{verdict} message", "tested": tested, "kept": kept}  # fmt: skip


def test_repeats_must_agree_and_the_first_timed_run_must_not_lag():
    assert gpucheck.check_repeats([run(100), run(104), run(98), run(101)]).status == "PASS"
    slow_alternate = gpucheck.check_repeats([run(25), run(114), run(25), run(113)])  # as seen on an H200
    assert slow_alternate.status == "FAIL" and "25.0, 114.0, 25.0, 113.0" in slow_alternate.figure
    assert gpucheck.check_repeats([run(80), run(100), run(101), run(99)]).status == "FAIL"  # a slow first run


def test_alpha_and_the_verdict_are_held_to_what_was_asked():
    assert gpucheck.check_alpha([run(1, tested=128, kept=102)] * 2, 0.8).status == "PASS"
    assert gpucheck.check_alpha([run(1, tested=128, kept=3)] * 2, 0.8).status == "FAIL"  # 0.02: the H200's collapse
    assert gpucheck.check_lossless([run(1), run(1, "rounding")]).status == "PASS"
    failed = gpucheck.check_lossless([run(1), run(1, "differs")])
    assert failed.status == "FAIL" and "differs message" in failed.figure


def test_bandwidth_comes_from_the_card_name():
    assert gpucheck.bandwidth("NVIDIA H200") == 4.8e12
    assert gpucheck.bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and gpucheck.bandwidth("NVIDIA H100 PCIe") == 2e12
    assert gpucheck.bandwidth("Some Future Card") is None


def test_gpu_check_full_runs_without_a_gpu_and_says_what_it_skipped(monkeypatch, tmp_path, capsys):
    """On this CPU the checks that need CUDA are skipped by name; a failing check makes the exit code 1."""
    monkeypatch.setattr(gpucheck, "run_repeats", lambda s: [run(20), run(21), run(20), run(19)])
    monkeypatch.setattr(gpucheck, "check_app", lambda s: gpucheck.Check("app", "PASS", "app / engine 0.99", {}))
    out = tmp_path / "check.json"
    assert main(["gpu-check", "--full", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "on a CPU (no CUDA GPU): random:smollm2-135m" in text
    for name in ("compile", "bound", "speedup", "nvml"):
        assert f"SKIP  {name}" in text and "needs a CUDA GPU" in text
    data = json.loads(out.read_text())
    assert [c["name"] for c in data["checks"]][:4] == ["repeats", "lossless", "alpha", "app"]
    monkeypatch.setattr(gpucheck, "run_repeats", lambda s: [run(20, tested=100, kept=10)] * 4)
    assert main(["gpu-check", "--full"]) == 1
    assert "FAIL  alpha" in capsys.readouterr().out


def test_the_backends_gpu_check_fails_on_an_alpha_or_verdict_that_is_off():
    cell = {"lossless": "rounding"}
    good = [{"cell": 0, "positions": [[100, 80], [80, 64]]}]
    bad = [{"cell": 0, "positions": [[100, 2], [2, 1]]}]
    assert off_cells({"runs": {"transformers": {"cells": [cell], "samples": good}}}, 0.8) == []
    wrong = off_cells({"runs": {"vllm": {"cells": [{"lossless": "differs"}], "samples": bad}}}, 0.8)
    assert wrong == ["vllm: alpha 0.029 measured over 102 drafted tokens, 0.8 asked", "vllm: lossless verdict differs"]

"""`python -m engine run`: JSON output in the public format, one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.__main__ import main

METRIC_KEYS = {
    "tokens_per_s", "ttft_s", "total_s", "new_tokens", "target_passes", "draft_passes", "acceptance_rate",
    "mean_accepted_length", "per_position_acceptance", "accepted_length_hist", "no_draft_steps", "draft_s", "verify_s",
    "overhead_s", "cost_ratio_c", "predicted_speedup",
}  # fmt: skip


def test_cli_json_carries_the_public_fields(model_dirs):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "engine", "run", "--json", "--target", model_dirs["target"], "--draft",
           model_dirs["draft"], "--prompt", "abc abc abc", "--max-new-tokens", "20", "--gamma", "3"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["identical"] is True
    assert isinstance(data["speedup"], float)
    for side in ("baseline", "speculative"):
        run = data[side]
        assert METRIC_KEYS <= set(run["metrics"])
        assert len(run["token_ids"]) == run["metrics"]["new_tokens"] == 20
        assert run["steps"][0]["kind"] == "prefill"
        assert run["text"] == "".join(p for s in run["steps"] for p in s["pieces"])
    assert data["baseline"]["token_ids"] == data["speculative"]["token_ids"]
    assert data["speculative"]["metrics"]["draft_passes"] > 0


def test_cli_sampled_run_reports_identical_as_null(model_dirs, capsys):
    code = main(["run", "--json", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                 "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3"])  # fmt: skip
    assert code == 0
    assert json.loads(capsys.readouterr().out)["identical"] is None


def test_cli_prints_a_readable_summary(model_dirs, capsys):
    assert main(["run", "--target", model_dirs["target"], "--prompt", "xyz xyz", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "lossless: outputs identical (lossless)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--target", "/no/such/folder"], "does not exist"),
        (["--prompt", "hi", "--target", "nobody/no-such-model"], "not in the local cache"),
        (["--prompt", "hi", "--gamma", "0"], "gamma 0 is out of range"),
        (["--prompt", "hi", "--temperature", "3"], "temperature 3.0 is out of range"),
        (["--prompt", "hi", "--top-p", "0"], "top-p 0.0 is out of range"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max new tokens 0 is out of range"),
        (["--prompt", "hi", "--drafter", "draft-model"], "draft model or head is empty"),
        (["--prompt", "hi", "--compile", "--device", "cpu"], "compile needs a CUDA GPU"),
        (["--prompt", "hi " * 300, "--max-new-tokens", "10"], "more than the context of 256 tokens"),
    ],
)
def test_cli_bad_input_is_one_clear_line(model_dirs, capsys, args, message):
    if "--target" not in args:
        args = args + ["--target", model_dirs["target"]]
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_cli_runs_a_draft_with_another_tokenizer(model_dirs, capsys):
    code = main(["run", "--prompt", "hi", "--target", model_dirs["target"], "--draft", model_dirs["other-vocab"],
                 "--max-new-tokens", "8", "--json"])  # fmt: skip
    assert code == 0 and json.loads(capsys.readouterr().out)["identical"] is True


def test_cli_error_exit_code_without_traceback_in_a_real_process():
    out = subprocess.run([sys.executable, "-m", "engine", "run", "--prompt", "hi", "--target", "/no/such"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and "Traceback" not in out.stderr

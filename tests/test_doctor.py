"""The pair doctor on tokenizers and configs built offline: matched, padded, mismatched."""

from __future__ import annotations

import json

import pytest

from engine.__main__ import main
from engine.models.doctor import diagnose, vocab_check
from tests.conftest import byte_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory):
    """Same tokens and ids as the target, plus extra ids at the end (like 151936 vs 152064 padding)."""
    folder = tmp_path_factory.mktemp("padded")
    tok = byte_tokenizer()
    tok.add_tokens([f"<pad_extra_{i}>" for i in range(8)])
    tiny_llama(vocab_size=392, layers=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def statuses(report):
    return {c["name"]: c["status"] for c in report["checks"]}


def test_matched_pair_passes(model_dirs):
    report = diagnose(model_dirs["target"], model_dirs["draft"])
    s = statuses(report)
    assert s["vocabulary"] == s["probe texts"] == s["special tokens"] == s["memory"] == "ok"
    assert s["size ratio"] == "warn"  # a draft as large as the target cannot pay off
    assert report["verdict"] == "warn" and report["params"]["target"] == report["params"]["draft"] > 0


def test_padding_only_difference_passes_with_a_note(model_dirs, padded_dir):
    check = vocab_check(byte_tokenizer(), __import__("transformers").AutoTokenizer.from_pretrained(padded_dir))
    assert check.status == "note" and "extra ids" in check.detail
    assert diagnose(model_dirs["target"], padded_dir)["verdict"] != "fail"


def test_another_tokenizer_is_a_warning_with_the_overlap_not_a_refusal(model_dirs):
    report = diagnose(model_dirs["target"], model_dirs["other-vocab"])
    check = next(c for c in report["checks"] if c["name"] == "vocabulary")
    assert report["verdict"] == "warn" and check["status"] == "warn"
    assert "another tokenizer: 3 of the target's 384 tokens are also the draft's" in check["detail"]
    assert "re-encoded" in check["detail"] and "same tokenizer" in check["detail"]


def test_memory_estimate_fails_when_it_cannot_fit(model_dirs, monkeypatch):
    monkeypatch.setattr("engine.models.sizing.free_memory_bytes", lambda device: 1000)
    check = next(c for c in diagnose(model_dirs["target"])["checks"] if c["name"] == "memory")
    assert check["status"] == "fail" and "smaller dtype" in check["detail"]


def test_doctor_cli_json_and_exit_codes(model_dirs, capsys):
    assert main(["doctor", "--json", "--target", model_dirs["target"], "--draft", model_dirs["draft"]]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "warn"
    assert main(["doctor", "--target", model_dirs["target"], "--draft", model_dirs["other-vocab"]]) == 0
    assert "another tokenizer" in capsys.readouterr().out
    assert main(["doctor", "--target", "/no/such"]) == 2

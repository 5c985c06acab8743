"""The bound beside every figure (engine.models.bandwidth): the weights a one-token pass reads, and a read bandwidth
that a busy first measurement cannot pin low."""

from __future__ import annotations

import torch


def test_bytes_per_token_count_a_tied_output_layer_once_and_an_untied_embedding_as_one_row():
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.bandwidth import bytes_per_token

    def model(tied: bool):
        config = LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, tie_word_embeddings=tied)  # fmt: skip
        return LlamaForCausalLM(config)

    tied, untied = model(True), model(False)
    every = sum(p.numel() * 4 for p in untied.parameters())
    assert bytes_per_token(untied) == every - 383 * 32 * 4  # the embedding: one row read
    assert bytes_per_token(tied) == every - 384 * 32 * 4  # the shared matrix read once, by the output layer


def test_the_read_bandwidth_keeps_the_best_measurement_and_is_recalled_without_one(tmp_path, monkeypatch):
    from engine.models import bandwidth

    monkeypatch.setenv("SPECARENA_CACHE", str(tmp_path))
    monkeypatch.setattr(bandwidth, "_KNOWN", {})
    reads = iter([12.6e9, 33.0e9, 20.0e9])
    monkeypatch.setattr(bandwidth, "measure_bandwidth", lambda device: next(reads))
    assert bandwidth.read_bandwidth("cpu") == 12.6e9  # unknown: measured (on a busy machine)
    assert bandwidth.read_bandwidth("cpu") == 12.6e9  # recalled, not measured
    assert bandwidth.read_bandwidth("cpu", measure=True) == 33.0e9  # a later load measures the quiet machine
    assert bandwidth.read_bandwidth("cpu", measure=True) == 33.0e9  # a busier one does not pull it down
    monkeypatch.setattr(bandwidth, "_KNOWN", {})  # another process: from the cache folder
    assert bandwidth.read_bandwidth(torch.device("cpu")) == 33.0e9
    limit = bandwidth.limit(538_000_000, "cpu")
    assert limit == {"read_gbs": 33.0, "token_mb": 538.0, "bound_tok_s": 61.3}
    assert bandwidth.words(limit) == "bound 61 tok/s (538 MB per token at 33.0 GB/s)"


def test_the_roofline_sets_each_kernel_beside_the_bandwidth_read_in_the_same_minutes(model_dirs, tmp_path, capsys):
    import json

    from engine.__main__ import main
    from engine.models.cpu import NAMES, measurable

    out = tmp_path / "roofline.json"
    assert main(["roofline", "--target", model_dirs["target"], "--rows", "2,3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == [1, 2, 3]  # the one-token pass, the one the bound is for, always among them
    assert set(data["kernels"]) == {NAMES[form] for form in measurable()}
    assert all(rates[n] > 0 for rates in data["kernels"].values() for n in ("1", "2", "3"))
    top = data["limit"]
    assert 0 < top["low_gbs"] <= top["now_gbs"] <= top["read_gbs"]  # the best ever seen includes this run's reads
    assert abs(top["now_bound_tok_s"] / top["bound_tok_s"] - top["now_gbs"] / top["read_gbs"]) < 0.01
    assert set(data["reads"]) == set(data["kernels"])  # each kernel beside a read of its own
    for passes in data["passes"].values():
        assert passes["cost"]["1"] == 1.0 and passes["tok_s"] > 0
        assert top["low_gbs"] <= passes["read_gbs"] <= top["now_gbs"]
        assert abs(passes["bound_tok_s"] / top["bound_tok_s"] - passes["read_gbs"] / top["read_gbs"]) < 0.01
    printed = capsys.readouterr().out.splitlines()
    assert f"read bandwidth {top['low_gbs']:.1f}-{top['now_gbs']:.1f} GB/s around these timings" in printed[0]
    assert printed[-1] == f"as loaded, linears: {data['linear_forms']}"  # which kernels the passes ran
    for name, rates in data["kernels"].items():
        read = data["reads"][name]
        assert f"({rates['1'] / read:.0%} of {read:.1f})" in next(line for line in printed if name in line)
    for name, passes in data["passes"].items():
        share = f"({passes['tok_s'] / passes['bound_tok_s']:.0%} of {passes['bound_tok_s']:.1f}"
        assert share in next(line for line in printed if name in line)
    # a draft head's passes in stock layers and in our kernel (the target's run it), each against the bound of the
    # bytes it reads: an EAGLE-3 step its layer and its LM head, a DFlash block fc, its layer and the target's LM head;
    # where the target's layers run as one call of ours, a head's do too, timed again in torch operations around our
    # products
    heads = data["heads"]
    fused = "whole layers in our kernels for every pass" in data["linear_forms"]
    variants = {"stock layers", "our kernels"} | ({"our products, torch ops"} if fused else set())
    for what in ("EAGLE-3 chain step", "DFlash block of 4"):
        assert {name.split(", ", 1)[1] for name in heads if name.startswith(what)} == variants
    for name, head in heads.items():
        assert head["bytes"] == heads[name.split(", ")[0] + ", stock layers"]["bytes"]  # the same weights either way
        assert abs(head["bound_ms"] / 1000 / (head["bytes"] / (head["read_gbs"] * 1e9)) - 1) < 0.01
        assert f"{head['ms']:>8.2f} ({head['of_bound']:.0%} of {head['bound_ms']:.2f} ms" in next(
            line for line in printed if name in line)  # fmt: skip

"""The same draft head on all three backends (issue 33): one head folder, written once in vLLM's speculators layout,
runs in the in-process engine, on vLLM (`--speculative-config {"method": "eagle3" | "dflash", "model": DIR}`) and on
llama-server (converted by llama.cpp's own converter, `--spec-type draft-eagle3 | draft-dflash`). On the bundled
model, greedy: each backend's speculative ids equal its baseline's and every other backend's, and acceptance per
draft position is printed side by side.

With dtype float32, llama.cpp runs the bundled model as an f32 GGUF that its own converter made from the very folder
the other two load (under dtype auto it runs the shipped Q4_1 file, which computes other logits, so its greedy text
parts from theirs after a few tokens). Servers start once per configuration and are reused: four vLLM and three
llama-server starts in all. A P-EAGLE head runs here and on vLLM (its eagle3 with `parallel_drafting`); llama.cpp has
no P-EAGLE, and the settings say so before anything starts. A DSpark head runs here and on llama.cpp (`draft-dspark`),
with and without its confidence stop; vLLM 0.32 runs DSpark on GPUs only, and the settings say so too.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.backends import llamacpp
from engine.backends.heads import head_gguf
from engine.backends.servers import POOL
from engine.compare import compare
from engine.decoding.metrics import position_counts
from engine.errors import UserError
from engine.settings import Settings, cache_dir

pytestmark = [pytest.mark.vllm, pytest.mark.llamacpp, pytest.mark.bundled]

GAMMA = 3
PROMPT = "hello hello hello hello hello world world world world world hello hello hello hello"
BACKENDS = ("transformers", "vllm", "llama.cpp")


def one_token_head(target, token: int, kind: str = "eagle3"):
    """A random-layer EAGLE-3 (or P-EAGLE) head whose draft vocabulary is the single token `token` (d2t maps draft id
    0 to it): it drafts that token at every position, so it is accepted exactly where the target writes it, whatever the
    arithmetic of the engine. That exercises the d2t mapping, the chain and acceptance per position on every backend
    with numbers that must agree, where a purely random head would accept nothing anywhere."""
    from engine.models.heads import random_head

    head = random_head(target, kind, draft_vocab=1)
    head.d2t = torch.tensor([token])
    head.lm_head.weight.data = target.get_output_embeddings().weight[[token]].clone()
    return head


def one_token_dspark(target, token: int):
    """A DSpark head as the trainer makes it by default (sliding layers, a causal block drafting from its first row, a
    Markov bias, a confidence head over the state and the Markov embedding) whose draft vocabulary is the single token
    `token`, for the same reason as one_token_head: its drafts are decided by the text, its confidences by its math."""
    from engine.models.heads import random_head

    head = random_head(target, "dspark", block_size=GAMMA, markov_rank=4, confidence="hidden+markov",
                       sample_from_anchor=True, windows=(2048,), causal=(True,), seed=3)  # fmt: skip
    head.config.draft_vocab_size = 1
    head.lm_head = torch.nn.Linear(head.config.hidden_size, 1, bias=False)
    head.lm_head.weight.data = target.get_output_embeddings().weight[[token]].clone()
    head.markov_head.markov_w2 = torch.nn.Linear(4, 1, bias=False)
    head.d2t = torch.tensor([token])
    return head.eval().requires_grad_(False)


def most_common_token(folder, target) -> int:
    """The token the target writes most often after PROMPT, greedy."""
    from collections import Counter

    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt").input_ids
    out = target.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :]
    return Counter(out.tolist()).most_common(1)[0][0]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from engine.models.heads import random_head, write_head
    from engine.models.loading import bundled_folder

    python = os.environ.get("SPECARENA_VLLM_PYTHON")
    if not python or not os.path.exists(os.path.expanduser(python)):
        pytest.fail("no vLLM environment: run tests/run.sh, which makes one and sets SPECARENA_VLLM_PYTHON")
    if llamacpp.binary() is None or not llamacpp.binary().is_file():
        pytest.fail("no llama-server: run tests/run.sh, which builds one (python -m engine build-llama-server)")
    folder = bundled_folder()
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = tmp_path_factory.mktemp("heads")
    eagle3 = one_token_head(target, most_common_token(folder, target))
    write_head(eagle3, out / "eagle3", "speculators-eagle3", verifier=str(folder), speculative_tokens=GAMMA)
    dflash = random_head(target, "dflash", layers=1, block_size=GAMMA + 1)
    write_head(dflash, out / "dflash", "speculators-dflash", verifier=str(folder), speculative_tokens=GAMMA)
    peagle = one_token_head(target, most_common_token(folder, target), "peagle")
    write_head(peagle, out / "peagle", "speculators-peagle", verifier=str(folder), speculative_tokens=GAMMA)
    dspark = one_token_dspark(target, most_common_token(folder, target))
    write_head(dspark, out / "dspark", "speculators-dspark", verifier=str(folder), speculative_tokens=GAMMA)
    dflash2 = random_head(target, "dflash2", block_size=GAMMA + 1, conv_kernel_size=2, conv_group_size=16,
                          selector_rank=16, selector_top_k=8)  # fmt: skip
    write_head(dflash2, out / "dflash2", "speculators-dflash2", verifier=str(folder), speculative_tokens=GAMMA)
    yield {kind: str(out / kind) for kind in ("eagle3", "dflash", "peagle", "dspark", "dflash2")}
    POOL.stop_all()


def settings(backend: str, drafter: str, heads: dict, p_min: float = 0.0) -> Settings:
    return Settings(backend=backend, target="bundled", drafter=drafter, draft=heads[drafter], gamma=GAMMA,
                    max_new_tokens=40, dtype="float32", chat=False, seed=0, p_min=p_min)  # fmt: skip


def runs(drafter: str, heads: dict, backends=BACKENDS, p_min: float = 0.0) -> dict:
    return {name: compare(settings(name, drafter, heads, p_min), PROMPT) for name in backends}


def side_by_side(found: dict) -> str:
    lines = [f"{'position':>9}" + "".join(f"{name:>16}" for name in found)]
    counts = {name: position_counts(c.speculative.steps[1:]) for name, c in found.items()}
    for i in range(GAMMA):
        cells = [counts[name][i] if i < len(counts[name]) else (0, 0) for name in found]
        lines.append(f"{i + 1:>9}" + "".join(f"{f'{k}/{r}':>16}" for r, k in cells))
    return "\n".join(lines)


def test_an_eagle3_head_gives_the_same_ids_on_all_three_backends(heads):
    found = runs("eagle3", heads)
    print("\nEAGLE-3 head, kept/reached per draft position\n" + side_by_side(found))
    ours = found["transformers"].speculative.token_ids
    assert len(ours) > 20
    for name, c in found.items():
        assert c.speculative.token_ids == c.baseline.token_ids == ours, name
        assert c.speculative.metrics.drafted_tokens > 0, name
    # the head drafts one token, so each backend keeps it exactly where the (same) text has it: the same counts per
    # position, except that vLLM does not shorten a draft that runs past max_tokens (ours and llama-server do), so
    # its last step may count once more at the positions beyond the limit
    counts = {name: position_counts(c.speculative.steps[1:]) for name, c in found.items()}
    assert sum(k for _, k in counts["transformers"]) > 0
    assert counts["llama.cpp"] == counts["transformers"], counts
    extra = [(v[0] - o[0], v[1] - o[1]) for v, o in zip(counts["vllm"], counts["transformers"])]
    assert len(counts["vllm"]) == len(counts["transformers"]), counts
    assert all(d in ((0, 0), (1, 0), (1, 1)) for d in extra), counts
    assert found["vllm"].environment["speculative_config"]["method"] == "eagle3"
    assert "draft-eagle3" in found["llama.cpp"].environment["spec_flags"]


def test_a_p_eagle_head_gives_the_same_ids_and_counts_here_and_on_vllm_and_llama_cpp_says_it_has_none(heads):
    found = runs("peagle", heads, ("transformers", "vllm"))
    print("\nP-EAGLE head, kept/reached per draft position\n" + side_by_side(found))
    ours = found["transformers"].speculative.token_ids
    for name, c in found.items():
        assert c.speculative.token_ids == c.baseline.token_ids == ours, name
    counts = {name: position_counts(c.speculative.steps[1:]) for name, c in found.items()}
    assert sum(k for _, k in counts["transformers"]) > 0 and len(counts["vllm"]) == len(counts["transformers"])
    extra = [(v[0] - o[0], v[1] - o[1]) for v, o in zip(counts["vllm"], counts["transformers"])]
    assert all(d in ((0, 0), (1, 0), (1, 1)) for d in extra), counts  # vLLM's last step past max_tokens, as above
    assert found["vllm"].environment["speculative_config"] | {"model": ""} == {
        "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": GAMMA, "model": ""}
    with pytest.raises(UserError, match="llama.cpp b11434 has no P-EAGLE drafting") as refused:
        settings("llama.cpp", "peagle", heads).validate()
    assert refused.value.field == "drafter" and "transformers or vLLM backend" in str(refused.value)


def test_llama_cpp_runs_the_weights_the_other_backends_load_when_a_dtype_is_named(heads):
    """Under dtype float32 the bundled target is llama.cpp's conversion of the folder transformers and vLLM load, made
    once and cached; under auto it is the GGUF as it ships."""
    import gguf

    from engine.models.loading import bundled_gguf

    assert llamacpp.model_gguf("bundled", "auto") == bundled_gguf()
    f32 = llamacpp.model_gguf("bundled", "float32")
    assert f32.parent == cache_dir() / "models-gguf" and f32.name.endswith("-f32.gguf")
    assert llamacpp.model_gguf("bundled", "float32", convert=False) == f32  # what serves() compares, no conversion
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(f32)).tensors if t.name.endswith(".weight")}
    assert types == {"F32"}, types
    environment = compare(settings("llama.cpp", "eagle3", heads), PROMPT).environment
    assert environment["model"] == str(f32) and environment["dtype"] == "f32, converted by llama.cpp's converter"


def test_a_dflash_head_gives_the_same_ids_on_all_three_backends(heads):
    found = runs("dflash", heads)
    print("\nDFlash head, kept/reached per draft position\n" + side_by_side(found))
    ours = found["transformers"].speculative.token_ids
    for name, c in found.items():
        assert c.speculative.token_ids == c.baseline.token_ids == ours, name
        assert c.speculative.metrics.drafted_tokens > 0, name
    assert found["vllm"].environment["speculative_config"]["method"] == "dflash"
    assert "draft-dflash" in found["llama.cpp"].environment["spec_flags"]


def test_a_head_that_llama_cpp_cannot_run_is_refused_before_any_server_starts(heads, tmp_path):
    import json
    import shutil

    s = settings("llama.cpp", "eagle3", heads)
    with pytest.raises(UserError, match="pick the DFlash head drafter"):
        head_gguf(Settings(**(s.to_dict() | {"draft": heads["dflash"]})))
    folder = tmp_path / "normed"
    shutil.copytree(heads["eagle3"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"norm_output": True}))
    with pytest.raises(UserError, match="norm_output"):
        head_gguf(Settings(**(s.to_dict() | {"draft": str(folder)})))
    with pytest.raises(UserError, match="at most 3 tokens"):
        head_gguf(Settings(**(settings("llama.cpp", "dflash", heads).to_dict() | {"gamma": 5})))
    reduced = tmp_path / "reduced"  # a DFlash head with a draft vocabulary, as the forge writes them
    shutil.copytree(heads["dflash"], reduced)
    config = json.loads((reduced / "config.json").read_text())
    (reduced / "config.json").write_text(json.dumps(config | {"draft_vocab_size": 4096}))
    with pytest.raises(UserError, match="drafts over 4,096 of its 49,152 tokens"):
        head_gguf(Settings(**(settings("llama.cpp", "dflash", heads).to_dict() | {"draft": str(reduced)})))


def test_the_llama_cpp_pair_doctor_checks_a_head_against_the_target_its_converter_reads(heads, capsys):
    """`doctor --backend llama.cpp` with a head: the target's GGUF facts and the head's checks, as on the other
    backends (it once handed the head's folder to the converter as if it were a model)."""
    from engine.__main__ import main

    assert main(["doctor", "--backend", "llama.cpp", "--dtype", "float32", "--drafter", "eagle3", "--draft",
                 heads["eagle3"]]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("Pair check: ok (f32, converted on llama.cpp)"), out
    assert "eagle3 head (speculators-eagle3 layout) reading target layers [2, 15, 27]" in out
    assert "verifier: the head was trained for" in out and "expect lower acceptance" not in out
    assert "target GGUF x 2 servers " in out and " + head " in out  # the head's weights are counted, once


@pytest.mark.parametrize("p_min", [0.0, 0.62])  # this head's confidences run 0.56-0.67: 0.62 cuts some drafts
def test_a_dspark_head_gives_the_same_ids_and_counts_here_and_on_llama_cpp_and_vllm_says_it_needs_a_gpu(heads, p_min):
    """llama-server's draft-dspark runs the head from llama.cpp's own conversion of the same folder: ids and counts per
    position equal to ours, without and with the confidence stop (--spec-draft-p-min), which cuts a draft at the first
    position whose confidence is below it on both engines."""
    import gguf

    found = runs("dspark", heads, ("transformers", "llama.cpp"), p_min)
    print(f"\nDSpark head, p_min {p_min}, kept/reached per draft position\n" + side_by_side(found))
    ours = found["transformers"].speculative.token_ids
    for name, c in found.items():
        assert c.speculative.token_ids == c.baseline.token_ids == ours, name
    counts = {name: position_counts(c.speculative.steps[1:]) for name, c in found.items()}
    assert sum(k for _, k in counts["transformers"]) > 0
    assert counts["llama.cpp"] == counts["transformers"], counts
    stops = sum("confidence stop" in step.draft_note for step in found["transformers"].speculative.steps)
    assert (stops > 0) == (p_min > 0), stops
    flags = found["llama.cpp"].environment["spec_flags"]
    assert "draft-dspark" in flags and flags[flags.index("--spec-draft-p-min") + 1] == f"{p_min:g}"
    fields = gguf.GGUFReader(str(head_gguf(settings("llama.cpp", "dspark", heads)))).fields
    assert bool(fields["dflash.attention.causal"].contents()) and bool(fields["dflash.sample_from_anchor"].contents())
    with pytest.raises(UserError, match="vLLM 0.32 runs DSpark heads on GPUs only") as refused:
        settings("vllm", "dspark", heads).validate()
    assert "transformers or llama.cpp backend" in str(refused.value)


def test_a_dflash2_head_runs_here_and_on_llama_cpp_from_its_flat_config_and_vllm_says_it_needs_a_gpu(heads):
    """llama.cpp's converter reads DFlash2 only in z-lab's flat layout, which the backend writes from the speculators
    one (convolutions and selector in dflash_config): llama-server's draft-dflash then runs it as DFlash2. A random
    head accepts almost nothing, so this checks that both engines run it losslessly and what the GGUF says; the math
    is checked against the reference (tests/test_heads_reference.py)."""
    import gguf

    found = runs("dflash2", heads, ("transformers", "llama.cpp"))
    print("\nDFlash2 head (random), kept/reached per draft position\n" + side_by_side(found))
    ours = found["transformers"].speculative.token_ids
    for name, c in found.items():
        assert c.speculative.token_ids == c.baseline.token_ids == ours, name
        assert c.speculative.metrics.drafted_tokens > 0, name
    assert "draft-dflash" in found["llama.cpp"].environment["spec_flags"]
    fields = gguf.GGUFReader(str(head_gguf(settings("llama.cpp", "dflash2", heads)))).fields
    assert int(fields["dflash.conv_kernel_size"].contents()) == 2
    assert int(fields["dflash.selector_top_k"].contents()) == 8
    assert not bool(fields["dflash.attention.causal"].contents())
    with pytest.raises(UserError, match="vLLM 0.32 runs DFlash2 heads on GPUs only"):
        settings("vllm", "dflash2", heads).validate()

"""The forge (engine.forge) on a tiny random Llama: the training forward is the inference forward, the vocabulary
mapping, and a 20-second forge that loads, runs lossless, never trains on held-out prompts, and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.decoding.heads import HeadCache
from engine.forge import data as D
from engine.forge import train as T
from tests.conftest import byte_tokenizer, tiny_llama


def _head(target, draft: int = 192):
    head = T.start_head(target, torch.arange(0, 2 * draft, 2), "target", seed=0)
    with torch.no_grad():  # away from the starting point, so the check is not about an identity
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    return head.eval()


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_training_forward_is_the_inference_forward(norm_before_residual):
    """Step 0 of ttt_forward = Head.eagle3 over the real rows; step k = the head fed its own state k times, as the
    drafter does (engine.decoding.heads.Eagle3.propose)."""
    target = tiny_llama(layers=6)
    head = _head(target)
    head.config.norm_before_residual = norm_before_residual
    n, steps = 14, 4
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 384, (n,), generator=gen)
    features = torch.randn(n - 1, head.config.feature_size, generator=gen)
    shifted = torch.zeros(1, n - 1 + steps, dtype=torch.long)
    shifted[0, : n - 1] = tokens[1:]
    c = head.config
    with torch.no_grad():
        trained = T.ttt_forward(head, shifted, features[None], steps)
        for t in range(n - 1 - steps):
            cache = HeadCache(1, c.num_kv_heads, c.head_dim, torch.float32, "cpu", 64)
            state, logits = head.eagle3(tokens[1 : t + 2], head.fuse(features[: t + 1]), cache)
            torch.testing.assert_close(logits[-1], trained[0][0, t], atol=1e-4, rtol=1e-4)
            for k in range(1, steps):
                state, logits = head.eagle3(tokens[t + k + 1 : t + k + 2], state[-1:], cache)
                torch.testing.assert_close(logits[-1], trained[k][0, t], atol=1e-4, rtol=1e-4)


def test_a_batch_of_sequences_gives_each_its_own_logits():
    """Padding a shorter sequence into a batch changes none of its rows (causal attention, padding at the end)."""
    target = tiny_llama(layers=6)
    head = _head(target)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 384, (2, 12), generator=gen)
    features = torch.randn(2, 10, head.config.feature_size, generator=gen)
    with torch.no_grad():
        both = T.ttt_forward(head, tokens, features, 2)
        alone = T.ttt_forward(head, tokens[1:, :8], features[1:, :6], 2)
    torch.testing.assert_close(both[0][1, :6], alone[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[1][1, :5], alone[1][0, :5], atol=1e-5, rtol=1e-5)


def test_the_draft_vocabulary_covers_the_labels_and_maps_both_ways():
    counts = torch.zeros(4000, dtype=torch.int64)
    counts[:3000] = torch.arange(3000, 0, -1) ** 2  # a steep, Zipf-like use of the first 3000 ids
    ids = T.draft_vocabulary(counts, coverage=0.95, least=0)
    assert T.covered(counts, ids) >= 0.95
    assert ids.numel() % 32 == 0 and ids.numel() < 3000
    assert torch.equal(ids, ids.sort().values)
    t2d = T.to_draft_ids(4000, ids)
    assert torch.equal(ids[t2d[ids]], ids)  # draft -> target -> draft
    assert int((t2d >= 0).sum()) == ids.numel()


def _target(model_dirs) -> Path:
    root = Path(model_dirs["target"]).parent  # SPECARENA_MODELS_DIR: the app may read local models from here
    folder = root / "forge-target"
    if not folder.is_dir():
        tiny_llama(layers=6).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
    return folder


def _prompts(folder: Path) -> Path:
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say something about thing {i} please."}) + "\n"
                               for i in range(40)))  # fmt: skip
    return prompts


@pytest.fixture(scope="module")
def forged(model_dirs, tmp_path_factory):
    """A 20-second forge of a 6-layer tiny Llama on 40 prompts, its events and summary."""
    from engine.forge import ForgeConfig, forge

    folder, prompts = _target(model_dirs), _prompts(tmp_path_factory.mktemp("forge"))
    out = tmp_path_factory.mktemp("forge") / "head"
    cfg = ForgeConfig(target=str(folder), out=str(out), suite=str(prompts), minutes=20 / 60, batch_size=16, steps=2,
                      max_new_tokens=16, threads="1", fast="off", pays=True, pays_max_new_tokens=16)  # fmt: skip
    events = []
    summary = forge(cfg, events.append)
    return cfg, events, summary


def test_a_forged_head_loads_and_runs_lossless(forged):
    from engine.models.heads import load_head
    from engine.models.loading import MODELS

    cfg, events, summary = forged
    assert {e.phase for e in events} >= {"load", "data", "vocab", "train", "export", "pays", "done"}
    target = MODELS.get(cfg.target, "float32", "cpu")
    head = load_head(cfg.out, target.model)
    ids = torch.load(Path(cfg.out) / "checkpoint" / "vocab.pt")
    assert torch.equal(head.d2t, ids)  # the draft vocabulary, as written and read back
    config = json.loads((Path(cfg.out) / "config.json").read_text())
    assert config["norm_before_residual"] is True and config["norm_before_fc"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    rows = [r for r in summary["pays"]["rows"] if r["drafter"] == "eagle3"]
    assert rows and all(r["identical"] is True for r in rows)  # greedy ids == the baseline's
    from engine.measure import promptsets  # measured by a process of its own, on prompts it wrote down

    written = promptsets.read_file(Path(cfg.out) / "held-out.jsonl")
    assert [i.id for i in written.items] == summary["prompts"]["held_out_ids"]
    measured = summary["plan"]["prompts"]  # the first ones: as many as the plan left the measurement time for
    assert measured >= 1 and summary["pays"]["prompts"] == summary["prompts"]["held_out_ids"][:measured]
    card = (Path(cfg.out) / "README.md").read_text()
    assert "Validation acceptance" in card and summary["machine"] in card
    # one draft length proposed everywhere: the fastest chain's in the config and the card's engine lines (vLLM and
    # llama.cpp verify chains), the fastest row's, tree or chain, for SpecArena's own engine and the Lab's button
    from app.forge_panel import head_of
    from engine.forge.export import reached

    assert {r["topk"] for r in rows} == {1, 3}
    # never a gamma past a position the validation answers never accepted (timing noise can make it read fastest)
    proposable = [r for r in rows if r["gamma"] <= reached(summary["training"]["val_acceptance"])]
    fastest = max(proposable, key=lambda r: r["speedup"])
    chain = max((r for r in proposable if r["topk"] == 1), key=lambda r: r["speedup"])["gamma"]
    assert summary["pays"]["recommended"] == fastest and summary["pays"]["chain"]["gamma"] == chain
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == chain
    assert f"- proposed gamma {chain}:" in card and f'"num_speculative_tokens":{chain}' in card
    tree = f" --topk {fastest['topk']}" if fastest["topk"] > 1 else ""
    assert f"--gamma {fastest['gamma']}{tree} --prompt" in card and "| eagle3, tree top-3 | 1 |" in card
    assert head_of(summary, cfg.out) | {"folder": ""} == {"target": cfg.target, "kind": "eagle3", "folder": "",
                                                          "config_gamma": chain, "gamma": fastest["gamma"],
                                                          "topk": fastest["topk"]}  # fmt: skip


def test_held_out_prompts_are_never_generated_on(forged):
    from engine.forge.bank import kind_shares
    from engine.forge.data import FOLLOW_UPS, Dataset

    cfg, _, summary = forged
    held = set(summary["prompts"]["held_out_ids"])
    assert held and summary["prompts"]["held_out"] == len(held)
    data = Dataset.read(Path(cfg.out) / "data")
    root = lambda s: s.prompt_id.split("+")[0]  # noqa: E731 (a follow-up's id is its conversation's + its round)
    seen_train = {root(s) for s in data.train}
    seen_val = {root(s) for s in data.val}
    assert not (held & (seen_train | seen_val))
    assert not (seen_train & seen_val)  # validation conversations are not trained on either
    general = {s.prompt_id for s in data.train if s.source == "general"}
    assert general and any(s.source == "general" for s in data.val) and not (general & held)
    follow = [s for s in data.train if s.source == "follow-up"]
    assert follow and summary["data"]["sources"]["follow-up"] > 0
    tokenizer = byte_tokenizer()
    for s in follow[:5]:  # each asked after the target's own first answer, in the same conversation
        first = next(x for x in data.train if x.prompt_id == root(s) and x.source == "greedy")
        asked = tokenizer.decode(s.tokens[: s.prompt_len], skip_special_tokens=True)
        question = tokenizer.decode(first.tokens[: first.prompt_len], skip_special_tokens=True).split("\n\n")[0]
        assert asked.startswith(f"User: {question}") and any(f"User: {q}" in asked for q in FOLLOW_UPS), asked
    assert summary["data"]["general_kinds"] == pytest.approx(kind_shares())  # prompts without categories: the even mix
    vocab = summary["vocabulary"]
    assert vocab["train_coverage"] >= 0.97 and vocab["size"] < vocab["target_vocabulary"]


def test_a_forge_resumes_from_its_folder(forged):
    from engine.forge import forge

    cfg, _, first = forged
    again = forge(type(cfg)(**{**cfg.__dict__, "minutes": 10 / 60, "pays": False}))
    assert again["training"]["resumed"] is True
    assert again["training"]["steps"] > first["training"]["steps"]
    assert again["data"]["train_answer_tokens"] == first["data"]["train_answer_tokens"]  # read back, not remade


def test_a_forge_killed_while_making_data_goes_on_where_it_was(model_dirs, tmp_path):
    """A run killed between two data batches (no state written) resumes by replaying its plan over the shards on
    disk: nothing is generated twice, what was written stays as it was, and the plan goes on to new batches."""
    from engine.forge.data import Dataset
    from engine.forge.pipeline import Forge, ForgeConfig
    from engine.forge.prompts import prompt_sets

    cfg = ForgeConfig(target=str(_target(model_dirs)), out=str(tmp_path / "head"), suite=str(_prompts(tmp_path)),
                      minutes=20 / 60, batch_size=16, steps=2, max_new_tokens=16, threads="1", fast="off")  # fmt: skip
    threads = torch.get_num_threads()

    def make_data(batches: int | None) -> list:
        forge = Forge(cfg)
        forge.train_set, forge.val_set, forge.held_set = prompt_sets(cfg)
        try:
            list(forge.load())
            events = forge.make_data()
            seen = []
            for event in events:
                seen.append(event)
                if batches is not None and len(seen) == batches:
                    events.close()  # as a kill: the state never says the data is done
            return seen
        finally:
            torch.set_num_threads(threads)

    make_data(3)
    data = Path(cfg.out) / "data"
    written = {p.name: p.read_bytes() for p in data.glob("shard-*")}
    assert len(written) == 3 and not (Path(cfg.out) / "forge-state.json").exists()
    events = make_data(None)
    assert any("back from" in e.message for e in events)
    assert all(data.joinpath(name).read_bytes() == raw for name, raw in written.items())
    assert len(list(data.glob("shard-*"))) > len(written) + 1
    keys = [(split, s.prompt_id, s.source) for split in ("train", "val") for s in getattr(Dataset.read(data), split)]
    assert len(keys) == len(set(keys))  # no prompt answered twice the same way
    greedy = {k[1] for k in keys if k[0] == "train" and k[2] == "greedy"}
    train, _, _ = prompt_sets(cfg)
    assert greedy == {i.id for i in train.items}  # and every training prompt once


def test_the_trained_draft_length_defaults_to_the_machines(model_dirs, tmp_path):
    """--gamma-max 0 (the default): 2 train-time-test steps on a CPU (its budget buys more updates than positions its
    verify costs never use), 4 on a GPU; out of range refused before anything loads."""
    from engine.errors import UserError
    from engine.forge.pipeline import Forge, ForgeConfig
    from engine.forge.prompts import prompt_sets

    cfg = ForgeConfig(target=str(_target(model_dirs)), out=str(tmp_path / "head"), suite=str(_prompts(tmp_path)),
                      threads="1", fast="off")  # fmt: skip
    assert cfg.steps == 0
    threads = torch.get_num_threads()
    forge = Forge(cfg)
    forge.train_set, forge.val_set, forge.held_set = prompt_sets(cfg)  # as run() sets them, before loading
    try:
        said = [e.message for e in forge.load()]
    finally:
        torch.set_num_threads(threads)
    assert forge.cfg.steps == 2 and "train-time test over 2 steps" in said[-2] and said[-1].startswith("plan after")
    for wrong in (-1, 9):
        with pytest.raises(UserError, match="gamma max"):
            next(Forge(ForgeConfig(**{**cfg.__dict__, "steps": wrong})).run())


def test_replay_generates_only_the_rows_a_batch_lacks():
    from engine.forge.data import Batch, Dataset, Replay, Sequence

    def seq(prompt_id, source):
        return Sequence([1, 2, 3], 1, torch.zeros(2, 4), torch.zeros(2, 16, dtype=torch.int32),
                        torch.zeros(2, 16, dtype=torch.float16), source, prompt_id)  # fmt: skip

    on_disk = Dataset(train=[seq("a", "greedy"), seq("c", "variation")], val=[seq("b", "greedy")])
    replay = Replay(on_disk)
    batch = Batch([[1], [2], [3], [4]], ["a", "b", "c", "c"], [0.0, 0.0, 0.0, 0.8], 8,
                  ["greedy", "greedy", "variation", "variation"])  # fmt: skip
    found, missing = replay.take("train", batch)
    assert [s and s.prompt_id for s in found] == ["a", None, "c", None]  # b is validation data, not training
    assert missing.ids == ["b", "c"] and missing.temperatures == [0.0, 0.8] and missing.prompts == [[2], [4]]
    assert replay.take("val", Batch([[2]], ["b"], 0.0, 8, "greedy")) == ([on_disk.val[0]], None)
    assert replay.taken == 2 + 2 + 2


def test_batched_generation_gives_each_prompt_what_it_gets_alone():
    """Left padding, and rows leaving the batch as they finish, change no row's tokens, features or labels."""
    from engine.forge.data import Batch, generate

    target = tiny_llama(layers=6)
    prompts = [[5, 9, 33, 70], [12, 40, 41, 42, 43, 44, 45, 46, 47], [100, 3]]
    gen = torch.Generator()
    alone = [generate(target, Batch([p], [str(i)], 0.0, 10, "greedy"), (2, 3, 3), set(), gen)[0]
             for i, p in enumerate(prompts)]  # fmt: skip
    eos = {alone[0].tokens[len(prompts[0]) + 2]}  # the first prompt's third answer token ends it early
    together = generate(target, Batch(prompts, ["0", "1", "2"], 0.0, 10, "greedy"), (2, 3, 3), eos, gen, compact=0.0)
    for one, both in zip(alone, together):
        cut = next((k + 1 for k, t in enumerate(one.tokens[one.prompt_len :]) if t in eos), None)
        n = one.prompt_len + cut if cut else len(one.tokens)
        assert both.tokens == one.tokens[:n]
        torch.testing.assert_close(both.features.float(), one.features[: n - 1].float(), atol=2e-3, rtol=1e-3)
        assert torch.equal(both.top_ids[:, 0], one.top_ids[: n - 1, 0])
    assert len(together[0].tokens) == len(prompts[0]) + 3


def test_only_answers_are_labelled():
    """A head drafts answers: the loss, the validation figures and the draft vocabulary count the answer's positions
    only (a prompt's rows, the chat template's boilerplate among them, made one head's validation read 2.09 tokens
    per verify pass where the engine measured 1.26). Row j's label is the target's distribution at position j + 1."""
    from engine.forge.data import Batch, generate

    target = tiny_llama(layers=6)
    prompt = [5, 9, 33, 70, 71, 72]
    seq = generate(target, Batch([prompt], ["p"], 0.0, 8, "greedy"), (2, 3, 3), set(), torch.Generator())[0]
    p, n = seq.prompt_len, len(seq.tokens)
    vocab = target.config.vocab_size
    batch = T.collate([seq], 2, T.to_draft_ids(vocab, None), torch.float32)
    labelled = (batch["label_ids"][0, :, 0] >= 0).nonzero()[:, 0].tolist()
    assert labelled == list(range(p - 2, n - 2))
    assert torch.equal(batch["label_ids"][0, p - 2 : n - 2, 0], seq.top_ids[p - 1 : n - 1, 0].long())
    assert batch["label_ids"][0, p - 2, 0] == seq.tokens[p]  # greedy: the first label is the first answer token
    assert int(T.label_counts([seq], vocab).sum()) == n - p
    mass = float(seq.top_p[p - 1 :].double().sum())
    assert float(T.label_counts([seq], vocab, soft=True).sum()) == pytest.approx(mass)


def test_greedy_and_sampled_rows_share_a_batch():
    """A batch's rows each keep their own temperature: the greedy row gives what it gives alone, the sampled one
    draws (and says so in its source)."""
    from engine.forge.data import Batch, generate

    target = tiny_llama(layers=6)
    prompt = [5, 9, 33, 70]
    alone = generate(target, Batch([prompt], ["p"], 0.0, 12, "greedy"), (2, 3, 3), set(), torch.Generator())[0]
    mixed = generate(target, Batch([prompt, prompt], ["p", "p"], [0.0, 5.0], 12, ["greedy", "sampled"]), (2, 3, 3),
                     set(), torch.Generator().manual_seed(1))  # fmt: skip
    assert mixed[0].tokens == alone.tokens and mixed[0].source == "greedy"
    assert mixed[1].tokens != alone.tokens and mixed[1].source == "sampled"  # at temperature 5 a random model wanders


def _suite_prompts() -> list[str]:
    from engine import presets

    tasks = [p for c in presets.tasks()["categories"].values() for p in c["prompts"]]
    bench = (presets.PRESETS / "specbench_mini.jsonl").read_text().splitlines()
    return tasks + [t for line in bench for t in json.loads(line)["turns"]]


def _grams(text: str, n: int = 6) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_general_prompts_are_varied_new_and_never_the_suites():
    """The forge's general prompts never repeat one, never ask what it was told to avoid, share no six words in a row
    with the task suite (whose held-out share measures the head), come in every kind, and put the target's own
    answers to work (a rewrite, a summary, typos to fix) once it has some."""
    from engine.forge.bank import Bank, bank

    suite = set().union(*(_grams(p) for p in _suite_prompts()))
    strings = [s for v in bank().values() if isinstance(v, list) for s in v] + [bank()["about"]]
    assert not [s for s in strings if _grams(s) & suite]
    avoid = "Give three interesting facts about rivers."
    taken = Bank(seed=0, avoid=[avoid.upper()]).take(400)
    texts = [p for _, p in taken]
    assert len(set(texts)) == len({i for i, _ in taken}) == 400 and avoid not in texts
    assert not [t for t in texts if _grams(t) & suite]
    # nor under other seeds, where a bank sentence after "Translate into Italian:" once began as a suite prompt does
    assert not [t for seed in range(1, 20) for _, t in Bank(seed=seed).take(400) if _grams(t) & suite]
    assert any("Python function" in t for t in texts) and any(t.startswith("Translate into") for t in texts)
    assert any("step by step" in t for t in texts) and any("lives in" in t for t in texts)
    assert Bank(seed=3).take(20) == Bank(seed=3).take(20) != Bank(seed=4).take(20)
    answer = ("Owls hunt at night. Their large eyes gather what little light there is, and their soft feathers "
              "let them fly without a sound. Most owls eat mice, insects and small birds, which they usually swallow "
              "whole.")
    general = Bank(seed=0)
    general.use([answer, "too short to work on"])
    on_answers = [p for _, p in general.take(90) if "mice," in p]  # a word no typo touches
    assert len(on_answers) >= 5 and any(answer in p for p in on_answers)
    assert any(answer not in p for p in on_answers)  # the one with typos to fix


def test_general_prompts_follow_the_workloads_categories_and_a_spent_kind_gives_way():
    """The bank's kinds take turns in the shares the given prompts' categories ask for (open questions and creative
    writing: subjects; a category it cannot read: the even mix), a quarter of the turns kept even; a kind with no new
    prompt left (the code tasks asked out) gives its turns to the others, and the stream goes on."""
    from collections import Counter

    from engine.forge.bank import EVEN_SHARE, KINDS, Bank, bank, kind_shares

    even = {k: KINDS.count(k) / len(KINDS) for k in set(KINDS)}
    assert kind_shares() == kind_shares(["repeated_work", "prompts"]) == even
    open_ended = kind_shares(["open_qa"] * 5 + ["creative_writing"] * 5)
    assert open_ended["topic"] == pytest.approx(EVEN_SHARE * even["topic"] + 1 - EVEN_SHARE, abs=1e-4)
    mixed = kind_shares(["code", "math_reasoning", "translation", "data_formatting"])
    assert {k: mixed[k] for k in ("code", "problem", "translate", "record")} == pytest.approx(
        {k: EVEN_SHARE * even[k] + (1 - EVEN_SHARE) / 4 for k in ("code", "problem", "translate", "record")}, abs=1e-4)
    assert sum(open_ended.values()) == pytest.approx(1) and sum(mixed.values()) == pytest.approx(1)
    general = Bank(seed=0, categories=["open_qa", "creative_writing"])
    turns = Counter(general._turn() for _ in range(360))
    assert turns == {k: round(360 * v) for k, v in open_ended.items()}  # exact shares, not a lottery
    code_only = Bank(seed=0, categories=["code"])
    asks = {a.format(task=t) for a in bank()["code_asks"] for t in bank()["code_tasks"]}
    taken = [p for _, p in code_only.take(1000)]
    assert len(set(taken)) == 1000  # all new
    assert len(asks & set(taken)) >= 0.95 * len(asks) and not asks & set(taken[-200:])  # code asked out, then others
    assert code_only.shares["code"] == 0 and code_only.shares["topic"] > 0


def test_word_problems_never_take_away_more_than_there_is():
    import re

    from engine.forge.bank import Bank

    general = Bank(seed=0)
    problems = [general._one("problem") for _ in range(3000)]
    shelves = [tuple(map(int, m.groups())) for t in problems
               if (m := re.search(r"has (\d+) shelves with (\d+) books on each. (\d+) books are taken", t))]
    stickers = [tuple(map(int, m.groups())) for t in problems
                if (m := re.search(r"has (\d+) stickers, gives (\d+)", t))]
    assert len(shelves) > 50 and len(stickers) > 50
    assert all(0 < taken < n * each for n, each, taken in shelves)
    assert all(0 < given < had for had, given in stickers)


def test_a_held_out_share_of_one_measures_every_prompt_and_trains_on_general_ones():
    from engine.errors import UserError
    from engine.forge import ForgeConfig
    from engine.forge.prompts import prompt_sets

    train, val, held = prompt_sets(ForgeConfig(target="t", out="o", held_out=1.0))
    assert not train.items and not val.items and len(held.items) == 45  # the task suite
    with pytest.raises(UserError, match="general prompts"):
        prompt_sets(ForgeConfig(target="t", out="o", held_out=1.0, general=False))
    with pytest.raises(UserError, match="out of range"):  # above 1 is no share at all
        prompt_sets(ForgeConfig(target="t", out="o", held_out=1.5))


def test_the_forge_runs_on_the_engine_thread_and_a_first_ctrl_c_stops_it(monkeypatch):
    """All of its torch work on the engine thread, where the final measurement's bench runs (two OpenMP teams on two
    cores slowed the bench's passes 2x); a Ctrl-C (SIGINT, sent while the forge works) sets its stop flag, and the
    forge ends as Stop ends it, with its summary."""
    import os
    import signal
    import threading

    from engine.forge import foreground, pipeline
    from engine.worker import ENGINE

    seen = {}

    def fake_events(cfg, stop, notify=None):
        seen["on_engine"] = ENGINE.on_it()
        yield pipeline.ForgeEvent("train", "working")
        if seen["on_engine"]:  # (on the main thread the signal would end the test session)
            os.kill(os.getpid(), signal.SIGINT)  # the main thread waits for the next event meanwhile
        seen["stopped"] = stop.wait(20 if seen["on_engine"] else 0)
        yield pipeline.ForgeEvent("done", "stopped", 1.0, metrics={"result": {"stopped": seen["stopped"]}})

    monkeypatch.setattr(foreground, "forge_events", fake_events)
    events = []
    assert threading.current_thread() is threading.main_thread()
    # as a terminal's Ctrl-C finds it: a test session started as a background job inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = foreground.forge(pipeline.ForgeConfig(target="t", out="o"), events.append)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == {"on_engine": True, "stopped": True} and summary == {"stopped": True}
    assert [e.phase for e in events] == ["train", "stop", "done"]


def test_a_ctrl_c_while_a_progress_line_prints_stops_the_forge_too(monkeypatch):
    """The main thread prints each event: a Ctrl-C landing there (not in its wait for the engine) is a Stop as well,
    and a second one leaves. (Python's own handler raised there, and the command left without its head, rc 130.)"""
    import os
    import signal

    from engine.forge import foreground, pipeline

    def fake_events(cfg, stop, notify=None):
        yield pipeline.ForgeEvent("train", "working")
        stopped = stop.wait(20)
        yield pipeline.ForgeEvent("done", "stopped", 1.0, metrics={"result": {"stopped": stopped}})

    def progress(event):
        events.append(event.phase)
        if event.phase == "train":
            os.kill(os.getpid(), signal.SIGINT)  # handled on this, the main thread, before the next line

    monkeypatch.setattr(foreground, "forge_events", fake_events)
    events = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = foreground.forge(pipeline.ForgeConfig(target="t", out="o"), progress)
        assert summary == {"stopped": True} and events == ["train", "stop", "done"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back

        def twice(event):
            if event.phase == "train":
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)

        with pytest.raises(KeyboardInterrupt):
            foreground.forge(pipeline.ForgeConfig(target="t", out="o"), twice)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sampled_rows_draw_from_the_targets_distribution_at_their_temperature():
    """The data's sampled answers follow softmax(logits / T) row by row; greedy rows take the argmax."""
    from engine.forge.data import _pick

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=gen) * 2
    temperatures = torch.tensor([0.0, 0.7, 1.3])
    n = 20000
    many = logits.repeat(n, 1)
    picks = _pick(many, many.topk(4, -1).indices, temperatures.repeat(n), gen).view(n, 3)
    assert bool((picks[:, 0] == logits[0].argmax()).all())
    for row in (1, 2):
        seen = torch.bincount(picks[:, row], minlength=12).double() / n
        expected = torch.softmax(logits[row] / temperatures[row], -1).double()
        assert float((seen - expected).abs().max()) < 0.015  # ~4 standard deviations at n = 20,000
        assert not bool(seen[expected < 1e-9].any())


def test_the_pays_table_gives_the_mean_accepted_length_and_proposes_the_gamma_measured_fastest():
    """Medians of a few answers coincide across gammas (63/46 at gamma 2, 3 and 4 once); the mean tells them apart.
    The gamma proposed is the one measured fastest, not the one the validation answers predicted (a forge once said
    "at the recommended gamma 2 the head gives 0.97x" and wrote gamma 1, measured 1.03x, into its config)."""
    from engine.forge.export import proposed_gamma
    from engine.forge.pays import summarise

    def sweep(drafter, lengths_by_gamma, speedups=None):
        cells, samples = [], []
        for i, (gamma, lengths) in enumerate(lengths_by_gamma.items()):
            one = {"median": (speedups or {}).get(gamma, 1.0)}
            cells.append({"drafter": drafter, "gamma": gamma, "speedup": one, "acceptance_rate": one,
                          "mean_accepted_length": {"median": sorted(lengths)[1]}, "all_identical": True,
                          "lossless": "identical", "by_category": {}})  # fmt: skip
            samples += [{"cell": i, "mean_accepted_length": v} for v in lengths]
        return {"cells": cells, "samples": samples, "fits": [], "prompt_set": {"ids": ["a", "b", "c"]}}

    head = sweep("eagle3", {1: [1.0, 1.5, 2.0], 2: [1.0, 1.5, 2.6]}, {1: 1.03, 2: 0.97})
    table = summarise(head, sweep("suffix", {4: [1.2, 1.4, 1.9]}), predicted_gamma=2)
    got = {(r["drafter"], r["gamma"]): r["mean_accepted_length"] for r in table["rows"]}
    assert got[("eagle3", 1)] == pytest.approx(1.5) and got[("eagle3", 2)] == pytest.approx(1.7)
    assert got[("suffix", 4)] == pytest.approx(1.5)
    assert table["recommended"]["gamma"] == 1 and table["predicted_gamma"] == 2
    assert table["verdict"].startswith("the head gives 1.03x at gamma 1")
    assert "predicted gamma 2 best, measured 0.97x" in table["verdict"]
    summary = {"held_out": {"recommended": {"gamma": 2}}}
    assert proposed_gamma(summary) == 2  # before the measurement: the forecast
    assert proposed_gamma(summary | {"pays": table}) == 1
    same = summarise(head, sweep("suffix", {4: [1.2, 1.4, 1.9]}), predicted_gamma=1)
    assert "predicted" not in same["verdict"].split("; ")[-1]  # nothing to add when the forecast was right
    # a tree measured fastest: SpecArena runs it, the config keeps the fastest chain's gamma
    trees = sweep("eagle3", {1: [1.0, 1.6, 2.0], 2: [1.0, 1.7, 2.2]}, {1: 1.10, 2: 1.08})
    for cell in trees["cells"]:
        cell["topk"] = 3
    both = {**head, "cells": head["cells"] + trees["cells"],
            "samples": head["samples"] + [s | {"cell": s["cell"] + 2} for s in trees["samples"]]}  # fmt: skip
    table = summarise(both, sweep("suffix", {4: [1.2, 1.4, 1.9]}), predicted_gamma=1)
    assert (table["recommended"]["gamma"], table["recommended"]["topk"]) == (1, 3) and table["chain"]["gamma"] == 1
    assert table["verdict"].startswith("the head gives 1.10x at gamma 1 as a tree of its top 3 candidates")
    assert "as a chain (what vLLM and llama.cpp run) 1.03x at gamma 1" in table["verdict"]
    from engine.forge.export import proposed_setting

    assert proposed_gamma({"pays": table}) == 1 and proposed_setting({"pays": table}) == {"gamma": 1, "topk": 3}


def test_ctrl_c_on_the_command_line_stops_the_forge_and_keeps_the_head(forged, tmp_path):
    """`python -m engine forge`: a first Ctrl-C (SIGINT) in training ends the run as Stop does: the head is written and
    the command exits 0. (Its data passes on a bfloat16 copy of the float32 target, --data-dtype.)"""
    import os
    import signal
    import subprocess
    import sys

    cfg = forged[0]
    out = tmp_path / "head"
    # three minutes of which the data gets 10 s: training lasts long after its first progress line, so the Ctrl-C
    # lands in it even on a loaded machine (a 30-second budget once ended its training before the signal came)
    command = [sys.executable, "-m", "engine", "forge", "--target", cfg.target, "--prompts", cfg.suite, "--minutes",
               "3", "--data-share", "0.01", "--out", str(out), "--gamma-max", "2", "--max-new-tokens", "16",
               "--batch-size", "16", "--threads", "1", "--no-pays", "--data-dtype", "bfloat16",
               "--batch-rows", "512"]  # fmt: skip
    # SIGINT as a terminal's Ctrl-C finds it, even where this session runs as a background job (SIGINT ignored,
    # which a child would inherit)
    child = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, HF_HUB_OFFLINE="1"),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    said = []
    for line in child.stderr:
        said.append(line)
        if line.split()[:1] == ["train"] and len(said) > 1 and child.poll() is None:
            child.send_signal(signal.SIGINT)
            break
    printed, errors = child.communicate(timeout=120)
    said.append(errors)
    assert child.returncode == 0, "".join(said)
    assert "stopping at the next batch" in "".join(said)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert "forged" in printed
    assert "made in bfloat16" in (out / "README.md").read_text()  # the data passes ran on a 16-bit copy
    assert json.loads((out / "forge-report.json").read_text())["config"]["batch_rows"] == 512


def test_the_greedy_loop_replayed_over_teacher_forced_hits_counts_tokens_per_verify_pass():
    """A pass from anchor t keeps the leading hits of its chain and adds the target's token; the next starts after."""
    from engine.forge.train import served_lengths

    step0 = [[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    step1 = [[1, 0, 0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    hits = [torch.tensor(step0, dtype=torch.bool), torch.tensor(step1, dtype=torch.bool)]
    # sequence 0 from row 0 to 7: gamma 1 passes at 0, 2, 3, 5, 7; gamma 2 at 0, 3, 6, 7
    # sequence 1 (every draft right) from row 1 to 5: gamma 1 at 1, 3, 5; gamma 2 at 1, 4
    assert served_lengths(hits, [(0, 7), (1, 5)], range(1, 3)) == {1: (8 + 6, 5 + 3), 2: (8 + 6, 4 + 2)}
    # a mean over rows would say 0.625 at the first position for sequence 0; the loop sees 3 of 5 passes accept
    assert served_lengths(hits[:1], [(0, 7)], range(1, 2)) == {1: (8, 5)}


def test_the_replayed_loop_keeps_at_every_verify_pass_what_the_engine_keeps(forged):
    """The forge's "tokens per verify pass as served" stands for the engine: the forged head, run by the engine
    (greedy, float32), keeps at each verify pass as many drafts as the replay over its teacher-forced hits says."""
    from engine.decoding.runtime import encode_prompt
    from engine.decoding.speculative import speculative_decode
    from engine.forge import data as D
    from engine.forge import train as T
    from engine.measure import promptsets
    from engine.models.heads import drafter_for, eagle3_layers, load_head
    from engine.models.loading import MODELS
    from tests.test_engine import GREEDY

    cfg = forged[0]
    loaded = MODELS.get(cfg.target, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    head = load_head(cfg.out, model)
    vocab = model.config.vocab_size
    t2d = T.to_draft_ids(vocab, head.d2t)
    layers, eos = eagle3_layers(model.config.num_hidden_layers), D.eos_of(model, tok)
    kept_somewhere = 0
    for item in promptsets.read_file(Path(cfg.out) / "held-out.jsonl").items[:4]:
        ids = encode_prompt(tok, item.prompt, loaded.has_chat_template)
        for gamma in (1, 2):
            drafter = drafter_for(head, vocab, gamma)
            drafter.start = gamma
            with torch.inference_mode():
                run = speculative_decode(model, tok, ids, drafter, GREEDY, 24, eos)
                steps = [s for s in run if s.kind != "stopped"]
                tokens = ids + [t for s in steps for t in s.tokens]
                out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
                features = torch.cat([out.hidden_states[i][0] for i in layers], -1)[:-1]
                top_p, top_ids = torch.softmax(out.logits[0, :-1].float(), -1).topk(D.TOP_K, -1)
                seq = D.Sequence(tokens, len(ids), features, top_ids.int(), top_p.half())
                _, stats = T.batch_loss(head, T.collate([seq], gamma, t2d, torch.float32), gamma)
            rows = [s["hit_mask"].tolist() for s in stats]
            engine = [s.accepted for s in steps[1:]]
            replayed = T.replay(rows, 0, len(ids) - 1, len(tokens) - 3, gamma)
            assert engine[:-1] == replayed[: len(engine) - 1], (item.id, gamma)  # the last pass meets the length cap
            kept_somewhere += sum(engine)
    assert kept_somewhere > 0  # a head that never hits would agree with anything


def test_a_head_forged_for_a_bfloat16_target_is_judged_lossless_and_identical_in_strict_mode(model_dirs, tmp_path):
    """Users forge for 16-bit targets. The head is stored in the target's dtype; the does-it-pay table says of each
    greedy pair what the lossless judge says (identical, or parted by 16-bit rounding with the evidence, never a bug),
    and so do its verdict and the Lab's table; with strict mode the head's ids equal the baseline's exactly."""
    from safetensors import safe_open

    from app.forge_panel import pays_rows
    from engine.compare import compare
    from engine.forge import ForgeConfig, forge
    from engine.forge.pays import LOSSLESS
    from engine.measure import promptsets
    from engine.measure.bench import worst
    from engine.settings import Settings

    folder, prompts = _target(model_dirs), _prompts(tmp_path)
    out = tmp_path / "head"
    cfg = ForgeConfig(target=str(folder), out=str(out), suite=str(prompts), minutes=20 / 60, batch_size=16, steps=2,
                      max_new_tokens=16, threads="1", fast="off", pays=True, pays_max_new_tokens=16,
                      dtype="bfloat16")  # fmt: skip
    summary = forge(cfg)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()} == {torch.bfloat16}
    rows = summary["pays"]["rows"]
    mine = [r for r in rows if r["drafter"] == "eagle3"]
    assert mine and all(r["lossless"] in ("identical", "rounding", "unjudged") for r in rows), rows
    assert summary["pays"]["verdict"].endswith(LOSSLESS.get(worst(r["lossless"] for r in mine), "."))
    assert [row[6] for row in pays_rows(summary["pays"])] == [r["lossless"] for r in rows]
    held = promptsets.read_file(out / "held-out.jsonl").items
    for item in held[:3]:
        s = Settings(target=str(folder), drafter="eagle3", draft=str(out), gamma=2, dtype="bfloat16", strict="on",
                     max_new_tokens=24, seed=0)  # fmt: skip
        c = compare(s, item.prompt)
        assert c.speculative.token_ids == c.baseline.token_ids, item.id


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc")
def test_a_shard_read_back_is_mapped_from_its_file_with_the_values_written(tmp_path):
    """The forge's data never has to fit in memory (issue: "never more memory than the machine has"): a shard read
    back holds the very values written, and its features and labels lie in the file's mapping, which the OS pages in
    and out, not in memory of the process's own (where a copy lies: the same check tells them apart)."""
    from engine.forge.data import Sequence, read_shard, write_shard

    gen = torch.Generator().manual_seed(0)

    def seq(i: int, dtype) -> Sequence:
        n = 64
        return Sequence(list(range(i, i + n + 1)), 7, torch.randn(n, 96, generator=gen).to(dtype),
                        torch.randint(0, 999, (n, 16), generator=gen, dtype=torch.int32),
                        torch.rand(n, 16, generator=gen).half(), "greedy", f"p{i}")  # fmt: skip

    for dtype in (torch.float16, torch.bfloat16):
        written = [seq(0, dtype), seq(1, dtype), seq(2, dtype)]
        path = write_shard(tmp_path / str(dtype), 0, written, "val")
        split, back = read_shard(path)
        assert split == "val" and len(back) == 3
        for a, b in zip(written, back):
            assert (a.tokens, a.prompt_len, a.source, a.prompt_id) == (b.tokens, b.prompt_len, b.source, b.prompt_id)
            for name in ("features", "top_ids", "top_p"):
                x, y = getattr(a, name), getattr(b, name)
                assert y.dtype == x.dtype and torch.equal(x, y), name
                assert _backing_file(y) == str(path), name
        assert _backing_file(back[0].features.clone()) == ""


def _backing_file(t: torch.Tensor) -> str:
    """The file mapped where a tensor's memory lies ("" for memory of the process's own: the heap, anonymous maps),
    from /proc/self/maps."""
    address = t.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5] if len(parts) > 5 and parts[5].startswith("/") else ""
    return ""


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc")
def test_the_data_a_forge_makes_is_held_as_its_shards_on_disk(model_dirs, tmp_path):
    """What the data phase makes is kept as the shards it wrote, mapped, not as the tensors it generated: every
    sequence's features and labels in the forge's data set lie in a shard file's mapping."""
    from engine.forge.pipeline import Forge, ForgeConfig
    from engine.forge.prompts import prompt_sets

    folder, prompts = _target(model_dirs), _prompts(tmp_path)
    cfg = ForgeConfig(target=str(folder), out=str(tmp_path / "head"), suite=str(prompts), minutes=6 / 60,
                      batch_size=16, steps=2, max_new_tokens=8, threads="1", fast="off", pays=False)  # fmt: skip
    run = Forge(cfg)
    run.train_set, run.val_set, run.held_set = prompt_sets(cfg)
    list(run.load())
    list(run.make_data())
    made = run.dataset.train + run.dataset.val
    assert made and run.dataset.shards > 1
    for s in made:
        for t in (s.features, s.top_ids, s.top_p):
            assert _backing_file(t).startswith(str(tmp_path / "head" / "data" / "shard-")), _backing_file(t)


def test_the_data_phase_stops_before_the_disk_fills(model_dirs, tmp_path, monkeypatch):
    """A shard that would leave less than the spare on the disk is not written: the data phase ends and says why, and
    a forge with nothing made says that, not "give it more minutes"."""
    import shutil

    from engine.forge import ForgeConfig, forge
    from engine.forge import data as D

    seqs = [D.Sequence([1, 2, 3], 1, torch.zeros(2, 4), torch.zeros(2, 16, dtype=torch.int32),
                       torch.zeros(2, 16, dtype=torch.float16))]  # fmt: skip
    free = shutil.disk_usage(tmp_path).free
    assert D.disk_full(tmp_path, seqs, spare=0) == ""
    assert D.disk_full(tmp_path, seqs, spare=free).startswith("stopped making data: the next shard")
    monkeypatch.setattr(D, "DISK_SPARE", free * 2)
    folder, prompts = _target(model_dirs), _prompts(tmp_path)
    cfg = ForgeConfig(target=str(folder), out=str(tmp_path / "head"), suite=str(prompts), minutes=10 / 60,
                      batch_size=16, steps=2, max_new_tokens=8, threads="1", fast="off", pays=False)  # fmt: skip
    events = []
    forge(cfg, events.append)
    assert any(e.phase == "data" and e.message.startswith("stopped making data") for e in events)
    assert events[-1].phase == "done" and events[-1].message.startswith("stopped making data")
    assert not list((tmp_path / "head" / "data").glob("shard-*"))
    # with room for three shards: it trains on them, and the summary and the card say why the data is short
    real, written = D.disk_full, []

    def three_shards(folder, seqs):
        written.append(folder)
        return "" if len(written) <= 3 else real(folder, seqs)

    monkeypatch.setattr(D, "disk_full", three_shards)
    cfg = ForgeConfig(**(cfg.__dict__ | {"out": str(tmp_path / "short")}))
    summary = forge(cfg)
    assert len(list((tmp_path / "short" / "data").glob("shard-*"))) == 3 and summary["training"]["steps"] > 0
    assert summary["data"]["stopped"].startswith("stopped making data: the next shard")
    assert "Stopped making data: the next shard" in (tmp_path / "short" / "README.md").read_text()
    assert json.loads((tmp_path / "short" / "forge-state.json").read_text())["data_done"] is False


def test_head_misses_counts_the_first_draft_hits_the_forge_measured_on_its_validation_answers(forged, capsys):
    """`python -m engine head-misses`: the forged head's first-draft hits by the target's confidence. On the forge's
    own validation answers they are the forge's validation acceptance at position 1 (teacher forced, the same rows);
    on its held-out prompts they are counted over the target's fresh greedy answers."""
    from engine.__main__ import main
    from engine.forge import data as D
    from engine.forge.misses import tally
    from engine.models.heads import load_head
    from engine.models.loading import MODELS

    cfg = forged[0]
    summary = json.loads((Path(cfg.out) / "forge-report.json").read_text())  # the last run's (a test resumes it)
    target = MODELS.get(cfg.target, "float32", "cpu", pack=False).model
    head = load_head(cfg.out, target).eval()
    val = D.Dataset.read(Path(cfg.out) / "data").val
    found = tally(head, val, target.config.vocab_size)
    assert found["positions"] == sum(b["positions"] for b in found["buckets"]) > 0
    from engine.forge.train import to_draft_ids

    t2d = to_draft_ids(target.config.vocab_size, head.d2t)  # outside: the target's token has no draft id
    assert found["outside_vocabulary"] == sum(
        int((t2d[s.top_ids[max(s.prompt_len - 1, 1) : len(s.tokens) - 1, 0].long()] < 0).sum()) for s in val
    )
    assert all(0 <= b["hits"] <= b["positions"] for b in found["buckets"])
    reached = found["positions"] - found["outside_vocabulary"]
    assert abs(found["hits"] - summary["training"]["val_acceptance"][0] * reached) <= 1  # one near-tie at most
    out = Path(cfg.out).parent / "misses.json"
    assert main(["head-misses", "--draft", cfg.out, "--tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["sets"]) == {"validation", "held-out"} and result["target"] == cfg.target
    held = result["sets"]["held-out"]
    assert 0 < held["positions"] <= 8 * summary["prompts"]["held_out"]  # at most 8 answer tokens a prompt
    assert held["misses"] == held["positions"] - held["hits"] and held["copy_misses"] <= held["misses"]
    assert "held-out:" in printed and "validation:" in printed


def test_the_budget_covers_the_whole_job_the_measurement_included():
    """`forge --minutes 15` forged in 887 s and then measured for 3 minutes more. The plan cuts the budget into the
    phases' seconds, the measurement's among them, and they add up to the budget; the measurement takes as many
    held-out prompts as its share allows (all where the budget is large), and a budget its floors outgrow says by
    how much."""
    from engine.forge.budget import PAYS_SHARE, measurement_s, plan_budget
    from engine.forge.pipeline import ForgeConfig

    cfg = ForgeConfig(target="t", out="o", minutes=15, steps=2, pays_max_new_tokens=64)
    turns = [1] * 16
    plan = plan_budget(cfg, load_s=30.0, pass_s=0.03, turns=turns)
    assert sum(plan.seconds().values()) == pytest.approx(15 * 60) and plan.over <= 0
    assert 1 <= plan.prompts < 16 and plan.pays <= PAYS_SHARE * 15 * 60
    assert plan.pays == pytest.approx(measurement_s(cfg, turns[: plan.prompts], 0.03, 30.0))
    assert plan.train > 0 and plan.data == pytest.approx(cfg.data_share * (plan.data + plan.train))
    assert f"the measurement takes {plan.prompts} of 16 held-out prompts" in plan.describe()
    roomy = plan_budget(type(cfg)(**{**cfg.__dict__, "minutes": 60}), 30.0, 0.03, turns)
    assert roomy.prompts == 16 and sum(roomy.seconds().values()) == pytest.approx(3600)
    off = plan_budget(type(cfg)(**{**cfg.__dict__, "pays": False}), 30.0, 0.03, turns)
    assert off.pays == 0 and off.prompts == 0 and sum(off.seconds().values()) == pytest.approx(900)
    tiny = plan_budget(type(cfg)(**{**cfg.__dict__, "minutes": 0.25}), 5.0, 0.03, turns)
    assert tiny.prompts == 1 and tiny.over > 0 and "over the budget" in tiny.describe()
    assert sum(tiny.seconds().values()) == pytest.approx(15 + tiny.over)


def test_the_forge_tells_one_story(forged):
    """The plan comes first, the measurement's progress counts up to one total ("4/4" then "1/2" was its two sweeps'
    own counts), each training step is reported once with its train loss, and "forged in" covers the measurement."""
    cfg, events, summary = forged
    said = [e.message for e in events if e.phase == "load"]
    assert said[-1].startswith("plan after loading") and "held-out prompts" in said[-1]
    counts = [e.message.split(" ")[0] for e in events if e.phase == "pays" and e.message.split(" ")[0].count("/") == 1]
    done = [int(c.split("/")[0]) for c in counts]
    assert counts and len({c.split("/")[1] for c in counts}) == 1 and done == sorted(done)
    assert done[-1] == int(counts[-1].split("/")[1])
    fractions = [e.done for e in events if e.phase == "pays"]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    steps = [r["step"] for r in summary["training"]["history"]]
    assert len(steps) == len(set(steps)) and all(r["train_loss"] is not None for r in summary["training"]["history"])
    shown = [e.metrics["step"] for e in events if e.phase == "train" and "val_acceptance" in e.metrics]
    assert shown == steps
    assert summary["timing"]["pays"] > 0 and summary["wall_s"] >= sum(summary["timing"].values()) - 1
    assert events[-1].message == f"forged {cfg.out} in {summary['wall_s']:.0f} s"


def test_the_last_training_step_is_reported_once(forged, tmp_path, monkeypatch):
    """An evaluation that falls just before the deadline is the final one: no second record of the same step (it
    came without a train loss, nothing having trained since). A clock that ticks a second at each reading puts
    the evaluation at the 10th second of 13."""
    from engine.forge import loop
    from engine.forge.data import Dataset
    from engine.models.loading import MODELS

    cfg, _, _ = forged
    target = MODELS.get(cfg.target, "float32", "cpu", pack=False).model
    ids = torch.load(Path(cfg.out) / "checkpoint" / "vocab.pt")
    data = Dataset.read(Path(cfg.out) / "data")
    data.train, data.val = data.train[:8], data.val[:4]
    ticks = iter(range(10**6))
    monkeypatch.setattr(loop, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: float(next(ticks)))}))
    trainer = loop.Trainer(target, ids, data, cfg, tmp_path / "checkpoint", torch.float32)
    records = list(trainer.run(13.0))
    steps = [r["step"] for r in records]
    assert steps == [r["step"] for r in trainer.history] and len(steps) == len(set(steps)) == 1
    assert all(r["train_loss"] is not None for r in records) and trainer.report()["best_step"] == steps[0]


def test_no_gamma_is_proposed_past_a_position_never_accepted():
    """A config once proposed gamma 2 where position 2 accepted nothing: timing noise made gamma 2 read faster. The
    validation answers' forecast and the measured table both stop at the last position ever accepted."""
    from engine.forge.export import reached, recommend
    from engine.forge.pays import summarise

    assert reached([0.5, 0.0, 0.3]) == 1 and reached([0.5, 0.4]) == 2 and reached([0.0]) == 1
    verify = [0.0, 1.0, 1.0, 1.0]  # a two-row pass costs what a one-row pass does
    assert recommend([0.5, 0.0], 0.0, verify, per_pass=[1.5, 1.6])["gamma"] == 1
    assert recommend([0.5, 0.4], 0.0, verify, per_pass=[1.5, 1.6])["gamma"] == 2

    def cell(gamma, speedup, positions):
        one = {"median": speedup}
        return {"drafter": "eagle3", "gamma": gamma, "topk": 1, "speedup": one, "acceptance_rate": one,
                "all_identical": True, "lossless": "identical", "by_category": {}, "positions": positions}

    head = {"cells": [cell(1, 1.02, [[40, 20]]), cell(2, 1.05, [[40, 20], [20, 0]])], "fits": [],
            "samples": [{"cell": i, "mean_accepted_length": 1.5} for i in (0, 1)], "prompt_set": {"ids": ["a"]}}
    others = {"cells": [], "fits": [], "samples": []}
    table = summarise(head, others, predicted_gamma=1)
    assert table["chain"]["gamma"] == table["recommended"]["gamma"] == 1
    head["cells"][1]["positions"] = [[40, 20], [20, 6]]
    assert summarise(head, others, predicted_gamma=1)["chain"]["gamma"] == 2
    assert summarise(head, others, 1, acceptance=[0.5, 0.0])["chain"]["gamma"] == 1  # the validation answers' too


def test_the_dflash_training_forward_is_the_block_pass():
    """engine.forge.blocks packs several sequences' blocks into one pass; each block's states equal what the served
    head computes for that block alone (Head.dflash over the context before its anchor), whatever its length."""
    import random

    from engine.forge import blocks

    target = tiny_llama(layers=6)
    head = blocks.start_head(target, torch.arange(0, 384, 2), steps=3, draft_layers=2).eval()
    c = head.config
    gen = torch.Generator().manual_seed(2)

    def sequence(n: int, prompt: int) -> D.Sequence:
        return D.Sequence(torch.randint(2, 384, (n,), generator=gen).tolist(), prompt,
                          torch.randn(n - 1, c.feature_size, generator=gen), torch.zeros(n - 1, 4, dtype=torch.int32),
                          torch.zeros(n - 1, 4, dtype=torch.float16))  # fmt: skip

    group = [sequence(15, 5), sequence(9, 3)]
    t2d = T.to_draft_ids(c.vocab_size, head.d2t)
    batch = blocks.collate(group, 3, t2d, torch.float32, random.Random(0))
    with torch.no_grad():
        states = blocks.block_forward(head, batch)
        lengths = set()
        for j in batch["block"].unique().tolist():
            rows = torch.nonzero(batch["block"] == j)[:, 0]
            i, a = int(batch["doc"][rows[0]]), int(batch["positions"][rows[0]])
            s = group[i]
            block = torch.tensor([s.tokens[a]] + [c.mask_token_id] * (rows.numel() - 1))
            cache = HeadCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, "cpu", 64)
            torch.testing.assert_close(states[rows], head.dflash(s.features[:a], block, cache), atol=1e-4, rtol=1e-4)
            lengths.add(rows.numel())
    assert lengths == {2, 3, 4}  # every served block length up to the longest trained
    assert len(batch["block"].unique()) == sum(len(blocks.anchors(s)) for s in group)  # every answer position


def test_a_forged_dflash_head_states_its_block_loads_and_runs_lossless(model_dirs, tmp_path):
    """`forge --kind dflash`: the speculators dflash layout with the block's causality stated as trained (every
    layer full attention, sliding_window_non_causal), read back as a non-causal head; greedy ids equal the
    baseline's, and the head's drafts are accepted on the prompts it was trained on."""
    from engine.decoding.runtime import encode_prompt
    from engine.forge import ForgeConfig, forge
    from engine.forge.prompts import prompt_sets
    from engine.models.heads import drafter_for, load_head
    from engine.models.loading import MODELS
    from tests.test_engine import run_baseline, run_spec

    cfg = ForgeConfig(target=str(_target(model_dirs)), out=str(tmp_path / "head"), suite=str(_prompts(tmp_path)),
                      kind="dflash", minutes=15 / 60, batch_size=16, steps=2, max_new_tokens=16, threads="1",
                      fast="off", pays=False)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        summary = forge(cfg)
    finally:
        torch.set_num_threads(threads)
    config = json.loads((Path(cfg.out) / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 3
    assert config["transformer_layer_config"]["layer_types"] == ["full_attention"]
    assert config["sliding_window_non_causal"] is True and config["aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert "# DFlash head for" in (Path(cfg.out) / "README.md").read_text() and summary["kind"] == "dflash"
    loaded = MODELS.get(cfg.target, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    head = load_head(cfg.out, model)
    assert head.config.kind == "dflash" and not any(head.config.block_causal(i) for i in range(head.config.num_layers))
    assert torch.equal(head.d2t, torch.load(Path(cfg.out) / "checkpoint" / "vocab.pt"))
    accepted = 0
    for item in prompt_sets(cfg)[0].items[:16]:
        ids = encode_prompt(tok, item.prompt, loaded.has_chat_template)
        expected = run_baseline(model, tok, ids, 32).token_ids
        for gamma in (1, 2):
            result = run_spec(model, tok, ids, drafter_for(head, model.config.vocab_size, gamma), gamma, 32)
            assert result.token_ids == expected, (item.id, gamma)
            accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0
    # head-misses reads a DFlash head too: on the validation answers its first-draft hits are the forge's
    # validation acceptance at position 1 (the same rows, blocks of the trained length)
    from engine.forge import data as D
    from engine.forge.misses import report, tally

    found = tally(head.eval(), D.Dataset.read(Path(cfg.out) / "data").val, model.config.vocab_size)
    reached = found["positions"] - found["outside_vocabulary"]
    assert reached > 0 and abs(found["hits"] - summary["training"]["val_acceptance"][0] * reached) <= 1
    result = report(cfg.out, tokens=4)
    assert set(result["sets"]) == {"validation", "held-out"}
    assert 0 < result["sets"]["held-out"]["positions"] <= 4 * summary["prompts"]["held_out"]


def test_a_head_beside_is_measured_on_the_same_held_out_prompts_or_refused(forged):
    """`forge --kind dflash --beside EAGLE3_DIR`: the other head's chains join the table and the verdict; a head whose
    forge held out other prompts (it may have trained on the ones measured here) is refused before anything loads."""
    from engine.errors import UserError
    from engine.forge.pays import add_beside
    from engine.forge.pipeline import ForgeConfig, beside_head

    cfg, _, summary = forged
    mine = ForgeConfig(target=cfg.target, out="o", kind="dflash", beside=cfg.out)
    beside = beside_head(mine, summary["prompts"]["held_out_ids"])
    minutes = json.loads((Path(cfg.out) / "forge-report.json").read_text())["config"]["minutes"]  # (a resume's)
    assert beside == {"folder": cfg.out, "kind": "eagle3", "gammas": [1, 2], "minutes": minutes}
    with pytest.raises(UserError, match="other held-out prompts"):
        beside_head(mine, summary["prompts"]["held_out_ids"][1:])
    one = {"median": 1.1}
    cell = {"drafter": "eagle3", "gamma": 1, "speedup": one, "acceptance_rate": one, "all_identical": True,
            "lossless": "identical", "by_category": {}}  # fmt: skip
    table = {"rows": [{"drafter": "dflash"}, {"drafter": "target alone"}], "verdict": "the head gives 1.20x."}
    add_beside(table, {"cells": [cell], "samples": [{"cell": 0, "mean_accepted_length": 1.4}]}, beside)
    assert [r["drafter"] for r in table["rows"]] == ["dflash", "eagle3", "target alone"]
    assert table["rows"][1]["beside"] == cfg.out and table["beside"]["best"]["speedup"] == 1.1
    assert table["verdict"].endswith(f"beside it the eagle3 head head, forged in {minutes:g} minutes: 1.10x at "
                                     "gamma 1, accepted length 1.40.")


def test_head_misses_refuses_a_head_kind_the_forge_does_not_make(model_dirs, tmp_path):
    """The misses are the trainer's own first-draft hits, which exist for EAGLE-3 and DFlash heads: a DSpark head is
    refused by name rather than read as an EAGLE-3 chain."""
    from transformers import AutoModelForCausalLM

    from engine.errors import UserError
    from engine.forge.misses import report
    from engine.models.heads import random_head, write_head

    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    folder = write_head(random_head(target, "dspark", markov_rank=4), tmp_path / "dspark", "speculators-dspark")
    with pytest.raises(UserError, match="head-misses reads the forge's kinds.*dspark head.*--drafter dspark"):
        report(str(folder), target=model_dirs["target"], suite="open_qa")

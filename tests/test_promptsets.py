"""Prompt sets: every layout read from small files written here, bad files said in one message, sampling and the
held-out split, Hub datasets without a network, and multi-turn questions run turn by turn after the model's own
answers (bench.sweep, the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.__main__ import main
from engine.errors import UserError
from engine.measure import bench, report
from engine.measure import promptsets as ps
from engine.settings import Settings

SPECBENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
    {"question_id": 82, "category": "writing", "turns": ["Write a limerick about a cat."]},
    {"question_id": 91, "category": "math_reasoning", "turns": ["What is 12 times 13?", "And divided by 4?"]},
    {"question_id": 101, "category": "translation", "turns": ["Translate to French: good morning."]},
]


def write(tmp_path: Path, name: str, content: str | list) -> Path:
    path = tmp_path / name
    if isinstance(content, list):  # records: one JSON a line
        content = "\n".join(json.dumps(r) for r in content) + "\n"
    path.write_text(content)
    return path


def test_specbench_turns_keep_categories_ids_and_every_turn(tmp_path):
    found = ps.read_file(write(tmp_path, "question.jsonl", SPECBENCH))
    assert found.layout == "turns" and len(found) == 4 and found.turns() == 6
    assert found.categories() == {"writing": 2, "math_reasoning": 1, "translation": 1}
    assert found.items[0].id == "81"
    assert found.items[0].turns == ("Write a haiku about rain.", "Now make it about snow.")
    assert found.fingerprint.startswith("sha256:") and "2 of them multi-turn" in found.summary()


@pytest.mark.parametrize(
    "records, layout, turns",
    [
        ([{"prompt": "p1"}, {"prompt": "p2"}], "prompt", [("p1",), ("p2",)]),
        ([{"text": "t1"}], "text", [("t1",)]),
        ([{"question": "q1", "category": "qa"}], "question", [("q1",)]),
        ([{"instruction": "i1"}], "instruction", [("i1",)]),
        ([{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "u1"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]}],
         "messages", [("u1", "u2")]),
        ([{"id": "x", "conversations": [{"from": "human", "value": "h1"}, {"from": "gpt", "value": "g1"},
                                        {"from": "human", "value": "h2"}]}], "conversations", [("h1", "h2")]),
    ],
)  # fmt: skip
def test_each_json_lines_layout(tmp_path, records, layout, turns):
    found = ps.read_file(write(tmp_path, "set.jsonl", records))
    assert found.layout == layout
    assert [i.turns for i in found.items] == turns


def test_json_documents_csv_and_text(tmp_path):
    listed = ps.read_file(write(tmp_path, "list.json", json.dumps(SPECBENCH)))
    assert listed.turns() == 6 and listed.categories()["writing"] == 2
    ours = ps.read_file(write(tmp_path, "ours.json", json.dumps({"categories": {"a": {"prompts": ["x", "y"]},
                                                                                "b": {"prompts": ["z"]}}})))
    assert ours.categories() == {"a": 2, "b": 1}
    chats = [{"conversations": [{"from": "human", "value": "h"}]}]
    sharegpt = ps.read_file(write(tmp_path, "sg.json", json.dumps(chats)))
    assert sharegpt.items[0].turns == ("h",) and sharegpt.items[0].category == "sg"
    table = ps.read_file(write(tmp_path, "t.csv", 'id,Prompt,category\n1,"first, with a comma",x\n2,second,y\n'))
    assert table.layout == "csv" and [i.prompt for i in table.items] == ["first, with a comma", "second"]
    assert table.categories() == {"x": 1, "y": 1} and table.items[0].id == "1"
    text = ps.read_file(write(tmp_path, "lines.txt", "one\n\ntwo\n"))
    assert text.layout == "txt" and [i.prompt for i in text.items] == ["one", "two"]
    assert text.categories() == {"lines": 2}


def test_records_without_a_prompt_are_skipped_and_said(tmp_path):
    found = ps.read_file(write(tmp_path, "mixed.jsonl", [{"prompt": "ok"}, {"foo": 1, "bar": 2}, {"prompt": " "}]))
    assert [i.prompt for i in found.items] == ["ok"]
    assert [(s.where, s.why) for s in found.skipped] == [("line 2", "no prompt in it (keys: bar, foo)"),
                                                         ("line 3", "an empty prompt")]  # fmt: skip
    assert "Skipped 2: line 2: no prompt in it (keys: bar, foo); line 3: an empty prompt." in found.summary()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", "\n \n", "empty.jsonl is empty"),
        ("odd.jsonl", '{"foo": 1, "bar": 2}\n{"baz": 3}\n', "unknown layout.*Keys seen: bar, foo, baz"),
        ("broken.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n', "broken.jsonl, line 2 is not JSON"),
        ("broken.json", '[{"prompt": "a"},\n{"prompt": }]', "broken.json is not valid JSON \\(line 2"),
        ("cols.csv", "a,b\n1,2\n", "no prompt column among a, b"),
        ("obj.json", '{"name": "x", "size": 3}', "unknown layout in obj.json: a JSON object with keys name, size"),
    ],
)
def test_bad_files_get_one_clear_message(tmp_path, name, content, message):
    with pytest.raises(UserError, match=message):
        ps.read_file(write(tmp_path, name, content))


def test_sampling_per_category_is_seeded_and_keeps_the_files_order(tmp_path):
    records = [{"prompt": f"{c}{i}", "category": c} for c in "ab" for i in range(6)]
    found = ps.read_file(write(tmp_path, "s.jsonl", records))
    assert [i.prompt for i in found.sample(2).items] == ["a0", "a1", "b0", "b1"]  # no seed: the first ones
    drawn = found.sample(2, seed=5)
    assert drawn.categories() == {"a": 2, "b": 2}
    assert [i.prompt for i in drawn.items] == [i.prompt for i in found.sample(2, seed=5).items]
    assert [i.prompt for i in drawn.items] == sorted(i.prompt for i in drawn.items)  # source order kept
    assert {i.prompt for i in found.sample(3, seed=1).items} != {i.prompt for i in found.sample(3, seed=2).items}
    assert found.only(["b"]).categories() == {"b": 6}
    with pytest.raises(UserError, match="has no categories \\['c'\\]: it has a, b"):
        found.only(["c"])


def test_the_held_out_split_depends_on_each_item_and_the_seed_alone(tmp_path):
    records = [{"prompt": f"question {i}", "category": "c"} for i in range(200)]
    found = ps.read_file(write(tmp_path, "h.jsonl", records))
    train, held = ps.split(found, 0.25, seed=7)
    assert not {i.id for i in train.items} & {i.id for i in held.items}
    assert len(train) + len(held) == 200 and 25 <= len(held) <= 75
    # the same items are held out from a shuffled, shortened file: a forge reading another copy agrees
    other = ps.read_file(write(tmp_path, "h2.jsonl", records[::-1][:120]))
    assert {i.id for i in ps.split(other, 0.25, seed=7)[1].items} == {i.id for i in held.items if i.prompt in
                                                                      {r["prompt"] for r in records[::-1][:120]}}
    assert {i.id for i in ps.split(found, 0.25, seed=8)[1].items} != {i.id for i in held.items}
    assert len(ps.split(found, 0.0)[1]) == 0
    assert held.selection == {"held_out": 0.25, "split_seed": 7, "part": "held-out"}
    with pytest.raises(UserError, match="held-out share 1.5 is out of range"):
        found.split(1.5)
    chosen = ps.select(found, None, 3, seed=7, held_out=0.25)
    assert {i.id for i in chosen.items} <= {i.id for i in held.items} and len(chosen) == 3


def test_the_fingerprint_follows_the_bytes(tmp_path):
    a = ps.read_file(write(tmp_path, "a.txt", "one\ntwo\n"))
    b = ps.read_file(write(tmp_path, "b.txt", "one\ntwo\n"))
    c = ps.read_file(write(tmp_path, "c.txt", "one\ntwo!\n"))
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_suite_names_categories_files_and_datasets(tmp_path):
    assert ps.load("code,open_qa").categories() == {"code": 5, "open_qa": 5}
    assert ps.load(None).name == "task suite" and len(ps.load(None).categories()) == 9
    assert ps.load(str(write(tmp_path, "q.jsonl", SPECBENCH))).turns() == 6
    with pytest.raises(UserError, match="unknown task categories \\['nope'\\]"):
        ps.load("nope")
    with pytest.raises(UserError, match="prompts file 'data/missing.jsonl' does not exist"):
        ps.load("data/missing.jsonl")


# --- Hub datasets, with no network --------------------------------------------------------------------------------


def test_an_unreachable_hub_says_so_like_a_model_does(online, monkeypatch, tmp_path):
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="Hub cannot be reached from here .*dataset 'org/prompts' is not in the "
                       "local cache: connect this machine to the network, or give the prompts as a local file"):
        ps.load("org/prompts")


def test_offline_mode_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="\\(HF_HUB_OFFLINE is set\\) and dataset 'org/prompts' is not in the local"):
        ps.read_hub("org/prompts:test")


def test_a_cached_dataset_is_read_offline_with_its_revision(monkeypatch, tmp_path):
    commit = "ab" * 20
    snapshot = tmp_path / "datasets--org--spec" / "snapshots" / commit
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "data" / "question.jsonl").write_text("\n".join(json.dumps(r) for r in SPECBENCH))
    (snapshot / "data" / "train.jsonl").write_text(json.dumps({"prompt": "a training prompt"}))
    (snapshot / "README.md").write_text("# spec")
    (tmp_path / "datasets--org--spec" / "refs").mkdir()
    (tmp_path / "datasets--org--spec" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    found = ps.load("org/spec:question")
    assert found.fingerprint == f"revision:{commit}" and found.turns() == 6
    assert found.categories()["writing"] == 2
    train = ps.load("org/spec:train")
    assert train.categories() == {"org/spec": 1}  # no category in the file: the dataset's name
    with pytest.raises(UserError, match="has 2 data files: name a split or a file after ':'"):
        ps.load("org/spec")
    with pytest.raises(UserError, match="no split or file 'validation'"):
        ps.load("org/spec:validation")


def test_a_dataset_the_hub_does_not_know_is_named(hub_without_repos):
    with pytest.raises(UserError, match="there is no dataset 'nobody/no-such-set' on the Hugging Face Hub"):
        ps.read_hub("nobody/no-such-set")


# --- running a set: multi-turn, the context, the report -------------------------------------------------------------


def test_later_turns_follow_the_models_own_answer():
    item = ps.PromptItem("1", "c", ("first?", "second?", "third?"))
    assert bench.conversation(item, 0, []) == "first?"
    assert bench.conversation(item, 2, ["A1", "A2"]) == [
        {"role": "user", "content": "first?"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "second?"}, {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "third?"},
    ]  # fmt: skip


def test_a_multi_turn_sweep_counts_each_turn_and_skips_what_outgrows_the_context(model_dirs, tmp_path):
    records = SPECBENCH + [{"question_id": 7, "category": "long", "turns": ["word " * 80]}]
    found = ps.read_file(write(tmp_path, "q.jsonl", records))
    base = Settings(target=model_dirs["target"], drafter="prompt-lookup", max_new_tokens=12, seed=0)
    data = bench.sweep(base, found, [2], [0.0], ["prompt-lookup", "suffix"], repeats=1)
    for cell in data["cells"]:
        assert cell["speedup"]["n"] == 6  # 4 questions, 2 of them with 2 turns; the long one skipped
        assert cell["by_category"]["writing"]["speedup"]["n"] == 3
        assert cell["all_identical"] is True
    samples = [s for s in data["samples"] if s["cell"] == 0]
    assert [(s["item"], s["turn"]) for s in samples] == [("81", 1), ("81", 2), ("82", 1), ("91", 1), ("91", 2),
                                                         ("101", 1)]  # fmt: skip
    assert data["prompt_set"]["fingerprint"] == found.fingerprint and data["prompt_set"]["turns"] == 6
    assert [s["where"] for s in data["prompt_set"]["skipped"]] == ["line 5"]
    assert "longer than the target's context" in data["prompt_set"]["skipped"][0]["why"]
    assert data["settings"]["prompts"][0]["turns"] == SPECBENCH[0]["turns"]
    assert data["timing"]["prompt_turns"] == 12 and data["timing"]["per_prompt_s"] > 0
    line = report.prompt_set_line(data)
    assert line.startswith(f"Prompt set: q.jsonl ({found.fingerprint}), 4 prompt(s), 6 turn(s) in 3 categories")
    assert "1 skipped" in line
    assert line in report.snippets_markdown(data)


def test_the_second_turn_is_asked_after_the_first_answer(model_dirs):
    """Turn 2 is encoded from turn 1 plus the answer the model gave in turn 1's runs."""
    base = Settings(target=model_dirs["target"], drafter="prompt-lookup", max_new_tokens=8, seed=0)
    session = bench.Session(base)
    first = session.ab(base, "abc abc", 0, 1)
    answer = session.answer
    assert answer and first[0].new_tokens == 8
    asked = bench.conversation(ps.PromptItem("1", "c", ("abc abc", "again")), 1, [answer])
    ids = session.backend.encode(asked, base)
    text = session.backend.decode(ids)
    assert "abc abc" in text and answer in text and text.rstrip().endswith("Assistant:")


def test_bench_cli_runs_a_multi_turn_file_and_names_it_in_the_report(model_dirs, tmp_path, capsys):
    path = write(tmp_path, "question.jsonl", SPECBENCH)
    out = tmp_path / "report"
    code = main(["bench", "--target", model_dirs["target"], "--suite", str(path), "--categories", "writing,translation",
                 "--per-category", "1", "--sample-seed", "0", "--drafters", "prompt-lookup,suffix", "--gamma", "2",
                 "--repeats", "1", "--max-new-tokens", "8", "--report", str(out)])  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    assert "question.jsonl (turns, sha256" in captured.err
    assert "Prompt set: question.jsonl (sha256:" in captured.out
    written = json.loads((out / "report.json").read_text())
    assert written["prompt_set"]["selection"]["per_category"] == 1
    assert set(written["prompt_set"]["categories"]) == {"writing", "translation"}
    assert written["prompt_set"]["fingerprint"] in (out / "settings.md").read_text()


def test_bench_cli_says_a_bad_file_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "bad.jsonl", '{"prompt": "a"}\nnot json\n')
    assert main(["bench", "--suite", str(path)]) == 2
    assert "error: bad.jsonl, line 2 is not JSON" in capsys.readouterr().err


# --- the Lab ---------------------------------------------------------------------------------------------------


def test_the_lab_says_what_a_file_holds_and_offers_its_categories(tmp_path):
    from app import prompt_sets

    path = write(tmp_path, "question.jsonl", SPECBENCH + [{"nothing": "here"}])
    text, categories, mark = prompt_sets.inspect(str(path), "", "", 0.5)
    assert "question.jsonl (turns, sha256" in text and "4 prompt(s), 2 of them multi-turn (6 turns in all)" in text
    assert "Skipped 1: line 5: no prompt in it (keys: nothing)" in text
    assert "Held out at share 0.5 (seed 0):" in text
    assert categories["choices"] == categories["value"] == ["writing", "math_reasoning", "translation"]
    text, categories, _ = prompt_sets.inspect(None, "", "", 0)
    assert text.startswith("task suite") and categories["value"] == prompt_sets.SUITE_DEFAULT
    assert prompt_sets.describe(str(write(tmp_path, "e.jsonl", " ")), "", "", 0).startswith("⚠ e.jsonl is empty")


def test_a_broken_file_is_said_once_under_its_field(tmp_path):
    """Uploaded, a file that cannot be read was said in the Lab's "found" line, in the forge's prompts line and,
    once a sweep was refused for it, under the field: the message now stands under the field alone (the Lab's form
    mark, which a refused sweep fills with the same message), the other lines point at it."""
    from app import forge_panel, prompt_sets

    path = str(write(tmp_path, "bad.jsonl", '{"prompt": "a"}\n{oops\n'))
    text, categories, mark = prompt_sets.inspect(path, "", "", 0)
    message = "bad.jsonl, line 2 is not JSON"
    assert message in mark and "#lab-field-prompts_file" in mark
    assert message not in text and text == "⚠ check prompts file, as marked."
    said = forge_panel.describe_prompts(["code"], path, "")
    assert message not in said and said == "Prompts: ⚠ check prompts file above."
    text, mark = prompt_sets.described(path, "", "x", 0)  # the seed's blur: the file's mark again, once
    assert message in mark and message not in text


def test_a_lab_sweep_runs_an_uploaded_multi_turn_file(model_dirs, tmp_path):
    from types import SimpleNamespace

    from app import lab
    from tests.test_app import lab_form, plain

    path = write(tmp_path, "question.jsonl", SPECBENCH)
    upload = {"path": str(path), "orig_name": "my-traffic.jsonl"}  # what preprocess=False hands over
    outputs = list(lab.run_sweep([2], "0", ["prompt-lookup"], ["writing", "math_reasoning"], 1, 1, 8, "", "0",
                                 upload, "", "3", 0, request=SimpleNamespace(session_hash="lab-file"),
                                 **lab_form(model_dirs)))  # fmt: skip
    uses, verdicts, cells, *_, status, mark = outputs[-1]
    assert plain(status) == "done: the results are below" and mark == ""
    assert "Prompt set: my-traffic.jsonl (sha256:" in verdicts and "1 per category drawn with seed 3" in verdicts
    assert "s per prompt and cell" in verdicts
    assert cells[0][8] in (3, 4)  # one writing and one maths question, each of one or two turns


def test_the_lab_marks_a_bad_file_under_its_field(model_dirs, tmp_path):
    from types import SimpleNamespace

    import gradio as gr

    from app import lab
    from tests.test_app import lab_form, plain

    path = write(tmp_path, "bad.jsonl", '{"prompt": "a"}\n{oops\n')
    outputs = []
    with pytest.raises(gr.Error) as err:
        for out in lab.run_sweep([2], "0", ["prompt-lookup"], ["code"], 1, 1, 8, "", "0", str(path), "", "", 0,
                                 request=SimpleNamespace(session_hash="lab-bad"), **lab_form(model_dirs)):  # fmt: skip
            outputs.append(out)
    assert "bad.jsonl, line 2 is not JSON" in str(err.value)
    assert plain(outputs[-1][lab.OUTPUTS]) == "not started: check prompts file, as marked"
    assert "#lab-field-prompts_file" in outputs[-1][lab.OUTPUTS + 1]

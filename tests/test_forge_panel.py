"""The Lab's Forge panel (app.forge_panel) at the handler level, on a tiny random Llama: a forge's events become the
status line, the acceptance table and chart, and at the end the does-it-pay table and "use this head"; Stop ends
it with the head written; bad fields are marked under themselves."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest

from engine.settings import HEAD_NAMES
from tests.conftest import byte_tokenizer, tiny_llama
from tests.test_app import plain


@pytest.fixture
def panel(model_dirs, tmp_path, monkeypatch):
    """The panel module with small batches and budgets allowed, heads written under a cache of this test's own;
    (module, target folder, prompts file)."""
    from app import forge_panel

    root = Path(model_dirs["target"]).parent  # SPECARENA_MODELS_DIR: the app may read local models from here
    folder = root / "forge-target"
    if not folder.is_dir():
        tiny_llama(layers=6).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Say something about thing {i} please."}) + "\n"
                               for i in range(30)))  # fmt: skip
    monkeypatch.setenv("SPECARENA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(forge_panel, "MIN_MINUTES", 0.1)
    monkeypatch.setattr(forge_panel, "OPTIONS", dict(batch_size=16, steps=2, max_new_tokens=16, threads="1",
                                                      fast="off", pays_max_new_tokens=16))  # fmt: skip
    return forge_panel, str(folder), str(prompts)


def request(name: str):
    return SimpleNamespace(session_hash=name)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_forge_streams_its_progress_and_ends_with_the_pays_table(panel, kind):
    forge_panel, target, prompts = panel
    outputs = list(forge_panel.run_forge(target, 20 / 60, "", True, [], prompts, "", "", 0, kind=kind,
                                         request=request(f"f1-{kind}")))  # fmt: skip
    statuses = [plain(out[forge_panel.OUTPUTS]) for out in outputs]
    assert statuses[0].startswith("forging into ") and outputs[0][forge_panel.OUTPUTS + 1] == ""
    for phase in ("load", "data", "train"):  # each phase in the status line, with its percent and the ETA
        assert any(re.match(rf"forging: {phase} \d+%, \d+:\d\d of the budget left · ", s) for s in statuses), phase
    assert any(s.startswith("forging: pays ") for s in statuses)  # the final measurement's progress (notify)
    table, chart, verdict, pays, use, head, status, mark = outputs[-1]
    assert plain(status) == f"done: the head is in {head['folder']}" and mark == ""
    assert table["headers"][-2:] == ["position 1", "position 2"] and table["data"]
    assert all(0 <= a <= 1 for row in table["data"] for a in row[-2:])
    assert len(chart.data) == 2  # a line per draft position
    trees = {"forged head, tree top-3"} if kind == "eagle3" else set()  # a DFlash block is one chain
    assert {row[0] for row in pays} == {"forged head", "prompt lookup", "suffix", "target alone"} | trees
    assert all(row[6] == "identical" for row in pays if row[0].startswith("forged head"))  # ids == the baseline's
    assert "Does it pay: " in verdict and "stopped early" not in verdict
    assert "the table below measures the held-out ones" in verdict
    assert use["visible"] is True
    folder = Path(head["folder"])
    assert folder.parent == Path(forge_panel.heads_root()).resolve() and (folder / "config.json").is_file()
    from engine.models.heads import layout_of, read_config

    assert kind in layout_of(read_config(folder))  # the kind chosen is the kind written
    assert folder.name.startswith("forge-target-")
    # "use this head": the Playground's target, drafter, draft and the proposed γ; the app may read it back
    assert forge_panel.use_head(head)[:3] == (target, kind, str(folder))
    assert f"(drafter {HEAD_NAMES[kind]}, draft = this folder)" in verdict
    from engine import policy

    assert policy.app_model(str(folder)) == str(folder)
    # the acceptance table drawn while it trains, not only at the end
    assert any(isinstance(out[0], dict) and out[0].get("data") for out in outputs[1:-1])


def test_stop_ends_the_forge_with_its_best_head_written(panel):
    forge_panel, target, prompts = panel
    outputs, stopped = [], None
    for out in forge_panel.run_forge(target, 20 / 60, "mine", True, [], prompts, "", "", 0, request=request("f2")):
        outputs.append(out)
        status = plain(out[forge_panel.OUTPUTS])
        trained_on = re.search(r"(\d+) train and", status)
        if stopped is None and (trained_on and int(trained_on.group(1)) > 0 or "forging: vocab" in status
                                or "forging: train" in status):  # fmt: skip
            stopped = plain(forge_panel.stop(request("f2")))
    assert stopped == "stopping: the forge writes its best checkpoint so far…"
    table, chart, verdict, pays, use, head, status, mark = outputs[-1]
    folder = forge_panel.heads_root().resolve() / "mine"
    assert plain(status) == f"done: the head is in {folder}" and head["folder"] == str(folder)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert "stopped early" in verdict and pays == []  # a stopped forge skips the measurement
    # ... and says how to measure the held-out prompts later, from the file it wrote beside the head
    command = re.search(r"held-out prompts? (were|was) not measured; this command measures (them|it): "
                        r"`(python -m engine bench [^`]+)`", verdict)  # fmt: skip
    assert command and f"--suite {folder}/held-out.jsonl" in command.group(3), verdict
    assert (folder / "held-out.jsonl").read_text().count("\n") > 0
    assert plain(forge_panel.stop(request("f2"))) == "nothing is being forged"


def refused(forge_panel, *args):
    outputs = []
    with pytest.raises(gr.Error) as err:
        for out in forge_panel.run_forge(*args, request=request("f3")):
            outputs.append(out)
    assert len(outputs) == 1  # nothing started
    return plain(outputs[-1][forge_panel.OUTPUTS]), outputs[-1][forge_panel.OUTPUTS + 1], str(err.value)


def test_bad_fields_are_marked_under_themselves(panel, tmp_path, monkeypatch):
    forge_panel, target, prompts = panel
    monkeypatch.setattr(forge_panel, "MIN_MINUTES", 1.0)
    cases = [
        (("  ", 15, "", True, ["code"]), "forge_target", "target"),
        ((target, 0.5, "", True, ["code"]), "forge_minutes", "minutes"),
        ((target, 61, "", True, ["code"]), "forge_minutes", "minutes"),
        ((target, "soon", "", True, ["code"]), "forge_minutes", "minutes"),
        ((target, 15, str(tmp_path / "elsewhere"), True, ["code"]), "forge_out", "output folder"),
        ((target, 15, "../escape", True, ["code"]), "forge_out", "output folder"),
        ((target, 15, "", True, []), "categories", "task categories"),
        ((target, 15, "", True, ["code"], str(tmp_path / "missing.jsonl")), "prompts_file", "prompts file"),
        (("/etc", 15, "", True, ["code"]), "forge_target", "target"),  # outside the operator's models folder
        ((target, 15, "", True, ["code"], None, "", "", 0, "int8"), "forge_data", "data passes in"),
        ((target, 15, "", True, ["code"], None, "", "", 0, "target", False, True), "forge_general", "general prompts"),
        ((target, 15, "", True, ["code"], None, "", "", 0, "target", True, False, "medusa"), "forge_kind", "head kind"),
    ]
    for args, field, label in cases:
        status, mark, err = refused(forge_panel, *args)
        assert status == f"not started: check {label}, as marked", (args, status)
        assert f"#lab-field-{field}" in mark and f"(field: {field})" in err, (args, mark, err)
    # a folder of something else inside the cache is not overwritten
    other = forge_panel.heads_root() / "not-a-forge"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    status, mark, _ = refused(forge_panel, target, 15, "not-a-forge", True, ["code"])
    assert "#lab-field-forge_out" in mark and "something other than a forge" in mark


def test_a_target_that_cannot_be_loaded_is_marked_under_the_target(panel):
    """The Hub's answer comes once the forge has started (loading the target): it is still the target's fault and
    marked there, as on the Playground, not a bare status line."""
    forge_panel, _, _ = panel
    outputs = []
    with pytest.raises(gr.Error) as err:
        for out in forge_panel.run_forge("nobody-here/no-such-model", 5, "", False, ["code"], request=request("f5")):
            outputs.append(out)
    status, mark = plain(outputs[-1][forge_panel.OUTPUTS]), outputs[-1][forge_panel.OUTPUTS + 1]
    assert len(outputs) > 1 and status == "failed: check target, as marked", status  # it had started
    assert "#lab-field-forge_target" in mark
    assert "no-such-model" in str(err.value) and "(field: forge_target)" in str(err.value)


def test_the_options_reach_the_forge(panel):
    """The data passes' dtype, the general prompts and "measure on every prompt" are the command line's
    --data-dtype, --no-general and --held-out 1."""
    forge_panel, target, _ = panel
    plain_run = forge_panel.plan(target, 5, "", True, ["code"])
    assert (plain_run.data_dtype, plain_run.general, plain_run.held_out) == ("target", True, forge_panel.HELD_OUT)
    cfg = forge_panel.plan(target, 5, "", True, ["code"], None, "", "", 0.3, "bfloat16", True, True)
    assert (cfg.data_dtype, cfg.general, cfg.held_out) == ("bfloat16", True, 1.0)
    cfg = forge_panel.plan(target, 5, "", True, ["code"], None, "", "", 0.3, "float16", False, False)
    assert (cfg.data_dtype, cfg.general, cfg.held_out) == ("float16", False, 0.3)
    from app.layout import build_demo

    forge = next(fn for fn in build_demo().fns.values() if fn.name == "run_forge")
    ids = [c.elem_id for c in forge.inputs]
    assert ids[-4:] == ["lab-field-forge_data", "lab-field-forge_general", "lab-field-forge_hold_all",
                        "lab-field-forge_kind"]  # fmt: skip
    assert plain_run.kind == "eagle3"
    cfg = forge_panel.plan(target, 5, "", True, ["code"], None, "", "", 0, "target", True, False, "dflash")
    assert cfg.kind == "dflash"


def test_the_operator_can_cap_forges_or_turn_them_off(panel, monkeypatch):
    """SPECARENA_FORGE: a number caps a forge's minutes, "off" refuses every forge (a public Space's machine is
    everyone's), and a value nobody can read turns the button off rather than leaving forges unbounded."""
    from engine import policy
    from engine.errors import UserError

    forge_panel, target, _ = panel
    monkeypatch.setattr(forge_panel, "MIN_MINUTES", 1.0)
    monkeypatch.setenv("SPECARENA_FORGE", "5")
    assert forge_panel.plan(target, 5, "", True, ["code"]).minutes == 5
    status, mark, err = refused(forge_panel, target, 6, "", True, ["code"])
    assert "#lab-field-forge_minutes" in mark and "1 to 5 minutes (this app's operator caps forges there)" in err
    monkeypatch.setenv("SPECARENA_FORGE", "off")
    status, mark, err = refused(forge_panel, target, 5, "", True, ["code"])
    assert status.startswith("not started: forging is off on this app") and mark == ""
    assert forge_panel.most_minutes() == 0
    monkeypatch.setenv("SPECARENA_FORGE", "soon")
    with pytest.raises(UserError, match="SPECARENA_FORGE='soon'"):
        policy.forge_minutes(60)
    assert forge_panel.most_minutes() == 0
    monkeypatch.delenv("SPECARENA_FORGE")
    assert forge_panel.most_minutes() == forge_panel.MAX_MINUTES


def test_the_panel_is_in_the_lab_and_holds_the_device_like_a_run():
    from app.layout import build_demo

    demo = build_demo()
    forge = next(fn for fn in demo.fns.values() if fn.name == "run_forge")
    sweep = next(fn for fn in demo.fns.values() if fn.name == "run_sweep")
    assert forge.concurrency_id == sweep.concurrency_id == "device" and forge.concurrency_limit == 1
    use = next(fn for fn in demo.fns.values() if fn.name == "use_head")
    assert [c.elem_id for c in use.outputs] == ["field-target", "field-drafter", "field-draft", "field-gamma",
                                                "field-topk", "status"]  # fmt: skip
    after = [fn for fn in demo.fns.values() if fn.js == forge_panel_js()]
    assert len(after) == 1 and after[0].fn is None  # then the Playground's tab, in the browser


def forge_panel_js() -> str:
    from app.forge_panel import TO_PLAYGROUND

    return TO_PLAYGROUND


def test_use_this_head_fills_the_playground_and_says_what_it_filled():
    """The sidebar's fields as the forge measured the head fastest, and one line on the Playground naming each."""
    from app import forge_panel
    from tests.test_app import plain

    head = {"target": "org/t", "folder": "/cache/heads/t-1", "gamma": 2, "topk": 3, "config_gamma": 1}
    *fills, status = forge_panel.use_head(head)
    assert fills == ["org/t", "eagle3", "/cache/heads/t-1", 2, 3]
    assert plain(status) == ("filled from the forged head: target org/t, drafter EAGLE-3 head, draft "
                             "/cache/heads/t-1, γ 2, tree width 3; press Run to try it.")  # fmt: skip
    block = {"target": "org/t", "kind": "dflash", "folder": "/cache/heads/t-2", "gamma": 3, "topk": 1}
    *fills, status = forge_panel.use_head(block)
    assert fills == ["org/t", "dflash", "/cache/heads/t-2", 3, 1]
    assert "drafter DFlash head, draft /cache/heads/t-2, γ 3, tree width 1;" in plain(status)
    *_, nothing = forge_panel.use_head({})
    assert "forge one first" in plain(nothing)

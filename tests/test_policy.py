"""What the web app may load: operator allow-list and the one local models folder."""

from __future__ import annotations

import pytest

from engine import policy
from engine.errors import UserError


def test_any_hub_id_without_an_allow_list(monkeypatch):
    monkeypatch.delenv("SPECARENA_ALLOWED_MODELS", raising=False)
    assert policy.app_model("org/any-model") == "org/any-model"
    assert policy.app_model("bundled") == "bundled"


def test_presets_allow_list(monkeypatch):
    from engine import presets

    monkeypatch.setenv("SPECARENA_ALLOWED_MODELS", "presets")
    for pair in presets.pairs():  # every model a preset names passes, unchanged
        for spec in filter(None, (pair["target"], pair.get("draft"))):
            assert policy.app_model(spec) == spec
    for refused in ("someone/else", "random:smollm2-135m", "Qwen/Qwen2.5-0.5B"):  # near names are not enough
        with pytest.raises(UserError, match="not on this app's list"):
            policy.app_model(refused)


def test_explicit_allow_list(monkeypatch):
    monkeypatch.setenv("SPECARENA_ALLOWED_MODELS", "a/b, c/d")
    assert policy.app_model("c/d") == "c/d"
    assert policy.app_model("bundled:smollm2-135m-instruct") == "bundled:smollm2-135m-instruct"  # always allowed
    with pytest.raises(UserError, match="choose one of a/b, bundled:smollm2-135m-instruct, c/d"):
        policy.app_model("e/f")


def test_local_folders_only_inside_the_models_folder(monkeypatch, tmp_path):
    inside = tmp_path / "models" / "mine"
    inside.mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    monkeypatch.delenv("SPECARENA_MODELS_DIR", raising=False)
    with pytest.raises(UserError, match="does not read local folders"):
        policy.app_model(str(inside))
    monkeypatch.setenv("SPECARENA_MODELS_DIR", str(tmp_path / "models"))
    assert policy.app_model(str(inside)) == str(inside.resolve())
    assert policy.app_model("mine") == str(inside.resolve())  # a bare name inside the folder
    for escape in (str(outside), str(tmp_path / "models" / ".." / "elsewhere"), "/etc"):
        with pytest.raises(UserError, match="models folder"):
            policy.app_model(escape)

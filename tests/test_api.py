"""The public `compare` endpoint through gradio_client, against `python app.py` on the bundled model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bundled

PROMPT = "Fix the spelling and repeat the text: The quick brown fox jumpd over the lazzy dog."


def call(client, prompt=PROMPT, **over):
    args = dict(prompt=prompt, target="bundled:smollm2-135m-instruct", drafter="prompt-lookup", draft="",
                temperature=0, top_p=1, top_k=0, max_new_tokens=20, gamma=4, seed=0, chat=True, dtype="auto",
                ngram=3, alpha=0.8, adaptive=False)  # fmt: skip
    args.update(over)
    return client.predict(**args, api_name="/compare")


@pytest.fixture(scope="module")
def client(live_app):
    from gradio_client import Client

    return Client(live_app, verbose=False)


def test_compare_endpoint_returns_both_texts_and_consistent_metrics(client):
    result = call(client)[0]
    base, spec = result["baseline"], result["speculative"]
    assert base["text"] and base["text"] == spec["text"]
    assert result["identical"] is True and base["token_ids"] == spec["token_ids"]
    m = spec["metrics"]
    # every target pass adds its own token after the accepted drafts (unless EOS came inside a draft)
    assert m["new_tokens"] <= m["accepted_tokens"] + m["target_passes"]
    if m["finish_reason"] == "length":
        assert m["new_tokens"] == m["accepted_tokens"] + m["target_passes"] == 20
    assert m["drafted_tokens"] >= m["accepted_tokens"] > 0
    assert sum(m["accepted_length_hist"]) == m["target_passes"] - 1
    assert result["speedup"] > 0 and result["environment"]["device"] == "cpu"


def test_compare_endpoint_reports_bad_input(client):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as err:
        call(client, prompt="")
    assert "prompt is empty" in str(err.value)
    assert call(client, max_new_tokens=3)[0]["identical"] is True  # still serving

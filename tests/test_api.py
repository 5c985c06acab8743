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
    assert sum(m["accepted_length_hist"]) + m["no_draft_steps"] == m["target_passes"] - 1
    assert result["speedup"] > 0 and result["environment"]["device"] == "cpu"


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(prompt=""), "prompt is empty: type something for the models to continue. (field: prompt)"),
        (dict(temperature=None), "temperature is empty: enter a number. (field: temperature)"),
        (dict(gamma=0), "gamma 0 is out of range: use a whole number from 1 to 16. (field: gamma)"),
        (dict(max_new_tokens=100000), "max new tokens 100000 is out of range: use 1 to 2048. (field: max_new_tokens)"),
        (dict(drafter="bogus"), "drafter 'bogus' is unknown"),
        (dict(drafter="draft-model"), "draft model or head is empty"),
        (dict(target="/etc"), "does not read local folders"),
        (dict(top_p=7), "top-p 7.0 is out of range"),
    ],
)
def test_compare_endpoint_names_the_field_of_a_bad_value(client, over, message):
    # Gradio's own bounds would answer these with a bare HTTP 400; the caller gets our message instead
    with pytest.raises(Exception) as err:
        call(client, **over)
    assert message in str(err.value)


def test_the_endpoint_keeps_serving_after_bad_values(client):
    with pytest.raises(Exception):
        call(client, gamma=-3)
    assert call(client, max_new_tokens=3)[0]["identical"] is True


def test_concurrent_clients_are_served_one_at_a_time_or_told_the_queue_is_full(live_app):
    """8 clients at once against a queue of 4: each job completes or is turned away, runs never overlap. The
    jobs are long enough that all 8 arrive while the first runs, so some must be turned away."""
    from concurrent.futures import ThreadPoolExecutor

    from gradio_client import Client

    def one(i):
        try:
            return call(Client(live_app, verbose=False), max_new_tokens=96, seed=i)[0]
        except Exception as exc:  # noqa: BLE001 - the queue's refusal is an exception on the client
            return exc

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(8), timeout=600))
    done = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if not isinstance(o, dict)]
    assert done and all(o["identical"] is True for o in done)
    assert refused and all("queue is full" in str(e).lower() for e in refused), refused
    spans = sorted((o["started_at"], o["finished_at"]) for o in done)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # never two at once


def test_a_client_that_cancels_frees_the_slot(live_app):
    import time

    from gradio_client import Client

    slow = Client(live_app, verbose=False)
    args = dict(prompt="Write a very long story about the sea.", target="bundled:smollm2-135m-instruct",
                drafter="prompt-lookup", draft="", temperature=0, top_p=1, top_k=0, max_new_tokens=400, gamma=4,
                seed=0, chat=True, dtype="auto", ngram=3, alpha=0.8, adaptive=False)  # fmt: skip
    job = slow.submit(**args, api_name="/compare")
    time.sleep(8)  # the long run is generating now
    job.cancel()
    started = time.time()
    result = call(Client(live_app, verbose=False), max_new_tokens=4)[0]
    assert result["identical"] is True
    assert time.time() - started < 120  # not stuck behind the abandoned 400-token run

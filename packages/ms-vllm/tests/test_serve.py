"""`vllm serve DIR` with the plugin answers the openai client on 127.0.0.1, streaming included;
malformed requests get 4xx and the server keeps serving."""

from __future__ import annotations

import json

import pytest
from conftest import JSON_SCHEMA as SCHEMA
from conftest import vllm_server

pytestmark = [pytest.mark.needs_mindspore, pytest.mark.needs_torch]

PROMPT = [0, 33, 34, 35, 36, 37]
FEW_BUCKETS = {"decode_sizes": [1, 2], "prefill_sizes": [16], "context_sizes": [96], "batch_tokens": 16}


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    """A `vllm serve` process on the tiny Llama; killed by pid (and its process group) at the end."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = [
        "--served-model-name", "tiny", "--max-model-len", "96", "--block-size", "4",
        "--kv-cache-memory-bytes", str(4 << 20),
        # Compiled, on three buckets (7 s of compiling) instead of the default set.
        "--additional-config", json.dumps({"compile": FEW_BUCKETS}),
        # xgrammar without free whitespace in JSON: a random tiny model would fill the budget with it
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
    ]  # fmt: skip
    with vllm_server(tiny_dirs["llama"], args, log) as base:
        yield base


def test_openai_client_completions_and_streaming(server, reference):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0, extra_body={"return_token_ids": True}
    )
    expected = reference("llama", PROMPT, 5)
    assert done.choices[0].token_ids == expected
    text = client.completions.create(model="tiny", prompt="Paged attention", max_tokens=4, temperature=0.0)
    assert text.usage.completion_tokens == 4 and isinstance(text.choices[0].text, str)
    # Streaming: pieces arrive as separate events and add up to the same tokens. vLLM merges the
    # outputs a slow reader has not taken yet, and a compiled tiny model makes a token in a few
    # milliseconds, so 5 tokens could arrive as one event: 48 take long enough to come in pieces.
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=48,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    pieces = [c.choices[0].token_ids or [] for c in stream if c.choices]
    assert len(pieces) >= 2
    assert [t for p in pieces for t in p] == reference("llama", PROMPT, 48)


def test_malformed_requests_get_4xx_and_server_keeps_serving(server, reference):
    import requests

    url = server + "/v1/completions"
    bad = [
        requests.post(url, data="{not json", headers={"Content-Type": "application/json"}, timeout=30),
        requests.post(url, json={"model": "tiny", "prompt": PROMPT, "max_tokens": -3}, timeout=30),
        requests.post(url, json={"model": "tiny", "prompt": list(range(300)), "max_tokens": 2}, timeout=30),
        requests.post(url, json={"model": "no-such-model", "prompt": PROMPT}, timeout=30),
        requests.post(url, json={"model": "tiny", "prompt": PROMPT, "temperature": "hot"}, timeout=30),
    ]
    assert all(400 <= r.status_code < 500 for r in bad), [(r.status_code, r.text[:200]) for r in bad]
    ok = requests.post(
        url, json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    )
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["token_ids"] == reference("llama", PROMPT, 3)


def test_json_schema_request_returns_valid_json(server):
    """Structured outputs through vLLM's own path: the scheduler's xgrammar bitmask is applied in the
    plugin's sampler (compiled steps), so even a random model answers with JSON of the schema."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    for temperature in (0.0, 1.0):
        done = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=40,
            temperature=temperature,
            seed=3,
            extra_body={"structured_outputs": {"json": SCHEMA}},
        )
        value = json.loads(done.choices[0].text)
        assert set(value) == {"answer", "n"} and value["answer"] in ("yes", "no"), value
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 9, value
        assert done.choices[0].finish_reason == "stop"
    picked = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "blue"]}}
    )
    assert picked.choices[0].text in ("red", "blue")

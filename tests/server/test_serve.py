"""`localpaged serve`: the OpenAI-compatible server on the tiny random model, driven by the official client.

One server for the module (uvicorn on a thread, over an AsyncLLM whose core runs in its own
process, the default), with an API key; one real `localpaged serve` subprocess for the signals.
Greedy replies must be what ``LLM.chat`` gives for the same messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localpaged.engine.async_llm import AsyncLLM
from tests.server.running import running_server
from tests.support import wait_until

REPO = Path(__file__).resolve().parent.parent.parent
KEY = "sk-test-key"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a paged KV cache?"}]
LONG_SYSTEM = "You are a careful assistant who answers questions about operating systems. " * 12
# Greedy, and long enough to be interrupted: the tiny model would otherwise stop at a random EOS.
ENDLESS = {"max_tokens": 900, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def base_url(engine: AsyncLLM):
    with running_server(engine, api_key=KEY) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def call(
    base_url: str,
    path: str,
    body: object = None,
    *,
    key: str | None = KEY,
    raw: bytes | None = None,
    headers: dict[str, str | None] | None = None,
):
    """(status, parsed JSON or text) of a plain HTTP request: for what the official client would not send.
    ``headers``: more of them, a None value leaving that one out."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base_url}{path}", data=data, method="GET" if data is None else "POST")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        if value is not None:
            request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metric_samples(base_url: str) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. ``localpaged_requests_total{finish_reason="length"}``."""
    status, text = call(base_url, "/metrics", key=None)
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# ----- replies --------------------------------------------------------------------------------------


def test_models_lists_the_engines_model(client: openai.OpenAI, engine: AsyncLLM) -> None:
    (card,) = client.models.list().data
    assert card.id == engine.info.model_name


def test_chat_matches_llm_chat(client: openai.OpenAI, engine: AsyncLLM, llm) -> None:
    from localpaged import SamplingParams

    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0))[0]
    reply = client.chat.completions.create(
        model=engine.info.model_name, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(engine.encode_chat(MESSAGES))
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_matches_llm_chat(client: openai.OpenAI, engine: AsyncLLM, llm) -> None:
    from localpaged import SamplingParams

    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0))[0]
    chunks = list(
        client.chat.completions.create(
            model=engine.info.model_name,
            messages=MESSAGES,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_text_completion_matches_llm_generate(client: openai.OpenAI, engine: AsyncLLM, llm) -> None:
    from localpaged import SamplingParams

    prompt = "The three laws of paging are"
    expected = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
    reply = client.completions.create(model=engine.info.model_name, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected.text
    streamed = client.completions.create(
        prompt=prompt, model=engine.info.model_name, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_without_max_tokens_the_reply_may_fill_the_context(client: openai.OpenAI, engine: AsyncLLM) -> None:
    limit = engine.info.max_model_len
    prompt = (engine.tokenizer.encode("paging " * limit, add_special_tokens=False))[: limit - 20]
    reply = client.completions.create(model=engine.info.model_name, prompt=prompt, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == limit - 20 and reply.usage.total_tokens == limit


def test_a_shared_system_prompt_is_served_from_the_prefix_cache(client: openai.OpenAI, engine: AsyncLLM) -> None:
    conversations = [
        [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
        for question in ("What is a page fault?", "Why do TLBs exist?")
    ]
    first, second = (engine.encode_chat(c) for c in conversations)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    full_blocks = shared // engine.info.block_size * engine.info.block_size
    assert full_blocks >= 64  # the test means something only if the shared part spans several blocks
    replies = [
        client.chat.completions.create(model=engine.info.model_name, messages=c, max_tokens=4, temperature=0)
        for c in conversations
    ]
    assert replies[1].usage.prompt_tokens_details.cached_tokens >= full_blocks


def test_a_client_that_closes_its_stream_frees_its_blocks(client: openai.OpenAI, engine: AsyncLLM) -> None:
    stream = client.chat.completions.create(model=engine.info.model_name, messages=MESSAGES, stream=True, **ENDLESS)
    for _, _chunk in zip(range(4), stream):
        pass
    assert engine.stats().blocks_used > 0
    stream.close()
    wait_until(lambda: engine.stats().blocks_used == 0 and engine.stats().running == 0)


# ----- refusals -------------------------------------------------------------------------------------


def test_the_api_key_is_required_except_for_health(base_url: str, engine: AsyncLLM) -> None:
    wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model=engine.info.model_name, messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    for key in (None, "sk-wrong"):
        status, body = call(base_url, "/v1/models", key=key)
        assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    assert call(base_url, "/health", key=None)[0] == 200


def test_an_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert caught.value.body["param"] == "model"


def test_continue_final_message_goes_on_from_the_reply(client: openai.OpenAI, engine: AsyncLLM, llm) -> None:
    """vLLM's fields: the prompt is the template up to the assistant's turn, then the partial reply, left open."""
    from localpaged import SamplingParams

    partial = "A paged KV cache"
    prompt = engine.encode_chat(MESSAGES) + engine.tokenizer.encode(partial, add_special_tokens=False)
    expected = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    reply = client.chat.completions.create(
        model=engine.info.model_name,
        messages=[*MESSAGES, {"role": "assistant", "content": partial}],
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == expected.text


GOOD = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
TOO_LONG = [{"role": "user", "content": "paging " * 1500}]


def test_json_numbers_and_64_bit_seeds_are_taken_as_peers_take_them(client: openai.OpenAI, base_url: str) -> None:
    """JSON has one number type (8.0 is 8), and a seed is any 64-bit integer, negative ones too."""
    body = {**GOOD, "max_tokens": 4.0, "seed": -5, "top_k": 1.0, "stop_token_ids": [2.0]}
    status, reply = call(base_url, "/v1/chat/completions", body)
    assert status == 200, reply
    status, reply = call(base_url, "/v1/completions", {"prompt": [17835.0, 28.0], "max_tokens": 2.0})
    assert status == 200 and reply["usage"]["prompt_tokens"] == 2, reply


def test_strict_clients_get_what_the_http_and_openai_specs_say(client: openai.OpenAI, base_url: str, engine) -> None:
    """405 names the allowed methods; models.retrieve works; a stream's finish comes in a chunk of its own."""
    request = urllib.request.Request(f"{base_url}/v1/models", data=b"{}", method="POST")
    request.add_header("Authorization", f"Bearer {KEY}")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 405 and caught.value.headers["Allow"] == "GET"
    assert client.models.retrieve(engine.info.model_name).id == engine.info.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    chunks = list(
        client.chat.completions.create(model=engine.info.model_name, messages=MESSAGES, max_tokens=3, stream=True)
    )
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].choices[0].delta.content in (None, "")
    text_chunks = list(client.completions.create(model=engine.info.model_name, prompt="Hi", max_tokens=3, stream=True))
    assert text_chunks[-1].choices[0].finish_reason and text_chunks[-1].choices[0].text == ""


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 5000}, "max_tokens"),  # past the 1024-token context
        ({"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "g"}}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),  # a call asked for, and no functions sent
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stop": 5}, "stop"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": TOO_LONG}, "messages"),
        ({"messages": TOO_LONG, "stream": True}, "messages"),
        ({"continue_final_message": True}, "add_generation_prompt"),  # both on: vLLM refuses it too
        ({"continue_final_message": True, "add_generation_prompt": False}, "messages"),  # the last is the user's
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(base_url: str, change: dict, param: str) -> None:
    status, body = call(base_url, "/v1/chat/completions", {**GOOD, **change})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    if change.get("messages") is TOO_LONG:
        assert "1024" in body["error"]["message"]  # says the limit
    status, body = call(base_url, "/v1/chat/completions", GOOD)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/completions", json.dumps({"prompt": ""}).encode(), "prompt"),
        ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode(), "prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, 10**9]}).encode(), "prompt"),
        ("/detokenize", json.dumps({"tokens": [-5]}).encode(), "tokens"),
        ("/tokenize", json.dumps({}).encode(), "prompt"),
    ],
)
def test_a_malformed_body_is_a_400(base_url: str, path: str, raw: bytes, param: str | None) -> None:
    status, body = call(base_url, path, raw=raw)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["message"]


def test_a_bad_request_leaves_other_streams_alone(client: openai.OpenAI, base_url: str, engine, llm) -> None:
    from localpaged import SamplingParams

    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0))[0].text
    stream = client.chat.completions.create(
        model=engine.info.model_name, messages=MESSAGES, max_tokens=24, temperature=0, stream=True
    )
    text = [next(iter(stream)).choices[0].delta.content or ""]
    assert call(base_url, "/v1/chat/completions", {**GOOD, "messages": TOO_LONG})[0] == 400
    assert call(base_url, "/v1/chat/completions", raw=b"\xff\xfe")[0] == 400
    text += [c.choices[0].delta.content or "" for c in stream]
    assert "".join(text) == expected


# ----- metrics, tokenizer ---------------------------------------------------------------------------


def test_metrics_parse_and_move(client: openai.OpenAI, base_url: str, engine: AsyncLLM) -> None:
    before = metric_samples(base_url)
    assert before["localpaged_engine_up"] == 1 and before["localpaged_kv_blocks_total"] > 0
    client.chat.completions.create(model=engine.info.model_name, messages=MESSAGES, max_tokens=5, temperature=0)
    after = metric_samples(base_url)
    assert after["localpaged_generation_tokens_total"] >= before.get("localpaged_generation_tokens_total", 0) + 1
    assert (
        after["localpaged_prefix_cache_queries_tokens_total"] > before["localpaged_prefix_cache_queries_tokens_total"]
    )
    assert after["localpaged_prefix_cache_hits_tokens_total"] >= before["localpaged_prefix_cache_hits_tokens_total"]
    assert (
        after["localpaged_time_to_first_token_seconds_count"] > before["localpaged_time_to_first_token_seconds_count"]
    )
    for name in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_shared"):
        assert f"localpaged_{name}" in after
    assert "localpaged_preemptions_total" in after and "localpaged_time_per_output_token_seconds_count" in after
    # speculative decoding is on by default ("auto"): its counters are there from the start
    assert after["localpaged_spec_decode_accepted_tokens_total"] <= after["localpaged_spec_decode_draft_tokens_total"]


def test_tokenize_and_detokenize_round_trip(base_url: str, engine: AsyncLLM) -> None:
    text = "Hello, paged world! naïve café"
    status, tokenized = call(base_url, "/tokenize", {"prompt": text})
    assert status == 200 and tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == engine.info.max_model_len
    assert call(base_url, "/detokenize", {"tokens": tokenized["tokens"]}) == (200, {"prompt": text})
    status, chat = call(base_url, "/tokenize", {"messages": MESSAGES})
    assert status == 200 and chat["tokens"] == engine.encode_chat(MESSAGES)


# ----- the real command -----------------------------------------------------------------------------


def test_sigterm_stops_localpaged_serve_with_exit_0(tiny_model_path: Path) -> None:
    command = [sys.executable, "-m", "localpaged.cli", "serve", "--port", "0", "--model", str(tiny_model_path)]
    command += ["--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
    env = {**os.environ, "LOCALPAGED_API_KEY": KEY}
    child = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in child.stderr:  # "serving NAME at http://127.0.0.1:PORT/v1 (...)"
            lines.append(line)
            if line.startswith("serving "):
                break
        url = lines[-1].split(" at ", 1)[1].split("/v1", 1)[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **ENDLESS)
        next(iter(stream))
        child.send_signal(signal.SIGTERM)
        start = time.monotonic()
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        assert child.wait(timeout=10) == 0, "".join(lines) + child.stderr.read()
        assert time.monotonic() - start < 5
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

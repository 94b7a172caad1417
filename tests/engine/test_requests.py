"""Requests on the tiny model: bad input, aborts, stop conditions, seeds, streaming text."""

from __future__ import annotations

import json

import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.errors import ConfigError, ModelNotFoundError, RequestError, UnsupportedModelError
from tests.conftest import DEVICE

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), dtype="float32", device=DEVICE, kv_cache_memory="32MiB", max_model_len=256)


def still_works(llm) -> None:
    out = llm.generate(["hello"], GREEDY)[0]
    assert len(out.token_ids) == 8
    assert llm.stats().blocks_used == 0


@pytest.mark.parametrize(
    "prompt, match",
    [("", "empty"), ([], "empty"), (list(range(300)), "300 tokens but the context holds 256"), ([10**9], "token ids")],
)
def test_bad_prompts_are_refused_and_engine_stays_usable(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.add_request(prompt, GREEDY)
    still_works(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "at least 1"),
        ({"max_tokens": 10**9}, "more than any context"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id(llm):
    llm.add_request("one", GREEDY, request_id="same")
    with pytest.raises(RequestError, match="already in use"):
        llm.add_request("two", GREEDY, request_id="same")
    llm.abort("same")
    still_works(llm)


def test_abort_frees_blocks_at_once(llm):
    rid = llm.add_request(list(range(100, 180)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    llm.step()
    assert llm.stats().blocks_used > 0
    llm.abort(rid)
    assert llm.stats().blocks_used == 0
    llm.pool.check_integrity()
    with pytest.raises(RequestError, match="no running request"):
        llm.abort(rid)


def test_stop_string_ends_reply_and_is_never_streamed(llm):
    free = llm.generate(["count"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[5:8]
    assert stop.strip(), "the tiny model's text should have something to stop at"
    llm.add_request("count", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    streamed, last = "", None
    while llm.has_unfinished_requests():
        for out in llm.step():
            streamed += out.delta
            last = out
    assert last.finish_reason == "stop" and stop not in streamed
    assert streamed == last.text == free.text[: free.text.find(stop)]


def test_max_tokens_and_eos_finish_reasons(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    eos = next(iter(llm.stop_token_ids))
    out = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=[]))[0]
    assert out.finish_reason in ("length", "stop")
    assert eos in llm.stop_token_ids


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = llm.generate(["tell me"], p)[0].token_ids
    crowd = llm.generate(["tell me", "other", "tell me"], [p, SamplingParams(max_tokens=12, temperature=1.0), p])
    assert crowd[0].token_ids == alone == crowd[2].token_ids


def test_deltas_add_up_to_text_without_broken_characters(llm):
    """Streamed, a reply is its tokens' own text: a character whose bytes span tokens waits until it is whole, so a
    U+FFFD shows only where the tokens' bytes are not UTF-8 themselves, as in the whole reply decoded at once (a hot
    random sample of a tiny model emits stray bytes now and then, and special tokens, left out of the text)."""
    held = 0  # tokens whose text waited for the next one: the case under test, which these seeds do reach
    for seed in range(3, 9):
        rid = llm.add_request("ñandú 🐍", SamplingParams(max_tokens=40, temperature=1.5, seed=seed, ignore_eos=True))
        deltas = []
        while llm.has_unfinished_requests():
            for out in llm.step():
                deltas.append(out.delta)
                held += out.delta == "" and not out.finished
        text = "".join(deltas)
        assert text == out.text and out.request_id == rid
        assert text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True), seed
    assert held > 0


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_unsupported_architecture_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported; supported: llama, mistral, qwen2"):
        LLM(str(tmp_path))


def test_pool_too_small_fails_at_start_with_numbers(tiny_model_path):
    with pytest.raises(ConfigError, match=r"cannot hold one sequence of max_model_len=1024 \(64 blocks\)"):
        LLM(str(tiny_model_path), device="cpu", dtype="float32", kv_cache_memory="64KiB", max_model_len=1024)


def test_the_default_pool_holds_a_whole_context_or_the_default_context_shortens(tiny_model_path, monkeypatch):
    """Neither kv_cache_memory nor max_model_len given: the pool grows to one whole context where half of available
    memory holds it, else the context shortens to what the pool holds, and the engine starts and answers."""
    from localpaged.engine import setup

    gib = 2**30
    monkeypatch.setattr(setup, "available_memory", lambda: 8 * gib)
    assert setup.default_kv_memory(torch.device("cpu"), 3 * gib) == 3 * gib  # Phi-3.5-mini's whole context
    assert setup.default_kv_memory(torch.device("cpu"), gib // 2) == 2 * gib  # the usual quarter, capped
    monkeypatch.setattr(setup, "available_memory", lambda: 4 * gib)
    assert setup.default_kv_memory(torch.device("cpu"), 3 * gib) == 2 * gib  # half of what is available, no more

    probe = LLM(str(tiny_model_path), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory="1MiB")
    block_bytes, full = probe.block_bytes, probe.runner.model.config.max_position_embeddings
    probe.close()
    monkeypatch.setattr(setup, "available_memory", lambda: 160 * block_bytes)  # the pool: 80 blocks, not full / 16
    assert full > 80 * 16
    llm = LLM(str(tiny_model_path), device="cpu", dtype="float32")
    assert llm.resolved.max_model_len == 80 * 16 and llm.resolved.num_blocks >= 80
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    llm.close()
    with pytest.raises(ConfigError, match="cannot hold one sequence"):  # a context asked for is never shortened
        LLM(str(tiny_model_path), device="cpu", dtype="float32", max_model_len=full)


def test_prefix_cache_serves_shared_system_prompt(llm):
    system = [{"role": "system", "content": "You answer questions about rivers. " * 12}]
    a = llm.encode_chat(system + [{"role": "user", "content": "Nile?"}])
    b = llm.encode_chat(system + [{"role": "user", "content": "Amazon?"}])
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    llm.generate([a], GREEDY)
    out = llm.generate([b], GREEDY)[0]
    assert out.metrics.cached_tokens == shared // 16 * 16 > 0
    assert llm.stats().prefix_hit_rate > 0


def test_half_precision_engine_runs(tiny_model_path):
    """bf16 weights and KV take the same paths (the decode cascade merges in fp32 and casts back)."""
    llm = LLM(str(tiny_model_path), dtype="bfloat16", device=DEVICE, kv_cache_memory="16MiB", max_model_len=256)
    system = [{"role": "system", "content": "Shared words. " * 20}]
    prompts = [llm.encode_chat(system + [{"role": "user", "content": q}]) for q in ("a", "b", "c")]
    llm.generate(prompts[:1], GREEDY)
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == 8 for o in outs) and outs[1].metrics.cached_tokens > 0
    assert llm.stats().blocks_used == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weights": "int4"}, "weights='int4'"),
        ({"dtype": "float64"}, "dtype='float64'"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8': use 'auto'"),
        ({"device": "tpu"}, "device='tpu'"),
    ],
)
def test_bad_engine_config(kwargs, match):
    from localpaged.config import EngineConfig

    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)

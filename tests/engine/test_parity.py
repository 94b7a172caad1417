"""Greedy output equals Hugging Face transformers', token for token, however requests arrive."""

from __future__ import annotations

import pytest

from localpaged import SamplingParams
from tests.conftest import DEVICE
from tests.oracle import assert_same_greedy, hf_greedy, load_hf

NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(tokenizer) -> list[list[int]]:
    """Prompts of 1 token, exactly 16 and 32, a few blocks, and over 500 tokens, most through the chat template."""

    def chat(text: str) -> list[int]:
        return list(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
        )

    long_text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(40))
    few_blocks = chat("Explain in detail how a paged KV cache with a block table per sequence works.")
    return [
        [1],
        few_blocks[:16],
        few_blocks[:32],
        chat("Hi"),
        chat("What is the capital of France?"),
        few_blocks,
        chat("Write a haiku about autumn leaves falling on a quiet pond in the early morning."),
        chat(long_text),
    ]


def _check_modes(llm, hf, prompts, label):
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert len(prompts[-1]) > 500 or "tiny" in label

    one_by_one = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    staggered = _staggered(llm, prompts)
    for mode, got in (("one at a time", one_by_one), ("all at once", together), ("staggered", staggered)):
        for i, (tokens, (want, gaps)) in enumerate(zip(got, expected)):
            assert_same_greedy(tokens, want, gaps, f"{label} {mode} prompt {i}")


def _staggered(llm, prompts) -> list[list[int]]:
    """A new request joins every third step while the others decode."""
    ids, done, pending = {}, {}, list(enumerate(prompts))
    steps = 0
    while pending or llm.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            ids[llm.add_request(p, GREEDY)] = i
        for out in llm.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        steps += 1
    return [done[i] for i in range(len(prompts))]


def test_tiny_llama_matches_hf(tiny_llm, tiny_model_path):
    llm = tiny_llm(max_num_batched_tokens=64, kv_cache_dtype="float32")  # the exact path; long prompts are chunked
    _check_modes(llm, load_hf(tiny_model_path), _prompts(llm.tokenizer), "tiny llama")
    assert llm.stats().blocks_used == 0


def test_tiny_qwen2_matches_hf(tiny_qwen2_path):
    from localpaged import LLM

    llm = LLM(
        str(tiny_qwen2_path),
        dtype="float32",
        kv_cache_dtype="float32",
        device=DEVICE,
        kv_cache_memory="64MiB",
        max_model_len=1024,
    )
    _check_modes(llm, load_hf(tiny_qwen2_path), _prompts(llm.tokenizer), "tiny qwen2")


@pytest.mark.model
def test_default_model_matches_hf(default_llm, default_hf):
    _check_modes(default_llm, default_hf, _prompts(default_llm.tokenizer), "SmolLM2")

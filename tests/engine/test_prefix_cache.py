"""A second chat with the same ~300-token system prompt is served from the prefix cache, unchanged."""

from __future__ import annotations

import pytest

from localpaged import LLM, SamplingParams
from tests.conftest import DEFAULT_MODEL, DEVICE

SYSTEM = (
    "You are the support assistant of a small bicycle repair shop in a hilly city. "
    "Answer questions about repairs, prices, opening hours and bike fitting. "
) * 10
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


@pytest.mark.model
def test_second_chat_reuses_system_prompt_blocks_and_matches_a_cold_run(default_llm):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When are you open?"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How much is a new chain?"}]
    a, b = default_llm.encode_chat(first), default_llm.encode_chat(second)
    shared = shared_prefix(a, b)
    assert 280 <= shared <= 360, f"the system prompt should be about 300 tokens, not {shared}"

    default_llm.chat(first, GREEDY)
    warm = default_llm.chat(second, GREEDY)[0]
    assert warm.metrics.cached_tokens == shared // 16 * 16

    cold_engine = LLM(
        DEFAULT_MODEL,
        dtype="float32",
        kv_cache_dtype="float32",  # as default_llm's
        device=DEVICE,
        kv_cache_memory="256MiB",
        max_model_len=2048,
    )
    cold = cold_engine.chat(second, GREEDY)[0]
    assert cold.metrics.cached_tokens == 0
    assert warm.token_ids == cold.token_ids and warm.text == cold.text

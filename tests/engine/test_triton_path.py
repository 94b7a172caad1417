"""The engine end to end through the Triton kernels (compiled on CUDA, interpreted on the CPU)."""

from __future__ import annotations

import pytest

from localpaged import SamplingParams
from tests.oracle import assert_same_greedy, hf_greedy, load_hf

pytest.importorskip("triton")


def test_tiny_llama_greedy_through_triton_matches_hf(tiny_llm, tiny_model_path):
    llm = tiny_llm(attention="triton", max_num_batched_tokens=24)  # chunked prefill mixed with decodes
    assert llm.runner.attention.name == "triton"
    tok = llm.tokenizer
    prompts = [
        [1],
        list(tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)["input_ids"]),
        list(range(100, 140)),
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hf = load_hf(tiny_model_path)
    got = llm.generate(prompts, params)
    again = llm.generate(prompts[1:2], params)[0]  # served from the prefix cache
    assert again.metrics.cached_tokens >= 16
    for i, (out, prompt) in enumerate(zip(got + [again], prompts + prompts[1:2])):
        want, gaps = hf_greedy(hf, prompt, 12)
        assert_same_greedy(out.token_ids, want, gaps, f"triton prompt {i}")

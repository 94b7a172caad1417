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


def test_cascade_through_triton_gives_the_tokens_of_the_plain_kernels(tiny_llm):
    """Sequences sharing a cached prompt, with shared-prefix attention through paged_prefill.cascade_prefill (decode
    steps and chunks) and without it: the same greedy tokens, and every block back."""
    llm = tiny_llm(attention="triton", max_num_batched_tokens=48, kv_disk=False)
    assert llm.runner.cascade
    llm.runner.cascade_tiers = ((4, 2),)  # group this small batch
    prompt = [(37 * i) % 900 + 10 for i in range(80)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=1))
    plans = []
    real = llm.runner.cascade_plan
    llm.runner.cascade_plan = lambda *entries: plans.append(p := real(*entries)) or p
    prompts = [prompt + [1000 + 7 * i + j for j in range(1 + 3 * i)] for i in range(3)]
    with_cascade = [o.token_ids for o in llm.generate(prompts, params)]
    assert any(p is not None and len(p.members) == 3 for p in plans)
    llm.runner.cascade = False
    assert [o.token_ids for o in llm.generate(prompts, params)] == with_cascade
    assert llm.stats().blocks_used == 0


def test_drafts_through_triton_give_the_tokens_without_them(tiny_llm, tiny_model_path):
    """Speculative decoding's verify rows (a sequence's token and its drafts, each a decode row over its own prefix)
    through the Triton kernels, n-gram drafts and a draft model's, alone and batched: the greedy tokens of no drafts,
    every block back."""
    from tests.engine.test_speculative import PROMPTS

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    off = tiny_llm(attention="triton", speculative="off", kv_disk=False)
    want = [o.token_ids for o in off.generate(PROMPTS[:2], params)]
    off.close()
    for speculative in ("suffix", {"draft": str(tiny_model_path), "k": 3}):  # suffix: batched, each repeats a reply
        llm = tiny_llm(attention="triton", speculative=speculative, kv_disk=False)
        llm.speculator.max_rows = None  # drafts for both chats at once, past the GPU's row budget
        llm.speculator.weighs_cost = False  # the target as its own draft never pays: it would rest
        assert [llm.generate([p], params)[0].token_ids for p in PROMPTS[:2]] == want
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == want
        stats = llm.stats()
        assert stats.spec_accepted_tokens > 0 and stats.blocks_used == 0, speculative
        llm.close()

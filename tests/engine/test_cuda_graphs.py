"""The padded static buffers behind the CUDA-graph decode path, run eagerly (no GPU needed)."""

from __future__ import annotations

from localpaged import SamplingParams
from localpaged.engine.cuda_graphs import DecodeGraphs, batch_ladder


def test_batch_ladder_covers_every_size():
    assert batch_ladder(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_ladder(5) == [1, 2, 4, 5]
    assert batch_ladder(1) == [1]


def test_padded_decode_buffers_give_the_same_tokens(tiny_llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[1], list(range(50, 90)), list(range(200, 217)), [5, 6, 7]]  # 3 sequences pad up to 4, 1 stays 1
    eager = tiny_llm()
    want = [o.token_ids for o in eager.generate(prompts, params)]
    padded = tiny_llm()
    r = padded.runner
    r.graphs = DecodeGraphs(r.model, r.attention, 8, padded.resolved.max_model_len // 16, 16, r.device, capture=False)
    got = [o.token_ids for o in padded.generate(prompts, params)]
    got += [o.token_ids for o in padded.generate(prompts[:3], params)]
    assert got == want + want[:3]
    assert padded.stats().blocks_used == 0

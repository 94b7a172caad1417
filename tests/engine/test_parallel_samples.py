"""Parallel samples (``SamplingParams.n``) on the tiny model: the prompt's KV held and computed once, each
sample its own stream, exact pool accounting through preemption and aborts, and both AsyncLLM modes.

The reproducibility contract (docs/api.md): sample i of a seeded request draws from a stream fixed by
(seed, i), so it depends on neither n nor what else runs; sample 0's stream is the seed's own, that of
the same request with n = 1. Greedy samples are all the n = 1 greedy reply.
"""

from __future__ import annotations

import asyncio

import pytest

from localpaged import LLM, AsyncLLM, SamplingParams
from localpaged.errors import RequestError
from tests.conftest import DEVICE

BS = 16
PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks and 4 tokens of a seventh
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def with_n(params: SamplingParams, n: int, **changes) -> SamplingParams:
    fields = {k: getattr(params, k) for k in ("max_tokens", "temperature", "seed", "ignore_eos", "stop")}
    return SamplingParams(**{**fields, **changes, "n": n})


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), dtype="float32", device=DEVICE, kv_cache_memory="32MiB", max_model_len=512)


def assert_clean(llm: LLM) -> None:
    assert llm.requests == {} and not llm.has_unfinished_requests()
    assert llm.stats().blocks_used == 0
    llm.pool.check_integrity()


def count_computed(llm: LLM, monkeypatch) -> list[int]:
    """Tokens the model computes per step, from here on."""
    steps: list[int] = []
    run = llm.runner.run

    def counting(batch):
        steps.append(batch.num_tokens)
        return run(batch)

    monkeypatch.setattr(llm.runner, "run", counting)
    return steps


def test_n_samples_hold_and_compute_the_prompt_once(tiny_llm, monkeypatch):
    llm = tiny_llm()
    steps = count_computed(llm, monkeypatch)
    rid = llm.add_request(PROMPT, with_n(SEEDED, 8))
    assert llm.step() == []  # the first sample prefills all but the last prompt token; no logits yet
    assert steps == [99] and llm.stats().blocks_used == 7
    outs = llm.step()  # 7 samples fork off it; each computes the last prompt token and samples
    assert steps == [99, 8]
    assert sorted(o.index for o in outs) == list(range(8)) and {o.request_id for o in outs} == {rid}
    samples = llm.requests[rid]
    full = samples[0].block_table[:6]
    assert all(s.block_table[:6] == full for s in samples)
    assert all(llm.pool.blocks[b].ref_count == 8 for b in full)
    assert len({s.block_table[6] for s in samples}) == 8  # the partial block: a copy each
    assert llm.stats().blocks_used == 6 + 8  # the prompt's full blocks once, not 8 times
    while llm.has_unfinished_requests():
        llm.step()
    assert sum(steps) == 99 + 8 * 12
    assert llm.kv.prefix_queries == len(PROMPT)  # the request counted once towards the prefix-hit rate
    assert_clean(llm)


def test_seeded_samples_differ_and_are_reproducible(llm):
    eight = llm.generate(PROMPT, with_n(SEEDED, 8))
    assert [o.index for o in eight] == list(range(8))
    assert len({tuple(o.token_ids) for o in eight}) == 8
    assert [o.token_ids for o in llm.generate(PROMPT, with_n(SEEDED, 8))] == [o.token_ids for o in eight]
    four = llm.generate(PROMPT, with_n(SEEDED, 4))  # sample i does not depend on n
    assert [o.token_ids for o in four] == [o.token_ids for o in eight[:4]]
    alone = llm.generate(PROMPT, SEEDED)[0]  # sample 0 draws from the seed's own stream
    assert alone.token_ids == eight[0].token_ids
    other_seed = llm.generate(PROMPT, with_n(SEEDED, 2, seed=8))
    assert other_seed[0].token_ids not in [o.token_ids for o in eight]
    assert_clean(llm)


def test_unseeded_samples_differ(llm):
    outs = llm.generate(PROMPT, with_n(SEEDED, 4, seed=None))
    assert len({tuple(o.token_ids) for o in outs}) == 4


@pytest.mark.parametrize("length", [1, 17, 33, 100])  # no block, a full block before the last token, partial
def test_greedy_samples_are_the_greedy_reply(llm, length):
    prompt = PROMPT[:length]
    alone = llm.generate(prompt, GREEDY)[0].token_ids
    for _ in range(2):  # cold, then with the prompt cached (for 17 and 33 the first sample then computes nothing)
        outs = llm.generate(prompt, with_n(GREEDY, 4))
        assert [o.token_ids for o in outs] == [alone] * 4
        assert all(o.finish_reason == "length" for o in outs)
    assert_clean(llm)


def test_generate_returns_each_prompt_samples_in_order(llm):
    outs = llm.generate([PROMPT[:20], PROMPT[:30], PROMPT[:40]], [with_n(GREEDY, 2), GREEDY, with_n(GREEDY, 3)])
    assert [(len(o.prompt_token_ids), o.index) for o in outs] == [(20, 0), (20, 1), (30, 0), (40, 0), (40, 1), (40, 2)]


def test_chunked_prefill_then_fork(tiny_llm):
    small_budget = tiny_llm(max_num_batched_tokens=32)
    outs = small_budget.generate(PROMPT, with_n(SEEDED, 3))
    whole = tiny_llm().generate(PROMPT, with_n(SEEDED, 3))
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
    assert_clean(small_budget)


def test_samples_without_the_prefix_cache(tiny_llm):
    llm = tiny_llm(enable_prefix_caching=False)
    alone = llm.generate(PROMPT, GREEDY)[0].token_ids
    assert [o.token_ids for o in llm.generate(PROMPT, with_n(GREEDY, 4))] == [alone] * 4
    assert_clean(llm)


def test_preempted_samples_recompute_to_the_same_tokens(tiny_llm):
    params = with_n(SEEDED, 6, max_tokens=60)
    roomy = tiny_llm().generate(PROMPT, params)
    probe = tiny_llm()
    # 6 shared prompt blocks + 6 x 4 of their own do not fit in 20
    tight = tiny_llm(kv_cache_memory=probe.block_bytes * 20, max_model_len=256)
    assert tight.pool.num_blocks == 20
    outs = tight.generate(PROMPT, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert_clean(tight)


def test_abort_ends_every_sample_before_and_after_the_fork(tiny_llm):
    llm = tiny_llm(max_num_batched_tokens=32)
    rid = llm.add_request(PROMPT, with_n(SEEDED, 4))
    llm.step()  # mid-prefill: the other samples still wait to fork
    assert llm.stats().blocks_used > 0
    llm.abort(rid)
    assert_clean(llm)
    rid = llm.add_request(PROMPT, with_n(SEEDED, 4))
    while not llm.step() or len(llm.scheduler.running) < 4:
        pass
    llm.abort(rid)
    assert_clean(llm)
    with pytest.raises(RequestError, match="no running request"):
        llm.abort(rid)


def test_prefix_cache_serves_the_prompt_afterwards(llm):
    llm.generate(PROMPT, with_n(SEEDED, 8))
    again = llm.generate(PROMPT, GREEDY)[0]
    assert again.metrics.cached_tokens == 96  # every full block before the last token
    assert_clean(llm)


def test_each_sample_stops_on_its_own(llm):
    """A stop string ends each sample where it first appears; the others run on to max_tokens."""
    free = llm.generate(PROMPT, with_n(SEEDED, 8, max_tokens=16))
    pieces = [o.text[i : i + 3] for o in free for i in range(4, len(o.text) - 3)]
    stop = next(p for p in pieces if p.strip() and sum(p in o.text for o in free) in range(1, 8))
    outs = llm.generate(PROMPT, with_n(SEEDED, 8, max_tokens=16, stop=[stop]))
    for o, f in zip(outs, free):
        if stop in f.text:
            assert o.finish_reason == "stop" and o.text == f.text[: f.text.index(stop)]
        else:
            assert o.finish_reason == "length" and o.token_ids == f.token_ids
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    assert_clean(llm)


def test_step_outputs_per_sample_and_the_request_ends_with_its_last(llm):
    rid = llm.add_request(PROMPT[:40], SamplingParams(n=3, max_tokens=4, temperature=0.0, ignore_eos=True))
    seen: dict[int, int] = {}
    while llm.has_unfinished_requests():
        outs = llm.step()
        assert len({out.index for out in outs}) == len(outs)  # one output a sample a step (with all its new tokens)
        for out in outs:
            seen[out.index] = len(out.token_ids)
            assert out.request_id == rid
            assert (rid in llm.requests) == any(not s.is_finished for s in llm.requests.get(rid, []))
    assert seen == {0: 4, 1: 4, 2: 4}
    assert_clean(llm)


def test_more_samples_than_max_num_seqs_is_refused(tiny_llm):
    llm = tiny_llm(max_num_seqs=4)
    with pytest.raises(RequestError, match="n=5 samples cannot run at once with max_num_seqs=4"):
        llm.add_request(PROMPT, with_n(SEEDED, 5))
    assert_clean(llm)


@pytest.mark.parametrize("engine_process", [False, True])
def test_async_llm_streams_every_sample(tiny_model_path, llm, engine_process):
    want = [o.token_ids for o in llm.generate(PROMPT, with_n(SEEDED, 4))]
    engine = AsyncLLM(
        str(tiny_model_path),
        engine_process=engine_process,
        dtype="float32",
        device=DEVICE,
        kv_cache_memory="32MiB",
        max_model_len=512,
    )
    try:

        async def run() -> tuple[dict[int, list], list]:
            by_index: dict[int, list] = {}
            async for out in engine.stream(PROMPT, with_n(SEEDED, 4), request_id="r"):
                by_index.setdefault(out.index, []).append(out)
            aborted = []
            async for out in engine.stream(PROMPT, with_n(SEEDED, 4, max_tokens=200), request_id="a"):
                if out.index == 2 and len(out.token_ids) == 3 and not out.finished:
                    await engine.abort("a")
                aborted.append(out)
            return by_index, aborted

        by_index, aborted = asyncio.run(run())
        assert sorted(by_index) == [0, 1, 2, 3]
        assert [outs[-1].token_ids for _, outs in sorted(by_index.items())] == want
        assert all(outs[-1].finished and not any(o.finished for o in outs[:-1]) for outs in by_index.values())
        assert all(outs[-1].text == "".join(o.delta for o in outs) for outs in by_index.values())
        finals = [o for o in aborted if o.finished]
        assert sorted(o.index for o in finals) == [0, 1, 2, 3]
        assert {o.finish_reason for o in finals} == {"abort"}
        assert engine.stats().blocks_used == 0
    finally:
        engine.shutdown()


def test_a_failed_step_before_the_fork_ends_every_sample(tiny_llm, monkeypatch):
    llm = tiny_llm()
    run = llm.runner.run
    calls = 0

    def fail_first(batch):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the device fell over")
        return run(batch)

    monkeypatch.setattr(llm.runner, "run", fail_first)
    rid = llm.add_request(PROMPT, with_n(SEEDED, 3))
    outs = llm.step()
    assert sorted(o.index for o in outs) == [0, 1, 2] and {o.request_id for o in outs} == {rid}
    assert all(o.finished and o.finish_reason == "error" and "the device fell over" in o.error for o in outs)
    assert_clean(llm)
    assert len(llm.generate(PROMPT, with_n(SEEDED, 3))) == 3

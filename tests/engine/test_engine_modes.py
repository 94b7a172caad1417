"""AsyncLLM and Session on the tiny real model, with the engine core in its own process and on a thread.

The two modes must behave the same to every caller: same greedy text, same block accounting, same
errors. Speed is measured by benchmarks/app_speed.py, never asserted here.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from localpaged.chat.session import Session
from localpaged.chat.store import ChatStore
from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.protocol import EngineClient
from localpaged.errors import RequestError
from localpaged.sampling import SamplingParams
from tests.support import wait_until

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
LONG = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
TINY = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "64MiB", "max_model_len": 1024}


@pytest.fixture(scope="module", params=["process", "thread"])
def engine(request, tiny_model_path: Path):
    engine = AsyncLLM(str(tiny_model_path), engine_process=request.param == "process", **TINY)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_model_path: Path) -> dict[str, str]:
    """The synchronous LLM's greedy replies: what both modes must give."""
    from localpaged import LLM

    llm = LLM(str(tiny_model_path), **TINY)
    prompts = [f"Question {i}: tell me about the number {i}." for i in range(6)]
    return {prompt: out.text for prompt, out in zip(prompts, llm.generate(prompts, GREEDY))}


async def collect(engine: AsyncLLM, prompt, params=GREEDY, request_id=None):
    return [out async for out in engine.stream(prompt, params, request_id=request_id)]


def test_is_an_engine_client(engine: AsyncLLM) -> None:
    assert isinstance(engine, EngineClient)


def test_stream_and_iter_stream_agree_with_the_synchronous_engine(engine: AsyncLLM, expected: dict) -> None:
    prompt, text = next(iter(expected.items()))
    async_outputs = asyncio.run(collect(engine, prompt))
    sync_outputs = list(engine.iter_stream(prompt, GREEDY))
    for outputs in (async_outputs, sync_outputs):
        assert outputs[-1].finished and all(not out.finished for out in outputs[:-1])
        assert "".join(out.delta for out in outputs) == outputs[-1].text == text
        assert len(outputs[-1].token_ids) == outputs[-1].metrics.generated_tokens
        assert outputs[-1].prompt_token_ids == engine.tokenizer.encode(prompt, add_special_tokens=False)
        for before, after in itertools.pairwise(outputs):  # a stream grows: each output's tokens start the next's
            assert after.token_ids[: len(before.token_ids)] == before.token_ids
    # How the tokens are split into outputs may differ: speculation takes more a step once it has seen the reply.
    assert async_outputs[-1].token_ids == sync_outputs[-1].token_ids


def test_many_streams_at_once_match_the_synchronous_engine(engine: AsyncLLM, expected: dict) -> None:
    async def main():
        return await asyncio.gather(*(collect(engine, prompt) for prompt in expected))

    results = asyncio.run(main())
    assert [outputs[-1].text for outputs in results] == list(expected.values())
    assert engine.stats().blocks_used == 0


def test_logprobs_cross_to_the_front_end_as_the_synchronous_engine_gives_them(
    engine: AsyncLLM, tiny_model_path
) -> None:
    """Every streamed output holds one TokenLogprob per token id so far, and the last equals LLM's."""
    from localpaged import LLM

    params = [
        SamplingParams(max_tokens=12, temperature=0, logprobs=3, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=1.0, seed=4, logprobs=0, min_p=0.05, ignore_eos=True),
    ]
    prompt = "Tell me about the number 7."
    want = LLM(str(tiny_model_path), **TINY).generate([prompt, prompt], params)
    for p, expected in zip(params, want):
        outputs = asyncio.run(collect(engine, prompt, p))
        assert all(len(out.logprobs) == len(out.token_ids) for out in outputs)
        assert outputs[-1].token_ids == expected.token_ids
        for got, lp in zip(outputs[-1].logprobs, expected.logprobs):  # equal to float32 rounding
            assert got.token_id == lp.token_id and [t for t, _ in got.top] == [t for t, _ in lp.top]
            assert got.logprob == pytest.approx(lp.logprob, abs=1e-4)
    assert asyncio.run(collect(engine, prompt))[-1].logprobs is None


def test_abort_frees_blocks_and_ends_the_stream(engine: AsyncLLM) -> None:
    async def main():
        streams = [engine.stream(f"request {i} " * 5, LONG, request_id=f"abort-{i}") for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        assert engine.stats().blocks_used > 0
        for i in range(3):
            await engine.abort(f"abort-{i}")
        for stream in streams:
            assert [out.finish_reason async for out in stream][-1] == "abort"

    asyncio.run(main())
    assert engine.stats().blocks_used == 0
    with pytest.raises(RequestError, match="no request"):
        asyncio.run(engine.abort("abort-0"))


def test_a_consumer_that_leaves_aborts_its_request(engine: AsyncLLM) -> None:
    stream = engine.iter_stream("walk away from me", LONG)
    next(stream)
    stream.close()
    wait_until(lambda: engine.stats().running == 0)
    assert engine.stats().blocks_used == 0


def test_a_bad_request_fails_only_its_own_consumer(engine: AsyncLLM, expected: dict) -> None:
    prompt, text = next(iter(expected.items()))

    async def main():
        good = asyncio.create_task(collect(engine, prompt))
        with pytest.raises(RequestError, match="empty"):
            await collect(engine, "")
        with pytest.raises(RequestError, match="max_model_len"):
            await collect(engine, list(range(5, 2000)))
        return await good

    assert asyncio.run(main())[-1].text == text


def test_a_duplicate_request_id_fails_only_the_newcomer(engine: AsyncLLM) -> None:
    async def main():
        first = engine.stream("the first one", LONG, request_id="same")
        await first.__anext__()
        with pytest.raises(RequestError, match="already in flight"):
            await collect(engine, "the second one", request_id="same")
        await engine.abort("same")
        assert [out.finish_reason async for out in first][-1] == "abort"

    asyncio.run(main())


def test_what_the_front_ends_read(engine: AsyncLLM, tiny_model_path: Path) -> None:
    assert engine.info.model_name == tiny_model_path.name
    assert engine.info.max_model_len == 1024 and engine.info.device == "cpu"
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.encode_chat(messages)
    assert ids and engine.tokenizer.decode(ids).count("hi") == 1
    stats = engine.stats()
    assert stats.blocks_total > 0 and stats.running == 0
    kv = engine.kv_map(ids)
    assert len(kv.states) == stats.blocks_total and kv.block_size == 16


def test_sessions_store_replies_and_reuse_cached_blocks(engine: AsyncLLM, tmp_path: Path) -> None:
    with ChatStore(tmp_path / "chats.db") as store:
        session = Session.new(engine, store, system="You are a tiny test model. " * 6)
        first = session.send("Tell me about paged attention.", GREEDY)
        assert first.status == "complete" and first.content and first.completion_tokens
        second = "".join(session.stream("And prefix caching?", GREEDY))
        assert session.history[-1].content == second and session.history[-1].status == "complete"
        assert session.last_metrics.cached_tokens >= 32  # the system prompt's full blocks, at least

        async def a_turn():
            return "".join([d async for d in session.astream("And the block pool?", GREEDY)])

        third = asyncio.run(a_turn())
        assert session.history[-1].content == third
        assert [m.role for m in session.history] == ["user", "assistant"] * 3


def test_stop_keeps_the_partial_reply(engine: AsyncLLM, tmp_path: Path) -> None:
    with ChatStore(tmp_path / "chats.db") as store:
        session = Session.new(engine, store)

        async def main():
            seen = []
            async for delta in session.astream("Go on for a long time.", LONG):
                seen.append(delta)
                if len(seen) == 5:
                    await session.stop()
            return "".join(seen)

        text = asyncio.run(main())
        reply = session.history[-1]
        assert reply.status == "partial" and reply.content == text
    assert engine.stats().blocks_used == 0


def test_the_front_end_of_a_core_process_needs_no_torch(tiny_model_path: Path) -> None:
    """The app's process stays light: its tokenizer loads without torch, and it matches the core's."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from localpaged.engine.async_llm import AsyncLLM\n"
        f"engine = AsyncLLM({str(tiny_model_path)!r}, **{TINY!r})\n"
        "print(engine.generate_text('hello', None).finished, 'torch' in sys.modules)\n"
        "engine.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.split() == ["True", "False"], done.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_front_end_encodes_as_the_engine(arch: str, tiny_model_path: Path, tiny_qwen2_path: Path) -> None:
    """The light tokenizer where it agrees with AutoTokenizer (llama here), AutoTokenizer where it does not
    (the qwen2 class treats the copied tokenizer files its own way): either way the same ids as the core."""
    from localpaged.engine.tokenizer import PROBE, encode_chat, load_tokenizer

    folder = tiny_model_path if arch == "llama" else tiny_qwen2_path
    with AsyncLLM(str(folder), **TINY) as engine:
        full = load_tokenizer(folder)
        assert engine.encode_chat(PROBE) == encode_chat(full, PROBE)
        conversation = [{"role": "user", "content": "Paged attention, 世界 — ünïcode\n\ttabs"}]
        assert engine.encode_chat(conversation) == encode_chat(full, conversation)

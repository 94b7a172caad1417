"""AsyncLLM: streams share the engine thread's steps; abort, errors and shutdown behave.

These tests drive a FakeLLM (milliseconds, deterministic, can be told to fail a step); the same
behaviour on the real tiny engine, in both modes, is in test_engine_modes.py.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import LocalpagedError, RequestError
from localpaged.sampling import SamplingParams
from tests.engine.fake_llm import FakeLLM
from tests.support import wait_until

REPO = Path(__file__).resolve().parent.parent.parent
GREEDY = SamplingParams(max_tokens=400, temperature=0.0)


async def collect(engine: AsyncLLM, prompt, params=GREEDY, request_id=None):
    return [out async for out in engine.stream(prompt, params, request_id=request_id)]


def test_stream_deltas_add_up_to_the_text(engine: AsyncLLM, fake: FakeLLM) -> None:
    outputs = asyncio.run(collect(engine, "hello"))
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert all(not out.finished for out in outputs[:-1])
    assert "".join(out.delta for out in outputs) == outputs[-1].text == fake.reply(fake.tokenizer.encode("hello"))


def test_many_streams_share_each_step(engine: AsyncLLM, fake: FakeLLM) -> None:
    fake.step_delay = 0.002  # all eight arrive while the first step runs
    prompts = [f"prompt number {i}" for i in range(8)]

    async def main():
        return await asyncio.gather(*(collect(engine, p) for p in prompts))

    results = asyncio.run(main())
    for prompt, outputs in zip(prompts, results):
        assert outputs[-1].text == fake.reply(fake.tokenizer.encode(prompt))
    longest = max(len(outputs[-1].text) for outputs in results)
    # Batched: about one step per token of the longest reply, far fewer than one per token of all.
    assert fake.steps <= longest + 4
    assert fake.steps < sum(len(outputs[-1].text) for outputs in results) / 2


def test_idle_engine_does_not_step(engine: AsyncLLM, fake: FakeLLM) -> None:
    asyncio.run(collect(engine, "hi"))
    steps = fake.steps
    time.sleep(0.2)
    assert fake.steps == steps


def test_abort_frees_blocks_and_ends_the_stream(fake: FakeLLM) -> None:
    fake.reply = lambda ids: "x" * 1000
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)

    async def main():
        stream = engine.stream("long one", GREEDY, request_id="r1")
        first = await stream.__anext__()
        assert engine.stats().blocks_used > 0
        await engine.abort("r1")
        assert engine.stats().blocks_used == 0
        rest = [out async for out in stream]
        return first, rest

    try:
        first, rest = asyncio.run(main())
    finally:
        engine.shutdown()
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert rest[-1].delta == ""
    assert len(rest[-1].text) >= len(first.text) > 0


def test_abort_of_an_unknown_request_is_a_request_error(engine: AsyncLLM) -> None:
    with pytest.raises(RequestError, match="no request 'nope'"):
        asyncio.run(engine.abort("nope"))


def test_a_consumer_that_leaves_aborts_its_request(fake: FakeLLM) -> None:
    fake.reply = lambda ids: "y" * 1000
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)

    async def main():
        async for out in engine.stream("leave early", GREEDY):
            if len(out.text) >= 3:
                break

    try:
        asyncio.run(main())
        wait_until(lambda: engine.stats().running == 0)
        assert engine.stats().blocks_used == 0
    finally:
        engine.shutdown()


def test_a_cancelled_consumer_aborts_its_request(fake: FakeLLM) -> None:
    fake.reply = lambda ids: "z" * 1000
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)

    async def main():
        task = asyncio.create_task(collect(engine, "cancel me"))
        while engine.stats().running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        wait_until(lambda: engine.stats().running == 0)
        assert engine.stats().blocks_used == 0
    finally:
        engine.shutdown()


def test_a_bad_request_fails_only_its_own_consumer(engine: AsyncLLM, fake: FakeLLM) -> None:
    async def main():
        return await asyncio.gather(collect(engine, "fine"), collect(engine, ""), return_exceptions=True)

    good, bad = asyncio.run(main())
    assert isinstance(bad, RequestError) and "empty" in str(bad)
    assert good[-1].finish_reason == "stop"


def test_a_duplicate_request_id_fails_only_the_newcomer(fake: FakeLLM) -> None:
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)

    async def main():
        first = asyncio.create_task(collect(engine, "first", request_id="same"))
        while engine.stats().running == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(RequestError, match="already"):
            await collect(engine, "second", request_id="same")
        return await first

    try:
        outputs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outputs[-1].finish_reason == "stop"


def test_a_failing_step_fails_every_stream_in_flight_and_the_engine_goes_on(fake: FakeLLM) -> None:
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)

    async def main():
        tasks = [asyncio.create_task(collect(engine, f"p{i}")) for i in range(3)]
        while engine.stats().running < 3:
            await asyncio.sleep(0.001)
        fake.fail_next_step = RuntimeError("GPU on fire")
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(main())
        for result in results:
            assert isinstance(result, LocalpagedError)
            assert "engine failed" in str(result) and "GPU on fire" in str(result)
        assert engine.stats().blocks_used == 0
        assert engine.generate_text("after the failure", GREEDY).finish_reason == "stop"
    finally:
        engine.shutdown()


def test_shutdown_is_idempotent_and_ends_the_thread(fake: FakeLLM) -> None:
    engine = AsyncLLM(llm=fake)
    thread = engine._core._thread
    engine.shutdown()
    engine.shutdown()
    assert not thread.is_alive()
    with pytest.raises(RequestError, match="shut down"):
        engine.generate_text("too late")


def test_shutdown_ends_streams_in_flight(fake: FakeLLM) -> None:
    fake.reply = lambda ids: "w" * 10_000
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)
    errors = []

    def consume():
        try:
            for _ in engine.iter_stream("forever", GREEDY):
                pass
        except RequestError as exc:
            errors.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    wait_until(lambda: fake.steps > 2)
    engine.shutdown()
    consumer.join(timeout=5)
    assert not consumer.is_alive()
    assert errors and "shut down" in str(errors[0])


def test_sync_wrappers_work_without_an_event_loop(engine: AsyncLLM, fake: FakeLLM) -> None:
    final = engine.generate_text("sync", GREEDY)
    assert final.finished and final.text == fake.reply(fake.tokenizer.encode("sync"))
    deltas = [out.delta for out in engine.iter_stream("sync", GREEDY)]
    assert "".join(deltas) == final.text


def test_closing_a_sync_stream_aborts_it(fake: FakeLLM) -> None:
    fake.reply = lambda ids: "v" * 1000
    fake.step_delay = 0.002
    engine = AsyncLLM(llm=fake)
    try:
        stream = engine.iter_stream("close me", GREEDY)
        next(stream)
        stream.close()
        wait_until(lambda: engine.stats().running == 0)
        assert engine.stats().blocks_used == 0
    finally:
        engine.shutdown()


def test_pass_throughs(engine: AsyncLLM, fake: FakeLLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert engine.encode_chat(messages) == fake.encode_chat(messages)
    assert isinstance(engine.tokenizer, type(fake.tokenizer)) and engine.tokenizer is not fake.tokenizer  # a copy
    assert engine.config is fake.config
    assert engine.info is fake.info
    assert engine.stats().blocks_total == fake.config.num_blocks
    assert engine.kv_map() == fake.kv_map()


def test_ctrl_c_in_a_script_does_not_hang() -> None:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.sigint_child"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "streaming\n", child.stderr.read()
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)  # every thread's stack, to see where it hangs
            time.sleep(1)
            child.kill()
            pytest.fail("the script did not exit after Ctrl-C; its threads:\n" + child.communicate()[1][-6000:])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "KeyboardInterrupt" in child.stderr.read()


def test_prompts_are_encoded_and_checked_in_the_front_end(engine: AsyncLLM, fake: FakeLLM) -> None:
    """The core is sent token ids only: no prompt's text costs its step loop anything, and one that cannot fit the
    context is refused here (by its length in characters first, before any time goes into encoding it)."""
    sent: list[object] = []
    add_request = fake.add_request

    def recording(prompt, params=None, request_id=None):
        sent.append(prompt)
        return add_request(prompt, params, request_id)

    fake.add_request = recording  # type: ignore[method-assign]
    messages = [{"role": "user", "content": "hi"}]
    engine.generate_text("hello", GREEDY)
    engine.generate_text(messages, GREEDY)
    assert sent == [fake.tokenizer.encode("hello"), fake.encode_chat(messages)]
    with pytest.raises(RequestError, match=r"has 8000000 characters, more than the context could hold .* 8192"):
        next(engine.iter_stream("x" * 8_000_000))
    with pytest.raises(RequestError, match="more than the context could hold"):
        next(engine.iter_stream([{"role": "user", "content": "y" * 9000}]))
    with pytest.raises(RequestError, match="the prompt is 9000 tokens but the context holds 8192"):
        next(engine.iter_stream([7] * 9000))
    with pytest.raises(RequestError, match="the prompt is empty"):
        next(engine.iter_stream(""))
    assert len(sent) == 2 and engine.stats().running == 0  # nothing refused reached the core


def test_a_refused_prompt_is_refused_to_its_own_stream(engine: AsyncLLM) -> None:
    async def both() -> tuple[BaseException | None, bool]:
        async def refused() -> None:
            async for _ in engine.stream("z" * 100_000):
                pass

        async def fine() -> bool:
            async for out in engine.stream("fine", GREEDY):
                last = out
            return last.finished

        results = await asyncio.gather(refused(), fine(), return_exceptions=True)
        return results[0], results[1]

    error, finished = asyncio.run(both())
    assert isinstance(error, RequestError) and "more than the context could hold" in str(error)
    assert finished is True

"""Session: storage of every turn, prompts over the whole history, branching, and bad input.

The storage and bookkeeping tests drive a FakeLLM; the tests about what the engine does with
the prompts (prefix reuse, greedy equality under concurrency, a kill mid-stream) run the real
tiny engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localpaged.chat.session import SAVE_EVERY_S, Session, title_from
from localpaged.chat.store import ChatStore
from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import LocalpagedError, RequestError, UnknownSessionError
from localpaged.sampling import SamplingParams
from tests.engine.fake_llm import FakeLLM

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


@pytest.fixture
def store(tmp_path: Path):
    store = ChatStore(tmp_path / "chats.db")
    yield store
    store.close()


def expected_reply(fake: FakeLLM, session: Session, upto: list[dict]) -> str:
    system = [{"role": "system", "content": session.system}] if session.system else []
    return fake.reply(fake.encode_chat(system + upto))


# ----- turns and storage ------------------------------------------------------------------


def test_send_stores_both_messages_with_metrics(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    session = Session.new(engine, store, system="Be brief.")
    reply = session.send("What is a block?", GREEDY)
    user, assistant = session.history
    assert (user.role, user.content, user.status) == ("user", "What is a block?", "complete")
    assert assistant.id == reply.id and assistant.role == "assistant" and assistant.status == "complete"
    assert reply.content == expected_reply(fake, session, [{"role": "user", "content": "What is a block?"}])
    assert reply.completion_tokens == len(reply.content)
    assert reply.prompt_tokens == len(
        fake.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}])
    )
    assert reply.cached_tokens == 0 and reply.model == fake.info.model_name and reply.ttft_s is not None
    assert session.last_metrics is not None and session.last_metrics.generated_tokens == len(reply.content)
    assert session.title == "What is a block?" == store.get_session(session.id).title
    assert not session.generating


def test_each_turn_replays_the_whole_history(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    prompts: list[list[int]] = []
    fake.reply = lambda ids: prompts.append(ids) or f"answer {len(prompts)}"
    session = Session.new(engine, store, system="sys")
    session.send("one", GREEDY)
    session.send("two", GREEDY)
    turn_two = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "two"},
    ]
    assert prompts[1] == fake.encode_chat(turn_two)
    assert session.context_tokens() == len(fake.encode_chat(turn_two + [{"role": "assistant", "content": "answer 2"}]))


def test_stream_yields_deltas_and_the_reply_is_saved_while_it_grows(
    engine: AsyncLLM, store: ChatStore, fake: FakeLLM
) -> None:
    fake.reply = lambda ids: "slow words " * 30
    fake.step_delay = 0.005  # 330 steps, about 1.7 s in all: several throttled saves
    session = Session.new(engine, store)
    seen_partial = []
    deltas = []
    for delta in session.stream("tell me", SamplingParams(max_tokens=400)):
        deltas.append(delta)
        stored = session.history[-1]
        if stored.status == "partial" and stored.content:
            seen_partial.append(stored.content)
    assert "".join(deltas) == "slow words " * 30
    assert seen_partial, "the growing reply was never saved mid-stream"
    assert len(set(seen_partial)) >= 2  # saved more than once...
    assert len(set(seen_partial)) <= 2.5 / SAVE_EVERY_S  # ...but throttled
    assert session.history[-1].status == "complete"


def test_astream_stores_like_stream(engine: AsyncLLM, store: ChatStore) -> None:
    session = Session.new(engine, store)

    async def main():
        return "".join([delta async for delta in session.astream("async hello", GREEDY)])

    text = asyncio.run(main())
    assert [m.role for m in session.history] == ["user", "assistant"]
    assert session.history[-1].content == text and session.history[-1].status == "complete"


def test_stop_keeps_the_partial_reply(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    fake.reply = lambda ids: "z" * 5000
    fake.step_delay = 0.002
    session = Session.new(engine, store)

    async def main():
        got = ""
        async for delta in session.astream("go on forever", SamplingParams(max_tokens=4000)):
            got += delta
            if len(got) >= 10:
                await session.stop()
        return got

    text = asyncio.run(main())
    reply = session.history[-1]
    assert reply.status == "partial" and reply.content == text and len(text) >= 10
    assert engine.stats().blocks_used == 0
    assert not session.generating


def test_breaking_out_of_a_stream_keeps_the_partial_reply(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    fake.reply = lambda ids: "q" * 5000
    session = Session.new(engine, store)
    stream = session.stream("stop early", SamplingParams(max_tokens=4000))
    got = next(stream) + next(stream)
    stream.close()
    reply = session.history[-1]
    assert reply.status == "partial" and reply.content.startswith(got)


def test_an_engine_failure_is_stored_as_an_error(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    fake.reply = lambda ids: "p" * 5000
    fake.step_delay = 0.002
    session = Session.new(engine, store)
    stream = session.stream("fail please", SamplingParams(max_tokens=4000))
    next(stream)
    fake.fail_next_step = RuntimeError("device lost")
    with pytest.raises(LocalpagedError, match="device lost"):
        for _ in stream:
            pass
    reply = session.history[-1]
    assert reply.status == "error" and "device lost" in reply.error
    assert not session.generating
    # The failed reply is not replayed: the next turn's prompt holds both user messages only.
    assert session.engine_messages() == [{"role": "user", "content": "fail please"}]
    fake.reply = lambda ids: "ok"
    reply = session.send("again", GREEDY)
    assert [m.role for m in session.history] == ["user", "assistant", "user", "assistant"]
    turns = [{"role": "user", "content": "fail please"}, {"role": "user", "content": "again"}]
    assert reply.prompt_tokens == len(fake.encode_chat(turns))


def test_regenerate_replaces_the_last_reply(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    answers = iter(["first answer", "second answer", "third answer"])
    fake.reply = lambda ids: next(answers)
    session = Session.new(engine, store)
    session.send("question", GREEDY)
    old = session.history[-1]
    new = session.regenerate(GREEDY)
    assert new.content == "second answer" and new.id != old.id
    assert [(m.role, m.content) for m in session.history] == [("user", "question"), ("assistant", "second answer")]

    async def main():
        return "".join([d async for d in session.aregenerate(GREEDY)])

    assert asyncio.run(main()) == "third answer"
    assert [m.content for m in session.history] == ["question", "third answer"]


def test_regenerate_without_a_user_message_is_a_request_error(engine: AsyncLLM, store: ChatStore) -> None:
    with pytest.raises(RequestError, match="no user message"):
        Session.new(engine, store).regenerate()


def test_fork_and_fork_before(engine: AsyncLLM, store: ChatStore) -> None:
    session = Session.new(engine, store, system="sys")
    session.send("one", GREEDY)
    session.send("two", GREEDY)
    u1, a1, u2, _a2 = session.history

    fork = session.fork(a1.id)
    assert fork.id != session.id and fork.parent_id == session.id and fork.system == "sys"
    assert [(m.role, m.content) for m in fork.history] == [(m.role, m.content) for m in (u1, a1)]
    fork.send("other two", GREEDY)
    assert [m.content for m in fork.history][:3] == ["one", a1.content, "other two"]
    assert len(session.history) == 4  # the original is untouched

    before = session.fork_before(u2.id)
    assert [m.content for m in before.history] == ["one", a1.content]
    first = session.fork_before(u1.id)
    assert first.history == [] and first.system == "sys" and first.parent_id == session.id
    with pytest.raises(RequestError, match="not part of session"):
        session.fork_before(10_000)


def test_round_trip_through_a_fresh_process(engine: AsyncLLM, tmp_path: Path) -> None:
    db = tmp_path / "chats.db"
    with ChatStore(db) as store:
        session = Session.new(engine, store, system="sys", prompt_name="general")
        session.send("hello there", GREEDY)
        session.send("and again", GREEDY)
        fork = session.fork(session.history[1].id)
        fork.send("forked question", GREEDY)
        fork.regenerate(GREEDY)
        expected = {s.id: [[m.role, m.content, m.status] for m in s.history] for s in (session, fork)}

    reader = (
        "import json, sys\n"
        "from localpaged.chat.store import ChatStore\n"
        "store = ChatStore(sys.argv[1])\n"
        "print(json.dumps({s.id: [[m.role, m.content, m.status] for m in store.messages(s.id)]"
        " for s in store.list_sessions()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", reader, str(db)], capture_output=True, text=True, cwd=REPO, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected

    with ChatStore(db) as store:
        again = Session.load(engine, store, session.id)
        assert (again.title, again.system, again.prompt_name) == ("hello there", "sys", "general")
        assert [[m.role, m.content, m.status] for m in again.history] == expected[session.id]


def test_rename_delete_and_export(engine: AsyncLLM, store: ChatStore) -> None:
    session = Session.new(engine, store, system="Be kind.", title="Kindness")
    session.send("hi", GREEDY)
    assert session.title == "Kindness"  # an explicit title is kept
    session.rename("Renamed")
    assert store.get_session(session.id).title == "Renamed"
    text = session.export_markdown()
    assert text.startswith("# Renamed\n")
    assert "## System\n\nBe kind." in text and "## User\n\nhi" in text and "## Assistant\n\n" in text
    session.delete()
    with pytest.raises(UnknownSessionError):
        Session.load(engine, store, session.id)


def test_titles_are_one_short_line() -> None:
    assert title_from("  hello\n  world  ") == "hello world"
    long = title_from("word " * 40)
    assert len(long) <= 50 and long.endswith("…") and "\n" not in long


# ----- bad input --------------------------------------------------------------------------


def test_unknown_session_id(engine: AsyncLLM, store: ChatStore) -> None:
    with pytest.raises(UnknownSessionError, match="no-such-id"):
        Session.load(engine, store, "no-such-id")


def test_empty_message_is_refused_before_anything_is_stored(engine: AsyncLLM, store: ChatStore) -> None:
    session = Session.new(engine, store)
    with pytest.raises(RequestError, match="empty"):
        session.send("   ")
    assert session.history == []


def test_context_overflow_says_by_how_much(store: ChatStore) -> None:
    fake = FakeLLM(max_model_len=200)
    with AsyncLLM(llm=fake) as engine:
        session = Session.new(engine, store)
        prompt_len = len(fake.encode_chat([{"role": "user", "content": "x" * 150}]))
        with pytest.raises(RequestError) as caught:
            session.send("x" * 150, SamplingParams(max_tokens=64))
        message = str(caught.value)
        assert f"{prompt_len + 64 - 200} tokens over the limit of 200" in message
        assert "truncate=True" in message
        assert session.history == []  # nothing half-done was stored


def test_truncate_drops_the_oldest_turns_and_says_so(store: ChatStore) -> None:
    prompts: list[str] = []
    fake = FakeLLM(max_model_len=300, reply=lambda ids: prompts.append(fake.tokenizer.decode(ids)) or "r" * 20)
    with AsyncLLM(llm=fake) as engine:
        session = Session.new(engine, store, system="SYSTEM", truncate=True)
        params = SamplingParams(max_tokens=40)
        for i in range(8):
            session.send(f"message {i} " + "m" * 20, params)
        assert session.warning and "exchange(s) were left out" in session.warning
        assert len(session.history) == 16  # everything stays stored
        # The newest prompt kept the system prompt and the newest message, dropped whole
        # exchanges from the front, and fits.
        last = prompts[-1]
        assert last.startswith("<system>SYSTEM\n<user>message ")
        assert "message 0 " not in last and "message 7 " in last
        assert len(last) + 40 <= 300

        reloaded = Session.load(engine, store, session.id)
        with pytest.raises(RequestError, match="tokens over the limit"):
            reloaded.send("one more " + "m" * 20, params)


def test_a_session_generates_one_reply_at_a_time(engine: AsyncLLM, store: ChatStore, fake: FakeLLM) -> None:
    fake.reply = lambda ids: "n" * 5000
    session = Session.new(engine, store)
    stream = session.stream("first", SamplingParams(max_tokens=4000))
    next(stream)
    with pytest.raises(RequestError, match="already generating"):
        session.send("second")
    stream.close()


# ----- the real tiny engine ---------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_turn_two_reuses_the_cached_blocks_of_turn_one(tiny_llm, store: ChatStore) -> None:
    llm = tiny_llm()
    block = llm.resolved.block_size
    with AsyncLLM(llm=llm) as engine:
        session = Session.new(engine, store, system="You are a tiny test model. " * 4)
        params = SamplingParams(max_tokens=24, temperature=0.0)
        first = session.send("Tell me about paged attention.", params)
        turn_one = engine.encode_chat(
            [
                {"role": "system", "content": session.system},
                {"role": "user", "content": "Tell me about paged attention."},
            ]
        )
        session.send("And prefix caching?", params)
        turn_two = engine.encode_chat(
            [
                {"role": "system", "content": session.system},
                {"role": "user", "content": "Tell me about paged attention."},
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": "And prefix caching?"},
            ]
        )
        cached = session.last_metrics.cached_tokens
        assert session.history[-1].cached_tokens == cached
        assert cached >= len(turn_one) // block * block  # the system prompt and turn one's prompt, at least
        # Everything turn two shares with turn one (its prompt and the reply as re-encoded) in full blocks.
        first_ids = turn_one + engine.tokenizer.encode(first.content, add_special_tokens=False)
        shared = common_prefix(turn_two, first_ids)
        assert cached >= shared // block * block


def test_eight_sessions_at_once_match_one_at_a_time(tiny_llm, tmp_path: Path) -> None:
    questions = [f"Question number {i}: what is {i} plus {i}?" for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0)

    with AsyncLLM(llm=tiny_llm()) as engine, ChatStore(tmp_path / "one.db") as store:
        alone = [Session.new(engine, store, system="Answer.").send(q, params).content for q in questions]

    with AsyncLLM(llm=tiny_llm()) as engine, ChatStore(tmp_path / "many.db") as store:
        sessions = [Session.new(engine, store, system="Answer.") for _ in questions]

        async def ask(session: Session, question: str) -> str:
            return "".join([d async for d in session.astream(question, params)])

        async def main():
            return await asyncio.gather(*(ask(s, q) for s, q in zip(sessions, questions)))

        together = asyncio.run(main())
        assert engine.stats().blocks_used == 0
        assert [s.history[-1].content for s in sessions] == together
    assert together == alone


def test_a_kill_mid_stream_leaves_the_partial_reply(tmp_path: Path, tiny_model_path: Path) -> None:
    db = tmp_path / "chats.db"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "crash_child.py"), str(db), str(tiny_model_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        session_id = child.stdout.readline().strip()
        assert session_id, child.stderr.read()
        deadline = time.monotonic() + 120
        while True:
            assert child.poll() is None, "the child ended before it was killed: " + child.stderr.read()
            assert time.monotonic() < deadline, "no partial reply was ever saved"
            with ChatStore(db) as store:
                messages = store.messages(session_id)
            if len(messages) == 2 and messages[1].status == "partial" and messages[1].content:
                break
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    with ChatStore(db) as store:
        user, reply = store.messages(session_id)
    assert (user.role, user.content) == ("user", "Write a very long story.")
    assert reply.role == "assistant" and reply.status == "partial" and reply.content


@pytest.mark.model
def test_a_conversation_with_the_default_model(default_llm, store: ChatStore) -> None:
    with AsyncLLM(llm=default_llm) as engine:
        session = Session.new(engine, store, system="You are a concise assistant. Answer in one sentence.")
        params = SamplingParams(max_tokens=48, temperature=0.0)
        first = session.send("What is the capital of France?", params)
        assert first.status == "complete" and "Paris" in first.content
        turn_one_prompt = first.prompt_tokens
        second = session.send("And of Italy?", params)
        assert second.status == "complete" and "Rome" in second.content
        assert second.cached_tokens >= turn_one_prompt // 16 * 16
        assert engine.stats().blocks_used == 0


# ----- how long a reply may run --------------------------------------------------------------


def test_without_a_limit_a_reply_runs_to_its_end(store: ChatStore) -> None:
    """No SamplingParams and no session limit: 600 tokens, not SamplingParams' 256."""
    fake = FakeLLM(reply=lambda ids: "w" * 600)
    with AsyncLLM(llm=fake) as engine:
        reply = Session.new(engine, store).send("write a lot")
    assert reply.completion_tokens == 600 and reply.finish_reason == "stop" and reply.status == "complete"


def test_without_a_limit_max_tokens_fills_the_context(store: ChatStore) -> None:
    """The reply may use all the context the prompt leaves, and it says it stopped on the limit."""
    fake = FakeLLM(max_model_len=300, reply=lambda ids: "w" * 1000)
    with AsyncLLM(llm=fake) as engine:
        session = Session.new(engine, store, system="SYSTEM")
        reply = session.send("never stop")
    assert reply.prompt_tokens + reply.completion_tokens == 300
    assert reply.finish_reason == "length" and reply.status == "complete"


def test_without_a_limit_only_the_prompt_must_fit(store: ChatStore) -> None:
    """Nothing is reserved beyond the prompt: a prompt of all but one token of the context is answered."""
    fake = FakeLLM(max_model_len=200, reply=lambda ids: "ok")
    with AsyncLLM(llm=fake) as engine:
        session = Session.new(engine, store)
        text = "x" * (199 - len(fake.encode_chat([{"role": "user", "content": ""}])))
        reply = session.send(text)
        assert reply.completion_tokens == 1 and reply.finish_reason == "length"
        with pytest.raises(RequestError, match="1 over the limit of 200") as caught:
            Session.new(engine, store).send(text + "x")
        assert "max_tokens" not in str(caught.value)  # no limit was set: nothing to lower


def test_a_session_limit_and_its_sampling_apply_to_every_turn(store: ChatStore) -> None:
    seen: list[SamplingParams] = []
    fake = FakeLLM(reply=lambda ids: "w" * 600)
    add_request = fake.add_request

    def spy(prompt, params=None, request_id=None):
        seen.append(params)
        return add_request(prompt, params, request_id)

    fake.add_request = spy
    with AsyncLLM(llm=fake) as engine:
        session = Session.new(engine, store, sampling=SamplingParams(temperature=0.0, top_k=5, seed=3), max_tokens=40)
        first = session.send("one")
        fork = session.fork(first.id)
        second = fork.send("two")
    assert [m.completion_tokens for m in (first, second)] == [40, 40]
    assert all(m.finish_reason == "length" for m in (first, second))
    assert [(p.max_tokens, p.temperature, p.top_k, p.seed) for p in seen] == [(40, 0.0, 5, 3)] * 2
    assert store.get_message(first.id).finish_reason == "length"  # stored, not only returned


def test_explicit_params_are_used_as_given(store: ChatStore) -> None:
    fake = FakeLLM(reply=lambda ids: "w" * 600)
    with AsyncLLM(llm=fake) as engine:
        reply = Session.new(engine, store, max_tokens=40).send("go", SamplingParams(max_tokens=7))
    assert reply.completion_tokens == 7


def test_a_stopped_reply_is_stored_as_aborted(engine: AsyncLLM, store: ChatStore) -> None:
    session = Session.new(engine, store)
    stream = session.stream("stop early", SamplingParams(max_tokens=4000))
    next(stream)
    stream.close()
    (_, reply) = session.history
    assert (reply.status, reply.finish_reason) == ("partial", "abort")


def test_live_context_counts_the_whole_prompt_and_the_reply_so_far(store: ChatStore) -> None:
    fake = FakeLLM(reply=lambda ids: "w" * 50)
    with AsyncLLM(llm=fake) as engine:
        session = Session.new(engine, store, system="S" * 500)
        assert session.live_context_tokens is None
        prompt = len(fake.encode_chat([{"role": "system", "content": "S" * 500}, {"role": "user", "content": "hi"}]))
        seen = []
        for _ in session.stream("hi"):
            seen.append(session.live_context_tokens)
        assert seen[0] >= prompt + 1 and seen[-1] == prompt + 50
        assert session.live_context_tokens is None


def test_sync_and_async_paths_store_the_same_rows(engine: AsyncLLM, store: ChatStore) -> None:
    """stream/continue_reply and astream/acontinue_reply share one recorder (Session._replying): for the
    same scripted engine they must leave the same rows, token ids included."""
    cut = SamplingParams(max_tokens=5, temperature=0)
    blocking, looped = Session.new(engine, store), Session.new(engine, store)
    blocking.send("the same question", cut)
    blocking.continue_reply(GREEDY)

    async def main() -> None:
        async for _ in looped.astream("the same question", cut):
            pass
        async for _ in looped.acontinue_reply(GREEDY):
            pass

    asyncio.run(main())

    def rows(session: Session) -> list[tuple]:
        fields = ("role", "content", "status", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens")
        return [(*(getattr(m, f) for f in fields), store.token_ids(m.id)) for m in store.messages(session.id)]

    assert rows(blocking) == rows(looped)
    assert rows(blocking)[-1][3] == "stop" and len(rows(blocking)) == 2  # continued in the same message

"""Per-chat reply settings (stored with the session) and continuing a reply that stopped at a token limit.

The bookkeeping runs on the scripted FakeLLM; whether a continue really reuses the cached KV and
gives the same text as one uninterrupted reply runs on the tiny real model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from localpaged.chat.session import Session, limit_note
from localpaged.chat.store import ChatStore
from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import ConfigError, RequestError
from localpaged.sampling import SamplingParams
from tests.engine.fake_llm import FakeLLM

SCRIPT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."
TINY = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "64MiB", "max_model_len": 1024}


def scripted(ids: list[int]) -> str:
    """SCRIPT, picked up where the prompt's last assistant turn leaves off (a continue's prompt holds its start)."""
    text = "".join(chr(i) for i in ids)
    said = text.rsplit("<assistant>", 1)[-1]
    return SCRIPT.removeprefix(said)


class RecordingLLM(FakeLLM):
    """A FakeLLM that keeps the SamplingParams and prompt of every request."""

    def __init__(self, **kwargs) -> None:
        super().__init__(scripted, **kwargs)
        self.seen: list[tuple[list[int], SamplingParams]] = []

    def add_request(self, prompt, params=None, request_id=None) -> str:
        self.seen.append((list(prompt), params))
        return super().add_request(prompt, params, request_id)


@pytest.fixture
def fake() -> RecordingLLM:
    return RecordingLLM()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "chats.db"


# ----- per-chat settings --------------------------------------------------------------------


def test_settings_survive_a_restart_and_reach_the_sampling_params(engine: AsyncLLM, fake: RecordingLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store)
        session.set_settings({"temperature": 0.3, "top_p": 0.9, "top_k": 20, "max_tokens": 12, "seed": 7})
        session_id = session.id
    with ChatStore(db) as store:  # reopened: read back from the database
        session = Session.load(engine, store, session_id, sampling=SamplingParams(temperature=1.2), max_tokens=500)
        assert session.settings == {"temperature": 0.3, "top_p": 0.9, "top_k": 20, "max_tokens": 12, "seed": 7}
        reply = session.send("hello")
        params = fake.seen[-1][1]
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (
            0.3,
            0.9,
            20,
            12,
            7,
        )
        assert reply.finish_reason == "length" and len(reply.content) == 12


def test_unset_settings_use_the_app_defaults(engine: AsyncLLM, fake: RecordingLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store, sampling=SamplingParams(temperature=1.1, top_k=5), max_tokens=30)
        session.set_settings({"temperature": 0.2, "top_k": None})
        session.send("hello")
        params = fake.seen[-1][1]
        assert (params.temperature, params.top_k, params.max_tokens) == (0.2, 5, 30)
        session.set_settings({})  # all back to the defaults
        session.send("again")
        assert fake.seen[-1][1].temperature == 1.1


def test_regenerate_and_forks_use_the_chats_settings(engine: AsyncLLM, fake: RecordingLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store)
        session.send("hello")
        session.set_settings({"temperature": 0.4, "max_tokens": 9, "seed": 3})
        session.regenerate()
        params = fake.seen[-1][1]
        assert (params.temperature, params.max_tokens, params.seed) == (0.4, 9, 3)
        fork = session.fork(session.history[0].id)
        assert fork.settings == session.settings
        assert store.session_settings(fork.id) == {"temperature": 0.4, "max_tokens": 9, "seed": 3}


@pytest.mark.parametrize(
    "bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": 1.5}, {"max_tokens": 0}, {"seed": 2**64}, {"colour": 1}]
)
def test_bad_settings_are_refused_and_not_stored(engine: AsyncLLM, db, bad: dict) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store)
        with pytest.raises(ConfigError):
            session.set_settings(bad)
        assert store.session_settings(session.id) == {} and session.settings == {}


def test_a_damaged_settings_value_is_ignored_on_load(engine: AsyncLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store)
        store.db.execute(
            "UPDATE sessions SET settings = ? WHERE id = ?", ['{"temperature": "hot", "top_k": 4}', session.id]
        )
        assert Session.load(engine, store, session.id).settings == {"top_k": 4}
        store.db.execute("UPDATE sessions SET settings = ? WHERE id = ?", ["not json", session.id])
        assert Session.load(engine, store, session.id).settings == {}


def test_a_database_from_before_per_chat_settings_is_brought_forward(engine: AsyncLLM, db) -> None:
    import sqlite3

    from sqlite_utils import Database

    from localpaged.chat import migrations

    conn = sqlite3.connect(db, isolation_level=None)
    old = Database(conn)
    old.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at FLOAT NOT NULL)")
    for fn in migrations.MIGRATIONS[:4]:  # up to m004: no settings, no token ids
        fn(old)
        old.execute("INSERT INTO _migrations VALUES (?, 0)", [fn.__name__])
    old.execute("INSERT INTO sessions (id, title, created, updated) VALUES ('abc', 'old chat', 0, 0)")
    old.execute(
        "INSERT INTO messages (session_id, role, content, status, finish_reason, prompt_tokens, completion_tokens,"
        " created, updated) VALUES ('abc', 'assistant', 'cut', 'complete', 'length', 5, 3, 0, 0)"
    )
    conn.close()
    with ChatStore(db) as store:
        session = Session.load(engine, store, "abc")
        assert session.settings == {} and store.token_ids(session.history[0].id) is None
        assert session.continuable() is None  # its tokens are unknown: regenerate it instead
        session.set_settings({"top_k": 3})
        assert store.session_settings("abc") == {"top_k": 3}


# ----- continue -----------------------------------------------------------------------------


def test_continue_grows_the_same_message_from_its_own_tokens(engine: AsyncLLM, fake: RecordingLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store, system="Be brief.")
        session.set_settings({"max_tokens": 20})
        first = session.send("tell me")
        assert first.finish_reason == "length" and first.content == SCRIPT[:20]
        assert session.continuable() is not None
        turn_prompt = fake.seen[-1][0]
        grown = session.continue_reply()
        assert grown.id == first.id and grown.content == SCRIPT[:40] and grown.finish_reason == "length"
        assert fake.seen[-1][0] == turn_prompt + [ord(c) for c in SCRIPT[:20]]  # no end-of-turn in between
        assert grown.completion_tokens == 40 and grown.prompt_tokens == len(turn_prompt)
        assert store.token_ids(grown.id) == [ord(c) for c in SCRIPT[:40]]
        session.set_settings({})
        done = session.continue_reply()
        assert done.content == SCRIPT and done.finish_reason == "stop" and done.status == "complete"
        assert [m.role for m in session.history] == ["user", "assistant"]
        assert session.continuable() is None
        with pytest.raises(RequestError, match="only a last reply that stopped at a token limit"):
            session.continue_reply()


def test_async_continue_yields_only_the_new_text(engine: AsyncLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store, max_tokens=10)
        session.send("tell me")

        async def main() -> str:
            return "".join([delta async for delta in session.acontinue_reply()])

        assert asyncio.run(main()) == SCRIPT[10:20]
        assert session.history[-1].content == SCRIPT[:20]


def test_continue_is_refused_when_the_context_is_full(db) -> None:
    fake = RecordingLLM(max_model_len=40)
    engine = AsyncLLM(llm=fake)
    try:
        with ChatStore(db) as store:
            session = Session.new(engine, store)
            reply = session.send("tell me")  # no limit: runs until the context is full
            assert reply.finish_reason == "length" and reply.prompt_tokens + reply.completion_tokens == 40
            assert session.continuable() is None
            assert limit_note(reply, 40) == "stopped: the context of 40 tokens is full"
            assert limit_note(reply) == f"stopped at {reply.completion_tokens} tokens"  # where the context is unknown
    finally:
        engine.shutdown()


def test_a_new_system_prompt_forks_a_chat_with_messages(engine: AsyncLLM, fake: RecordingLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store, system="Be formal.", prompt_name="formal")
        session.send("hello")
        session.set_settings({"temperature": 0.4})
        fork = session.with_system("Be brief.")
        assert fork.id != session.id and fork.parent_id == session.id
        assert (fork.system, fork.prompt_name, fork.settings) == ("Be brief.", None, {"temperature": 0.4})
        assert [(m.role, m.content) for m in fork.history] == [(m.role, m.content) for m in session.history]
        fork.send("again")
        assert "Be brief." in "".join(chr(i) for i in fake.seen[-1][0])
        stored = store.get_session(session.id)
        assert (stored.system, stored.prompt_name, len(store.messages(session.id))) == ("Be formal.", "formal", 2)


def test_a_new_system_prompt_changes_an_empty_chat_in_place(engine: AsyncLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store, system="Be formal.", prompt_name="formal")
        assert session.with_system("") is session and session.system is None
        assert store.get_session(session.id).system is None and len(store.list_sessions()) == 1
        with pytest.raises(RequestError, match="system prompt"):
            session.with_system(b"bytes")


def test_a_reply_without_stored_token_ids_cannot_be_continued(engine: AsyncLLM, db) -> None:
    with ChatStore(db) as store:
        session = Session.new(engine, store, max_tokens=10)
        reply = session.send("tell me")
        store.db.execute("UPDATE messages SET token_ids = NULL WHERE id = ?", [reply.id])  # as from an older version
        assert session.continuable() is None


# ----- the tiny real model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engine(tiny_model_path: Path):
    engine = AsyncLLM(str(tiny_model_path), engine_process=False, **TINY)
    yield engine
    engine.shutdown()


def test_continue_on_the_real_model_reuses_the_cache_and_matches_one_greedy_reply(real_engine, tmp_path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with ChatStore(tmp_path / "chats.db") as store:
        whole = Session.new(real_engine, store, sampling=greedy, max_tokens=60)
        whole.send(
            "Tell me a long story about paged attention.",
            SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        )
        expected = whole.history[-1]

        session = Session.new(real_engine, store, sampling=greedy)
        session.set_settings({"temperature": 0.0, "max_tokens": 25})
        params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
        first = session.send("Tell me a long story about paged attention.", params)
        assert first.finish_reason == "length" and first.completion_tokens == 25
        grown = session.continue_reply(SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True))
        metrics = session.last_metrics
        assert grown.id == first.id and grown.completion_tokens == 60
        assert store.token_ids(grown.id) == store.token_ids(expected.id)
        assert grown.content == expected.content
        assert metrics.prompt_tokens == first.prompt_tokens + 25
        assert metrics.cached_tokens >= metrics.prompt_tokens - 16  # all but the last, partly filled block

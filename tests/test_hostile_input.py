"""Regressions for what tests/test_fuzz.py and a hunt by hand found (issue 14): each failed with a raw
exception (or a failed request) before, and is now our own error naming what to change, or just works."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from localpaged import LLM, AsyncLLM, ChatStore, SamplingParams, cli
from localpaged.errors import ConfigError, RequestError, StoreError
from tests.conftest import DEVICE

ENGINE = {"dtype": "float32", "device": DEVICE, "kv_cache_memory": "1MiB", "max_model_len": 128}
LONE = "caf\udce9"  # "café" decoded from Latin-1 bytes with surrogateescape; a JSON "\udce9" escape reads the same
SHORT = SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), **ENGINE)


@pytest.fixture(scope="module")
def front_end(tiny_model_path: Path):
    engine = AsyncLLM(str(tiny_model_path), engine_process=False, **ENGINE)
    yield engine
    engine.shutdown()


def assert_idle(llm: LLM) -> None:
    assert llm.requests == {} and llm.stats().blocks_used == 0
    llm.pool.check_integrity()


@pytest.mark.parametrize(
    ("call", "argument", "params", "match"),
    [
        ("generate", None, SHORT, "prompts must be a prompt"),
        ("generate", 5, SHORT, "not int"),
        ("generate", "hello", True, "params must be SamplingParams"),
        ("generate", "hello", {"max_tokens": 3}, "not dict"),
        ("chat", "hello", SHORT, "chat takes a conversation"),  # was: one request per character
        ("chat", None, SHORT, "chat takes a conversation"),
        ("chat", [["user", "hi"]], SHORT, "chat takes a conversation"),
    ],
)
def test_generate_and_chat_refuse_wrong_types(llm: LLM, call: str, argument, params, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        getattr(llm, call)(argument, params)
    assert_idle(llm)


def test_a_tiny_temperature_decodes_greedily(llm: LLM) -> None:
    """temperature=1e-110 overflowed logits / temperature, and the request failed ("not finite")."""
    tiny = SamplingParams(max_tokens=6, temperature=1e-110)
    assert tiny.greedy
    out = llm.generate("the river", tiny)[0]
    assert out.finish_reason in ("stop", "length"), out.error
    assert out.token_ids == llm.generate("the river", SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids


def test_text_that_is_not_unicode_is_refused_by_the_engine(llm: LLM) -> None:
    """The tokenizer raised a bare TypeError for a lone surrogate."""
    with pytest.raises(RequestError, match="lone surrogate"):
        llm.generate(LONE, SHORT)
    with pytest.raises(RequestError, match="message 1 content cannot be encoded: it holds a lone surrogate"):
        llm.chat([{"role": "system", "content": "hi"}, {"role": "user", "content": LONE}], SHORT)
    with pytest.raises(ConfigError, match="stop=.*lone surrogate"):
        SamplingParams(stop=["ok", LONE])
    assert_idle(llm)


def test_text_that_is_not_unicode_is_refused_by_the_store(tmp_path: Path) -> None:
    """SQLite raised a bare UnicodeEncodeError."""
    with ChatStore(tmp_path / "chats.db") as store:
        session = store.create_session(title="fine")
        with pytest.raises(StoreError, match="message content cannot be stored: it holds a lone surrogate"):
            store.add_message(session.id, "user", LONE)
        with pytest.raises(StoreError, match="session title cannot be stored"):
            store.create_session(title=LONE)
        with pytest.raises(StoreError, match="search text cannot be stored"):
            store.search(LONE)
        with pytest.raises(StoreError, match="not Unicode text"):
            store.get_session(LONE)
        assert store.messages(session.id) == [] and len(store.list_sessions()) == 1


def test_the_async_front_end_refuses_what_cannot_reach_the_core(front_end: AsyncLLM) -> None:
    """msgspec raised UnicodeEncodeError/OverflowError out of stream(), and the stream stayed registered."""
    for prompt, match in (
        (LONE, "the prompt cannot be encoded: it holds a lone surrogate"),
        ([{"role": "user", "content": LONE}], "message 0 content cannot be encoded"),
        ([1, 2**70], "cannot be sent to the engine"),
    ):
        with pytest.raises(RequestError, match=match):
            front_end.generate_text(prompt, SHORT)
        assert len(front_end._streams) == 0
    with pytest.raises(RequestError, match="message 0 content cannot be encoded"):
        front_end.encode_chat([{"role": "user", "content": LONE}])
    assert front_end.generate_text("hello", SHORT).finish_reason == "length"  # the engine goes on


@pytest.mark.parametrize(
    ("field", "value"), [("top_k", 2**31), ("top_k", 2**70), ("stop_token_ids", [2**31]), ("stop_token_ids", [2**64])]
)
def test_numbers_beyond_any_vocabulary_are_config_errors(field: str, value: object) -> None:
    """Accepted before, then the request failed crossing to the engine process (msgspec takes 64-bit ints)."""
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_the_server_answers_400_to_text_that_is_not_unicode(front_end: AsyncLLM) -> None:
    """Both answered 500 with the encoder's exception."""
    from starlette.testclient import TestClient

    from localpaged.server.app import build_app

    client = TestClient(build_app(front_end), base_url="http://localhost", raise_server_exceptions=False)
    escaped = json.dumps({"messages": [{"role": "user", "content": LONE}], "max_tokens": 3})  # "\udce9" in the JSON
    assert "\\udce9" in escaped
    for path, body in (
        ("/v1/chat/completions", escaped),
        ("/v1/completions", json.dumps({"prompt": LONE, "max_tokens": 3})),
        ("/tokenize", json.dumps({"prompt": LONE})),
        ("/tokenize", json.dumps({"messages": [{"role": "user", "content": LONE}]})),
    ):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        assert "lone surrogate" in response.json()["error"]["message"]


@pytest.mark.parametrize("when", [float("inf"), -float("inf"), 1e300, -(2**62)])
def test_times_no_calendar_holds_print_as_a_question_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, when: float
) -> None:
    """`sessions list` raised OverflowError/OSError from time.localtime on a database edited by hand."""
    from localpaged.tui.widgets.sidebar import ago

    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    with ChatStore() as store:
        store.create_session(title="odd")
    with sqlite3.connect(tmp_path / "chats.db") as conn:
        conn.execute("UPDATE sessions SET updated = ?", (when,))
    assert cli.main(["sessions", "list"]) == 0
    assert capsys.readouterr().out.split("\t")[1:] == ["?", "odd\n"]
    assert ago(when, 1e9) in ("?", "now")


def test_text_stored_as_invalid_utf8_reads_with_replacement_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """One such title made `sessions list`, `show`, `export` and `search` fail ("Could not decode to UTF-8")."""
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    with ChatStore() as store:
        session = store.create_session(title="fine")
        store.add_message(session.id, "user", "kept as it was")
    with sqlite3.connect(tmp_path / "chats.db") as conn:
        conn.execute("UPDATE sessions SET title = CAST(x'41ff42' AS TEXT)")
        conn.execute(
            "INSERT INTO messages (session_id, role, content, created, updated) "
            "VALUES (?, 'user', CAST(x'68c3206869' AS TEXT), 0, 0)",
            (session.id,),
        )
    for argv in (
        ["sessions", "list"],
        ["sessions", "show", session.id],
        ["sessions", "export", session.id],
        ["search", "hi"],
    ):
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert "A\ufffdB" in capsys.readouterr().out or argv[1] == "show"
    with ChatStore() as store:
        assert [m.content for m in store.messages(session.id)] == ["kept as it was", "h\ufffd hi"]

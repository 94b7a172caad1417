"""ChatStore: schema, round trips, search, and the failures users can meet."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from sqlite_utils import Database

from localpaged.chat.migrations import MIGRATIONS
from localpaged.chat.store import ChatStore
from localpaged.errors import StoreError, UnknownSessionError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def store(home: Path):
    with ChatStore() as s:
        yield s


def test_default_path_follows_localpaged_home(home: Path, store: ChatStore) -> None:
    assert store.path == home / "chats.db"
    assert store.path.is_file()
    assert store.db.journal_mode == "wal"


def test_in_memory_store() -> None:
    with ChatStore(":memory:") as s:
        assert s.path is None
        session = s.create_session()
        s.add_message(session.id, "user", "kept in memory")
        assert s.search("memory")[0].session_id == session.id
        with pytest.raises(StoreError, match="in-memory"):
            s.get_message(12345)


def test_migrations_recorded_once_and_idempotent_on_reopen(home: Path) -> None:
    names = [fn.__name__ for fn in MIGRATIONS]
    for _ in range(2):
        with ChatStore() as s:
            rows = list(s.db.query("SELECT name FROM _migrations ORDER BY rowid"))
            assert [r["name"] for r in rows] == names
            assert {"sessions", "messages", "messages_fts"} <= set(s.db.table_names())


def test_a_database_from_before_finish_reasons_is_brought_forward(home: Path) -> None:
    """m004 adds the column to a database made by the first three migrations; its old rows read as None."""
    path = home / "old.db"
    home.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    old = Database(conn)
    old.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at FLOAT NOT NULL)")
    for fn in MIGRATIONS[:3]:
        fn(old)
        old.execute("INSERT INTO _migrations VALUES (?, 0)", [fn.__name__])
    old.execute("INSERT INTO sessions VALUES ('s1', 't', NULL, NULL, NULL, NULL, 0, 0)")
    old.execute("INSERT INTO messages (session_id, role, content, created, updated) VALUES ('s1', 'user', 'hi', 0, 0)")
    conn.commit()
    conn.close()
    with ChatStore(path) as s:
        (message,) = s.messages("s1")
        assert message.finish_reason is None
        reply = s.add_message("s1", "assistant", "cut", finish_reason="length", completion_tokens=40)
        assert s.get_message(reply.id).finish_reason == "length"
        with pytest.raises(StoreError, match="finish_reason"):
            s.update_message(reply.id, finish_reason="tired")


def test_session_and_message_round_trip(store: ChatStore) -> None:
    s = store.create_session(title="Plans", system="Be brief.", prompt_name="concise", model="smol")
    assert store.get_session(s.id) == s
    user = store.add_message(s.id, "user", "hello there")
    reply = store.add_message(s.id, "assistant", "hi", prompt_tokens=12, cached_tokens=8, model="smol")
    assert store.messages(s.id) == [user, reply]
    assert store.get_message(reply.id).prompt_tokens == 12
    assert store.get_session(s.id).updated >= s.updated

    store.rename_session(s.id, "Renamed")
    assert store.get_session(s.id).title == "Renamed"


def test_list_sessions_most_recently_updated_first(store: ChatStore) -> None:
    a = store.create_session(title="a")
    b = store.create_session(title="b")
    assert [x.id for x in store.list_sessions()] == [b.id, a.id]
    store.add_message(a.id, "user", "bump")
    assert [x.id for x in store.list_sessions()] == [a.id, b.id]


def test_partial_reply_completes(store: ChatStore) -> None:
    s = store.create_session()
    m = store.add_message(s.id, "assistant", "", status="partial")
    store.update_message(m.id, content="Once upon")
    store.update_message(m.id, content="Once upon a time", status="complete", completion_tokens=4, ttft_s=0.05)
    got = store.get_message(m.id)
    assert (got.content, got.status, got.completion_tokens, got.ttft_s) == ("Once upon a time", "complete", 4, 0.05)
    assert got.updated >= got.created

    store.update_message(m.id, status="error", error="engine stopped")
    assert store.get_message(m.id).error == "engine stopped"


def test_invalid_values_are_refused(store: ChatStore) -> None:
    s = store.create_session()
    with pytest.raises(StoreError, match="role"):
        store.add_message(s.id, "bot", "x")
    with pytest.raises(StoreError, match="status"):
        store.add_message(s.id, "user", "x", status="done")
    with pytest.raises(TypeError, match="tokens_per_sec"):
        store.add_message(s.id, "user", "x", tokens_per_sec=3)
    with pytest.raises(StoreError, match="no message with id 999"):
        store.update_message(999, content="x")
    assert store.messages(s.id) == []


def test_unknown_session_names_id_and_next_step(store: ChatStore) -> None:
    for call in (
        lambda: store.get_session("nope"),
        lambda: store.messages("nope"),
        lambda: store.add_message("nope", "user", "x"),
        lambda: store.delete_session("nope"),
    ):
        with pytest.raises(UnknownSessionError, match=r"'nope'.*localpaged sessions list"):
            call()


def test_fork_copies_messages_up_to_and_including(store: ChatStore) -> None:
    s = store.create_session(title="Origin", system="sys", prompt_name="general")
    m1 = store.add_message(s.id, "user", "one")
    m2 = store.add_message(s.id, "assistant", "two", completion_tokens=1)
    store.add_message(s.id, "user", "three")

    fork = store.fork_session(s.id, m2.id)
    assert (fork.parent_id, fork.title, fork.system, fork.prompt_name) == (s.id, "Origin (fork)", "sys", "general")
    copied = store.messages(fork.id)
    assert [(m.role, m.content, m.completion_tokens) for m in copied] == [
        ("user", "one", None),
        ("assistant", "two", 1),
    ]
    assert all(m.id > m2.id for m in copied)
    assert len(store.messages(s.id)) == 3

    other = store.create_session()
    with pytest.raises(StoreError, match="not part of session"):
        store.fork_session(other.id, m1.id)


def test_delete_messages_after_for_regenerate(store: ChatStore) -> None:
    s = store.create_session()
    m1 = store.add_message(s.id, "user", "question")
    old = store.add_message(s.id, "assistant", "old answer")
    store.delete_messages_after(s.id, m1.id)
    assert store.messages(s.id) == [m1]
    assert store.search("old answer") == []
    new = store.add_message(s.id, "assistant", "new answer")
    assert new.id > old.id  # ids are never reused


def test_delete_session_cascades_and_keeps_forks(store: ChatStore) -> None:
    s = store.create_session(title="doomed")
    m = store.add_message(s.id, "user", "unicorn sighting")
    fork = store.fork_session(s.id, m.id)
    store.delete_session(s.id)

    with pytest.raises(UnknownSessionError):
        store.get_session(s.id)
    assert store.get_session(fork.id).parent_id is None
    assert [h.session_id for h in store.search("unicorn")] == [fork.id]
    assert store.db.execute("SELECT count(*) FROM messages WHERE session_id = ?", [s.id]).fetchone()[0] == 0
    # The FTS index agrees with its content table.
    store.db.execute("INSERT INTO messages_fts (messages_fts) VALUES ('integrity-check')")


def test_search_ranks_and_marks_matches(store: ChatStore) -> None:
    s = store.create_session(title="Zoo")
    store.add_message(s.id, "user", "Tell me about the penguin.")
    store.add_message(s.id, "assistant", "A penguin is a flightless bird. Penguin colonies can be huge.")
    store.add_message(s.id, "user", "Thanks!")

    hits = store.search("penguin")
    assert {h.role for h in hits} == {"user", "assistant"} and len(hits) == 2
    assert all(h.session_id == s.id and h.session_title == "Zoo" for h in hits)
    assert "«penguin»" in hits[0].snippet.lower()
    assert store.search("flightless bird")[0].role == "assistant"
    assert store.search("penguin", limit=1) == hits[:1]
    assert store.search("   ") == []


@pytest.mark.parametrize(
    "text",
    [
        '"',
        '"unbalanced',
        "AND",
        "penguin AND",
        "OR NOT",
        "*",
        "pen*",
        "(",
        "((penguin",
        ")",
        "a:b",
        "NEAR(x y)",
        "^",
        "-",
        "'",
    ],
)
def test_search_survives_odd_input(store: ChatStore, text: str) -> None:
    s = store.create_session()
    store.add_message(s.id, "user", 'penguin AND (friends) say "hi"')
    assert isinstance(store.search(text), list)


def test_search_treats_operators_as_words(store: ChatStore) -> None:
    s = store.create_session()
    store.add_message(s.id, "user", "cats AND dogs")
    store.add_message(s.id, "user", "cats only")
    assert len(store.search("cats AND")) == 1
    assert len(store.search("cats OR dogs")) == 0  # every word must appear, "OR" included


def test_corrupt_file_is_reported_and_left_untouched(home: Path) -> None:
    home.mkdir()
    path = home / "chats.db"
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    with pytest.raises(StoreError) as info:
        ChatStore(path)
    message = str(info.value)
    assert str(path) in message and "--db" in message and "aside" in message
    assert path.read_bytes() == garbage
    assert sorted(p.name for p in home.iterdir()) == ["chats.db"]


def test_damaged_database_is_reported_and_left_untouched(home: Path) -> None:
    with ChatStore() as s:
        s.add_message(s.create_session().id, "user", "hello")
    path = home / "chats.db"
    data = bytearray(path.read_bytes())
    data[100:] = bytes(len(data) - 100)  # keep the header, wipe every page after it
    path.write_bytes(data)
    with pytest.raises(StoreError, match="damaged"):
        ChatStore(path)
    assert path.read_bytes() == data


def test_readonly_database_maps_to_store_error(store: ChatStore) -> None:
    """A real SQLITE_READONLY fault, injected with query_only (chmod does not stop root)."""
    s = store.create_session()
    store.db.execute("PRAGMA query_only = ON")
    with pytest.raises(StoreError, match=r"read-only") as info:
        store.add_message(s.id, "user", "x")
    assert str(store.path) in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    store.db.execute("PRAGMA query_only = OFF")
    assert store.messages(s.id) == []  # the failed write left nothing half-done


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_readonly_file_and_folder(home: Path) -> None:
    with ChatStore() as s:
        sid = s.create_session().id
    path = home / "chats.db"
    path.chmod(0o444)
    home.chmod(0o555)
    try:
        with pytest.raises(StoreError, match=str(path)), ChatStore(path) as s:
            s.add_message(sid, "user", "x")
    finally:
        home.chmod(0o755)
        path.chmod(0o644)


def test_unwritable_location_is_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match=str(blocker)):
        ChatStore(blocker / "chats.db")


def test_opening_retries_the_switch_to_wal_that_another_first_start_holds(tmp_path, monkeypatch) -> None:
    """Two processes switching a fresh database to WAL at once deadlock, and SQLite answers one "database is
    locked" at once (no busy wait): opening tries again until its timeout."""
    from sqlite_utils import Database

    answers = iter([sqlite3.OperationalError("database is locked")] * 2)
    enable_wal = Database.enable_wal

    def contended(db: Database) -> None:
        failure = next(answers, None)
        if failure is not None:
            raise failure
        enable_wal(db)

    monkeypatch.setattr(Database, "enable_wal", contended)
    with ChatStore(tmp_path / "chats.db") as store:
        assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    answers = iter([sqlite3.OperationalError("database is locked")] * 1000)
    with pytest.raises(StoreError, match="locked"):
        ChatStore(tmp_path / "other.db", timeout=0.05)


def test_locked_database_times_out_with_store_error(store: ChatStore) -> None:
    s = store.create_session()
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        locked = ChatStore(store.path, timeout=0.1)
        with pytest.raises(StoreError, match="locked"):
            locked.add_message(s.id, "user", "x")
        locked.close()
    finally:
        other.rollback()
        other.close()
    store.add_message(s.id, "user", "works again")


def test_writes_from_another_thread(store: ChatStore) -> None:
    s = store.create_session()

    def write() -> None:
        for i in range(20):
            store.add_message(s.id, "user", f"t{i}")

    workers = [threading.Thread(target=write) for _ in range(4)]
    for w in workers:
        w.start()
    for _ in range(20):
        store.messages(s.id)
    for w in workers:
        w.join()
    assert len(store.messages(s.id)) == 80


def test_sigkill_mid_reply_leaves_everything_written(home: Path) -> None:
    child = textwrap.dedent(
        """
        import os, signal, sys
        from localpaged.chat.store import ChatStore
        store = ChatStore()
        sid = store.create_session(title="crash").id
        store.add_message(sid, "user", "tell me a story")
        reply = store.add_message(sid, "assistant", "", status="partial")
        text = ""
        for word in ["Once", " upon", " a", " time"]:
            text += word
            store.update_message(reply.id, content=text)
        print(sid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        cwd=REPO,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    session_id = done.stdout.strip()

    with ChatStore() as store:
        user, reply = store.messages(session_id)
        assert (user.role, user.content) == ("user", "tell me a story")
        assert (reply.role, reply.status, reply.content) == ("assistant", "partial", "Once upon a time")

"""Schema of the chat database, as named migrations applied once each, in order.

Modelled on the `llm` tool's logs.db: every schema change is a function registered
with ``@migration``; ``migrate`` runs the ones not yet named in the ``_migrations``
table and records each as it finishes. Never edit a migration that has shipped: add
a new one, so databases created by older versions are brought forward.

The pending migrations run in one transaction with their records, so a crash leaves
either all of them or none; each is still written to be harmless when repeated.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlite_utils import Database

Migration = Callable[[Database], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    """Register ``fn`` as the next migration; its function name is its permanent id."""
    MIGRATIONS.append(fn)
    return fn


def migrate(db: Database) -> None:
    """Apply, in order, every registered migration the database has not recorded yet.

    All of them run in one BEGIN IMMEDIATE transaction, and what is applied is read again inside
    it: several processes opening a fresh database at once (the first start of the app and a
    script) then wait for each other under the busy timeout, and only the first one migrates,
    where checking outside the lock made the others fail with ``UNIQUE constraint failed:
    _migrations.name``. An up-to-date database is recognised without taking the write lock.
    """
    if not pending(db):
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at FLOAT NOT NULL)")
        applied = {row["name"] for row in db.query("SELECT name FROM _migrations")}
        for fn in MIGRATIONS:
            if fn.__name__ not in applied:
                fn(db)
                db.execute(
                    "INSERT INTO _migrations (name, applied_at) VALUES (?, ?)",
                    [fn.__name__, time.time()],
                )
        db.execute("COMMIT")
    finally:
        if db.conn.in_transaction:
            db.conn.rollback()


def pending(db: Database) -> list[str]:
    """The registered migrations this database has not recorded, found without writing anything
    (so a read-only database can be checked before it is opened for reading only)."""
    if not db["_migrations"].exists():
        return [fn.__name__ for fn in MIGRATIONS]
    applied = {row["name"] for row in db.query("SELECT name FROM _migrations")}
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in applied]


@migration
def m001_sessions(db: Database) -> None:
    # No foreign key on parent_id: deleting a session that was forked must not be
    # refused; ChatStore.delete_session clears its children's parent_id instead.
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS sessions (
            id TEXT PRIMARY KEY,
            title TEXT,
            system TEXT,
            prompt_name TEXT,
            model TEXT,
            parent_id TEXT,
            created FLOAT NOT NULL,
            updated FLOAT NOT NULL
        )
        """
    )
    db.execute("CREATE INDEX IF NOT EXISTS sessions_updated ON sessions (updated)")


@migration
def m002_messages(db: Database) -> None:
    # AUTOINCREMENT so an id is never reused after regenerate deletes the tail of a
    # conversation: a stale id held by the UI can then never name a newer message.
    db.execute(
        """
        CREATE TABLE IF NOT EXISTS messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL REFERENCES sessions (id),
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'complete'
                CHECK (status IN ('complete', 'partial', 'error')),
            error TEXT,
            prompt_tokens INTEGER,
            cached_tokens INTEGER,
            completion_tokens INTEGER,
            ttft_s FLOAT,
            tokens_per_s FLOAT,
            model TEXT,
            created FLOAT NOT NULL,
            updated FLOAT NOT NULL
        )
        """
    )
    db.execute("CREATE INDEX IF NOT EXISTS messages_session ON messages (session_id, id)")


@migration
def m003_messages_fts(db: Database) -> None:
    # Triggers keep the index in step with every insert, update and delete.
    db["messages"].enable_fts(["content"], create_triggers=True, replace=True)


@migration
def m004_messages_finish_reason(db: Database) -> None:
    # Why a reply ended ("stop", "length", "abort", "error"), so a reply cut off by a token limit
    # says so after a restart. Older rows keep NULL: nobody knows why they ended.
    if "finish_reason" not in db["messages"].columns_dict:
        db["messages"].add_column("finish_reason", str)


@migration
def m005_sessions_settings(db: Database) -> None:
    # A chat's own reply settings (temperature, top_p, top_k, max_tokens, seed) as one JSON object; NULL or a
    # missing key: the app's default. One JSON column, not five: a new setting needs no migration, a fork
    # copies them in one go, and they are always read and written together.
    if "settings" not in db["sessions"].columns_dict:
        db["sessions"].add_column("settings", str)


@migration
def m006_messages_token_ids(db: Database) -> None:
    # A reply's own token ids (a JSON list), so "continue" can resume from exactly the tokens the model
    # generated (re-encoding the text may not give them back) and hit the prefix cache. NULL: not known.
    if "token_ids" not in db["messages"].columns_dict:
        db["messages"].add_column("token_ids", str)


@migration
def m007_messages_tools(db: Database) -> None:
    # Tool calls and their results as OpenAI has them: an assistant message's calls (tool_calls, a JSON list
    # of {"id", "type", "function": {"name", "arguments"}}), and role "tool" messages answering one call each
    # (tool_call_id). SQLite cannot widen the role CHECK in place, so the table is rebuilt: same columns, same
    # ids, the AUTOINCREMENT counter carried over, its index and FTS triggers made again.
    columns = db["messages"].columns_dict
    if "tool_call_id" in columns:
        return
    db.execute(
        """
        CREATE TABLE messages_new (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL REFERENCES sessions (id),
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'complete'
                CHECK (status IN ('complete', 'partial', 'error')),
            error TEXT,
            prompt_tokens INTEGER,
            cached_tokens INTEGER,
            completion_tokens INTEGER,
            ttft_s FLOAT,
            tokens_per_s FLOAT,
            model TEXT,
            created FLOAT NOT NULL,
            updated FLOAT NOT NULL,
            finish_reason TEXT,
            token_ids TEXT,
            tool_calls TEXT,
            tool_call_id TEXT
        )
        """
    )
    kept = ", ".join(columns)
    db.execute(f"INSERT INTO messages_new ({kept}) SELECT {kept} FROM messages")
    counter = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
    db.execute("DROP TABLE IF EXISTS messages_fts")
    db.execute("DROP TABLE messages")
    db.execute("ALTER TABLE messages_new RENAME TO messages")
    if counter is not None:
        db.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'messages'", [counter[0]])
    db.execute("CREATE INDEX IF NOT EXISTS messages_session ON messages (session_id, id)")
    db["messages"].enable_fts(["content"], create_triggers=True, replace=True)

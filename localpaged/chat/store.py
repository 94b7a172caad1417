"""ChatStore: chat sessions and their messages in one SQLite file, through sqlite-utils.

Every write is its own committed transaction, so a crash or SIGKILL leaves a readable
database holding everything written before it. A file that is not a healthy SQLite
database is reported and left exactly as it is: it may be the only copy of someone's
chats, so this module never overwrites, truncates or "repairs" it.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlite_utils import Database

from localpaged.chat.migrations import migrate, pending
from localpaged.engine.output import FINISH_REASONS, FinishReason
from localpaged.errors import StoreError, UnknownSessionError
from localpaged.locations import chat_db_path, create_private_file, make_private
from localpaged.unicode_text import check_text

if TYPE_CHECKING:
    from typing import Self

ROLES = ("system", "user", "assistant", "tool")
STATUSES = ("complete", "partial", "error")
METRICS = ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "tokens_per_s", "model")
# Around each matched word in SearchHit.snippet; plain characters, so that neither
# Rich markup (square brackets) nor Markdown in the message itself is disturbed.
MATCH_START, MATCH_END = "«", "»"


@dataclass(frozen=True)
class SessionRecord:
    """One row of ``sessions``: a snapshot, not updated when the database changes."""

    id: str
    title: str | None
    system: str | None
    prompt_name: str | None
    model: str | None
    parent_id: str | None
    created: float
    updated: float


@dataclass(frozen=True)
class MessageRecord:
    """One row of ``messages``: a snapshot, not updated when the database changes."""

    id: int
    session_id: str
    role: str
    content: str
    status: str
    error: str | None
    finish_reason: FinishReason | None  # why the reply ended; None for user messages and older replies
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    tokens_per_s: float | None
    model: str | None
    created: float
    updated: float
    tool_calls: str | None = None  # an assistant message's calls: OpenAI's tool_calls as JSON text
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    @property
    def calls(self) -> list[dict]:
        """The tool calls of an assistant message, OpenAI's shape; [] for none (or a list damaged by hand)."""
        try:
            calls = json.loads(self.tool_calls) if self.tool_calls else []
        except ValueError:
            return []
        return [c for c in calls if _is_call(c)] if isinstance(calls, list) else []


def _is_call(call: object) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(call, dict)
        and isinstance(call.get("id"), str)
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )


@dataclass(frozen=True)
class SearchHit:
    """A message that matched a search, with its words marked by MATCH_START/MATCH_END."""

    session_id: str
    session_title: str | None
    message_id: int
    role: str
    snippet: str


_SAME = object()  # fork_session's default system prompt: the source's
_SESSION_COLUMNS = ", ".join(f.name for f in fields(SessionRecord))
_MESSAGE_COLUMNS = ", ".join(f.name for f in fields(MessageRecord))


MAX_SEARCH_LIMIT = 1_000_000  # far more hits than anyone reads; keeps LIMIT inside SQLite's integers


def default_db_path() -> Path:
    """The default database, :func:`localpaged.locations.chat_db_path` (``chats.db`` in $LOCALPAGED_HOME)."""
    return chat_db_path()


class ChatStore:
    """Sessions and messages in SQLite; safe to share between the UI thread and a worker.

    ``path`` defaults to :func:`default_db_path`; ``":memory:"`` keeps everything in
    memory (tests). A database file this creates is 0600, and so are its -wal and -shm
    files (SQLite gives them the database's mode); the default one is made 0600 if an
    older version left it readable by others. ``timeout`` is how long a write waits for
    another program's lock before giving up with StoreError. ``db`` is the sqlite-utils
    Database, for ad-hoc reads; write through the methods so the rules above hold.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, timeout: float = 5.0) -> None:
        self.path: Path | None = None if path == ":memory:" else Path(path or default_db_path()).expanduser()
        self._timeout = timeout
        # One connection, shared: the lock serialises statements so that one thread's
        # reads never land inside another thread's open write transaction.
        self._lock = threading.RLock()
        if self.path is not None and self.path.is_symlink():
            # Never through a link: its modes would be set, and its file written, on whatever it points at.
            raise StoreError(
                f"the chat database {self.path} is a symbolic link; localpaged opens only a regular file of its own "
                "there: point --db (or LOCALPAGED_HOME) at the file itself, or move the link aside"
            )
        # A database we may not write (its file or folder) is opened for reading only, so listing,
        # showing and searching still work; writing commands then fail with a read-only StoreError.
        self.read_only = self.path is not None and _not_writable(self.path)
        if self.path is not None and not self.read_only:
            self._create_file(default=not path)
        with self._errors():
            # isolation_level=None: each statement outside an explicit BEGIN commits at once.
            target: str | Path = self.path or ":memory:"
            if self.read_only:
                assert self.path is not None
                target = f"{self.path.resolve().as_uri()}?mode=ro"
                wal = self.path.with_name(self.path.name + "-wal")
                if not os.access(self.path.parent, os.W_OK) and not (wal.is_file() and wal.stat().st_size):
                    # SQLite cannot make the -shm file a WAL reader needs in a folder it may not write;
                    # with no -wal data pending, the main file alone is the whole database.
                    target += "&immutable=1"
            self._conn = sqlite3.connect(
                target, timeout=timeout, isolation_level=None, check_same_thread=False, uri=self.read_only
            )
            # Text another program stored as invalid UTF-8 reads with U+FFFD in place of the bad bytes: by
            # default one such title made every listing fail ("Could not decode to UTF-8 column 'title'").
            self._conn.text_factory = _lenient_text
        try:
            with self._errors():
                # Read before anything can write, so a file that is not a database is
                # reported untouched (journal_mode=wal would otherwise be the first write).
                self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
                self._conn.execute("PRAGMA foreign_keys = ON")
                self.db = Database(self._conn)
                if self.read_only:
                    self._check_current()
                else:
                    self._enable_wal()
                    migrate(self.db)
        except BaseException:
            self._conn.close()
            raise

    def _enable_wal(self) -> None:
        """Switch the database to WAL, trying again until the timeout while another process holds it.

        Processes switching a fresh database at once each hold a shared lock and want the exclusive
        one: SQLite sees the deadlock and answers all but one "database is locked" at once, without
        waiting in its busy handler (often, with a few processes starting at once), so a first start
        next to another one failed. Once one has switched, the others find WAL already on.
        """
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                self.db.enable_wal()
                return
            except sqlite3.OperationalError as exc:
                if not _is_lock_error(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _check_current(self) -> None:
        """A read-only database must already have every migration: it cannot be brought forward."""
        missing = pending(self.db)
        if missing:
            raise StoreError(
                f"The chat database {self.path} is read-only and was written by an older version of localpaged "
                f"(it lacks {', '.join(missing)}). Make the file and its folder writable once so it can be "
                "upgraded, or pass --db with another path."
            )

    def _create_file(self, *, default: bool) -> None:
        """Create the database file 0600 before SQLite opens it (SQLite would use 0644 less the umask)."""
        assert self.path is not None
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # --db's folder; the default exists
            if not create_private_file(self.path) and default:
                for name in ("", "-wal", "-shm"):  # a database from before files were private
                    file = self.path.with_name(self.path.name + name)
                    if file.is_file():
                        make_private(file)
        except OSError as exc:
            raise StoreError(
                f"Cannot create the chat database {self.path}: {exc}. "
                "Make its folder writable, or pass --db with another path."
            ) from exc

    # -- sessions ------------------------------------------------------------------

    def create_session(
        self,
        *,
        title: str | None = None,
        system: str | None = None,
        prompt_name: str | None = None,
        model: str | None = None,
        parent_id: str | None = None,
    ) -> SessionRecord:
        """Start an empty session and return it; its id is a short random hex string."""
        for field, value in (("title", title), ("system", system), ("prompt_name", prompt_name), ("model", model)):
            check_text(f"session {field}", value, StoreError, optional=True)
        now = time.time()
        with self._write():
            session_id = self._new_session_id()
            self._conn.execute(
                f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, title, system, prompt_name, model, parent_id, now, now),
            )
        return SessionRecord(session_id, title, system, prompt_name, model, parent_id, now, now)

    def get_session(self, session_id: str) -> SessionRecord:
        """The session with this id; UnknownSessionError if there is none."""
        rows = self._query(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ?", [session_id])
        if not rows:
            raise self._unknown(session_id)
        return SessionRecord(**rows[0])

    def list_sessions(self) -> list[SessionRecord]:
        """Every session, the most recently active first."""
        rows = self._query(f"SELECT {_SESSION_COLUMNS} FROM sessions ORDER BY updated DESC, rowid DESC")
        return [SessionRecord(**row) for row in rows]

    def rename_session(self, session_id: str, title: str) -> None:
        """Set the title. Leaves ``updated`` alone, so renaming does not reorder the list."""
        check_text("session title", title, StoreError)
        with self._write():
            cursor = self._conn.execute("UPDATE sessions SET title = ? WHERE id = ?", (title, session_id))
            if not cursor.rowcount:
                raise self._unknown(session_id)

    def delete_session(self, session_id: str) -> None:
        """Delete the session and its messages; its forks stay, with ``parent_id`` cleared."""
        with self._write():
            self._conn.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
            self._conn.execute("UPDATE sessions SET parent_id = NULL WHERE parent_id = ?", (session_id,))
            if not self._conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount:
                raise self._unknown(session_id)

    def fork_session(
        self, session_id: str, upto_message_id: int, *, title: str | None = None, system: str | None | object = _SAME
    ) -> SessionRecord:
        """A new session (``parent_id`` = this one) holding copies of its messages up to
        and including ``upto_message_id``. The title defaults to the source's plus " (fork)".
        Given ``system``, the fork has that system prompt instead (no prompt name: it is the user's own).
        """
        check_text("session title", title, StoreError, optional=True)
        if system is not _SAME:
            check_text("session system", system, StoreError, optional=True)
        with self._write():
            source = self.get_session(session_id)
            if self.get_message(upto_message_id).session_id != session_id:
                raise StoreError(f"Message {upto_message_id} is not part of session {session_id}.")
            if title is None and source.title is not None:
                title = f"{source.title} (fork)"
            prompt_name = source.prompt_name
            if system is _SAME:
                system = source.system
            elif system != source.system:
                prompt_name = None
            now = time.time()
            fork_id = self._new_session_id()
            self._conn.execute(
                f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (fork_id, title, system, prompt_name, source.model, session_id, now, now),
            )
            self._conn.execute(
                "UPDATE sessions SET settings = (SELECT settings FROM sessions WHERE id = ?) WHERE id = ?",
                (session_id, fork_id),
            )
            copied = _MESSAGE_COLUMNS.removeprefix("id, session_id, ") + ", token_ids"
            self._conn.execute(
                f"INSERT INTO messages (session_id, {copied}) SELECT ?, {copied} FROM messages"
                " WHERE session_id = ? AND id <= ? ORDER BY id",
                (fork_id, session_id, upto_message_id),
            )
        return SessionRecord(fork_id, title, system, prompt_name, source.model, session_id, now, now)

    def set_session_system(self, session_id: str, system: str | None) -> None:
        """Change the system prompt of a session that has no messages yet (no prompt name: the user's own).

        A session with messages keeps its system prompt, since its replies were written under it:
        fork it with ``fork_session(..., system=...)`` instead.
        """
        check_text("session system", system, StoreError, optional=True)
        with self._write():
            if self._conn.execute("SELECT 1 FROM messages WHERE session_id = ? LIMIT 1", (session_id,)).fetchone():
                raise StoreError(
                    f"Session {session_id} has messages, so its system prompt stays; fork it with the new one."
                )
            cursor = self._conn.execute(
                "UPDATE sessions SET system = ?, prompt_name = NULL WHERE id = ?", (system, session_id)
            )
            if not cursor.rowcount:
                raise self._unknown(session_id)

    def session_settings(self, session_id: str) -> dict[str, Any]:
        """The chat's own reply settings (a JSON object in ``sessions.settings``); {} when it has none."""
        rows = self._query("SELECT settings FROM sessions WHERE id = ?", [session_id])
        if not rows:
            raise self._unknown(session_id)
        try:
            settings = json.loads(rows[0]["settings"] or "{}")
        except ValueError:
            return {}  # damaged by hand: the app's defaults, never a chat that cannot open
        return settings if isinstance(settings, dict) else {}

    def set_session_settings(self, session_id: str, settings: dict[str, Any]) -> None:
        """Store the chat's own reply settings; keys with None are left out (they mean "the default")."""
        kept = {name: value for name, value in settings.items() if value is not None}
        with self._write():
            cursor = self._conn.execute(
                "UPDATE sessions SET settings = ? WHERE id = ?", (json.dumps(kept) if kept else None, session_id)
            )
            if not cursor.rowcount:
                raise self._unknown(session_id)

    # -- messages ------------------------------------------------------------------

    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        *,
        status: str = "complete",
        error: str | None = None,
        finish_reason: str | None = None,
        tool_calls: list[dict] | None = None,
        tool_call_id: str | None = None,
        **metrics: Any,
    ) -> MessageRecord:
        """Append a message and mark the session as just updated.

        ``metrics`` are any of: prompt_tokens, cached_tokens, completion_tokens, ttft_s,
        tokens_per_s, model. A streaming reply starts as ``status="partial"``. ``tool_calls`` (an
        assistant's, OpenAI's shape) and ``tool_call_id`` (a "tool" message's) record a tool round.
        """
        check_text("message content", content, StoreError)
        check_text("message error", error, StoreError, optional=True)
        _check_choice("role", role, ROLES)
        _check_choice("status", status, STATUSES)
        if finish_reason is not None:
            _check_choice("finish_reason", finish_reason, FINISH_REASONS)
        _check_metrics(metrics)
        _check_tool_fields(role, tool_calls, tool_call_id)
        values = {"session_id": session_id, "role": role, "content": content, "status": status, "error": error}
        values["finish_reason"] = finish_reason
        values["tool_calls"] = json.dumps(tool_calls, ensure_ascii=False) if tool_calls else None
        values["tool_call_id"] = tool_call_id
        values.update(metrics)
        now = time.time()
        with self._write():
            self._touch_session(session_id, now)
            cursor = self._conn.execute(
                f"INSERT INTO messages ({', '.join(values)}, created, updated)"
                f" VALUES ({', '.join('?' * len(values))}, ?, ?)",
                (*values.values(), now, now),
            )
            return self.get_message(cursor.lastrowid)

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        status: str | None = None,
        error: str | None = None,
        finish_reason: str | None = None,
        tool_calls: list[dict] | None = None,
        **metrics: Any,
    ) -> None:
        """Change the given fields of a message (None leaves a field as it is).

        Called repeatedly while a reply streams in, then once with ``status="complete"``
        (or ``"error"`` and ``error=...``), the engine's ``finish_reason`` and the final metrics.
        """
        check_text("message content", content, StoreError, optional=True)
        check_text("message error", error, StoreError, optional=True)
        if status is not None:
            _check_choice("status", status, STATUSES)
        if finish_reason is not None:
            _check_choice("finish_reason", finish_reason, FINISH_REASONS)
        _check_metrics(metrics)
        _check_tool_fields("assistant", tool_calls, None)
        calls = json.dumps(tool_calls, ensure_ascii=False) if tool_calls else None
        changes = {"content": content, "status": status, "error": error, "finish_reason": finish_reason, **metrics}
        changes["tool_calls"] = calls
        changes = {name: value for name, value in changes.items() if value is not None}
        now = time.time()
        assignments = "".join(f"{name} = ?, " for name in changes)
        with self._write():
            cursor = self._conn.execute(
                f"UPDATE messages SET {assignments}updated = ? WHERE id = ?",
                (*changes.values(), now, message_id),
            )
            if not cursor.rowcount:
                raise StoreError(f"There is no message with id {message_id} in {self._where()}.")
            self._conn.execute(
                "UPDATE sessions SET updated = ? WHERE id = (SELECT session_id FROM messages WHERE id = ?)",
                (now, message_id),
            )

    def set_token_ids(self, message_id: int, token_ids: list[int]) -> None:
        """Store a reply's own token ids (for continue), as a JSON list."""
        with self._write():
            cursor = self._conn.execute(
                "UPDATE messages SET token_ids = ? WHERE id = ?", (json.dumps([int(t) for t in token_ids]), message_id)
            )
            if not cursor.rowcount:
                raise StoreError(f"There is no message with id {message_id} in {self._where()}.")

    def token_ids(self, message_id: int) -> list[int] | None:
        """A reply's stored token ids; None when they were never stored (older replies, user messages)."""
        rows = self._query("SELECT token_ids FROM messages WHERE id = ?", [message_id])
        if not rows:
            raise StoreError(f"There is no message with id {message_id} in {self._where()}.")
        try:
            ids = json.loads(rows[0]["token_ids"]) if rows[0]["token_ids"] else None
        except ValueError:
            return None
        return ids if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None

    def delete_messages_after(self, session_id: str, message_id: int) -> None:
        """Drop the session's messages with an id greater than ``message_id`` (for regenerate)."""
        with self._write():
            self._touch_session(session_id, time.time())
            self._conn.execute("DELETE FROM messages WHERE session_id = ? AND id > ?", (session_id, message_id))

    def messages(self, session_id: str) -> list[MessageRecord]:
        """The session's messages in the order they were added."""
        with self._read():
            self.get_session(session_id)
            rows = self._query(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_id = ? ORDER BY id", [session_id]
            )
        return [MessageRecord(**row) for row in rows]

    def get_message(self, message_id: int) -> MessageRecord:
        """The message with this id; StoreError if there is none."""
        rows = self._query(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", [message_id])
        if not rows:
            raise StoreError(f"There is no message with id {message_id} in {self._where()}.")
        return MessageRecord(**rows[0])

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Messages containing every word of ``text``, best match first.

        Each word is quoted as an FTS phrase, so quotes, ``AND``/``OR``/``NOT``, ``*``
        and parentheses are searched for as text instead of being parsed as syntax. A NUL
        separates words (FTS5 reads it as the end of the query); ``limit`` is capped at
        MAX_SEARCH_LIMIT, so a huge one is not an SQLite overflow.
        """
        check_text("search text", text, StoreError)
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise StoreError(f"The search limit must be a whole number (int); got {type(limit).__name__}.")
        limit = min(max(limit, 0), MAX_SEARCH_LIMIT)
        text = text.replace("\x00", " ")
        query = " ".join('"' + word.replace('"', '""') + '"' for word in text.split())
        if not query:
            return []
        rows = self._query(
            f"""
            SELECT m.session_id, s.title AS session_title, m.id AS message_id, m.role,
                   snippet(messages_fts, 0, '{MATCH_START}', '{MATCH_END}', '…', 12) AS snippet
            FROM messages_fts
            JOIN messages AS m ON m.id = messages_fts.rowid
            JOIN sessions AS s ON s.id = m.session_id
            WHERE messages_fts MATCH ?
            ORDER BY messages_fts.rank, m.id DESC
            LIMIT ?
            """,
            [query, limit],
        )
        return [SearchHit(**row) for row in rows]

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; calling it again does nothing."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------

    def _new_session_id(self) -> str:
        """A random id not yet taken (checked inside the caller's write transaction)."""
        while True:
            session_id = secrets.token_hex(5)
            if not self._conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone():
                return session_id

    def _touch_session(self, session_id: str, now: float) -> None:
        if not self._conn.execute("UPDATE sessions SET updated = ? WHERE id = ?", (now, session_id)).rowcount:
            raise self._unknown(session_id)

    def _query(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        with self._read():
            return list(self.db.query(sql, params))

    def _unknown(self, session_id: str) -> UnknownSessionError:
        return UnknownSessionError(
            f"No session with id {session_id!r} in {self._where()}. "
            "Run `localpaged sessions list` to see the stored sessions."
        )

    def _where(self) -> str:
        return str(self.path) if self.path else "the in-memory chat store"

    @contextmanager
    def _read(self) -> Iterator[None]:
        with self._lock, self._errors():
            yield

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One transaction, committed on the way out (rolled back on an error).

        BEGIN IMMEDIATE takes the write lock up front, so waiting for another program
        happens here, under the busy timeout, instead of failing midway.
        """
        with self._lock, self._errors():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._conn.execute("COMMIT")
            finally:
                if self._conn.in_transaction:
                    self._conn.rollback()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn sqlite3's errors into a StoreError that names the file and what to do."""
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(_explain(exc, self._where(), self._timeout)) from exc
        except UnicodeEncodeError as exc:  # a lone surrogate in a value the checks above do not see (an id)
            raise StoreError(
                f"A value given to the chat store is not Unicode text ({exc.object[exc.start]!r} at character "
                f"{exc.start}); remove it."
            ) from exc


def _lenient_text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _not_writable(path: Path) -> bool:
    """True for an existing database file that this user may not write, or whose folder it may not write
    (SQLite writes its -wal and -shm files there)."""
    return path.is_file() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))


def _is_lock_error(exc: sqlite3.Error) -> bool:
    """Whether SQLite refused because another connection holds the database."""
    code = getattr(exc, "sqlite_errorname", "") or ""
    return code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in str(exc)


def _explain(exc: sqlite3.Error, where: str, timeout: float) -> str:
    code = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    if code.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in text or "malformed" in text:
        return (
            f"The chat database {where} is damaged or is not an SQLite file ({text}). "
            "It was left untouched. Move it aside (e.g. rename it to chats.db.bad) to start "
            "a fresh one, or pass --db with another path."
        )
    if code.startswith("SQLITE_READONLY") or "readonly" in text:
        return (
            f"The chat database {where} is read-only ({text}). "
            "Make the file and its folder writable, or pass --db with another path."
        )
    if _is_lock_error(exc):
        return (
            f"The chat database {where} is locked by another program (waited {timeout:g} s). "
            "Close other localpaged windows using it and try again, or pass --db with another path."
        )
    if code.startswith("SQLITE_CANTOPEN") or "unable to open" in text:
        return (
            f"Cannot open the chat database {where} ({text}). "
            "Check that the path is a file in a folder you can write to, or pass --db with another path."
        )
    return f"The chat database {where} failed: {text}."


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise StoreError(f"A message {field} must be one of {', '.join(allowed)}; got {value!r}.")


def _check_tool_fields(role: str, tool_calls: list[dict] | None, tool_call_id: str | None) -> None:
    """tool_calls only on an assistant message, each of OpenAI's shape; tool_call_id on every "tool" one."""
    if tool_calls:
        if role != "assistant":
            raise StoreError(f"Only an assistant message makes tool calls; got tool_calls on a {role} message.")
        if not isinstance(tool_calls, list) or not all(_is_call(c) for c in tool_calls):
            raise StoreError(
                'tool_calls must be a list of {"id": str, "type": "function", "function": {"name": str, '
                '"arguments": str}} (OpenAI\'s shape).'
            )
        for call in tool_calls:
            check_text("tool call", json.dumps(call, ensure_ascii=False), StoreError)
    if (role == "tool") != (tool_call_id is not None):
        raise StoreError("A tool message answers one call: give it the tool_call_id, and only it.")
    check_text("tool_call_id", tool_call_id, StoreError, optional=True)


def _check_metrics(metrics: dict[str, Any]) -> None:
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise TypeError(f"Unknown message field(s) {', '.join(unknown)}; expected any of {', '.join(METRICS)}.")

"""The `localpaged` command: each subcommand, plain output for pipes, exit codes, clear errors.

Most tests call cli.main() in-process (with a FakeLLM behind `run`); a few run the real
console entry in a subprocess to see exactly what a person sees: no traceback, exit 2.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from localpaged import cli
from localpaged.chat.store import ChatStore
from localpaged.engine.async_llm import AsyncLLM
from tests.engine.fake_llm import FakeLLM

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the default database and the user's prompt folder inside the test's folder."""
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[AsyncLLM]:
    """Every engine `run` opens: a FakeLLM behind an AsyncLLM."""
    opened: list[AsyncLLM] = []

    def open_engine(model: str | None, **engine_config: object) -> AsyncLLM:
        opened.append(AsyncLLM(llm=FakeLLM(reply=lambda ids: f"fake answer {len(ids)}")))
        return opened[-1]

    monkeypatch.setattr(cli, "open_engine", open_engine)
    return opened


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "localpaged.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_run_streams_the_answer_and_stores_the_turn(home: Path, engines, capsys) -> None:
    assert cli.main(["run", "What is paging?", "--system", "Be brief.", "--max-tokens", "50"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("fake answer ") and out.endswith("\n")
    assert "\033" not in out  # no colour into a pipe
    (session,) = ChatStore(home / "chats.db").list_sessions()
    assert f"--session {session.id}" in err
    assert engines[0]._core._thread.is_alive() is False  # shut down on the way out

    assert cli.main(["run", "And then?", "--session", session.id]) == 0
    messages = ChatStore(home / "chats.db").messages(session.id)
    assert [(m.role, m.status) for m in messages] == [("user", "complete"), ("assistant", "complete")] * 2
    assert messages[0].content == "What is paging?" and messages[2].content == "And then?"


def test_run_with_a_named_prompt_and_no_store(home: Path, engines, capsys) -> None:
    assert cli.main(["run", "hi", "--prompt", "general", "--no-store"]) == 0
    assert capsys.readouterr().out.startswith("fake answer")
    assert not (home / "chats.db").exists() or ChatStore(home / "chats.db").list_sessions() == []


def test_run_argument_errors_are_one_line(engines, capsys) -> None:
    assert cli.main(["run", "hi", "--session", "abc", "--system", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: --system and --prompt set up new sessions")
    assert cli.main(["run", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli.main(["run", "hi", "--session", "nope"]) == 2
    assert "No session with id 'nope'" in capsys.readouterr().err
    assert engines == []  # every one of these failed before loading a model


def test_ctrl_c_exits_130_quietly_and_keeps_the_partial_reply(home: Path, engines, monkeypatch, capsys) -> None:
    real_write = sys.stdout.write
    written = []

    def write_then_interrupt(text: str) -> int:
        written.append(text)
        if len(written) == 3:
            raise KeyboardInterrupt
        return real_write(text)

    monkeypatch.setattr(sys.stdout, "write", write_then_interrupt)
    assert cli.main(["run", "interrupt me"]) == 130
    monkeypatch.undo()
    assert capsys.readouterr().err == ""
    assert not engines[0]._core._thread.is_alive()
    (session,) = ChatStore(home / "chats.db").list_sessions()
    user, reply = ChatStore(home / "chats.db").messages(session.id)
    assert user.content == "interrupt me" and reply.status == "partial"


def test_sigterm_exits_143_and_keeps_the_partial_reply(home: Path, engines, monkeypatch, capsys) -> None:
    """`kill PID` during `localpaged run` is handled as Ctrl-C is: the reply so far is stored, not lost."""
    import os
    import signal

    real_write = sys.stdout.write
    written = []

    def write_then_terminate(text: str) -> int:
        written.append(text)
        if len(written) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises on the way out of this call
        return real_write(text)

    monkeypatch.setattr(sys.stdout, "write", write_then_terminate)
    assert cli.main(["run", "terminate me"]) == 143
    monkeypatch.undo()
    assert capsys.readouterr().err == ""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored for the rest of the process
    (session,) = ChatStore(home / "chats.db").list_sessions()
    user, reply = ChatStore(home / "chats.db").messages(session.id)
    assert user.content == "terminate me" and reply.status == "partial" and reply.content


def test_sessions_list_show_export_delete_and_search(home: Path, tmp_path: Path, capsys) -> None:
    with ChatStore(home / "chats.db") as store:
        session = store.create_session(title="Paging talk", system="sys")
        store.add_message(session.id, "user", "what is a block table?")
        store.add_message(session.id, "assistant", "it maps positions to blocks")

    assert cli.main(["sessions", "list"]) == 0
    assert capsys.readouterr().out.split("\t")[::2] == [session.id, "Paging talk\n"]

    assert cli.main(["sessions", "show", session.id]) == 0
    out = capsys.readouterr().out
    assert "user\nwhat is a block table?" in out and "assistant\nit maps positions to blocks" in out

    assert cli.main(["sessions", "export", session.id]) == 0
    assert capsys.readouterr().out.startswith("# Paging talk\n")
    target = tmp_path / "talk.md"
    assert cli.main(["sessions", "export", session.id, "-o", str(target)]) == 0
    assert "## Assistant\n\nit maps positions to blocks" in target.read_text()

    capsys.readouterr()

    assert cli.main(["search", "block table"]) == 0
    hit = capsys.readouterr().out.strip().split("\t")
    assert hit[:3] == [session.id, "1", "user"] and "«block»" in hit[4]

    assert cli.main(["sessions", "delete", session.id]) == 0
    assert cli.main(["sessions", "show", session.id]) == 2
    assert "No session with id" in capsys.readouterr().err


def test_sessions_use_the_db_option(tmp_path: Path, capsys) -> None:
    db = tmp_path / "elsewhere.db"
    with ChatStore(db) as store:
        store.create_session(title="Over there")
    assert cli.main(["sessions", "list", "--db", str(db)]) == 0
    assert "Over there" in capsys.readouterr().out


def test_prompts_list_and_show(capsys) -> None:
    assert cli.main(["prompts", "list"]) == 0
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert "general" in names
    assert cli.main(["prompts", "show", "general"]) == 0
    assert "helpful" in capsys.readouterr().out
    assert cli.main(["prompts", "show", "no-such-prompt"]) == 2
    assert "No prompt named 'no-such-prompt'" in capsys.readouterr().err


def test_chat_hands_its_options_to_the_tui(monkeypatch) -> None:
    import types

    calls = []
    fake_app = types.ModuleType("localpaged.tui.app")
    fake_app.run_app = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "localpaged.tui.app", fake_app)
    assert cli.main(["chat", "--model", "m.gguf", "--prompt", "general", "--session", "s1", "--db", "x.db"]) == 0
    (call,) = calls
    settings = call.pop("settings")
    assert call == {
        "model": "m.gguf",
        "prompt": "general",
        "session_id": "s1",
        "db": "x.db",
        "backend": None,
        "api_key": None,
    }
    assert (settings.model, settings.prompt) == ("m.gguf", "general")
    assert settings.origin("model") == "flag --model"


def test_chat_on_a_backend_takes_it_from_the_flag_or_the_environment(monkeypatch, tmp_path) -> None:
    """--backend/--api-key, else $LOCALPAGED_BACKEND/$LOCALPAGED_API_KEY; --model then names the server's model,
    and the settings file's model (a local path) is not sent to the server."""
    import types

    calls = []
    fake_app = types.ModuleType("localpaged.tui.app")
    fake_app.run_app = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "localpaged.tui.app", fake_app)
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('model = "~/models/local.gguf"\n')
    assert cli.main(["chat", "--backend", "http://gpu:8000/v1", "--api-key", "k1", "--model", "served"]) == 0
    monkeypatch.setenv("LOCALPAGED_BACKEND", "http://env:8000/v1")
    monkeypatch.setenv("LOCALPAGED_API_KEY", "k2")
    assert cli.main(["chat"]) == 0
    got = [(c["backend"], c["api_key"], c["model"]) for c in calls]
    assert got == [("http://gpu:8000/v1", "k1", "served"), ("http://env:8000/v1", "k2", None)]


# ----- what a person sees: subprocesses ------------------------------------------------------


def test_version_prints_the_package_version_and_exits_0() -> None:
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"localpaged {version('localpaged')}\n"
    assert done.stderr == ""


def test_unknown_session_is_one_clear_line_and_exit_2(home: Path) -> None:
    ChatStore(home / "chats.db").close()
    done = run_cli("sessions", "show", "deadbeef")
    assert done.returncode == 2
    assert done.stderr.startswith("error: No session with id 'deadbeef'")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_corrupt_database_is_reported_and_left_untouched(tmp_path: Path) -> None:
    db = tmp_path / "chats.db"
    garbage = b"this is not an sqlite database\x00" * 100
    db.write_bytes(garbage)
    done = run_cli("sessions", "list", "--db", str(db))
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "damaged or is not an SQLite file" in done.stderr
    assert "Traceback" not in done.stderr
    assert db.read_bytes() == garbage
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.db"]


def test_a_malformed_prompt_file_is_reported(home: Path) -> None:
    folder = home / "prompts"
    folder.mkdir()
    (folder / "broken.md").write_text("no front matter here\njust text\n")
    done = run_cli("prompts", "show", "broken")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "broken.md, line 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_export_never_overwrites_without_force_and_never_the_database(home: Path, tmp_path: Path, capsys) -> None:
    database = home / "chats.db"
    with ChatStore(database) as store:
        session = store.create_session(title="Keep me")
        store.add_message(session.id, "user", "precious words")
    before = database.read_bytes()
    existing = tmp_path / "notes.md"
    existing.write_text("my own notes")

    def export(*extra: str) -> str:
        assert cli.main(["sessions", "export", session.id, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1  # one line
        return err

    assert "--force" in export("-o", str(existing))
    assert existing.read_text() == "my own notes"
    for own in (database, database.with_name("chats.db-wal")):
        if own.exists():
            assert "the chat database itself" in export("-o", str(own), "--force")
    assert database.read_bytes() == before and ChatStore(database).messages(session.id)[0].content == "precious words"
    assert "is a folder" in export("-o", str(tmp_path))
    assert "does not exist" in export("-o", str(tmp_path / "missing" / "out.md"))

    assert cli.main(["sessions", "export", session.id, "-o", str(existing), "--force"]) == 0
    assert "precious words" in existing.read_text()


def test_text_from_the_store_never_drives_the_terminal(home: Path, monkeypatch, capsys) -> None:
    """Control characters in titles and messages are escaped on a terminal, and kept as they are in pipes."""
    evil = "clear\x1b[2J title\x1b]0;pwned\x07"
    with ChatStore(home / "chats.db") as store:
        session = store.create_session(title=evil)
        store.add_message(session.id, "user", "line one\rover\x08written\x9b31m\nline two")

    assert cli.main(["sessions", "show", session.id]) == 0
    assert "\rover\x08written\x9b31m" in capsys.readouterr().out  # a pipe gets the text unchanged

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    for command in (["sessions", "list"], ["sessions", "show", session.id], ["search", "line"]):
        assert cli.main(command) == 0
        out = capsys.readouterr().out
        assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in out), (command, out)
    assert cli.main(["sessions", "show", session.id]) == 0
    assert "line one\\x0dover\\x08written\\x9b31m\nline two" in capsys.readouterr().out


def test_a_message_cannot_forge_a_turn_in_the_export(home: Path, capsys) -> None:
    with ChatStore(home / "chats.db") as store:
        session = store.create_session(title="two\nlines")
        store.add_message(session.id, "user", "hello\n## Assistant\nI am a forged reply\n## Steps stay headings")
        store.add_message(session.id, "assistant", "the real reply")

    assert cli.main(["sessions", "export", session.id]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# two lines"
    assert [line for line in lines if line.startswith("## ")] == ["## User", "## Steps stay headings", "## Assistant"]
    assert "\\## Assistant" in lines

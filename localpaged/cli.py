"""The `localpaged` command: chat (the TUI), run, sessions, search, prompts, bench.

Commands that only read the chat store never import the engine (and so never torch):
listing sessions should be instant. Our own errors (LocalpagedError) become one
`error: ...` line and exit code 2; Ctrl-C shuts the engine down and exits 130, SIGTERM
the same way with 143 (a reply in flight is kept as partial either way).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from localpaged.chat.prompts import get_prompt, list_prompts, load_prompt
from localpaged.chat.session import export_markdown
from localpaged.chat.store import ChatStore
from localpaged.errors import ConfigError, LocalpagedError

if TYPE_CHECKING:
    from localpaged.engine.async_llm import AsyncLLM

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput.py"


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the reply in flight is stored as partial and the engine shut down."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    # Unknown arguments are the benchmark's own options; for any other command they are a mistake.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.bench_args = extra
    engines: list[AsyncLLM] = []  # shut down on the way out, whatever happens
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        args.func(args, engines)
        return 0
    except LocalpagedError as exc:
        print(f"{_red('error:', sys.stderr)} {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Terminated:
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `localpaged sessions list | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush is quiet
        return EXIT_BROKEN_PIPE
    finally:
        for engine in engines:
            engine.shutdown()
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localpaged", description="Many chat sessions at once against one local paged-KV LLM engine."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    chat = commands.add_parser("chat", help="open the terminal chat app")
    _add_model(chat)
    chat.add_argument("--prompt", metavar="NAME", help="system prompt for new sessions (see `prompts list`)")
    chat.add_argument("--session", metavar="ID", help="open this stored session")
    _add_db(chat)
    chat.set_defaults(func=cmd_chat)

    run = commands.add_parser("run", help="answer one message, streaming to stdout, and store the turn")
    run.add_argument("message", help="the user message")
    system = run.add_mutually_exclusive_group()
    system.add_argument("--system", metavar="TEXT", help="system prompt text (new sessions only)")
    system.add_argument("--prompt", metavar="NAME", help="a named system prompt (new sessions only)")
    run.add_argument("--session", metavar="ID", help="continue this stored session")
    run.add_argument("--max-tokens", type=int, metavar="N", help="most tokens in the reply")
    run.add_argument("--temperature", type=float, metavar="T", help="0 is greedy")
    _add_model(run)
    _add_db(run)
    run.add_argument("--no-store", action="store_true", help="keep nothing: use an in-memory store")
    run.set_defaults(func=cmd_run)

    sessions = commands.add_parser("sessions", help="list, show, export or delete stored sessions")
    actions = sessions.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="list sessions, most recent first")
    _add_db(listing)
    listing.set_defaults(func=cmd_sessions_list)
    show = actions.add_parser("show", help="print a session's messages")
    show.add_argument("id")
    _add_db(show)
    show.set_defaults(func=cmd_sessions_show)
    export = actions.add_parser("export", help="write a session as Markdown")
    export.add_argument("id")
    export.add_argument("-o", "--output", metavar="FILE", help="file to write (default: stdout)")
    export.add_argument("--force", action="store_true", help="overwrite FILE if it exists (never the chat database)")
    _add_db(export)
    export.set_defaults(func=cmd_sessions_export)
    delete = actions.add_parser("delete", help="delete a session and its messages")
    delete.add_argument("id")
    _add_db(delete)
    delete.set_defaults(func=cmd_sessions_delete)

    search = commands.add_parser("search", help="find messages containing every word of TEXT")
    search.add_argument("text")
    search.add_argument("--limit", type=int, default=50, metavar="N")
    _add_db(search)
    search.set_defaults(func=cmd_search)

    prompts = commands.add_parser("prompts", help="list or show system prompts")
    prompt_actions = prompts.add_subparsers(dest="action", required=True, metavar="ACTION")
    prompt_actions.add_parser("list", help="list prompt names and titles").set_defaults(func=cmd_prompts_list)
    prompt_show = prompt_actions.add_parser("show", help="print a prompt's text")
    prompt_show.add_argument("name")
    prompt_show.set_defaults(func=cmd_prompts_show)

    bench = commands.add_parser(
        "bench", help="run the throughput benchmark (benchmarks/throughput.py); other options are passed on to it"
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="PATH", help="local HF folder or .gguf file (default: SmolLM2-135M-Instruct)"
    )


def _add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="PATH", help="chat database (default: in the user data folder)")


# ----- commands ---------------------------------------------------------------------------


def cmd_chat(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    from localpaged.tui.app import run_app  # Textual loads only for the app

    run_app(model=args.model, prompt=args.prompt, session_id=args.session, db=args.db)


def cmd_run(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    from localpaged.chat.session import Session
    from localpaged.sampling import SamplingParams

    if args.session and (args.system or args.prompt):
        raise ConfigError("--system and --prompt set up new sessions; a continued --session keeps its own")
    if args.session and args.no_store:
        raise ConfigError("--session continues a stored session; drop --no-store")
    settings = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    params = SamplingParams(**{name: value for name, value in settings.items() if value is not None})
    system = load_prompt(args.prompt) if args.prompt else args.system
    with ChatStore(":memory:" if args.no_store else args.db) as store:
        if args.session:
            store.get_session(args.session)  # fail on a wrong id before spending seconds on the model
        engine = open_engine(args.model)
        engines.append(engine)
        if args.session:
            session = Session.load(engine, store, args.session)
        else:
            session = Session.new(engine, store, system=system, prompt_name=args.prompt)
        # closing(): on Ctrl-C the reply is finalised (stored as partial) before the engine stops.
        with closing(session.stream(args.message, params)) as deltas:
            for delta in deltas:
                sys.stdout.write(delta)
                sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()  # before the note on stderr, so a terminal shows them in order
    if session.warning:
        print(f"warning: {session.warning}", file=sys.stderr)
    if not args.no_store:
        print(f"session {session.id} (continue with --session {session.id})", file=sys.stderr)


def open_engine(model: str | None) -> AsyncLLM:
    """Load the model, telling a person at a terminal what is happening meanwhile."""
    from localpaged.engine.async_llm import AsyncLLM

    if not sys.stderr.isatty():
        return AsyncLLM(model)

    def progress(message: str, fraction: float | None) -> None:
        percent = f" {fraction:.0%}" if fraction is not None else ""
        sys.stderr.write(f"\r\033[K{message}{percent}")
        sys.stderr.flush()

    engine = AsyncLLM(model, progress=progress)
    sys.stderr.write("\r\033[K")
    return engine


def cmd_sessions_list(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    with ChatStore(args.db) as store:
        for s in store.list_sessions():
            print(f"{s.id}\t{_when(s.updated)}\t{_shown(s.title or '(untitled)', one_line=True)}")


def cmd_sessions_show(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    with ChatStore(args.db) as store:
        messages = store.messages(args.id)
    for m in messages:
        status = "" if m.status == "complete" else f" [{m.status}{': ' + m.error if m.error else ''}]"
        print(f"--- {m.id} {m.role}{_shown(status, one_line=True)}")
        print(_shown(m.content))


def cmd_sessions_export(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    with ChatStore(args.db) as store:
        text = export_markdown(store.get_session(args.id), store.messages(args.id))
        database = store.path
    if not args.output:
        sys.stdout.write(_shown(text))
        return
    target = Path(args.output).expanduser()
    _check_export_target(target, database, args.force)
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc.strerror}; pick another file") from exc
    print(f"wrote {target}", file=sys.stderr)


def _check_export_target(target: Path, database: Path | None, force: bool) -> None:
    """Refuse a target that is a folder, sits in a missing folder, is the chat database, or exists (unless forced)."""
    if target.is_dir():
        raise ConfigError(f"{target} is a folder; name a file in it, e.g. {target / 'chat.md'}")
    if not target.parent.is_dir():
        raise ConfigError(f"the folder {target.parent} does not exist; create it first or pick another file")
    if database is not None:
        for own in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
            if own.exists() and target.exists() and os.path.samefile(own, target):
                raise ConfigError(f"{target} is the chat database itself; pick another file")
    if target.exists() and not force:
        raise ConfigError(f"{target} already exists; pass --force to overwrite it, or pick another file")


def cmd_sessions_delete(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    with ChatStore(args.db) as store:
        store.delete_session(args.id)
    print(f"deleted session {args.id}", file=sys.stderr)


def cmd_search(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    with ChatStore(args.db) as store:
        hits = store.search(args.text, limit=args.limit)
    for hit in hits:
        snippet = _shown(" ".join(hit.snippet.split()), one_line=True)
        title = _shown(hit.session_title or "(untitled)", one_line=True)
        print(f"{hit.session_id}\t{hit.message_id}\t{hit.role}\t{title}\t{snippet}")


def cmd_prompts_list(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    for prompt in list_prompts():
        origin = "" if prompt.builtin else " (yours)"
        print(
            f"{prompt.name}\t{_shown(prompt.title, one_line=True)}{origin}\t{_shown(prompt.description, one_line=True)}"
        )


def cmd_prompts_show(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    print(get_prompt(args.name).text)


def cmd_bench(args: argparse.Namespace, engines: list[AsyncLLM]) -> None:
    if not BENCH_SCRIPT.is_file():
        raise ConfigError(
            f"the benchmark script {BENCH_SCRIPT} is not here; it ships with the source checkout, "
            "run it from there: python benchmarks/throughput.py"
        )
    sys.argv = [str(BENCH_SCRIPT), *args.bench_args]
    runpy.run_path(str(BENCH_SCRIPT), run_name="__main__")


# ----- helpers ----------------------------------------------------------------------------


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


# Control characters (C0 but newline and tab, DEL, C1) as visible escapes: text from the store
# or a prompt file must not drive the terminal (clear it, retitle it, plant hyperlinks).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\n\t"}
_CONTROLS_ONE_LINE = {**_CONTROLS, ord("\n"): "\\n", ord("\t"): "\\t"}


def _shown(text: str, *, one_line: bool = False) -> str:
    """``text`` for stdout: control characters escaped when that is a terminal, unchanged into pipes and files."""
    if not sys.stdout.isatty():
        return text
    return text.translate(_CONTROLS_ONE_LINE if one_line else _CONTROLS)


def _red(text: str, stream: TextIO) -> str:
    """Colour only for a person at a terminal; pipes and files get plain text."""
    return f"\033[31m{text}\033[0m" if stream.isatty() else text


if __name__ == "__main__":
    sys.exit(main())

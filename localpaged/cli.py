"""The `localpaged` command: chat (the TUI), run, serve, sessions, search, config, prompts, models; --version.

Commands that only read the chat store never import the engine (and so never torch):
listing sessions should be instant. Our own errors (LocalpagedError) become one
`error: ...` line and exit code 2; Ctrl-C shuts the engine down and exits 130, SIGTERM
the same way with 143 (a reply in flight is kept as partial either way). `serve` is the
exception once it is serving: Ctrl-C and SIGTERM are how a server is meant to stop, so it
aborts the requests in flight and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

# The chat layer (sqlite-utils) is imported by the commands that use it: ``serve`` starts its engine core sooner.
from localpaged.chat.prompts import get_prompt, list_prompts, load_prompt
from localpaged.errors import ConfigError, LocalpagedError, PromptError, RequestError

if TYPE_CHECKING:
    from localpaged.chat.session import Session
    from localpaged.chat.tool_turn import ToolCallRequest
    from localpaged.chat.tools import Tool
    from localpaged.config_file import Settings
    from localpaged.engine.protocol import EngineClient

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the reply in flight is stored as partial and the engine shut down."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    engines: list[EngineClient] = []  # shut down on the way out, whatever happens
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        _check_utf8(args)
        args.func(args, engines)
        return 0
    except LocalpagedError as exc:
        print(f"{_red('error:', sys.stderr)} {_shown(str(exc), stream=sys.stderr)}", file=sys.stderr)
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


def _check_utf8(args: argparse.Namespace) -> None:
    """Reject an argument that is not valid UTF-8 (Python hands its bytes over as lone surrogates).

    Such text cannot be stored, searched, printed or given to the tokenizer; left alone it fails later
    with a UnicodeEncodeError traceback from wherever it is first written.
    """
    for name, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not isinstance(item, str):
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                shown = os.fsencode(item)
                flag = "--" + name.replace("_", "-") if name not in ("message", "text", "id", "name") else name.upper()
                raise ConfigError(
                    f"the {flag} argument is not valid UTF-8 ({shown!r}); pass it as UTF-8 text"
                ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localpaged", description="Many chat sessions at once against one local paged-KV LLM engine."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    chat = commands.add_parser("chat", help="open the terminal chat app")
    _add_model(chat)
    _add_backend(chat)
    _add_kv_disk(chat)
    _add_kv_cache_dtype(chat)
    _add_speculative(chat)
    chat.add_argument("--prompt", metavar="NAME", help="system prompt for new sessions (see `prompts list`)")
    chat.add_argument("--session", metavar="ID", help="open this stored session")
    _add_sampling(chat)
    _add_db(chat)
    chat.set_defaults(func=cmd_chat)

    run = commands.add_parser("run", help="answer one message, streaming to stdout, and store the turn")
    run.add_argument("message", help="the user message")
    system = run.add_mutually_exclusive_group()
    system.add_argument("--system", metavar="TEXT", help="system prompt text (new sessions only)")
    system.add_argument("--prompt", metavar="NAME", help="a named system prompt (new sessions only)")
    run.add_argument("--session", metavar="ID", help="continue this stored session")
    _add_sampling(run)
    _add_model(run)
    _add_backend(run)
    _add_kv_disk(run)
    _add_kv_cache_dtype(run)
    _add_speculative(run)
    _add_db(run)
    run.add_argument("--no-store", action="store_true", help="keep nothing: use an in-memory store")
    run.add_argument(
        "--truncate",
        action="store_true",
        help="when the conversation outgrows the context, drop its oldest turns (default: refuse, saying by how much)",
    )
    run.add_argument(
        "--tool",
        action="append",
        metavar="NAME",
        help="let the model call this tool of an [mcp.servers] server of the settings file (NAME or SERVER/NAME; "
        "repeat for more); each call is asked about on the terminal",
    )
    run.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        default="auto",
        help="auto (default), required (the model must call a tool first), none, or a tool's name",
    )
    run.add_argument("--allow-tools", action="store_true", help="run the tools' calls without asking")
    run.set_defaults(func=cmd_run)

    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)"
    )
    serve.add_argument(
        "--port", type=int, default=8000, metavar="N", help="port to listen on (default: 8000; 0 picks a free one)"
    )
    _add_model(serve)
    _add_kv_disk(serve)
    _add_kv_cache_dtype(serve)
    _add_speculative(serve)
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $LOCALPAGED_API_KEY; none: no key needed)",
    )
    serve.add_argument(
        "--allowed-hosts",
        metavar="NAME",
        nargs="+",
        default=[],
        help="Host names a server without an API key answers besides loopback ones (localhost, 127.0.0.1, ::1), "
        "e.g. this machine's name on the LAN; keeps web pages that rebind their DNS name to this machine out",
    )
    _add_engine(serve)
    serve.set_defaults(func=cmd_serve)

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

    config = commands.add_parser("config", help="show the effective settings, or where the settings file is")
    config_actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    config_show = config_actions.add_parser(
        "show", help="print every setting and where it came from (flag, settings file, built-in)"
    )
    _add_model(config_show)
    config_show.add_argument("--prompt", metavar="NAME", help="a named system prompt, as for `run`")
    _add_sampling(config_show)
    config_show.add_argument(
        "--engine",
        action="store_true",
        help="also start the engine with these settings and print what it settled on here (device, dtypes, pool)",
    )
    config_show.set_defaults(func=cmd_config_show)
    config_actions.add_parser("path", help="print the settings file's path").set_defaults(func=cmd_config_path)

    prompts = commands.add_parser("prompts", help="list or show system prompts")
    prompt_actions = prompts.add_subparsers(dest="action", required=True, metavar="ACTION")
    prompt_actions.add_parser("list", help="list prompt names and titles").set_defaults(func=cmd_prompts_list)
    prompt_show = prompt_actions.add_parser("show", help="print a prompt's text")
    prompt_show.add_argument("name")
    prompt_show.set_defaults(func=cmd_prompts_show)

    models = commands.add_parser(
        "models", help="list the model files already on this machine (Ollama, LM Studio, llama.cpp, Hugging Face)"
    )
    models.set_defaults(func=cmd_models)
    return parser


def package_version() -> str:
    """The installed distribution's version (pyproject's ``version``), or "unknown" from an uninstalled checkout."""
    try:
        return version("localpaged")
    except PackageNotFoundError:
        return "unknown"


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH|NAME",
        help="local HF folder or .gguf file, or a name `localpaged models` lists, e.g. qwen2.5:1.5b "
        "(default: SmolLM2-135M-Instruct)",
    )


def _add_backend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        metavar="URL",
        help="chat with the model of this OpenAI-compatible server (localpaged serve, vLLM, SGLang, llama-server) "
        "instead of loading one here, e.g. http://gpu-box:8000/v1; --model then names one it serves "
        "(default: $LOCALPAGED_BACKEND)",
    )
    parser.add_argument(
        "--api-key", metavar="KEY", help="the --backend server's API key (default: $LOCALPAGED_API_KEY)"
    )


def _backend(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The remote engine's URL (None: the local engine) and API key, from the flags or the environment."""
    url = args.backend or os.environ.get("LOCALPAGED_BACKEND") or None
    return url, args.api_key or os.environ.get("LOCALPAGED_API_KEY") or None


def _add_kv_disk(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-kv-disk",
        action="store_true",
        help="keep KV blocks in memory only: nothing written to the disk tier, nothing read from it",
    )


def _add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="type of the KV cache's values: 16 bits halve its memory and speed up long chats; float32 is the "
        "exact path (default: auto, float16 on the CPU's native kernels, else the model's dtype)",
    )


def _add_speculative(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=("auto", "off", "ngram", "suffix"),
        help="speculative decoding's draft tokens, checked several to a step (greedy replies are unchanged): from "
        "the chat's own text (ngram), and from earlier replies too (suffix); off; auto (default): suffix while few "
        "chats decode",
    )
    parser.add_argument(
        "--speculative-draft",
        metavar="MODEL",
        help="draft tokens from this smaller model of the same vocabulary instead (a path or name, as --model)",
    )
    parser.add_argument(
        "--speculative-k",
        type=int,
        metavar="N",
        help="the draft model's drafts a step at most, 1 to 8 (default: 3)",
    )


def _speculative_flags(args: argparse.Namespace, current: object) -> tuple[object, str]:
    """``engine.speculative`` from the flags (None: not given) and the flag to name for it; ``current``: the
    settings file's value, whose draft ``--speculative-k`` alone changes the k of."""
    mode = getattr(args, "speculative", None)
    draft, k = getattr(args, "speculative_draft", None), getattr(args, "speculative_k", None)
    if draft is not None:
        if mode is not None:
            raise ConfigError(
                f"--speculative {mode} and --speculative-draft: pass one (a draft model is its own kind of drafts)"
            )
        return {"draft": draft, **({"k": k} if k is not None else {})}, "--speculative-draft"
    if k is not None:
        if mode is not None or not isinstance(current, Mapping):
            raise ConfigError(
                "--speculative-k sets a draft model's k: pass --speculative-draft MODEL too "
                "(or set speculative = { draft = MODEL } in the settings file's [engine])"
            )
        return {**current, "k": k}, "--speculative-k"
    return mode, "--speculative"


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    """The sampling flags; each overrides the settings file's [sampling] value."""
    parser.add_argument(
        "--max-tokens", type=int, metavar="N", help="most tokens in the reply (default: none, the whole reply)"
    )
    parser.add_argument("--temperature", type=float, metavar="T", help="0 is greedy (default: 0.7)")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling, in (0, 1]; 1 is off (default)")
    parser.add_argument("--top-k", type=int, metavar="K", help="keep the K likeliest tokens; 0 is off (default)")
    parser.add_argument("--seed", type=int, metavar="N", help="the same seed gives the same reply (default: random)")


def _settings(args: argparse.Namespace) -> Settings:
    """The settings file with this command's flags on top (flag > file > built-in)."""
    from localpaged.config_file import load_settings

    flags = {"model": getattr(args, "model", None), "prompt": getattr(args, "prompt", None)}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        flags[f"sampling.{name}"] = getattr(args, name, None)
    flags["engine.kv_disk"] = False if getattr(args, "no_kv_disk", False) else None
    flags["engine.kv_cache_dtype"] = getattr(args, "kv_cache_dtype", None)
    settings = load_settings()
    flags["engine.speculative"], speculative_flag = _speculative_flags(args, settings.engine.speculative)
    return settings.with_flags(flags, {"engine.kv_disk": "--no-kv-disk", "engine.speculative": speculative_flag})


def _add_engine(parser: argparse.ArgumentParser) -> None:
    """The engine's capacity knobs (EngineConfig checks their values)."""
    parser.add_argument("--max-num-seqs", type=int, metavar="N", help="most requests in one batch (default: 64)")
    parser.add_argument(
        "--kv-cache-memory", metavar="SIZE", help="memory for the KV cache, e.g. 2GiB (default: sized from free memory)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="context length, prompt and reply (default: the model's, <= 8192)",
    )


def _engine_settings(args: argparse.Namespace) -> dict:
    settings = {
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": args.max_model_len,
    }
    return {name: value for name, value in settings.items() if value is not None}


def _add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="PATH", help="chat database (default: in the user data folder)")


# ----- commands ---------------------------------------------------------------------------


def cmd_chat(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.tui.app import run_app  # Textual loads only for the app

    settings = _settings(args)
    backend, api_key = _backend(args)
    model = args.model if backend else settings.model  # the settings file's model is a local path
    run_app(
        model=model,
        prompt=args.prompt,
        session_id=args.session,
        db=args.db,
        settings=settings,
        backend=backend,
        api_key=api_key,
    )


def cmd_run(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.chat.session import Session, filled_context, limit_note
    from localpaged.chat.store import ChatStore

    if args.session and (args.system or args.prompt):
        raise ConfigError("--system and --prompt set up new sessions; a continued --session keeps its own")
    if args.session and args.no_store:
        raise ConfigError("--session continues a stored session; drop --no-store")
    settings = _settings(args)
    # A new session's system prompt: --system, else --prompt, else the settings file's prompt.
    prompt_name = None if args.system else settings.prompt
    system = load_prompt(prompt_name) if prompt_name else args.system
    reply = {
        "sampling": settings.sampling.template(),
        "max_tokens": settings.sampling.max_tokens,
        "truncate": args.truncate,
    }
    if not args.message.strip():  # checked before seconds go into loading the model
        raise RequestError("the message is empty; pass some text to send")
    with ChatStore(":memory:" if args.no_store else args.db) as store:
        if args.session:
            store.get_session(args.session)  # fail on a wrong id before spending seconds on the model
        backend, api_key = _backend(args)
        if backend:  # the settings file's model is a local path; --model names the server's
            engine = open_engine(args.model, backend=backend, api_key=api_key)
        else:
            engine = open_engine(settings.model, **settings.engine.as_kwargs())
        engines.append(engine)
        if args.session:
            session = Session.load(engine, store, args.session, **reply)
        else:
            session = Session.new(engine, store, system=system, prompt_name=prompt_name, **reply)
        try:
            if args.tool:
                with _mcp_tools(settings, args.tool) as tools:
                    _run_with_tools(session, args, tools)
            else:
                # closing(): on Ctrl-C the reply is finalised (stored as partial) before the engine stops.
                with closing(session.stream(args.message)) as deltas:
                    for delta in deltas:
                        sys.stdout.write(_shown(delta))
                        sys.stdout.flush()
        except BaseException:
            # A first turn rejected before anything was stored (too long, ...) leaves no empty session behind.
            if not args.session and not store.messages(session.id):
                session.delete()
            raise
    sys.stdout.write("\n")
    sys.stdout.flush()  # before the note on stderr, so a terminal shows them in order
    if session.warning:
        print(f"warning: {_shown(session.warning, stream=sys.stderr)}", file=sys.stderr)
    context, reply = session.engine.info.max_model_len, session.last_reply
    if reply is not None and (note := limit_note(reply, context)):
        if filled_context(reply, context):
            print(f"note: the reply {note}; start a new session to go on", file=sys.stderr)
        else:
            print(f"note: the reply {note} (raise --max-tokens or max_tokens in {settings.path})", file=sys.stderr)
    if not args.no_store:
        print(f"session {session.id} (continue with --session {session.id})", file=sys.stderr)


@contextmanager
def _mcp_tools(settings: Settings, names: list[str]) -> Iterator[list[Tool]]:
    """The settings' MCP servers started (and, on the way out, stopped), and the tools ``names`` picks."""
    from localpaged.chat.tools import START_TIMEOUT_S, McpServers

    if not settings.mcp_servers:
        raise ConfigError(f"--tool: no MCP server is set up; add an [mcp.servers.NAME] table to {settings.path}")
    servers = McpServers(settings.mcp_servers)
    servers.start()
    try:
        servers.wait(START_TIMEOUT_S + 1)
        for error in servers.errors():
            print(f"warning: {_shown(error, stream=sys.stderr)}", file=sys.stderr)
        available = servers.tools()
        picked = []
        for name in names:
            found = [t for t in available if name in (t.name, t.key)]
            if not found:
                listed = ", ".join(t.key for t in available) or "none: no server is running"
                raise ConfigError(f"--tool {name}: no running MCP server has a tool of that name; tools: {listed}")
            picked.append(found[0])
        yield picked
    finally:
        servers.close()


def _run_with_tools(session: Session, args: argparse.Namespace, tools: list[Tool]) -> None:
    """One turn with tools: its text on stdout; each call, its approval and its result on stderr."""
    from localpaged.chat.tool_turn import TextDelta, ToolCallEvent, ToolResultEvent

    def approve(call: ToolCallRequest, tool: Tool) -> str:
        if args.allow_tools:
            return "once"
        if not sys.stdin.isatty():
            print("note: the call was denied (pass --allow-tools to run calls without asking)", file=sys.stderr)
            return "deny"
        answer = input("allow this call? [y]es once / [a]ll this chat / [N]o: ").strip().lower()
        return {"y": "once", "yes": "once", "a": "chat"}.get(answer, "deny")

    events = session.stream_events(args.message, tools=tools, approve=approve, tool_choice=args.tool_choice)
    with closing(events):
        for event in events:
            if isinstance(event, TextDelta):
                sys.stdout.write(_shown(event.text))
                sys.stdout.flush()
            elif isinstance(event, ToolCallEvent):
                arguments = _shown(event.call.arguments, one_line=True, stream=sys.stderr)
                print(f"\n[tool call] {event.call.name} {arguments}", file=sys.stderr)
            elif isinstance(event, ToolResultEvent):
                outcome = f"error: {event.error}" if event.error else "result"
                print(f"[{outcome}] {_shown(event.content, stream=sys.stderr)}", file=sys.stderr)


def open_engine(model: str | None, **engine_config: object) -> EngineClient:
    """The engine (``engine.factory.make_engine``: ``backend=URL`` for a remote one), telling a person at a terminal
    what is happening meanwhile."""
    from localpaged.engine.factory import make_engine

    if not sys.stderr.isatty():
        return make_engine(model=model, **engine_config)

    def progress(message: str, fraction: float | None) -> None:
        percent = f" {fraction:.0%}" if fraction is not None else ""
        sys.stderr.write(f"\r\033[K{message}{percent}")
        sys.stderr.flush()

    engine = make_engine(model=model, progress=progress, **engine_config)
    sys.stderr.write("\r\033[K")
    return engine


def cmd_serve(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.config import EngineConfig
    from localpaged.server.listen import listen

    # The app's imports (FastAPI, pydantic) run while the core process loads the model, not before it starts.
    app_imports = threading.Thread(target=importlib.import_module, args=("localpaged.server.app",), daemon=True)
    app_imports.start()
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: use a port from 1 to 65535 (0 picks a free one)")
    api_key = args.api_key or os.environ.get("LOCALPAGED_API_KEY") or None
    # The settings file's model and [engine] table, under serve's own flags (flag > file > built-in).
    file_settings = _settings(args)
    model = file_settings.model
    settings = {**file_settings.engine.as_kwargs(), **_engine_settings(args)}
    EngineConfig(model=model, **settings)  # a bad setting fails before the port is taken or the model loads
    with closing(listen(args.host, args.port)) as sock:  # a port in use fails before the model loads
        engine = open_engine(model, **settings)
        engines.append(engine)
        app_imports.join()
        from localpaged.server.app import build_app
        from localpaged.server.runner import serve

        app = build_app(engine, api_key=api_key, allowed_hosts=args.allowed_hosts)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        print(
            f"serving {engine.info.model_name} at {url}/v1 (OpenAI and Anthropic APIs; Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        if api_key is None and not _is_loopback(args.host):
            print(
                f"warning: listening on {args.host} without an API key: anyone who can reach port {port} can use "
                "the model; pass --api-key (or set LOCALPAGED_API_KEY)",
                file=sys.stderr,
                flush=True,
            )
        serve(app, sock)
    print("stopped", file=sys.stderr)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def cmd_sessions_list(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.chat.store import ChatStore

    with ChatStore(args.db) as store:
        for s in store.list_sessions():
            print(f"{s.id}\t{_when(s.updated)}\t{_shown(s.title or '(untitled)', one_line=True)}")


def cmd_sessions_show(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.chat.session import limit_note
    from localpaged.chat.store import ChatStore

    with ChatStore(args.db) as store:
        messages = store.messages(args.id)
    for m in messages:
        status = "" if m.status == "complete" else f" [{m.status}{': ' + m.error if m.error else ''}]"
        if note := limit_note(m):
            status += f" [{note}]"
        print(f"--- {m.id} {m.role}{_shown(status, one_line=True)}")
        print(_shown(m.content))


def cmd_sessions_export(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.chat.session import export_markdown
    from localpaged.chat.store import ChatStore

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


def cmd_sessions_delete(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.chat.store import ChatStore

    with ChatStore(args.db) as store:
        store.delete_session(args.id)
    print(f"deleted session {args.id}", file=sys.stderr)


def cmd_search(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.chat.store import MAX_SEARCH_LIMIT, ChatStore

    if not 1 <= args.limit <= MAX_SEARCH_LIMIT:
        raise ConfigError(f"--limit {args.limit}: use a number from 1 to {MAX_SEARCH_LIMIT:,}")
    if "\x00" in args.text:
        raise ConfigError("the search text contains a NUL character (\\x00), which search cannot match; remove it")
    with ChatStore(args.db) as store:
        hits = store.search(args.text, limit=args.limit)
    for hit in hits:
        snippet = _shown(" ".join(hit.snippet.split()), one_line=True)
        title = _shown(hit.session_title or "(untitled)", one_line=True)
        print(f"{hit.session_id}\t{hit.message_id}\t{hit.role}\t{title}\t{snippet}")


def cmd_config_show(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.config_file import UNSET

    settings = _settings(args)
    exists = settings.path is not None and settings.path.is_file()
    print(f"# settings file: {settings.path}{'' if exists else ' (not there: built-in defaults)'}")
    print("# each value comes from, highest first: a flag, the settings file, the built-in default")
    entries = [(key, _toml_value(value, UNSET.get(key)), origin) for key, value, origin in settings.entries()]
    width = max(len(f"{key} = {value}") for key, value, _ in entries)
    for key, value, origin in entries:
        print(_shown(f"{f'{key} = {value}':<{width}}  # {origin}", one_line=True))
    if args.engine:
        engine = open_engine(settings.model, **settings.engine.as_kwargs())
        engines.append(engine)
        resolved = engine.info.resolved
        assert resolved is not None  # a local engine always reports it
        print(f"\n# what the engine settled on for {engine.info.model_name} on this machine")
        for name, value in dataclasses.asdict(resolved).items():
            print(f"{name} = {_toml_value(value, 'none')}")


def _toml_value(value: object, unset: str | None) -> str:
    """A setting as TOML would write it; an unset one as what it means, in parentheses."""
    if value is None:
        return f"({unset or 'not set'})"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):  # an inline table: speculative = { draft = "...", k = 3 }
        return "{ " + ", ".join(f"{key} = {_toml_value(item, None)}" for key, item in value.items()) + " }"
    if isinstance(value, str):
        import json

        return json.dumps(value)
    return str(value)


def cmd_config_path(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.locations import config_file_path

    print(config_file_path())


def cmd_prompts_list(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    problems: list[PromptError] = []
    prompts = list_prompts(problems)
    for problem in problems:  # a broken file is named, the rest still listed
        print(f"warning: {_shown(problem, stream=sys.stderr)}", file=sys.stderr)
    for prompt in prompts:
        origin = "" if prompt.builtin else " (yours)"
        print(
            f"{prompt.name}\t{_shown(prompt.title, one_line=True)}{origin}\t{_shown(prompt.description, one_line=True)}"
        )


def cmd_prompts_show(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    print(get_prompt(args.name).text)


def cmd_models(args: argparse.Namespace, engines: list[EngineClient]) -> None:
    from localpaged.locations import model_store_dirs
    from localpaged.models.catalog import find_models
    from localpaged.models.loader import SUPPORTED_ARCHITECTURES

    found = find_models()
    if not found:
        folders = ", ".join(str(f) for fs in model_store_dirs().values() for f in fs)
        print(f"no model files found in {folders}; pass --model a .gguf file or a Hugging Face folder", file=sys.stderr)
        return
    rows = [("NAME", "SIZE", "QUANT", "ARCH", "SOURCE")]
    for m in found:
        supported = m.architecture in (*SUPPORTED_ARCHITECTURES, "?")  # "?": the file could not be read
        arch = m.architecture if supported else f"{m.architecture} (not supported)"
        rows.append((_shown(m.name, one_line=True), f"{m.size / 2**30:.2f} GiB", m.quantization, arch, m.source))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])


# ----- helpers ----------------------------------------------------------------------------


def _when(timestamp: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))
    except (OverflowError, OSError, ValueError):  # a time no calendar holds (a database edited by hand)
        return "?"


# Control characters (C0 but newline and tab, DEL, C1) as visible escapes: text from the store
# or a prompt file must not drive the terminal (clear it, retitle it, plant hyperlinks).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\n\t"}
_CONTROLS_ONE_LINE = {**_CONTROLS, ord("\n"): "\\n", ord("\t"): "\\t"}


def _shown(text: str, *, one_line: bool = False, stream: TextIO | None = None) -> str:
    """``text`` for ``stream`` (stdout): control characters escaped when that is a terminal, unchanged into pipes
    and files. A model's reply, a server's error and a stored title are all text someone else chose."""
    if not (stream or sys.stdout).isatty():
        return text
    return text.translate(_CONTROLS_ONE_LINE if one_line else _CONTROLS)


def _red(text: str, stream: TextIO) -> str:
    """Colour only for a person at a terminal; pipes and files get plain text."""
    return f"\033[31m{text}\033[0m" if stream.isatty() else text


if __name__ == "__main__":
    sys.exit(main())

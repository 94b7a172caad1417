"""Tools a Session's model may call: plain Python functions, and the tools of MCP servers.

A Tool is a name, a description, the JSON schema of its arguments, and an async ``run`` that returns text.
``function_tool`` makes one from a Python function: the schema from its signature (through pydantic, as
``llm`` does), the description from its docstring, parameter lines of a Google-style ``Args:`` section
describing each argument. ``McpServers`` runs the settings' ``[mcp.servers.NAME]`` servers through the
official SDK (stdio or streamable HTTP), each in a task of one background event loop of its own: the app's
first screen never waits for a server, a broken one is one message naming it, and every tool call goes to
the loop its connection lives on, whichever loop or thread asks.

What a tool returns is untrusted text: ``clean_output`` keeps it to MAX_RESULT_CHARS and turns control
characters (terminal escapes) into visible ``\\xNN`` text before anyone stores, shows or sends it.

Names: a tool's name is what the model calls it by. A Python function's is its ``__name__``; an MCP tool's
is the server's name for it, unless another running server has a tool of that name, then both are
``SERVER__TOOL``. A chat stores the tools it may use by ``key`` (``SERVER/TOOL``, ``python/NAME``), which
does not change when another server comes up.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import tempfile
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from localpaged.errors import ConfigError, ToolError

if TYPE_CHECKING:
    from localpaged.config_file import McpServerConfig

log = logging.getLogger(__name__)

MAX_RESULT_CHARS = 16_000  # a tool's answer, as stored and sent: a page of text, not a file dump
START_TIMEOUT_S = 60.0  # a server that has not listed its tools by then is reported as failed
CALL_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 5.0
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Tool:
    """One callable tool. ``run`` takes the arguments (a dict) and returns the result's text, or raises."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments, an object
    run: Callable[[dict], Awaitable[str]] = field(repr=False, compare=False)
    key: str = ""  # stable id for a chat's choice: SERVER/TOOL for MCP tools, python/NAME for functions
    source: str = "python"  # "python", or the MCP server's name

    def definition(self) -> dict:
        """The tool as OpenAI's API (and the chat templates) take it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    async def acall(self, arguments: str) -> str:
        """Run the call with ``arguments`` (the model's JSON text); its cleaned result, or ToolError saying why not."""
        try:
            parsed = json.loads(arguments or "{}")
        except ValueError as exc:
            raise ToolError(f"the arguments are not valid JSON ({exc}); call {self.name} again with a JSON object")
        if not isinstance(parsed, dict):
            raise ToolError(f"the arguments must be a JSON object, not {type(parsed).__name__}")
        try:
            return clean_output(await self.run(parsed))
        except ToolError:
            raise
        except Exception as exc:
            raise ToolError(clean_output(f"{self.name} failed: {exc or type(exc).__name__}")) from exc


def clean_output(text: object) -> str:
    """A tool's result as safe plain text: control characters (but newline and tab) as visible ``\\xNN``,
    at most MAX_RESULT_CHARS characters, a cut one saying how much was left out."""
    text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates never reach the store
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if len(text) > MAX_RESULT_CHARS:
        left = len(text) - MAX_RESULT_CHARS
        text = text[:MAX_RESULT_CHARS] + f"\n[… {left} more characters left out]"
    return text


# ----- Python functions --------------------------------------------------------------------------


def function_tool(fn: Callable[..., Any]) -> Tool:
    """A Tool from a Python function (sync or async): its name, its docstring, a schema from its signature.

    Arguments are checked against the signature (pydantic) before the function runs; a bad call is a
    ToolError the model reads. A sync function runs in a worker thread, so a slow one never blocks a loop.
    """
    import pydantic

    name = getattr(fn, "__name__", "")
    if not _NAME.match(name):
        raise ConfigError(f"tool {name!r}: a tool's name must be 1 to 64 letters, digits, '_' or '-'; rename it")
    doc = inspect.getdoc(fn) or ""
    described = _argument_lines(doc)
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ConfigError(f"tool {name}: *args and **kwargs have no schema; give each argument a name")
        annotation = Any if parameter.annotation is parameter.empty else parameter.annotation
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (annotation, pydantic.Field(default, description=described.get(parameter.name)))
    try:
        model = pydantic.create_model(f"{name}_arguments", **fields)
        schema = _untitled(model.model_json_schema())
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise ConfigError(f"tool {name}: its arguments' types have no JSON schema ({exc}); use JSON types") from exc

    async def run(arguments: dict) -> str:
        try:
            values = dict(model.model_validate(arguments))
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
            raise ToolError(f"{name} was called with bad arguments: {problems}") from None
        if inspect.iscoroutinefunction(fn):
            result = await fn(**values)
        else:
            result = await asyncio.to_thread(fn, **values)
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)

    description = doc.split("\n\n", 1)[0].strip() if doc else ""
    return Tool(name, description, schema, run, key=f"python/{name}")


def as_tools(tools: list[Any]) -> list[Tool]:
    """Tools and plain functions as Tools; ConfigError for anything else, or two tools with one name."""
    out = []
    for tool in tools:
        if isinstance(tool, Tool):
            out.append(tool)
        elif callable(tool):
            out.append(function_tool(tool))
        else:
            raise ConfigError(f"tools: {tool!r} is neither a Tool nor a function; pass functions or MCP tools")
    names = [t.name for t in out]
    if clash := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"tools: more than one tool is named {', '.join(clash)}; each name must be unique")
    return out


def _argument_lines(doc: str) -> dict[str, str]:
    """``name: what it is`` lines of a docstring's ``Args:`` (or ``Arguments:``/``Parameters:``) section."""
    found: dict[str, str] = {}
    inside = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.rstrip(":").lower() in ("args", "arguments", "parameters") and stripped.endswith(":"):
            inside = True
        elif inside and (m := re.match(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$", stripped)):
            found[m.group(1)] = m.group(2)
        elif inside and not stripped:
            inside = False
    return found


def _untitled(schema: Any) -> Any:
    """The schema without pydantic's "title" entries: words the model would read for nothing."""
    if isinstance(schema, dict):
        return {k: _untitled(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_untitled(v) for v in schema]
    return schema


# ----- MCP servers -------------------------------------------------------------------------------

ServerStatus = Literal["starting", "ready", "failed", "stopped"]


@dataclass
class ServerState:
    """What is known of one configured server: its status, its tools once listed, why it failed."""

    config: McpServerConfig
    status: ServerStatus = "starting"
    listed: list[Any] = field(default_factory=list)  # the SDK's Tool objects
    error: str | None = None


class McpServers:
    """The settings' MCP servers, run on one background thread's event loop from ``start`` to ``close``.

    ``on_change`` (optional) is called from that thread each time a server becomes ready or fails.
    """

    def __init__(self, configs: Mapping[str, McpServerConfig], on_change: Callable[[], None] | None = None) -> None:
        self.states = {name: ServerState(config) for name, config in configs.items()}
        self.on_change = on_change
        self._clients: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._settled = threading.Event()
        self._stopped = threading.Event()

    def start(self) -> None:
        """Start every server in the background; returns at once."""
        if self._thread is not None:
            return
        if not self.states:
            self._settled.set()
            self._stopped.set()
            return
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="mcp-servers", daemon=True)
        self._thread.start()
        ready.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every server is ready or failed (True), or ``timeout`` seconds passed (False)."""
        return self._settled.wait(timeout)

    def tools(self) -> list[Tool]:
        """The tools of the servers that are ready, in settings order, their names unique (see the module doc)."""
        listed = [(name, t) for name, state in self.states.items() if state.status == "ready" for t in state.listed]
        counts: dict[str, int] = {}
        for _, t in listed:
            counts[t.name] = counts.get(t.name, 0) + 1
        tools = []
        for server, t in listed:
            name = t.name if counts[t.name] == 1 else f"{server}__{t.name}"[:64]
            schema = (
                _untitled(t.input_schema) if isinstance(t.input_schema, dict) else {"type": "object", "properties": {}}
            )
            tools.append(
                Tool(
                    name,
                    clean_output(t.description or ""),
                    schema,
                    self._runner(server, t.name),
                    key=f"{server}/{t.name}",
                    source=server,
                )
            )
        return tools

    def errors(self) -> list[str]:
        """One message for each server that failed, naming it."""
        return [state.error for state in self.states.values() if state.status == "failed" and state.error]

    def close(self) -> None:
        """Stop every server (their processes end) and the loop; waits at most STOP_TIMEOUT_S for them."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or self._stopped.is_set():
            return
        loop.call_soon_threadsafe(stop.set)
        self._stopped.wait(STOP_TIMEOUT_S + 1)
        if self._thread is not None:
            self._thread.join(1)

    # ----- the loop's side -------------------------------------------------------------------------

    def _main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        ready.set()
        try:
            loop.run_until_complete(self._serve_all())
        finally:
            loop.close()
            self._stopped.set()

    async def _serve_all(self) -> None:
        assert self._stop is not None
        tasks = [asyncio.create_task(self._serve(name)) for name in self.states]
        await self._stop.wait()
        for state in self.states.values():
            if state.status in ("starting", "ready"):
                state.status = "stopped"
        _, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _serve(self, name: str) -> None:
        """Connect to one server, list its tools, then hold the connection until close."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        assert self._stop is not None
        state = self.states[name]
        config = state.config
        with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
            try:
                if config.url is not None:
                    transport: Any = config.url
                else:
                    assert config.command is not None
                    params = StdioServerParameters(command=config.command, args=list(config.args), env=dict(config.env))
                    transport = stdio_client(params, errlog=errlog)  # its stderr kept, never on the app's screen
                async with asyncio.timeout(START_TIMEOUT_S):
                    client = await Client(transport, read_timeout_seconds=CALL_TIMEOUT_S).__aenter__()
                try:
                    async with asyncio.timeout(START_TIMEOUT_S):
                        state.listed = await _list_tools(client)
                    self._clients[name] = client
                    state.status = "ready"
                    self._changed()
                    await self._stop.wait()
                finally:
                    self._clients.pop(name, None)
                    await client.__aexit__(None, None, None)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 -- an SDK ExceptionGroup, an OSError, a timeout: all one notice
                if state.status == "stopped":
                    return
                state.status = "failed"
                state.error = f"MCP server {name!r} ({config.describe()}) did not start: {_why(exc, errlog)}"
                log.warning("%s", state.error)
                self._changed()
            finally:
                if all(s.status != "starting" for s in self.states.values()):
                    self._settled.set()

    def _changed(self) -> None:
        if all(s.status != "starting" for s in self.states.values()):
            self._settled.set()
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # the app's callback must never take the servers down
                log.exception("MCP servers: on_change failed")

    def _runner(self, server: str, tool: str) -> Callable[[dict], Awaitable[str]]:
        async def run(arguments: dict) -> str:
            loop = self._loop
            if loop is None or server not in self._clients:
                raise ToolError(f"the MCP server {server!r} is not running, so {tool} cannot be called")
            future = asyncio.run_coroutine_threadsafe(self._call(server, tool, arguments), loop)
            return await asyncio.wrap_future(future)

        return run

    async def _call(self, server: str, tool: str, arguments: dict) -> str:
        client = self._clients.get(server)
        if client is None:
            raise ToolError(f"the MCP server {server!r} stopped, so {tool} cannot be called")
        try:
            result = await client.call_tool(tool, arguments)
        except Exception as exc:  # noqa: BLE001 -- whatever the transport raised, the model reads why
            raise ToolError(f"the MCP server {server!r} failed the call of {tool}: {_flat(exc)}") from None
        text = "\n".join(_block_text(block) for block in result.content)
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content, ensure_ascii=False)
        if result.is_error:
            raise ToolError(clean_output(text or f"{tool} failed without saying why"))
        return text


async def _list_tools(client: Any) -> list[Any]:
    tools, cursor = [], None
    for _ in range(100):  # a server that pages forever still gets listed
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _block_text(block: Any) -> str:
    """One content block of a result as text: text as it is, anything else (an image, a resource) named."""
    text = getattr(block, "text", None)
    if isinstance(text, str):
        return text
    return f"[{getattr(block, 'type', 'content')} left out: only text results are shown]"


def _flat(exc: BaseException) -> str:
    """The innermost message of an exception (the SDK raises ExceptionGroups from its task groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__


def _why(exc: BaseException, errlog: Any) -> str:
    """Why a server failed to start: the error, and the last line the server wrote to stderr."""
    reason = f"it took longer than {START_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else _flat(exc)
    try:
        errlog.flush()
        errlog.seek(0)
        lines = [line.strip() for line in errlog.read()[-4000:].splitlines() if line.strip()]
    except (OSError, ValueError):
        lines = []
    if lines:
        reason += f" (it said: {clean_output(lines[-1])[:300]})"
    return reason

"""The user's settings file, ``config.toml``: defaults for `localpaged run` and `localpaged chat`.

Where it lives is decided by :func:`localpaged.locations.config_file_path` ($LOCALPAGED_HOME/config.toml,
else ``config.toml`` in the user config folder). Every key is optional; a missing file is simply the
built-in defaults. A value is taken, highest first, from a command-line flag, from the file, or from
the built-in default, and :meth:`Settings.entries` says which, for ``localpaged config show``::

    model = "~/models/qwen2.5-1.5b-instruct-q4_k_m.gguf"
    prompt = "coding"            # system prompt of new chats (`localpaged prompts list`)
    theme = "nord"               # the app writes this line when you pick a theme

    [sampling]
    temperature = 0.2
    top_p = 0.9
    top_k = 40
    max_tokens = 1024            # leave it out and a reply runs until the model stops or the context is full
    seed = 7

    [engine]
    kv_cache_memory = "2GiB"
    kv_cache_dtype = "bfloat16"  # KV values in 16 bits: half the memory, faster with many long chats
    activations = "float32"      # a GGUF's matmuls on the exact path's inputs (auto: int16 where the CPU has VNNI)
    max_num_seqs = 16
    max_model_len = 8192
    kv_disk = true               # keep KV blocks on disk, so chats resume warm after a restart
    kv_disk_bytes = "2GiB"

    [keys]                       # Textual keymap: binding id -> key
    new_chat = "ctrl+t"

    [mcp.servers.files]          # an MCP server the app starts (stdio): its tools, for chats that pick them
    command = "npx"
    args = ["-y", "@modelcontextprotocol/server-filesystem", "~/notes"]
    env = { LOG_LEVEL = "warn" }

    [mcp.servers.search]         # one already running, over streamable HTTP
    url = "http://127.0.0.1:8931/mcp"

The file is checked in full when it is read: a value of the wrong type or out of range, an unknown
key or table, or a file that is not TOML is one ConfigError naming the file, the key, and the line
where it can tell; sampling values go through SamplingParams' own checks, engine values through
EngineConfig's (``config.check_field``), so a message reads the same whether the value came from a flag, the file or code.
The user's parsed document is only read, never changed: the settings are frozen copies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from localpaged.errors import ConfigError, LocalpagedError
from localpaged.locations import (
    UnsafeFileError,
    config_file_path,
    create_private_file,
    make_private,
    read_regular_file,
)
from localpaged.sampling import SamplingParams

Origin = Literal["built-in", "file", "flag"]

_BUILT_IN = SamplingParams()  # the library's defaults, but for max_tokens (see SamplingSettings)


@dataclass(frozen=True)
class SamplingSettings:
    """How a chat reply picks its tokens; ``max_tokens=None`` (the default) means no limit.

    Unlike ``SamplingParams`` (256 tokens by default, for ``LLM.generate``), a chat reply with no
    limit runs until the model stops or the context is full: Session works out the room left.
    """

    temperature: float = _BUILT_IN.temperature
    top_p: float = _BUILT_IN.top_p
    top_k: int = _BUILT_IN.top_k
    max_tokens: int | None = None
    seed: int | None = None

    def template(self) -> SamplingParams:
        """These values as SamplingParams; its max_tokens is a placeholder that Session replaces."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)


@dataclass(frozen=True)
class EngineSettings:
    """The engine's capacity knobs; None leaves each to the engine (see EngineConfig)."""

    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str | None = None
    activations: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_disk: bool | None = None
    kv_disk_bytes: int | str | None = None
    speculative: str | Mapping[str, Any] | None = None  # a mode, or a draft model: { draft = "...", k = 3 }

    def as_kwargs(self) -> dict[str, Any]:
        """The ones that are set, as keyword arguments for AsyncLLM / EngineConfig."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class McpServerConfig:
    """One ``[mcp.servers.NAME]`` table: a command to start (stdio) or the ``url`` of a running server."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    url: str | None = None

    def describe(self) -> str:
        """The server in a few words, for `config show` and notices: its URL, or its command line."""
        return self.url or " ".join([self.command or "", *self.args])


MCP_SERVER_KEYS = ("command", "args", "env", "url")
_MCP_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")  # it prefixes tool names that clash, which OpenAI limits so


@dataclass(frozen=True)
class Settings:
    """The effective settings, and where each came from (``origins``: dotted key -> origin; absent is built-in)."""

    model: str | None = None
    prompt: str | None = None
    theme: str | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    mcp_servers: Mapping[str, McpServerConfig] = field(default_factory=lambda: MappingProxyType({}))
    path: Path | None = None  # the file that was read (it may not exist); None: built-in defaults only
    origins: Mapping[str, Origin] = field(default_factory=lambda: MappingProxyType({}))
    flags: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # dotted key -> flag name

    def with_flags(self, values: Mapping[str, Any], flags: Mapping[str, str] | None = None) -> Settings:
        """These settings with command-line ``values`` (dotted key -> value; None is "not given") on top.

        ``flags`` names the flag of each key for `config show` (default: ``--`` and the key's last part).
        Values are checked as the file's are, so a bad flag reads like a bad line of the file.
        """
        given = {key: value for key, value in values.items() if value is not None}
        if not given:
            return self
        top: dict[str, Any] = {}
        tables: dict[str, dict[str, Any]] = {"sampling": {}, "engine": {}}
        names = dict(self.flags)
        for key, value in given.items():
            table, _, name = key.rpartition(".")
            flag = (flags or {}).get(key) or "--" + name.replace("_", "-")
            names[key] = flag
            checked = _check_value(table, name, value, lambda f=flag: f)
            (tables[table] if table else top)[name] = checked
        return dataclasses.replace(
            self,
            **top,
            sampling=dataclasses.replace(self.sampling, **tables["sampling"]),
            engine=dataclasses.replace(self.engine, **tables["engine"]),
            origins=MappingProxyType({**self.origins, **dict.fromkeys(given, "flag")}),
            flags=MappingProxyType(names),
        )

    def origin(self, key: str) -> str:
        """Where the value of ``key`` (dotted) came from, in words: ``flag --top-p``, the file's path, or built-in."""
        origin = self.origins.get(key, "built-in")
        if origin == "flag":
            return f"flag {self.flags.get(key, '')}".strip()
        if origin == "file":
            return str(self.path)
        return "built-in"

    def entries(self) -> Iterator[tuple[str, Any, str]]:
        """(dotted key, value, origin) for every setting, in the file's order; keys.* only where set."""
        for name in TOP_KEYS:
            yield name, getattr(self, name), self.origin(name)
        for table, values in (("sampling", self.sampling), ("engine", self.engine)):
            for f in dataclasses.fields(values):
                key = f"{table}.{f.name}"
                yield key, getattr(values, f.name), self.origin(key)
        for binding, key in sorted(self.keys.items()):
            yield f"keys.{binding}", key, self.origin(f"keys.{binding}")
        for name, server in self.mcp_servers.items():
            yield f"mcp.servers.{name}", server.describe(), str(self.path)


TOP_KEYS = ("model", "prompt", "theme")
TABLE_KEYS = {
    "sampling": tuple(f.name for f in dataclasses.fields(SamplingSettings)),
    "engine": tuple(f.name for f in dataclasses.fields(EngineSettings)),
    "keys": (),  # any binding id
    "mcp": ("servers",),  # [mcp.servers.NAME] tables, checked by _mcp_servers
}
# What an unset value means, for `config show`.
UNSET = {
    "model": "SmolLM2-135M-Instruct",
    "prompt": "no system prompt",
    "theme": "textual-dark",
    "sampling.max_tokens": "no limit: until the model stops or the context is full",
    "sampling.seed": "random",
    "engine.kv_cache_memory": "sized from free memory",
    "engine.kv_cache_dtype": "auto: float16 where the native CPU kernels run, else the model's dtype",
    "engine.activations": "auto: int16 where the CPU has AVX-512 VNNI, else float32 (the exact path)",
    "engine.max_num_seqs": "64",
    "engine.max_model_len": "the model's, at most 8192",
    "engine.kv_disk": "true: KV blocks are kept on disk across restarts",
    "engine.kv_disk_bytes": "2GiB",
    "engine.speculative": "auto: draft tokens from the chat's own text and earlier replies while few chats decode",
}


MAX_SETTINGS_BYTES = 1024 * 1024  # a settings file is a few hundred bytes; anything near this is a mistake


def _read_settings_text(path: Path) -> str:
    """The file's text; a FIFO, a folder or a huge file there is an OSError that says so, never a hang."""
    try:
        return read_regular_file(path, MAX_SETTINGS_BYTES).decode("utf-8")
    except UnsafeFileError as exc:
        raise OSError(f"{exc}; the settings file is a small TOML text file") from exc


def load_settings(path: str | os.PathLike | None = None) -> Settings:
    """The settings in ``path`` (default: :func:`config_file_path`); a missing file gives the built-in defaults."""
    path = Path(path).expanduser() if path is not None else config_file_path()
    try:
        text = _read_settings_text(path)
    except (FileNotFoundError, NotADirectoryError):  # no file there (a path through a file holds none either)
        return Settings(path=path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(
            f"cannot read the settings file {path}: {exc.strerror or exc}; fix its permissions or move it aside"
        ) from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}. Fix that line (see https://toml.io)") from exc
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(f"{path} nests arrays or tables thousands deep; no setting does: fix the file") from None
    return _settings(document, path, text)


def _settings(document: Mapping[str, Any], path: Path, text: str) -> Settings:
    """Check every key and value of a parsed file; the Settings they make (the document is not changed)."""
    unknown = [name for name in document if name not in TOP_KEYS and name not in TABLE_KEYS]
    if unknown:
        tables = [name for name in unknown if isinstance(document[name], dict)]
        keys = [name for name in unknown if name not in tables]
        what = "; ".join(
            part
            for part in (
                f"unknown table(s) {', '.join(f'[{t}]' for t in tables)}" if tables else "",
                f"unknown key(s) {', '.join(keys)}" if keys else "",
            )
            if part
        )
        raise ConfigError(
            f"{path}: {what}. Valid top-level keys: {', '.join(TOP_KEYS)}; "
            f"valid tables: {', '.join(f'[{t}]' for t in TABLE_KEYS)}"
        )
    top: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {"sampling": {}, "engine": {}, "keys": {}}
    origins: dict[str, Origin] = {}
    servers: dict[str, McpServerConfig] = {}
    for name, value in document.items():
        if name == "mcp":
            servers = _mcp_servers(value, path, text)
        elif name in TABLE_KEYS:
            if not isinstance(value, dict):
                raise ConfigError(f"{_where(path, text, '', name)}: must be a table, [{name}], not a value")
            for key, item in value.items():
                valid = TABLE_KEYS[name]
                if valid and key not in valid:
                    raise ConfigError(
                        f"{_where(path, text, name, key)}: unknown key {key!r} in [{name}]; "
                        f"valid keys: {', '.join(valid)}"
                    )
                tables[name][key] = _check_value(name, key, item, lambda n=name, k=key: _where(path, text, n, k))
                origins[f"{name}.{key}"] = "file"
        else:
            top[name] = _check_value("", name, value, lambda n=name: _where(path, text, "", n))
            origins[name] = "file"
    return Settings(
        **top,
        sampling=SamplingSettings(**tables["sampling"]),
        engine=EngineSettings(**tables["engine"]),
        keys=MappingProxyType(dict(tables["keys"])),
        mcp_servers=MappingProxyType(servers),
        path=path,
        origins=MappingProxyType(origins),
    )


def _mcp_servers(value: Any, path: Path, text: str) -> dict[str, McpServerConfig]:
    """The ``[mcp.servers.NAME]`` tables, each checked: ConfigError naming the server and the key to fix."""
    example = '[mcp.servers.NAME] with command = "..." (and args = [...]) or url = "http://..."'
    if not isinstance(value, dict) or set(value) - {"servers"} or not isinstance(value.get("servers", {}), dict):
        raise ConfigError(f"{path}: [mcp] holds only server tables: write {example}")
    servers = {}
    for name, table in value.get("servers", {}).items():
        line = _line_of(text, "", f"mcp.servers.{name}")
        where = f"{path}{f', line {line}' if line else ''}: [mcp.servers.{name}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table: write {example}")
        if not _MCP_NAME.match(name):
            raise ConfigError(f"{where}: name the server with 1 to 32 letters, digits, '_' or '-'")
        unknown = sorted(set(table) - set(MCP_SERVER_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(MCP_SERVER_KEYS)}")
        command, url, args, env = table.get("command"), table.get("url"), table.get("args", []), table.get("env", {})
        if (command is None) == (url is None):
            raise ConfigError(f"{where}: give exactly one of command (a server to start) or url (one running)")
        if command is not None and (not isinstance(command, str) or not command.strip()):
            raise ConfigError(f"{where}: command must be the program to run, a non-empty string")
        if url is not None and (not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url)):
            raise ConfigError(f"{where}: url must be an http(s) URL, e.g. http://127.0.0.1:8931/mcp")
        if url is not None and ("args" in table or "env" in table):
            raise ConfigError(f"{where}: args and env are for a server started by command, not one at a url")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConfigError(f'{where}: args must be a list of strings, e.g. args = ["--root", "~/notes"]')
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ConfigError(f'{where}: env must be a table of strings, e.g. env = {{ LOG_LEVEL = "warn" }}')
        servers[name] = McpServerConfig(
            name, command, tuple(os.path.expanduser(a) for a in args), MappingProxyType(dict(env)), url
        )
    return servers


def _check_value(table: str, key: str, value: Any, where: Any) -> Any:
    """``value`` checked (and normalised) for ``[table] key``; ConfigError prefixed by ``where()`` if it is bad."""
    try:
        if table == "sampling":
            # One field at a time, so the message is about this key whatever the others hold.
            params = SamplingParams(**{key: value})
            return getattr(params, key)
        if table == "engine":
            return _engine_value(key, value)
        if table == "keys":
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f'{key}={value!r}: use a key string, e.g. {key} = "ctrl+t"')
            return value
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{key}={value!r}: must be a non-empty string")
        if key == "model":
            return str(Path(value).expanduser())
        if key == "prompt":
            return _prompt_name(value)
        if key == "theme":
            return _theme_name(value)
        return value
    except ConfigError as exc:
        raise ConfigError(f"{where()}: {exc}") from exc


def _engine_value(key: str, value: Any) -> int | str | bool | Mapping[str, Any]:
    from localpaged.config import check_field  # torch-free: the one check EngineConfig's fields go through

    check_field(key, value)
    return value


def _prompt_name(name: str) -> str:
    from localpaged.chat.prompts import get_prompt

    try:
        return get_prompt(name).name
    except LocalpagedError as exc:  # PromptError: unknown name or a malformed file
        raise ConfigError(str(exc)) from exc


def _theme_name(name: str) -> str:
    from textual.theme import BUILTIN_THEMES  # only when a theme is set: Textual takes a moment to import

    if name not in BUILTIN_THEMES:
        raise ConfigError(f"{name!r} is not a theme; use one of {', '.join(sorted(BUILTIN_THEMES))}")
    return name


def _where(path: Path, text: str, table: str, key: str) -> str:
    """``path, line N: [table] key`` ("" table: the top level); without the line if it cannot tell."""
    line = _line_of(text, table, key)
    return f"{path}{f', line {line}' if line else ''}: {f'[{table}] ' if table else ''}{key}"


_TABLE_HEADER = re.compile(r"^\s*\[\s*([^\]\s]+)\s*\]")


def _line_of(text: str, table: str, key: str) -> int | None:
    """The 1-based line where ``key =`` is set in ``[table]``, by a plain scan (tomllib reports no positions)."""
    current = ""
    pattern = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')\s*=")
    for number, line in enumerate(text.splitlines(), 1):
        header = _TABLE_HEADER.match(line)
        if header:
            current = header.group(1)
            if not table and current == key:
                return number
        elif current == table and pattern.match(line):
            return number
    return None


# ----- writing the theme -----------------------------------------------------------------------


_THEME_LINE = re.compile(r"^\s*theme\s*=")


def save_theme(theme: str, path: str | os.PathLike | None = None) -> Path:
    """Set the top-level ``theme = "..."`` in the settings file, leaving every other line as it is.

    tomlkit is not a dependency, so this is a careful line edit: the top-level ``theme`` line is
    replaced, or a new one goes first (before any table, where a top-level key must be). A missing
    file is created 0600. The result is parsed before it replaces the file, so a file this cannot
    edit safely is left untouched (ConfigError). Returns the file's path.
    """
    path = Path(path).expanduser() if path is not None else config_file_path(create=True)
    _theme_name(theme)
    try:
        text = _read_settings_text(path)
    except FileNotFoundError:
        text = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the settings file {path} to save the theme: {exc}") from exc
    new_line = f"theme = {json.dumps(theme)}"
    lines = text.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if _TABLE_HEADER.match(line):
            lines.insert(index, new_line + "\n")  # no top-level theme line: the new one goes before the tables
            break
        if _THEME_LINE.match(line):
            lines[index] = new_line + ("\n" if line.endswith("\n") else "")
            break
    else:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines.append(new_line + "\n")
    updated = "".join(lines)
    try:
        if tomllib.loads(updated).get("theme") != theme:
            raise ConfigError(f"{path}: the theme line could not be placed safely; set theme = {json.dumps(theme)}")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid TOML ({exc}), so the theme was not saved; fix the file or set theme by hand"
        ) from exc
    _write_private(path, updated)
    return path


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a 0600 temporary file and a rename, so a crash never leaves half a file."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.unlink(missing_ok=True)
        create_private_file(temporary)
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
        make_private(path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the settings file {path}: {exc.strerror}; make its folder writable") from exc

"""Every folder localpaged writes to on the user's machine, decided here and nowhere else.

One module, so that there is one place to see, and to change, where the chat database,
the user's prompts, converted models, compiled kernels and the disk KV tier go, and so
that every one of them is private by default: each function below returns its folder
after creating it with mode 0700 (and tightening it to 0700 where it already exists with
looser permissions and is localpaged's own), and the helpers at the end make the files
put there 0600 (0700 for the compiled kernel library). Nothing else in the package reads
the environment variables or platformdirs for these folders.

- ``data_dir()``: $LOCALPAGED_HOME, else platformdirs' user data folder (``~/.local/share/localpaged``)
- ``chat_db_path()``: ``chats.db`` in data_dir()
- ``user_prompts_dir()``: $LOCALPAGED_HOME/prompts, else ``prompts`` in the user config folder
  (``~/.config/localpaged/prompts``)
- ``config_file_path()``: $LOCALPAGED_HOME/config.toml, else ``config.toml`` in the user config folder
  (``~/.config/localpaged/config.toml``), the settings file
- ``cache_dir()``: $LOCALPAGED_CACHE, else platformdirs' user cache folder (``~/.cache/localpaged``)
- ``models_cache_dir()``: ``models`` in cache_dir(), each GGUF file's config and tokenizer (its metadata)
- ``kernels_cache_dir()``: ``kernels`` in cache_dir(), the compiled CPU kernels
- ``kv_cache_dir()``: $LOCALPAGED_KV_CACHE, else ``kv`` in cache_dir(), the disk KV tier
- ``peers_cache_dir()``: ``peers`` in cache_dir(), llama.cpp built by ``make bench-peers``
- ``model_store_dirs()``: where other tools keep the models a user already has (Ollama, LM Studio,
  llama.cpp, the Hugging Face hub): only read, never created

A folder named by a variable that already exists is the user's own and keeps its mode
(only what localpaged creates in it is made private); one the variable names but that does
not exist yet is created 0700. Folders above a root (``~/.cache``, ``$HOME``) are created
with the platform's usual mode where missing, and never changed. A variable naming a file,
or a folder that cannot be created, is a ConfigError that names the variable, the path and
what to do.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import platformdirs

from localpaged.errors import ConfigError

APP = "localpaged"
HOME_VAR = "LOCALPAGED_HOME"
CACHE_VAR = "LOCALPAGED_CACHE"
KV_CACHE_VAR = "LOCALPAGED_KV_CACHE"

DIR_MODE = 0o700
FILE_MODE = 0o600
EXECUTABLE_MODE = 0o700  # the compiled kernel library: dlopen needs only read, the x bit is conventional


# -- the folders ---------------------------------------------------------------------------------


def data_dir() -> Path:
    """$LOCALPAGED_HOME, else platformdirs' user data folder: the chat database lives here."""
    return _root(HOME_VAR, platformdirs.user_data_dir)


def chat_db_path() -> Path:
    """The default chat database file, ``chats.db`` in :func:`data_dir` (the folder is created, the file not)."""
    return data_dir() / "chats.db"


def user_prompts_dir(create: bool = True) -> Path:
    """The user's own system prompts: $LOCALPAGED_HOME/prompts, else ``prompts`` in the user config folder.

    ``create=False`` for reading: nothing is made, so a read-only home still lists the shipped prompts.
    """
    if not create:
        return _config_home() / "prompts"
    if os.environ.get(HOME_VAR):
        return _sub(data_dir(), "prompts", HOME_VAR)
    return _sub(_root(None, platformdirs.user_config_dir, fix_var=HOME_VAR), "prompts", HOME_VAR)


def config_file_path(create: bool = False) -> Path:
    """The settings file: $LOCALPAGED_HOME/config.toml, else ``config.toml`` in the user config folder.

    Reading never needs a write: the folder is created only with ``create`` (to save a setting), the file
    never here (a missing one means the built-in defaults).
    """
    if not create:
        return _config_home() / "config.toml"
    if os.environ.get(HOME_VAR):
        return data_dir() / "config.toml"
    return _root(None, platformdirs.user_config_dir, fix_var=HOME_VAR) / "config.toml"


def _config_home() -> Path:
    """Where the settings file and the user's prompts are read from: $LOCALPAGED_HOME, else the user config folder."""
    home = os.environ.get(HOME_VAR)
    return Path(home).expanduser() if home else Path(platformdirs.user_config_dir(APP))


def cache_dir() -> Path:
    """$LOCALPAGED_CACHE, else platformdirs' user cache folder: what localpaged makes once and reuses."""
    return _root(CACHE_VAR, platformdirs.user_cache_dir)


def models_cache_dir() -> Path:
    """Each GGUF file's config and tokenizer, read from its metadata, and its weights packed for the CPU kernels;
    each model's tokenizer record (engine/engine_tokenizer.py): one folder each, named after the source's hash."""
    return _sub(cache_dir(), "models", CACHE_VAR)


def kernels_cache_dir() -> Path:
    """The native CPU kernels, compiled on first use."""
    return _sub(cache_dir(), "kernels", CACHE_VAR)


def kv_cache_dir() -> Path:
    """$LOCALPAGED_KV_CACHE, else ``kv`` in :func:`cache_dir`: the disk tier below the KV block pool."""
    if os.environ.get(KV_CACHE_VAR):
        return _root(KV_CACHE_VAR, None)
    return _sub(cache_dir(), "kv", KV_CACHE_VAR)


def peers_cache_dir() -> Path:
    """The peer engines the benchmarks compare against (llama.cpp), built once by ``make bench-peers``."""
    return _sub(cache_dir(), "peers", CACHE_VAR)


def model_store_dirs() -> dict[str, list[Path]]:
    """Where other tools keep model files, by tool, in the places (and under the variables) those tools use.

    Ollama: $OLLAMA_MODELS, else ``~/.ollama/models`` and the Linux service's ``/usr/share/ollama/.ollama/models``.
    LM Studio: ``~/.lmstudio/models`` (0.3 on), ``~/.cache/lm-studio/models`` (before). llama.cpp's ``-hf``
    downloads: $LLAMA_CACHE, else its user cache folder. Hugging Face: $HF_HUB_CACHE, else $HF_HOME/hub,
    else ``~/.cache/huggingface/hub``. These folders are the other tools': nothing here creates or changes them.
    """
    home = Path.home()
    env = os.environ.get
    hf_home = Path(env("HF_HOME") or Path(env("XDG_CACHE_HOME") or home / ".cache") / "huggingface")
    return {
        "ollama": [Path(env("OLLAMA_MODELS"))]
        if env("OLLAMA_MODELS")
        else [
            home / ".ollama" / "models",
            Path("/usr/share/ollama/.ollama/models"),
        ],
        "lmstudio": [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"],
        "llama.cpp": [Path(env("LLAMA_CACHE") or platformdirs.user_cache_dir("llama.cpp", appauthor=False))],
        "huggingface": [Path(env("HF_HUB_CACHE") or hf_home / "hub")],
    }


# -- reading what the user keeps in these folders --------------------------------------------------


class UnsafeFileError(ValueError):
    """A file in one of the user's folders that is not a regular file, or is too big to read whole."""


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; UnsafeFileError (why) for anything else.

    Prompts and the settings file sit in folders users write to, where a FIFO would hang every command
    that opens it and a huge file would be read whole. The type is checked with stat before opening,
    the file is opened non-blocking all the same (it could be swapped between the two) and read no
    further than the limit. A missing or unreadable file raises OSError as open() does.
    """
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError("not a regular file (a folder, FIFO or device)")
    if info.st_size > limit:
        raise UnsafeFileError(f"{info.st_size:,} bytes, more than the {limit:,} allowed")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise UnsafeFileError("not a regular file (a folder, FIFO or device)")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFileError(f"more than the {limit:,} bytes allowed")
    return data


# -- private files --------------------------------------------------------------------------------


def create_private_file(path: str | os.PathLike) -> bool:
    """Create ``path`` empty with mode 0600 if it does not exist; True if this call created it."""
    try:  # O_EXCL never follows a link, and never creates a file at the end of one
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    _chmod(Path(path), FILE_MODE)  # the umask may have taken bits from the owner too
    return True


def make_private(path: str | os.PathLike, mode: int = FILE_MODE) -> None:
    """Set ``path`` (one file or folder) to ``mode`` if it is the user's; best effort. A symbolic link is left
    alone: a mode set through it would land on a file that is not ours."""
    path = Path(path)
    try:
        st = path.lstat()
    except OSError:
        return
    if _owned(st) and stat.S_IMODE(st.st_mode) != mode:
        _chmod(path, mode)


def make_private_tree(folder: str | os.PathLike) -> None:
    """Every folder under ``folder`` (itself included) 0700, every file 0600 (0700 where the owner may run it,
    as the compiled kernel library): for a freshly written tree."""
    folder = Path(folder)
    make_private(folder, DIR_MODE)
    for parent, dirs, files in os.walk(folder):
        for name in dirs:
            make_private(Path(parent, name), DIR_MODE)
        for name in files:
            path = Path(parent, name)
            make_private(path, EXECUTABLE_MODE if path.stat().st_mode & stat.S_IXUSR else FILE_MODE)


# -- how ---------------------------------------------------------------------------------------------


def _root(var: str | None, default: Callable[[str], str] | None, *, fix_var: str | None = None) -> Path:
    """The folder ``var`` names if it is set (its mode kept if it exists), else ``default(APP)``, localpaged's own."""
    value = os.environ.get(var) if var else None
    if value:
        fix = f"Point {var} at a folder you can write to, or unset it to use the default."
        return _ensure(Path(value).expanduser(), fix, var=var, owned=False)
    assert default is not None
    return _ensure(Path(default(APP)), f"Set {fix_var or var} to a folder you can write to.", owned=True)


def _sub(parent: Path, name: str, var: str) -> Path:
    """``parent/name``: a folder localpaged owns under one of its roots."""
    path = parent / name
    return _ensure(path, f"Move {path} aside, or set {var} to another folder.", owned=True)


def _ensure(path: Path, fix: str, *, var: str | None = None, owned: bool) -> Path:
    """Make ``path`` a folder: created 0700 if missing, tightened to 0700 if ``owned`` and looser."""
    if path.exists() and not path.is_dir():
        raise ConfigError(_not_a_folder(path, var, fix))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # above the root: the platform's folders, default modes
        try:
            path.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not path.is_dir():  # a file appeared since the check above
                raise ConfigError(_not_a_folder(path, var, fix)) from None
            if owned:
                _tighten(path)
        else:
            _chmod(path, DIR_MODE)  # mkdir's mode passes through the umask
    except OSError as exc:  # a file or a read-only folder above it
        reason = exc.strerror or str(exc)
        where = f"{var} points at {path}, which cannot be created" if var else f"Cannot create the folder {path}"
        raise ConfigError(f"{where} ({reason}). {fix}") from exc
    return path


def _not_a_folder(path: Path, var: str | None, fix: str) -> str:
    if var:
        return f"{var} points at {path}, which is not a folder. {fix}"
    return f"localpaged keeps a folder at {path}, but a file is in the way. {fix}"


def _tighten(folder: Path) -> None:
    """Take group and other bits off an existing folder of the user's; never $HOME or a folder above it."""
    try:
        st = folder.lstat()
    except OSError:
        return
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077 or not _owned(st) or _home_or_above(folder):
        return
    _chmod(folder, mode & ~0o077)


def _home_or_above(folder: Path) -> bool:
    try:
        home = Path.home().resolve()
        return home == folder.resolve() or folder.resolve() in home.parents
    except (OSError, RuntimeError):
        return True  # cannot tell: leave it alone


def _owned(st: os.stat_result) -> bool:
    getuid = getattr(os, "getuid", None)
    return getuid is None or st.st_uid == getuid()


def _chmod(path: Path, mode: int) -> None:
    """``path``'s mode, unless it is a symbolic link (a mode set through a link lands on what it points at)."""
    try:
        if path.is_symlink():
            return
        os.chmod(path, mode)
    except OSError:
        pass  # a file system without Unix modes (FAT, some network mounts): nothing more to do

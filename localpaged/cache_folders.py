"""Folders localpaged builds once in its cache (converted models, the compiled CPU kernels) and reuses.

What sits in the cache is loaded without being rebuilt: weights are read into the model and the
kernel library is dlopen'ed, which runs its constructors. So a cached folder is used only while it
is trusted: owned by this user, with nothing in it (the folder, its files, its subfolders) writable
by group or others, no symbolic links, and the caller's own check (the kernel library's recorded
sha256) passing. Anything else is set aside, removed, and built again.

Building happens in a private temporary folder beside the target, which is renamed onto the target
in one step once complete: a killed build never leaves a half-written folder at the name that is
loaded, and of several processes building the same folder at once (two first starts), the one that
renames last finds the target already published (ENOTEMPTY) and uses that one instead of failing.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from localpaged.errors import ConfigError
from localpaged.locations import make_private_tree

Check = Callable[[Path], "str | None"]
T = TypeVar("T")


def cached_folder(target: Path, build: Callable[[Path], None], check: Check | None = None) -> Path:
    """``target``, built by ``build(folder)`` unless a trusted one is already there.

    ``build`` fills the empty private folder it is given; ``check(target)`` returns why a published
    folder must not be used (None when it may), on top of the ownership and mode checks. A folder that
    fails either is set aside with a warning and rebuilt; one that still fails after this process built
    it is a ConfigError.
    """
    if target.exists():
        reason = untrusted_reason(target, check)
        if reason is None:
            return target
        set_aside(target, reason)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))  # 0700
    try:
        build(building)
        make_private_tree(building)  # whatever wrote the files used the umask's modes
        try:
            os.replace(building, target)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Another process published the same folder first: use it (checked below like any other).
    finally:
        shutil.rmtree(building, ignore_errors=True)
    reason = untrusted_reason(target, check)
    if reason is not None:
        raise ConfigError(
            f"{target} was just built but cannot be trusted ({reason}); another program is changing "
            f"{target.parent}. Remove that folder, or point LOCALPAGED_CACHE at a folder only you can write."
        )
    return target


def read_trusted(target: Path, read: Callable[[Path], T], errors: tuple[type[Exception], ...]) -> T | None:
    """``read(target)`` where a trusted folder is there; None where there is none, or it is untrusted or ``read``
    raises one of ``errors`` (that folder set aside with a warning, for the caller to build again)."""
    if not target.exists():
        return None
    reason = untrusted_reason(target)
    if reason is None:
        try:
            return read(target)
        except errors as exc:
            reason = f"it cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
    set_aside(target, reason)
    return None


def untrusted_reason(path: Path, check: Check | None = None) -> str | None:
    """Why the cached folder ``path`` must not be used, or None: see the module's docstring."""
    for entry in (path, *sorted(path.rglob("*"))) if path.is_dir() and not path.is_symlink() else (path,):
        reason = _entry_reason(entry)
        if reason is not None:
            return f"{entry.name}: {reason}" if entry != path else reason
    return check(path) if check is not None else None


def _entry_reason(entry: Path) -> str | None:
    try:
        st = entry.lstat()
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "not a regular file or folder"
    getuid = getattr(os, "getuid", None)
    if getuid is not None and st.st_uid != getuid():
        return f"owned by user id {st.st_uid}, not by you"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def set_aside(target: Path, reason: str) -> None:
    """Move an untrusted folder out of the way (a rename within the user's own cache folder), then remove it.

    The next ``cached_folder`` for ``target`` builds it again. Callers whose check needs the folder in use
    (the kernel library's ABI version, read once it is loaded) call this themselves.
    """
    warnings.warn(f"not using {target}: {reason}; building it again", stacklevel=3)
    aside = Path(tempfile.mkdtemp(prefix=f".untrusted-{target.name}-", dir=target.parent))
    try:
        os.replace(target, aside / target.name)
    except FileNotFoundError:
        pass  # another process set it aside first
    except OSError as exc:
        raise ConfigError(
            f"{target} cannot be trusted ({reason}) and cannot be moved aside ({exc.strerror or exc}). "
            "Remove it, or point LOCALPAGED_CACHE at a folder only you can write."
        ) from exc
    finally:
        shutil.rmtree(aside, ignore_errors=True)

"""Content hashes of weight files, computed once per file and remembered.

The disk KV tier keys its folder by what the weights *are*, not by names and times, so it needs the
sha256 of each weight file. Hashing the whole GGUF at every start costs a free core a noticeable
while and a busy one more; the digest is therefore kept in ``weight-digests.json`` in the
cache folder, keyed by the file's path, size, mtime_ns and inode: any rewrite of the file (even one of
the same size) changes its mtime or inode, and the file is hashed again. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from localpaged.locations import FILE_MODE, cache_dir

DIGESTS_FILE = "weight-digests.json"
_CHUNK = 1 << 22


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_digests(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):  # missing, unreadable or half-written by an old version: start afresh
        return {}
    return data if isinstance(data, dict) else {}


def _write_digests(file: Path, digests: dict) -> None:
    """Atomically (temp file + rename), so a reader in another process never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=".weight-digests.", dir=file.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            json.dump(digests, f)
        os.replace(tmp, file)
    except OSError:
        Path(tmp).unlink(missing_ok=True)  # a read-only cache only costs the next start a rehash


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's content, from the remembered digests when the file is unchanged."""
    path = Path(path).resolve()
    key = _stat_key(path)
    store = cache_dir() / DIGESTS_FILE
    digests = _read_digests(store)
    known = digests.get(str(path))
    if isinstance(known, dict) and known.get("stat") == key and isinstance(known.get("sha256"), str):
        return known["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    digests = _read_digests(store)  # re-read: another process may have added its own meanwhile
    digests[str(path)] = {"stat": _stat_key(path), "sha256": digest}
    _write_digests(store, digests)
    return digest


def weights_digest(folder: Path, gguf: Path | None) -> str:
    """The content hash of a model's weights: its GGUF file's, else its folder's config and safetensors files."""
    if gguf is not None:
        return file_sha256(gguf)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{file_sha256(f)}".encode())
    return h.hexdigest()

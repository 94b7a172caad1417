"""The disk tier below the KV block pool: full blocks as files, by chained block hash, under a fingerprint.

Why: on a small CPU the ~2,500-token coding prompt takes seconds to prefill, and a restart loses
every cached prefix (benchmarks/kv_disk.py times it cold, from disk in a new process, and warm).
Block hashes are chained content hashes (a block's hash covers every token before it), so a block's
file name alone says which prefix it holds, in any process, after any restart, and a prompt's blocks
are found on disk by the same chain walk as in memory.

Layout: ``<kv_cache_dir>/<fingerprint[:32]>/<block hash hex>.kvb``. The fingerprint covers everything
that makes KV values differ (weights' content hash, KV dtype, block size, layer/head shapes, RoPE
settings, kernel path), so a block of another model or layout is never even looked at. Each file is

    b"LPKVBLK\\0" | u32 format version | u32 header length | header (JSON) | payload

where the header names the fingerprint, block hash, shape, dtype, payload length and the payload's
XXH3-64 checksum, all checked on read. Plain bytes and JSON: nothing is pickled. The checksum guards
against torn and flipped bytes, not against an attacker who can already write to the user's 0700
folder, so it need not be cryptographic, only fast: XXH3 costs a small fraction of a block's read, where
zlib's CRC-32 and sha256 would cost a sizeable part of it.

Files are written whole to a temp file and renamed (atomic), mode 0600 in a 0700 folder (KV blocks
reveal the conversation). The index (hash -> size, last use) is rebuilt by scanning the folder at
start, a file's mtime standing for its last use, and kept in memory; a file another process has
evicted since is simply a miss, and a file that fails any check is deleted and recomputed. Writes
run on one background thread so that decode never waits on the disk; the engine thread only copies
the blocks out of the pool. The total size is bounded; the least recently used files go first.

This module is torch-free, like the pool; the runner hands it the pool's memory to read blocks into
(``block_buffers``) and copies blocks out for the writer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from localpaged.locations import DIR_MODE, make_private

log = logging.getLogger(__name__)

MAGIC = b"LPKVBLK\0"
FORMAT_VERSION = 2  # 2: XXH3-64 instead of CRC-32; files of version 1 are recomputed
SUFFIX = ".kvb"
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_MAX_HEADER = 1 << 16
# Temp files of a writer that died are removed at start once this old (a live writer's are seconds old).
STALE_TEMP_S = 3600.0
# Blocks copied out of the pool but not yet on disk are held in memory up to this many bytes; beyond
# it new writes are dropped (the tier is a cache) rather than letting a slow disk grow memory without bound.
MAX_PENDING_BYTES = 256 << 20
# The writer rescans the folder (other processes add and evict files) at most this often, or when its own count says
# the tier is over its limit; it then evicts down to EVICT_TO of the limit, so that a full tier does not rescan after
# every batch. A scan of thousands of files takes CPU that every prompt's batch used to pay.
RESCAN_S = 30.0
EVICT_TO = 0.9
# The writer runs at this niceness (Linux, where it is the thread's own): its CPU for a long prompt's blocks otherwise
# came out of the next prompt's compute on a machine of few cores (benchmarks/kv_disk.py measures decode while the
# writer works, against the tier off).
WRITER_NICENESS = 10
# Threads that read a chain's block files at once. Reading into the pool is bound by first-touch page
# faults and the checksum, both of which run in parallel: a chain reads in far less time on two threads than on
# one, and a little less again on three (benchmarks/kv_disk.py times a prompt read back in a new process).
READ_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class BlockLayout:
    """What every block file of one tier folder holds: ``shape`` of ``dtype`` values, ``nbytes`` in all."""

    fingerprint: str  # sha256 hex of everything that makes KV values differ
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def layout_fingerprint(fields: dict) -> str:
    """sha256 (hex) of the fields that make KV values differ, in a canonical JSON form."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode_header(layout: BlockLayout, block_hash: bytes, payload: memoryview) -> bytes:
    """The bytes before a block's payload in its file."""
    header = json.dumps(
        {
            "fingerprint": layout.fingerprint,
            "block_hash": block_hash.hex(),
            "shape": list(layout.shape),
            "dtype": layout.dtype,
            "payload_bytes": payload.nbytes,
            "xxh3_64": xxhash.xxh3_64_intdigest(payload),
        }
    ).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header


def payload_checksum(header: bytes, layout: BlockLayout, block_hash: bytes) -> int | None:
    """The payload's XXH3-64 that a block file's header (the bytes after the prefix) declares, or None
    if anything in it is not exactly as this tier's layout and the block's hash expect."""
    try:
        fields = json.loads(header)
    except ValueError:
        return None
    expected = {
        "fingerprint": layout.fingerprint,
        "block_hash": block_hash.hex(),
        "shape": list(layout.shape),
        "dtype": layout.dtype,
        "payload_bytes": layout.nbytes,
    }
    if not isinstance(fields, dict) or any(fields.get(k) != v for k, v in expected.items()):
        return None
    checksum = fields.get("xxh3_64")
    return checksum if isinstance(checksum, int) else None


def read_block(fd: int, layout: BlockLayout, block_hash: bytes, buffers: list[memoryview]) -> bool:
    """Read an open block file's payload into ``buffers`` (``layout.nbytes`` in all, in order) and
    check it; False if anything about the file is not exactly as expected (the buffers then hold junk)."""
    prefix = os.pread(fd, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        return False
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC or version != FORMAT_VERSION or header_len > _MAX_HEADER:
        return False
    checksum = payload_checksum(os.pread(fd, header_len, _PREFIX.size), layout, block_hash)
    if checksum is None:
        return False
    beyond = bytearray(1)  # a file longer than its payload is as wrong as a shorter one
    if os.preadv(fd, [*buffers, beyond], _PREFIX.size + header_len) != layout.nbytes:
        return False
    actual = xxhash.xxh3_64()
    for buffer in buffers:
        actual.update(buffer)
    return actual.intdigest() == checksum


class DiskIndex:
    """hash -> (file size, last use) of the tier's files, least recently used first; no I/O, no locking."""

    def __init__(self, files: Iterable[tuple[bytes, int, float]] = ()) -> None:
        self._entries: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self.total_bytes = 0
        for block_hash, size, last_use in sorted(files, key=lambda f: f[2]):
            self.add(block_hash, size, last_use)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def last_use(self, block_hash: bytes) -> float:
        return self._entries[block_hash][1]

    def add(self, block_hash: bytes, size: int, last_use: float) -> None:
        """Record a file as the most recently used."""
        self.remove(block_hash)
        self._entries[block_hash] = (size, last_use)
        self.total_bytes += size

    def touch(self, block_hash: bytes, now: float) -> None:
        size, _ = self._entries.pop(block_hash)
        self._entries[block_hash] = (size, now)

    def remove(self, block_hash: bytes) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.total_bytes -= entry[0]

    def oldest(self) -> bytes:
        return next(iter(self._entries))


def _lower_priority() -> None:
    """The writer thread's niceness to WRITER_NICENESS, on Linux (elsewhere a thread id is not a process id to
    setpriority); a failure leaves it as it was."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except OSError:
            pass


def _zero(buffers: list[memoryview]) -> None:
    for buffer in buffers:
        buffer[:] = bytes(len(buffer))


def _parse_name(name: str) -> bytes | None:
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None


class KVDiskTier:
    """The block files of one fingerprint folder: look-ups and reads on the engine's thread, writes on a thread of its own."""

    def __init__(self, root: Path, layout: BlockLayout, capacity_bytes: int) -> None:
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.folder = root / layout.fingerprint[:32]
        self.folder.mkdir(mode=DIR_MODE, exist_ok=True)
        make_private(self.folder, DIR_MODE)
        self._lock = threading.Lock()  # guards the index, the pending set and the counters
        self.index = DiskIndex(self._scan(remove_stale_temps=True))
        self._pending: set[bytes] = set()
        self._pending_bytes = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="localpaged-kv-disk", initializer=_lower_priority)
        self._last_scan = time.monotonic()
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="localpaged-kv-read")
        self._warned = False
        self.blocks_written = 0
        self.bytes_written = 0
        self.write_seconds = 0.0  # the writer thread's time spent writing, for its throughput
        self.blocks_dropped = 0  # not written: the writer was behind by MAX_PENDING_BYTES
        self.files_rejected = 0  # corrupt, truncated or foreign files deleted

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}{SUFFIX}"

    # ----- the engine's side ---------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self.index

    def read_chain(self, block_hashes: list[bytes], buffers: list[list[memoryview]]) -> int:
        """Read each block into its buffers (as ``read_into``), several at once; how many of the
        chain's first blocks were read: the chain breaks at the first missing or bad file."""
        read = list(self._readers.map(self.read_into, block_hashes, buffers))
        return read.index(False) if False in read else len(read)

    def read_into(self, block_hash: bytes, buffers: list[memoryview]) -> bool:
        """Read the block's payload into ``buffers`` (``layout.nbytes`` in all, in order), checked.

        False, the buffers zeroed (no stray NaN may stay in a pool block) and the file gone, if it is
        missing, corrupt or foreign. Reading into the caller's buffers, the pool's own memory on the
        CPU, saves two copies of every byte against returning the payload.
        """
        path = self.path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                ok = read_block(fd, self.layout, block_hash, buffers)
            finally:
                os.close(fd)
        except FileNotFoundError:  # evicted by another process: a miss
            with self._lock:
                self.index.remove(block_hash)
            return False
        except OSError as exc:
            _zero(buffers)
            self._warn_once(f"could not read the KV block file {path} ({exc}); its tokens are recomputed")
            return False
        if not ok:
            _zero(buffers)
            with self._lock:
                self.index.remove(block_hash)
                self.files_rejected += 1
            path.unlink(missing_ok=True)
            self._warn_once(
                f"ignored a corrupt, truncated or foreign KV block file in {self.folder} (deleted; its tokens "
                "are recomputed); further ones are deleted silently"
            )
            return False
        with self._lock:
            if block_hash in self.index:
                self.index.touch(block_hash, time.time())
        try:
            os.utime(path)  # the last use, for the LRU order of a later start and of other processes
        except OSError:
            pass
        return True

    def missing(self, block_hashes: list[bytes]) -> list[int]:
        """Indices of the hashes neither on disk nor being written, as many as the writer can take now.

        Beyond MAX_PENDING_BYTES in flight the rest are dropped (counted), the chain's first blocks
        kept: a prefix is worth more than the tail it leads to.
        """
        with self._lock:
            todo = [i for i, h in enumerate(block_hashes) if h not in self.index and h not in self._pending]
            room = max(MAX_PENDING_BYTES - self._pending_bytes, 0) // self.layout.nbytes
            self.blocks_dropped += max(len(todo) - room, 0)
            return todo[:room]

    def save(self, blocks: list[tuple[bytes, memoryview]]) -> None:
        """Write these (hash, payload) blocks in the background; the payloads must not change afterwards."""
        with self._lock:
            blocks = [(h, p) for h, p in blocks if h not in self._pending]
            self._pending.update(h for h, _ in blocks)
            self._pending_bytes += sum(p.nbytes for _, p in blocks)
        if blocks:
            self._writer.submit(self._write_all, blocks)

    def flush(self) -> None:
        """Wait until every block handed to ``save`` so far is on disk (or given up)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the pending writes, bring the folder within its limit as it now is, stop the writer and readers."""
        self._writer.submit(self._rescan_and_evict)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)

    def stats(self) -> dict:
        with self._lock:
            return {
                "disk_blocks": len(self.index),
                "disk_bytes": self.index.total_bytes,
                "disk_blocks_written": self.blocks_written,
                "disk_bytes_written": self.bytes_written,
                "disk_write_s": self.write_seconds,
                "disk_blocks_dropped": self.blocks_dropped,
                "disk_files_rejected": self.files_rejected,
            }

    # ----- the writer thread ------------------------------------------------------------------

    def _write_all(self, blocks: list[tuple[bytes, memoryview]]) -> None:
        started = time.perf_counter()
        for block_hash, payload in blocks:
            try:
                size = self._write(block_hash, payload)
            except OSError as exc:
                self._warn_once(f"could not write a KV block file in {self.folder} ({exc}); the disk tier skips it")
                size = None
            with self._lock:
                self._pending.discard(block_hash)
                self._pending_bytes -= payload.nbytes
                if size is not None:
                    self.index.add(block_hash, size, time.time())
                    self.blocks_written += 1
                    self.bytes_written += size
        with self._lock:
            over = self.index.total_bytes > self.capacity_bytes
        if over or time.monotonic() - self._last_scan >= RESCAN_S:
            self._rescan_and_evict()
        with self._lock:
            self.write_seconds += time.perf_counter() - started

    def _write(self, block_hash: bytes, payload: memoryview) -> int:
        """Write one block file atomically; its size in bytes."""
        header = encode_header(self.layout, block_hash, payload)
        fd, tmp = tempfile.mkstemp(prefix=f".{block_hash.hex()[:16]}.", suffix=".tmp", dir=self.folder)  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(block_hash))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(header) + payload.nbytes

    def _rescan_and_evict(self) -> None:
        """Scan the folder, then, if the tier is over its size limit, delete the least recently used files down to
        EVICT_TO of it. The scan comes first: other processes sharing the folder add and evict files too (their
        new blocks become hits here), and the limit is on what is on disk, not on what this process wrote.
        """
        files = self._scan(remove_stale_temps=False)
        self._last_scan = time.monotonic()
        with self._lock:
            ours = self.index
            self.index = DiskIndex(
                (h, size, max(mtime, ours.last_use(h)) if h in ours else mtime) for h, size, mtime in files
            )
            victims = []
            over = self.index.total_bytes > self.capacity_bytes
            while over and self.index.total_bytes > self.capacity_bytes * EVICT_TO and len(self.index):
                victim = self.index.oldest()
                self.index.remove(victim)
                victims.append(victim)
        for victim in victims:
            self.path(victim).unlink(missing_ok=True)

    # ----- both -------------------------------------------------------------------------------

    def _scan(self, remove_stale_temps: bool) -> list[tuple[bytes, int, float]]:
        """(hash, size, mtime) of every block file in the folder; stale temp files removed on request."""
        files = []
        now = time.time()
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            block_hash = _parse_name(entry.name)
            if block_hash is not None and entry.is_file(follow_symlinks=False):
                files.append((block_hash, st.st_size, st.st_mtime))
            elif remove_stale_temps and entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_S:
                Path(entry.path).unlink(missing_ok=True)
        return files

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message)

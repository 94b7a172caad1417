"""The disk KV tier on its own (torch-free): files, checks, LRU size limit, sharing a folder between processes."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from localpaged.engine.kv_disk import EVICT_TO, BlockLayout, KVDiskTier, encode_header, layout_fingerprint

SHAPE = (2, 3, 4, 2, 8)
NBYTES = 2 * 3 * 4 * 2 * 8 * 4
LAYOUT = BlockLayout(layout_fingerprint({"model": "a"}), SHAPE, "float32", NBYTES)


def block(i: int) -> tuple[bytes, memoryview]:
    """A block hash and a payload that says which block it is."""
    payload = hashlib.sha256(str(i).encode()).digest() * (NBYTES // 32)
    return hashlib.sha256(f"block {i}".encode()).digest(), memoryview(payload)


def read(tier: KVDiskTier, block_hash: bytes) -> bytes | None:
    """The block's payload read back into three buffers (as the pool's separate K/V runs take it), or None."""
    buffer = bytearray(b"\xff" * tier.layout.nbytes)  # not zero: a failed read must zero it
    cut = tier.layout.nbytes // 3
    view = memoryview(buffer)
    if tier.read_into(block_hash, [view[:cut], view[cut : 2 * cut], view[2 * cut :]]):
        return bytes(buffer)
    assert not any(buffer) or buffer == bytearray(b"\xff" * tier.layout.nbytes), "a failed read left junk"
    return None


def written(root: Path, blocks: range, capacity: int = 1 << 30, layout: BlockLayout = LAYOUT) -> KVDiskTier:
    tier = KVDiskTier(root, layout, capacity)
    tier.save([block(i) for i in blocks])
    tier.flush()
    return tier


def test_blocks_round_trip_through_private_files_and_a_rescan(tmp_path):
    tier = written(tmp_path, range(5))
    assert [bytes(read(tier, block(i)[0]) or b"") for i in range(5)] == [bytes(block(i)[1]) for i in range(5)]
    assert stat.S_IMODE(tier.folder.stat().st_mode) == 0o700
    files = sorted(tier.folder.iterdir())
    assert len(files) == 5 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert tier.stats()["disk_blocks"] == 5
    again = KVDiskTier(tmp_path, LAYOUT, 1 << 30)  # a restart: the index comes from the folder
    assert all(again.contains(block(i)[0]) for i in range(5))
    assert bytes(read(again, block(3)[0]) or b"") == bytes(block(3)[1])
    assert not again.contains(block(9)[0]) and read(again, block(9)[0]) is None


def test_another_layout_has_its_own_folder(tmp_path):
    tier = written(tmp_path, range(2))
    other = KVDiskTier(tmp_path, BlockLayout(layout_fingerprint({"model": "b"}), SHAPE, "float32", NBYTES), 1 << 30)
    assert other.folder != tier.folder and not other.contains(block(0)[0])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: NBYTES // 2])


def _foreign(path: Path) -> None:
    """A well-formed file of another model: its header names another fingerprint (its CRC is right)."""
    other = BlockLayout(layout_fingerprint({"model": "b"}), SHAPE, "float32", NBYTES)
    block_hash = bytes.fromhex(path.name[:64])
    payload = memoryview(path.read_bytes()[-NBYTES:])
    path.write_bytes(encode_header(other, block_hash, payload) + bytes(payload))


def _wrong_shape(path: Path) -> None:
    other = BlockLayout(LAYOUT.fingerprint, (2, 3, 4, 1, 16), "float32", NBYTES)
    block_hash = bytes.fromhex(path.name[:64])
    payload = memoryview(path.read_bytes()[-NBYTES:])
    path.write_bytes(encode_header(other, block_hash, payload) + bytes(payload))


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(NBYTES + 300))


@pytest.mark.parametrize("damage", [_flip, _truncate, _foreign, _wrong_shape, _garbage])
def test_a_damaged_or_foreign_file_is_a_miss_and_is_deleted(tmp_path, damage, caplog):
    written(tmp_path, range(4))
    tier = KVDiskTier(tmp_path, LAYOUT, 1 << 30)
    for i in (1, 2):
        damage(tier.path(block(i)[0]))
    with caplog.at_level(logging.WARNING, logger="localpaged.engine.kv_disk"):
        assert read(tier, block(1)[0]) is None and read(tier, block(2)[0]) is None
        assert bytes(read(tier, block(3)[0]) or b"") == bytes(block(3)[1])
    assert not tier.path(block(1)[0]).exists() and not tier.contains(block(1)[0])
    assert tier.stats()["disk_files_rejected"] == 2
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1  # a warning at most once


def test_a_chain_reads_up_to_its_first_bad_block(tmp_path):
    tier = written(tmp_path, range(6))
    _flip(tier.path(block(3)[0]))
    buffers = [[memoryview(bytearray(NBYTES))] for _ in range(6)]
    assert tier.read_chain([block(i)[0] for i in range(6)], buffers) == 3
    assert [bytes(b[0]) for b in buffers[:3]] == [bytes(block(i)[1]) for i in range(3)]
    assert not any(buffers[3][0])  # zeroed, not left half-read


def test_a_file_another_process_evicted_is_a_miss(tmp_path):
    tier = written(tmp_path, range(3))
    tier.path(block(1)[0]).unlink()
    assert tier.contains(block(1)[0]) and read(tier, block(1)[0]) is None
    assert not tier.contains(block(1)[0])


def test_the_size_limit_evicts_the_least_recently_used(tmp_path):
    tier = written(tmp_path, range(4), capacity=1 << 30)
    size = max(f.stat().st_size for f in tier.folder.iterdir())  # a file: the payload and its header
    tier = KVDiskTier(tmp_path, LAYOUT, 6 * size)
    read(tier, block(0)[0])  # used last: it outlives 1, 2, 3
    tier.save([block(i) for i in range(4, 8)])
    tier.flush()
    on_disk = sum(f.stat().st_size for f in tier.folder.iterdir())
    assert on_disk <= EVICT_TO * 6 * size and tier.stats()["disk_bytes"] == on_disk  # 5 files of the 8
    assert tier.contains(block(0)[0]) and not tier.contains(block(1)[0])
    assert all(tier.contains(block(i)[0]) for i in range(5, 8))


def test_the_writer_rescans_the_folder_only_when_over_its_limit_or_after_a_while(tmp_path, monkeypatch):
    """A scan of a full tier's files took 23-40 ms, once paid after every prompt's batch."""
    tier = KVDiskTier(tmp_path, LAYOUT, 1 << 30)
    scans = []
    scan = tier._scan
    monkeypatch.setattr(tier, "_scan", lambda remove_stale_temps: scans.append(1) or scan(remove_stale_temps))
    for i in range(3):
        tier.save([block(i)])
        tier.flush()
    assert not scans  # under the limit, and RESCAN_S has not passed
    monkeypatch.setattr("localpaged.engine.kv_disk.RESCAN_S", 0.0)
    tier.save([block(3)])
    tier.flush()
    assert len(scans) == 1 and tier.stats()["disk_blocks"] == 4


def test_the_writer_never_rewrites_what_is_stored_or_pending(tmp_path):
    tier = written(tmp_path, range(3))
    hashes = [block(i)[0] for i in range(5)]
    assert tier.missing(hashes) == [3, 4]
    tier.save([block(3)])
    assert tier.missing(hashes) == [4]  # block 3 is being written
    tier.flush()
    assert tier.stats()["disk_blocks_written"] == 4


WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.engine.test_kv_disk import block, LAYOUT
from localpaged.engine.kv_disk import KVDiskTier
tier = KVDiskTier(Path({root!r}), LAYOUT, {capacity})
for start in range({first}, {first} + 60, 3):
    tier.save([block(i) for i in range(start, start + 3)])
tier.close()
"""


def test_two_processes_writing_at_once_leave_a_readable_tier(tmp_path):
    capacity = 40 * (NBYTES + 400)
    repo = str(Path(__file__).parents[2])
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(WRITER).format(repo=repo, root=str(tmp_path), capacity=capacity, first=first),
            ]
        )
        for first in (0, 30)  # blocks 30-59 are written by both
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    tier = KVDiskTier(tmp_path, LAYOUT, capacity)
    files = [f for f in tier.folder.iterdir() if f.suffix == ".kvb"]
    assert files and not [f for f in tier.folder.iterdir() if f.suffix == ".tmp"]
    for f in files:
        block_hash = bytes.fromhex(f.name[:64])
        assert read(tier, block_hash) is not None, f"{f.name} does not read back"
    assert sum(f.stat().st_size for f in files) <= capacity  # the last to write saw the other's files too


def test_a_writer_too_far_behind_keeps_the_chains_first_blocks_and_drops_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr("localpaged.engine.kv_disk.MAX_PENDING_BYTES", 3 * NBYTES)
    tier = KVDiskTier(tmp_path, LAYOUT, 1 << 30)
    hashes = [block(i)[0] for i in range(5)]
    assert tier.missing(hashes) == [0, 1, 2]
    assert tier.stats()["disk_blocks_dropped"] == 2

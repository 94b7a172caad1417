"""A GGUF's projections as the CPU kernels pack them, kept on disk so a later start maps them instead of packing.

Packing a model's blocks into the kernels' tiles (``cpu.pack_blocks``) reads and rewrites every weight: seconds
for a 1-4 GB file, at every start. The first start writes the packed tensors to a safetensors file in a private
cache folder (``cache_folders.cached_folder``: built aside, renamed into place, trusted only while it is the
user's), and later starts memory-map it: no copy, no pickle, the pages shared with the page cache as the GGUF's
are. The folder's name holds the GGUF's sha256, the activations the weights were packed for and
``cpu.pack_format()`` (the kernel sources and flags that laid them out), so no other file's or version's packing
is ever read (a packing by another version is removed when one is written); each tensor is checked against the
layout it claims when loaded (``PackedBlocks``), and against the projection it is loaded into. A file that fails
either is set aside and packed again. The packed folders of the ``KEEP`` models started last are kept; older ones
are removed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from localpaged.cache_folders import cached_folder, read_trusted, set_aside
from localpaged.errors import ConfigError, KernelArgumentError
from localpaged.kernels import cpu
from localpaged.locations import models_cache_dir

log = logging.getLogger(__name__)
FILE = "packed.safetensors"
FIELDS = tuple(f.name for f in dataclasses.fields(cpu.PackedBlocks) if f.name not in cpu.PACKED_TENSORS)
KEEP = 4  # packed models kept: each is about its GGUF's size again
SPARE_BYTES = 1 << 30  # free disk left after writing one, else it is not written
PAGE_BYTES = 4096


class PackedCache:
    """The packed projections of the GGUF whose sha256 is ``fingerprint``, for ``activations``."""

    def __init__(self, fingerprint: str, activations: str) -> None:
        self.version = cpu.pack_format()[:16]
        self.folder = models_cache_dir() / f"{fingerprint[:32]}-packed-{activations}-{self.version}"

    def load(self) -> dict[str, cpu.PackedBlocks]:
        """Each projection's packed weight by module name, mapped from the file; empty where there is none to trust."""
        errors = (OSError, SafetensorError, ValueError, KeyError, TypeError, KernelArgumentError)
        packs = read_trusted(self.folder, lambda folder: _read(folder / FILE), errors)
        if packs is None:
            return {}
        os.utime(self.folder)  # its last use, for KEEP
        threading.Thread(target=_map_in, args=(list(packs.values()),), name="localpaged-map-in", daemon=True).start()
        return packs

    def set_aside(self, reason: str) -> None:
        """Remove a folder whose packing did not fit the model (the next start writes it again)."""
        set_aside(self.folder, reason)

    def save(self, packs: dict[str, cpu.PackedBlocks]) -> None:
        """Write ``packs`` for later starts, where the disk has room; a cache, so failing to write costs only time."""
        size = sum(t.nbytes for p in packs.values() for t in p.tensors().values())
        try:
            free = shutil.disk_usage(self.folder.parent).free
            if free < size + SPARE_BYTES:
                log.warning(
                    "not keeping this model's packed weights (%d MiB): %d MiB free in %s; the next start packs "
                    "them again",
                    size >> 20,
                    free >> 20,
                    self.folder.parent,
                )
                return
            cached_folder(self.folder, lambda folder: _write(folder / FILE, packs))
        except (OSError, SafetensorError, ConfigError) as exc:
            log.warning("could not keep this model's packed weights (%s); the next start packs them again", exc)
            return
        self._forget_old()

    def _forget_old(self) -> None:
        """Remove packings by other kernel versions (this one never reads them), and every packed folder past the
        KEEP used last."""
        folders = [f for f in self.folder.parent.glob("*-packed-*") if f.is_dir() and not f.name.startswith(".")]
        stale = [f for f in folders if not f.name.endswith(f"-{self.version}")]
        kept = sorted(set(folders) - set(stale), key=lambda f: f.stat().st_mtime, reverse=True)
        for folder in stale + kept[KEEP:]:
            shutil.rmtree(folder, ignore_errors=True)


def _map_in(packs: list[cpu.PackedBlocks]) -> None:
    """Read a byte of every page of the mapped weights, so the first step does not stop at each (a 1.2 GB model is
    300,000 page faults): on a thread of its own while the engine finishes starting (torch lets go of the GIL)."""
    for pack in packs:
        for t in pack.tensors().values():
            t.view(-1)[:: PAGE_BYTES // t.element_size()].sum()


def _write(path: Path, packs: dict[str, cpu.PackedBlocks]) -> None:
    tensors = {f"{module}.{name}": t for module, pack in packs.items() for name, t in pack.tensors().items()}
    fields = {module: {name: getattr(pack, name) for name in FIELDS} for module, pack in packs.items()}
    save_file(tensors, str(path), metadata={"fields": json.dumps(fields)})


def _read(path: Path) -> dict[str, cpu.PackedBlocks]:
    with safe_open(str(path), framework="pt") as f:
        fields = json.loads(f.metadata()["fields"])
        names = set(f.keys())
        packs = {}
        for module, values in fields.items():
            tensors = {
                n: f.get_tensor(f"{module}.{n}") if f"{module}.{n}" in names else None for n in cpu.PACKED_TENSORS
            }
            packs[module] = cpu.PackedBlocks(**tensors, **{n: values[n] for n in FIELDS})
    if not packs:
        raise ValueError("it holds no weights")
    return packs

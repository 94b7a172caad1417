"""A model's packed weights copied onto 2 MiB pages in the background, then swapped in between two steps.

A decode step reads every packed weight once, from memory. On 4 KiB pages that stream keeps missing the TLB, and on
a virtual machine each miss walks two page tables: one-row projections read well below a plain read's rate, and the
same bytes on 2 MiB pages read near it. The packed cache's file is mapped on 4 KiB pages (the page cache's), and
torch's tensors are on them too, so the weights are copied into one anonymous mapping advised ``MADV_HUGEPAGE``.

Not at load: Linux takes its time to find 2 MiB pages (seconds for a 1-4 GB model where memory is fragmented), and
a start waiting on them would answer its first token that much later. So a thread of its own copies them while the
engine runs on the mapped weights, and the engine swaps the copies in at its next step. The cost: memory for both
while it copies, and weights that two engine processes no longer share through the page cache. Whether a model
moves is the engine's decision (``engine/setup.py``'s ``move_to_huge_pages``: where Linux gives transparent huge
pages and memory holds the copy).
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import threading
from pathlib import Path

import torch
from torch import nn

from localpaged.kernels import cpu
from localpaged.layers.linear import BlockLinear

log = logging.getLogger(__name__)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64  # bytes: each tensor starts on a cache line, as torch's own allocations do
HUGE_PAGE = 2 << 20


def huge_pages_available() -> bool:
    """Whether this kernel backs an ``MADV_HUGEPAGE`` mapping with 2 MiB pages (its setting is ``always`` or
    ``madvise``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def projections(model: nn.Module) -> list[BlockLinear]:
    """``model``'s BlockLinear projections, in module order: what a move copies."""
    return [m for m in model.modules() if isinstance(m, BlockLinear)]


def packed_bytes(packs: list[cpu.PackedBlocks]) -> int:
    """The bytes ``onto_huge_pages`` copies ``packs`` into."""
    return sum(_aligned(t.nbytes) for p in packs for t in p.tensors().values())


def huge_page_buffer(size: int) -> torch.Tensor:
    """``size`` zeroed bytes of an anonymous mapping, from a 2 MiB boundary, advised ``MADV_HUGEPAGE`` where Linux
    gives huge pages (the tensor keeps the mapping alive)."""
    # One huge page of slack: the mapping starts on a 4 KiB boundary, the buffer on the next 2 MiB one, so that huge
    # pages cover it from its first byte.
    area = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        area.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    at = -whole.data_ptr() % HUGE_PAGE
    return whole[at : at + size]


def onto_huge_pages(packs: list[cpu.PackedBlocks]) -> list[cpu.PackedBlocks]:
    """Each of ``packs`` with its tensors copied, in order, into one ``huge_page_buffer``: the same weights in new
    storage."""
    whole, at = huge_page_buffer(packed_bytes(packs)), 0
    moved = []
    for pack in packs:
        copies = {}
        for name, t in pack.tensors().items():
            copies[name] = whole[at : at + t.nbytes].view(t.dtype).view(t.shape)
            copies[name].copy_(t)
            at += _aligned(t.nbytes)
        moved.append(dataclasses.replace(pack, **copies))
    return moved


class HugePageMove:
    """``model``'s packed projections copied onto huge pages by a thread of its own (``start``); once ``ready``,
    ``swap_in`` (between steps, on the engine's thread) hands each projection its copy."""

    def __init__(self, modules: list[BlockLinear]) -> None:
        self.modules = modules
        self.copies: list[cpu.PackedBlocks] | None = None
        self.thread = threading.Thread(target=self._copy, name="localpaged-huge-pages", daemon=True)

    @classmethod
    def start(cls, model: nn.Module) -> HugePageMove | None:
        """The move of ``model``'s BlockLinear weights, under way; None where it has none."""
        modules = projections(model)
        if not modules:
            return None
        move = cls(modules)
        move.thread.start()
        return move

    def _copy(self) -> None:
        try:
            self.copies = onto_huge_pages([m.packed for m in self.modules])
        except (OSError, RuntimeError, MemoryError) as exc:  # the weights stay as they are: slower, still right
            log.warning("packed weights stay on 4 KiB pages: copying them onto huge pages failed (%s)", exc)

    def ready(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        """Until the copy is done (or has failed): ``ready`` after."""
        self.thread.join()

    def swap_in(self) -> None:
        """Each projection's weight from its copy (nothing where the copy failed); only once ``ready``."""
        if self.copies is not None:
            for module, pack in zip(self.modules, self.copies):
                module.move_to(pack)
        self.copies = None

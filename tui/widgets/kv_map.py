"""The KV block pool drawn as a grid of coloured cells."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from localpaged.engine.output import KVMap
from localpaged.engine.protocol import EngineStats

FREE, USED, SHARED, CACHED = 0, 1, 2, 3
HIGHLIGHT = 4  # drawn over any state: the open chat's blocks
CELL = "■"
# One style per state; the order of STATES is also the priority when several blocks share a cell.
STATES = {
    FREE: ("free", "$foreground 20%"),
    CACHED: ("cached", "$warning"),
    USED: ("in use", "$primary"),
    SHARED: ("shared", "$success"),
    HIGHLIGHT: ("this chat", "bold $error"),
}
PRIORITY = list(STATES)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cells(states: list[int], highlight: list[int], count: int) -> list[int]:
    """Fold the pool into at most `count` cells, each showing its most notable block."""
    marked = list(states)
    for block in highlight:
        if 0 <= block < len(marked):
            marked[block] = HIGHLIGHT
    per_cell = max(1, -(-len(marked) // max(count, 1)))
    return [max(marked[i : i + per_cell], key=PRIORITY.index) for i in range(0, len(marked), per_cell)]


class KVMapPanel(VerticalScroll):
    """Free, in-use, cached and shared blocks, with the open chat's blocks picked out.

    A big pool is folded so that the grid fits the panel: a cell then stands for several
    blocks and takes the colour of the most notable one among them.
    """

    MAX_ROWS = 24

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shown: tuple[KVMap, EngineStats] | None = None  # the last show()'s arguments, for on_resize

    def compose(self) -> ComposeResult:
        yield Static(id="kv-grid")
        yield Static(id="kv-legend")
        yield Static(id="kv-figures")

    def show_remote(self, where: str) -> None:
        """No grid: a remote engine's pool is on its server, which does not show it."""
        self._shown = None
        self.query_one("#kv-grid", Static).update(
            Content(f"{where}: the KV pool is on the server and not visible from here.")
        )
        self.query_one("#kv-legend", Static).update("")
        self.query_one("#kv-figures", Static).update("")

    def show(self, kv_map: KVMap, stats: EngineStats) -> None:
        """Redraw from an engine `KVMap` and `stats()`."""
        self._shown = (kv_map, stats)
        width = max(self.content_size.width, 8)
        grid = cells(kv_map.states, kv_map.highlight, width * self.MAX_ROWS)
        rows = [grid[i : i + width] for i in range(0, len(grid), width)]
        self.query_one("#kv-grid", Static).update(
            Content("\n").join(Content.assemble(*((CELL, STATES[c][1]) for c in row)) for row in rows)
        )
        per_cell = -(-len(kv_map.states) // max(len(grid), 1))
        legend = [Content.assemble((CELL, style), f" {name}") for name, style in STATES.values()]
        if per_cell > 1:
            legend.append(Content(f"(1 cell = {per_cell} blocks)"))
        self.query_one("#kv-legend", Static).update(Content("  ").join(legend))
        self.query_one("#kv-figures", Static).update(
            f"blocks {stats.blocks_used or 0} used / {stats.blocks_total or len(kv_map.states)} total"
            f" · {stats.blocks_cached or 0} cached · {stats.blocks_shared or 0} shared\n"
            f"this chat {len(kv_map.highlight)} blocks"
            f" ({len(kv_map.highlight) * kv_map.block_size} tokens)"
            f" · saved by sharing {human_bytes(kv_map.bytes_saved)}"
            f" · block {kv_map.block_size} tokens, {human_bytes(kv_map.block_bytes)}"
        )

    def on_resize(self) -> None:
        """Fold the grid again for the panel's new width. The figures that come with showing the panel can arrive
        before it is laid out, and the grid was then folded for its old width (a full run of the suite caught the
        snapshot that way)."""
        if self._shown is not None:
            self.show(*self._shown)

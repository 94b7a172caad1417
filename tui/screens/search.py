"""Full-text search across every chat, to jump to a hit."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

MATCH_START, MATCH_END = "«", "»"


def highlight(snippet: str) -> Content:
    """The store marks matches with «…»; draw them highlighted instead."""
    parts: list[str | tuple[str, str]] = []
    for i, piece in enumerate(snippet.replace(MATCH_END, MATCH_START).split(MATCH_START)):
        parts.append((piece, "bold $accent") if i % 2 else piece.replace("\n", " "))
    return Content.assemble(*parts)


class SearchDialog(ModalScreen[Any]):
    """Searches as you type; enter or a click on a hit returns that `SearchHit`."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="search_cancel"),
        Binding("down", "focus_hits", "Hits", show=False, id="search_hits"),
    ]

    def __init__(self, store: Any) -> None:
        super().__init__(classes="dialog")
        self.store = store
        self.hits: list[Any] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Search all chats", classes="dialog-title")
            yield Input(placeholder="words to find", id="search-input")
            yield OptionList(id="search-hits")
            yield Label("type to search · enter/↓ to pick a hit · escape to cancel", classes="dialog-hint")

    def on_input_changed(self, event: Input.Changed) -> None:
        self.hits = self.store.search(event.value, limit=50) if event.value.strip() else []
        hits = self.query_one(OptionList)
        hits.clear_options()
        hits.add_options(
            [
                Option(
                    Content.assemble((h.session_title or "Untitled", "bold"), f" · {h.role}\n  ", highlight(h.snippet)),
                    id=str(i),
                )
                for i, h in enumerate(self.hits)
            ]
        )
        if self.hits:
            hits.highlighted = 0

    def on_input_submitted(self) -> None:
        if self.hits:
            self.dismiss(self.hits[self.query_one(OptionList).highlighted or 0])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.hits[int(event.option.id or 0)])

    def action_focus_hits(self) -> None:
        self.query_one(OptionList).focus()

    def action_cancel(self) -> None:
        self.dismiss(None)

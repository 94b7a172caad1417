"""The list of chats down the left side."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from textual.content import Content
from textual.widgets import OptionList
from textual.widgets.option_list import Option

LIVE_MARK = "●"


@dataclass(frozen=True)
class SessionEntry:
    """What the sidebar shows of one chat."""

    id: str
    title: str
    updated: float  # seconds since the epoch
    live: bool = False


def ago(then: float, now: float) -> str:
    """A short, human age: 'now', '5m', '3h', '2d', or the date for older chats."""
    seconds = max(0.0, now - then)
    if seconds < 60:
        return "now"
    if seconds < 3600:
        return f"{int(seconds // 60)}m ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h ago"
    if seconds < 7 * 86400:
        return f"{int(seconds // 86400)}d ago"
    try:
        return datetime.fromtimestamp(then).strftime("%Y-%m-%d")
    except (OverflowError, OSError, ValueError):  # a time no calendar holds (a database edited by hand)
        return "?"


class SessionList(OptionList):
    """Chats, newest first, each with its last activity and a live marker while it generates.

    Option ids are session ids, so selection survives a refresh of titles or markers.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.entries: list[SessionEntry] = []

    def set_entries(self, entries: list[SessionEntry], now: float) -> None:
        """Redraw the list, keeping the highlighted chat highlighted."""
        current = self.current_id
        self.entries = entries
        self.clear_options()
        self.add_options([Option(self._label(e, i, now), id=e.id) for i, e in enumerate(entries)])
        if current is not None:
            self.select(current)

    def _label(self, entry: SessionEntry, index: int, now: float) -> Content:
        return Content.from_markup(
            "[bold $success]$mark[/] [b]$title[/b]\n  [dim]$key$age[/dim]",
            mark=LIVE_MARK if entry.live else " ",
            title=entry.title or "Untitled",
            key=f"alt+{index + 1} · " if index < 9 else "",
            age=ago(entry.updated, now),
        )

    @property
    def current_id(self) -> str | None:
        if self.highlighted is None or self.highlighted >= self.option_count:
            return None
        return self.get_option_at_index(self.highlighted).id

    def select(self, session_id: str) -> None:
        """Highlight a chat without opening it (the screen decides what is open)."""
        ids = [e.id for e in self.entries]
        if session_id in ids:
            self.highlighted = ids.index(session_id)

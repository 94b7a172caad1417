"""The line of live engine and chat figures above the footer."""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.widgets import Static

from localpaged.engine.protocol import EngineStats

BAR_WIDTH = 12


@dataclass(frozen=True)
class ChatFigures:
    """The open chat's own figures; None where there is nothing to show yet."""

    tokens_per_s: float | None
    ttft_s: float | None
    context_tokens: int | None  # None: unknown (a remote server that cannot count tokens)
    max_context: int | None  # None: a remote server that does not say
    from_disk: bool = False  # the last reply's prompt was partly read from the disk KV tier


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A text bar with eighth-cell resolution, e.g. '███▌        '."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, rest = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[rest] if full < width else ""
    return ("█" * full + partial).ljust(width)


def _num(value: float | None, fmt: str, unit: str) -> str:
    return "–" if value is None else f"{value:{fmt}}{unit}"


def context(chat: ChatFigures) -> str:
    """'context 41 of 8192 tokens', as much of it as is known."""
    used = "–" if chat.context_tokens is None else str(chat.context_tokens)
    return f"context {used} tokens" if chat.max_context is None else f"context {used} of {chat.max_context} tokens"


def drafts(stats: EngineStats) -> str:
    """' · drafts kept 62%' once speculative decoding has checked a draft token; '' while it has not or is off."""
    if not stats.spec_proposed_tokens:
        return ""
    return f" · drafts kept {100 * (stats.spec_accepted_tokens or 0) / stats.spec_proposed_tokens:.0f}%"


class StatusLine(Static):
    """Model, device, queue, throughput, context and KV pool use, redrawn on a timer."""

    def show(self, model: str, device: str, stats: EngineStats, chat: ChatFigures | None, *, pool: bool = True) -> None:
        """First row: the engine and its block pool; second row: the open chat and the prefix cache.

        ``pool`` False (a remote engine): the pool and the prefix cache are on the server, out of view,
        and the line says so rather than showing zeros.
        """
        total = max(stats.blocks_total or 0, 1)
        used = stats.blocks_used or 0
        kv = (
            Content.from_markup(
                "KV [$accent on $panel-lighten-1]$bar[/] $pct% of $total blocks",
                bar=bar(used / total),
                pct=f"{100 * used / total:.0f}",
                total=str(total),
            )
            if pool
            else Content("KV pool on the server")
        )
        engine = Content(" │ ").join(
            [
                Content.from_markup("[b]$model[/b] on $device", model=model, device=device),
                Content(f"running {stats.running} · waiting {stats.waiting}"),
                Content(f"all chats {_num(stats.tokens_per_s, '.1f', ' tok/s')}"),
                kv,
            ]
        )
        this = (
            Content("no chat open")
            if chat is None
            else Content(
                f"this chat {_num(chat.tokens_per_s, '.1f', ' tok/s')} · first token {_num(chat.ttft_s, '.2f', ' s')}"
                + (" from disk" if chat.from_disk else "")
                + f" · {context(chat)}"
            )
        )
        cache = (
            Content(
                f"prefix cache hits {100 * (stats.prefix_hit_rate or 0.0):.0f}%"
                f" · {stats.blocks_shared or 0} shared blocks" + drafts(stats)
            )
            if pool
            else Content("prefix cache on the server")
        )
        # Two rows of fixed height that never wrap (app.tcss): a repaint, not a re-layout of the screen.
        self.update(Content("\n").join([engine, Content(" │ ").join([this, cache])]), layout=False)

"""One message of a chat: a header line and its Markdown body."""

from __future__ import annotations

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownStream

from localpaged.chat.session import limit_note
from localpaged.tui.widgets.reply_markdown import ReplyMarkdown

STATUS_MARKS = {"partial": "stopped — partial reply", "error": "error"}


def metrics_note(record: object, max_model_len: int | None = None) -> str:
    """The stored figures of a reply, e.g. '61.4 tok/s · ttft 0.02 s'; empty when there are none.

    A reply that ended on a token limit says so first ('stopped at 256 tokens', or that the context
    of ``max_model_len`` tokens is full): otherwise a cut-off answer looks like a finished one.
    """
    rate, ttft = getattr(record, "tokens_per_s", None), getattr(record, "ttft_s", None)
    parts = ([f"{rate:.1f} tok/s"] if rate else []) + ([f"ttft {ttft:.2f} s"] if ttft is not None else [])
    return " · ".join([note, *parts] if (note := limit_note(record, max_model_len)) else parts)


def code_blocks(text: str) -> list[str]:
    """The fenced and indented code blocks of a Markdown text, in order."""
    tokens = MarkdownIt("gfm-like").parse(text)
    return [t.content for t in tokens if t.type in ("fence", "code_block")]


class MessageBubble(Vertical, can_focus=True):
    """A focusable message; the assistant's reply streams into it while it is generated.

    Streaming goes through a `MarkdownStream`, which batches fragments when tokens arrive faster
    than Markdown can re-parse; `finish` replaces the text with one full `update` so the final
    rendering never depends on how the stream happened to be chunked.
    """

    BINDINGS = [
        Binding("c", "copy", "Copy message", id="copy_message"),
        Binding("b", "copy_code", "Copy code block", id="copy_code"),
        Binding("e", "edit", "Edit & resend", id="edit_message"),
    ]

    class EditRequested(Message):
        """The user asked to edit this (user) message and resend it in a fork."""

        def __init__(self, bubble: MessageBubble) -> None:
            super().__init__()
            self.bubble = bubble

    def __init__(
        self, role: str, text: str, message_id: int | None = None, status: str = "complete", note: str = ""
    ) -> None:
        super().__init__(classes=f"bubble {role}")
        self.role = role
        self.text = text
        self.message_id = message_id
        self.status = status
        self.note = note
        self.shown = len(text)
        self._stream: MarkdownStream | None = None
        self._code_index = 0

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="bubble-header")
        yield ReplyMarkdown(self.text, classes="bubble-body")

    def _header(self) -> str:
        who = "you" if self.role == "user" else "assistant"
        parts = [who, STATUS_MARKS.get(self.status, ""), self.note]
        return " · ".join(p for p in parts if p)

    def set_note(self, note: str) -> None:
        """Show live figures (tok/s, time to first token) next to the role."""
        self.note = note
        for header in self.query(".bubble-header").results(Label):  # none until composed
            header.update(self._header(), layout=False)  # one row of fixed size (app.tcss): a repaint

    async def grow(self, text: str) -> None:
        """Append what `text` has beyond what is shown; safe to call with the same text twice."""
        if len(text) <= self.shown:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        fragment, self.shown, self.text = text[self.shown :], len(text), text
        await self._stream.write(fragment)

    async def close_stream(self) -> None:
        """Stop feeding the Markdown (before the bubble is removed mid-reply)."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def finish(self, text: str, status: str, message_id: int | None, note: str = "") -> None:
        """End streaming and render the final text in one piece."""
        await self.close_stream()
        self.text, self.shown, self.status, self.message_id, self.note = text, len(text), status, message_id, note
        self.query_one(".bubble-header", Label).update(self._header())
        await self.query_one(Markdown).update(text)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Only stored user messages can be edited; code can only be copied where there is some."""
        if action == "edit":
            return self.role == "user" and self.message_id is not None
        if action == "copy_code":
            return bool(code_blocks(self.text))
        return True

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.notify("Message copied to the clipboard")

    def action_copy_code(self) -> None:
        """Copy the next code block; pressing again walks through the blocks of the message."""
        blocks = code_blocks(self.text)
        index = self._code_index % len(blocks)
        self._code_index = index + 1
        self.app.copy_to_clipboard(blocks[index])
        self.notify(f"Code block {index + 1} of {len(blocks)} copied to the clipboard")

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))

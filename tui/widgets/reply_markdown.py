"""A message's Markdown body, whose code blocks are highlighted only in the language they name.

Textual guesses a language for a block that names none (pygments tries every lexer on the text), and a guessed
lexer can take minutes on text it was not written for: a model's indented prose, guessed to be Maple, held the
app's event loop. A block without a language shows as plain text.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownFence


class CodeFence(MarkdownFence):
    """A fenced or indented code block: highlighted as the language its fence names, else plain text."""

    @classmethod
    def highlight(cls, code: str, language: str, ansi: bool = False, dark: bool = False) -> Content:
        return super().highlight(code, language.strip() or "text", ansi=ansi, dark=dark)


class ReplyMarkdown(Markdown):
    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}

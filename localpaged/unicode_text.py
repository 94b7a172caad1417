"""Text that is not Unicode: the one check every boundary that takes text from outside makes.

Python strings can hold lone surrogates (``"\\ud800"``): a JSON ``\\ud800`` escape, a file name or
argument decoded with ``surrogateescape``, a careless slice of UTF-16. No UTF-8 encoder takes them,
so such text fails far from where it came in: in the tokenizer (a TypeError), in SQLite (a
UnicodeEncodeError), or when a request is sent to the engine process (the HTTP server answered
500). Each boundary (prompts, chat messages, stop strings, the chat store) asks this module
instead and refuses the text with its own error, naming what to fix.
"""

from __future__ import annotations


def not_unicode(text: str) -> str | None:
    """Why ``text`` is not Unicode text (where its first lone surrogate is), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"it holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is not Unicode text; "
            "decode bytes with errors='replace', or remove it"
        )
    return None


def check_text(what: str, value: object, error: type[Exception], *, optional: bool = False) -> None:
    """``value`` is Unicode text (or None where ``optional``), else ``error`` naming ``what``: the public methods and
    the store's text columns take str only (None, bytes or an int would fail far from the mistake, or be stored as a
    value no reader expects)."""
    if optional and value is None:
        return
    if not isinstance(value, str):
        raise error(f"the {what} must be text (str){' or None' if optional else ''}, not {type(value).__name__}")
    if reason := not_unicode(value):
        raise error(f"the {what} cannot be stored: {reason}")

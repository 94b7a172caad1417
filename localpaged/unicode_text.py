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

"""An incremental JSON scanner: text in as it streams, events out by path (where each value starts and ends,
the decoded characters of strings), so a tool call's name and the raw text of its arguments can be handed
on while the model is still writing them.

Torch-free and dependency-free; it checks the grammar of JSON (``ScanError`` at the first character
that breaks it) and keeps no more state than the path it is in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

Path = tuple[str | int, ...]
WHITESPACE = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = ("true", "false", "null")
_NUMBER = set("0123456789+-.eE")


class ScanError(ValueError):
    """The text stopped being JSON at ``pos``."""

    def __init__(self, pos: int, why: str) -> None:
        super().__init__(f"not JSON at character {pos}: {why}")
        self.pos = pos


@dataclass
class Event:
    kind: str  # "start" (a value begins at pos), "end" (it ended just before pos), "chars" (a string's text)
    path: Path
    pos: int
    text: str = ""  # "chars": the decoded characters; "start": "object", "array", "string" or "scalar"


@dataclass
class _Frame:
    container: str  # "object" or "array"
    path: Path
    expect: str  # object: "key|end", "key", "colon", "value", "comma|end"; array: "value|end", "value", "comma|end"
    key: str = ""
    index: int = 0


@dataclass
class JsonScanner:
    """Scans one JSON value (after optional whitespace); ``done`` once it is complete, ``end`` its end offset.

    ``offset``: where the scanner's first character sits in the caller's text, so events carry the
    caller's positions. Characters after the value are not consumed (``feed`` returns how many were).
    """

    offset: int = 0
    pos: int = 0
    done: bool = False
    end: int = -1
    _stack: list[_Frame] = field(default_factory=list)
    _started: bool = False
    _string: Path | None = None  # the path of the string being read, key strings included (path None: a key)
    _in_key: bool = False
    _key: list[str] = field(default_factory=list)
    _escape: str | None = None  # "" just after a backslash, "uXXXX" as a \u escape is read
    _high: str = ""  # a pending UTF-16 high surrogate
    _scalar: Path | None = None
    _scalar_text: str = ""

    def feed(self, text: str) -> tuple[list[Event], int]:
        """Scan ``text`` (the next characters): the events, and how many characters belonged to the value."""
        events: list[Event] = []
        chars: list[str] = []
        for i, ch in enumerate(text):
            if self.done:
                self._flush(chars, events)
                return events, i
            self._step(ch, events, chars)
            self.pos += 1
        self._flush(chars, events)
        return events, len(text)

    def _flush(self, chars: list[str], events: list[Event]) -> None:
        if chars and self._string is not None and not self._in_key:
            events.append(Event("chars", self._string, self._at(), "".join(chars)))
        chars.clear()

    def _at(self) -> int:
        return self.offset + self.pos

    def _step(self, ch: str, events: list[Event], chars: list[str]) -> None:
        if self._string is not None or self._in_key:
            self._string_char(ch, events, chars)
            return
        if self._scalar is not None:
            if ch in _NUMBER or ch.isalpha():
                self._scalar_text += ch
                return
            self._end_scalar(events)
        if ch in WHITESPACE:
            return
        frame = self._stack[-1] if self._stack else None
        if frame is None:
            if self._started:
                raise ScanError(self._at(), "text after the value")
            self._start_value((), ch, events)
            return
        if frame.container == "object":
            self._object_char(frame, ch, events)
        else:
            self._array_char(frame, ch, events)

    def _object_char(self, frame: _Frame, ch: str, events: list[Event]) -> None:
        if frame.expect in ("key|end", "key") and ch == '"':
            self._in_key, self._key = True, []
        elif frame.expect in ("key|end", "comma|end") and ch == "}":
            self._close(events)
        elif frame.expect == "colon" and ch == ":":
            frame.expect = "value"
        elif frame.expect == "value":
            frame.expect = "comma|end"
            self._start_value((*frame.path, frame.key), ch, events)
        elif frame.expect == "comma|end" and ch == ",":
            frame.expect = "key"
        else:
            raise ScanError(self._at(), f"{ch!r} where an object expects {frame.expect.replace('|', ' or ')}")

    def _array_char(self, frame: _Frame, ch: str, events: list[Event]) -> None:
        if frame.expect == "value|end" and ch == "]":
            self._close(events)
        elif frame.expect in ("value|end", "value"):
            frame.expect = "comma|end"
            self._start_value((*frame.path, frame.index), ch, events)
        elif frame.expect == "comma|end" and ch == ",":
            frame.expect, frame.index = "value", frame.index + 1
        elif frame.expect == "comma|end" and ch == "]":
            self._close(events)
        else:
            raise ScanError(self._at(), f"{ch!r} where an array expects {frame.expect.replace('|', ' or ')}")

    def _start_value(self, path: Path, ch: str, events: list[Event]) -> None:
        self._started = True
        if ch == "{":
            events.append(Event("start", path, self._at(), "object"))
            self._stack.append(_Frame("object", path, "key|end"))
        elif ch == "[":
            events.append(Event("start", path, self._at(), "array"))
            self._stack.append(_Frame("array", path, "value|end"))
        elif ch == '"':
            events.append(Event("start", path, self._at(), "string"))
            self._string = path
        elif ch in _NUMBER or ch in "tfn":
            events.append(Event("start", path, self._at(), "scalar"))
            self._scalar, self._scalar_text = path, ch
        else:
            raise ScanError(self._at(), f"{ch!r} cannot start a JSON value")

    def _end_scalar(self, events: list[Event]) -> None:
        text, path = self._scalar_text, self._scalar
        self._scalar = None
        if text not in _LITERALS and not _is_number(text):
            raise ScanError(self._at(), f"{text!r} is not a JSON number, true, false or null")
        self._ended(path, events, self._at())  # type: ignore[arg-type]

    def _close(self, events: list[Event]) -> None:
        frame = self._stack.pop()
        self._ended(frame.path, events, self._at() + 1)

    def _ended(self, path: Path, events: list[Event], end: int) -> None:
        events.append(Event("end", path, end))
        if not self._stack:
            self.done, self.end = True, end

    def _string_char(self, ch: str, events: list[Event], chars: list[str]) -> None:
        out = self._key if self._in_key else chars
        if self._escape is not None:
            self._escape_char(ch, out)
        elif ch == "\\":
            self._escape = ""
        elif ch == '"':
            if self._high:
                raise ScanError(self._at(), "a lone UTF-16 surrogate escape")
            if self._in_key:
                self._in_key = False
                frame = self._stack[-1]
                frame.key, frame.expect = "".join(self._key), "colon"
            else:
                self._flush(chars, events)
                path, self._string = self._string, None
                self._ended(path, events, self._at() + 1)  # type: ignore[arg-type]
        elif ch < " ":
            raise ScanError(self._at(), "a control character inside a string")
        else:
            out.append(ch)

    def _escape_char(self, ch: str, out: list[str]) -> None:
        if self._escape == "":
            if ch == "u":
                self._escape = "u"
                return
            if ch not in _ESCAPES:
                raise ScanError(self._at(), f"\\{ch} is not a JSON escape")
            self._escape = None
            out.append(_ESCAPES[ch])
            return
        if ch not in "0123456789abcdefABCDEF":
            raise ScanError(self._at(), "a \\u escape takes four hex digits")
        self._escape += ch
        if len(self._escape) < 5:
            return
        code, self._escape = int(self._escape[1:], 16), None
        if 0xD800 <= code < 0xDC00:
            self._high = chr(code)
            return
        if 0xDC00 <= code < 0xE000:
            if not self._high:
                raise ScanError(self._at(), "a lone UTF-16 surrogate escape")
            code, self._high = 0x10000 + ((ord(self._high) - 0xD800) << 10) + (code - 0xDC00), ""
        elif self._high:
            raise ScanError(self._at(), "a lone UTF-16 surrogate escape")
        out.append(chr(code))

    def finish(self) -> list[Event]:
        """The text is over: a number at the very end is complete now (``{"a": 1`` is still incomplete)."""
        events: list[Event] = []
        if self._scalar is not None and not self._stack:
            self._end_scalar(events)
        return events


def _is_number(text: str) -> bool:
    if text[:1] == "+" or text.lstrip("-")[:1] == "." or text.lower() in ("nan", "infinity", "-infinity"):
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

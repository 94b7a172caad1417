"""One choice of a reply (one of ``n`` samples) as OpenAI's API shows it: its text or tool calls, its
log-probabilities and finish reason, whole (``message``) or a chunk's delta at a time (``deltas``).

Both read the reply through the same ToolCallParser, so a streamed reply reassembles into exactly
the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass

from localpaged.chat.tool_calls import CallDelta, ContentDelta, Delta, ToolCallParser, ToolFormat, ToolPlan, collect
from localpaged.engine.output import RequestOutput
from localpaged.engine.vocabulary import Vocabulary
from localpaged.server.logprobs import chat_logprobs, completion_logprobs, new_logprobs


@dataclass(frozen=True)
class ToolSetup:
    """A request's tools and the format its model writes calls in."""

    plan: ToolPlan
    fmt: ToolFormat
    legacy: bool = False  # answered as OpenAI's legacy function_call


class ChatChoice:
    """Choice ``index`` of a chat reply; ``texts`` set when the request asked for logprobs."""

    def __init__(self, index: int, tools: ToolSetup | None, texts: Vocabulary | None) -> None:
        self.index, self.tools, self.texts = index, tools, texts
        self.parser = ToolCallParser(tools.fmt, tools.plan) if tools is not None else None
        self.sent_logprobs = 0
        self.made_calls = False

    # ----- streamed -----------------------------------------------------------------------------

    def deltas(self, out: RequestOutput) -> list[dict]:
        """The chunk choices for one output of this sample: its text or call pieces, then its finish."""
        pieces: list[dict] = []
        if self.parser is None:
            if out.delta:
                pieces.append({"content": out.delta})
        else:
            found = self.parser.feed(out.delta) if out.delta else []
            if out.finished:
                found += self.parser.finish()
            pieces += [self._delta(d) for d in found]
            pieces = [p for p in pieces if p]
        logprobs = self._logprobs(out)
        if logprobs is not None and not pieces:
            pieces.append({})
        choices = [self._choice(p, logprobs if i == 0 else None) for i, p in enumerate(pieces)]
        if out.finished:  # in a chunk of its own with an empty delta, as OpenAI sends it
            choices.append(self._choice({}, None, self._finish_reason(out)))
        return choices

    def _delta(self, d: Delta) -> dict:
        if isinstance(d, ContentDelta):
            return {"content": d.text}
        assert isinstance(d, CallDelta)
        self.made_calls = True
        if self.tools is not None and self.tools.legacy:
            if d.index > 0:  # the legacy API has one call a reply
                return {}
            call = {"arguments": d.arguments} if d.name is None else {"name": d.name, "arguments": d.arguments}
            return {"function_call": call}
        if d.name is not None:
            function = {"name": d.name, "arguments": d.arguments}
            return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function", "function": function}]}
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}

    def _choice(self, delta: dict, logprobs: dict | None, finish_reason: str | None = None) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, out: RequestOutput) -> dict | None:
        if self.texts is None:
            return None
        entries = new_logprobs(out, self.sent_logprobs)
        self.sent_logprobs += len(entries)
        return chat_logprobs(entries, self.texts) if entries else None

    # ----- whole --------------------------------------------------------------------------------

    def message(self, out: RequestOutput) -> dict:
        """The non-streamed choice of a finished sample."""
        message: dict = {"role": "assistant", "content": out.text}
        if self.parser is not None:
            text, calls = collect(self.parser.feed(out.text) + self.parser.finish())
            self.made_calls = bool(calls)
            message["content"] = text if text.strip() or not calls else None
            if calls and self.tools is not None and self.tools.legacy:
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            elif calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
        logprobs = chat_logprobs(new_logprobs(out, 0), self.texts) if self.texts is not None else None
        return {
            "index": self.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(out),
        }

    def _finish_reason(self, out: RequestOutput) -> str | None:
        if self.made_calls and out.finish_reason == "stop":
            return "function_call" if self.tools is not None and self.tools.legacy else "tool_calls"
        return out.finish_reason


class CompletionChoice:
    """Choice ``index`` of a text completion; ``texts`` set when the request asked for logprobs."""

    def __init__(self, index: int, texts: Vocabulary | None) -> None:
        self.index, self.texts = index, texts
        self.sent_logprobs = 0
        self.offset = 0  # characters of the reply the logprobs handed out so far cover

    def deltas(self, out: RequestOutput) -> list[dict]:
        logprobs = self._logprobs(out)
        choices = []
        if out.delta or logprobs is not None:
            choices.append(self._choice(out.delta, logprobs, None))
        if out.finished:  # in a chunk of its own, as OpenAI sends it
            choices.append(self._choice("", None, out.finish_reason))
        return choices

    def whole(self, out: RequestOutput) -> dict:
        return self._choice(out.text, self._logprobs(out), out.finish_reason)

    def _choice(self, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, out: RequestOutput) -> dict | None:
        if self.texts is None:
            return None
        entries = new_logprobs(out, self.sent_logprobs)
        self.sent_logprobs += len(entries)
        shaped = completion_logprobs(entries, self.texts, self.offset)
        self.offset += sum(len(t) for t in shaped["tokens"])
        return shaped

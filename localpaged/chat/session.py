"""Session: one conversation, stored in a ChatStore and answered by a shared engine (an EngineClient).

Each turn's prompt is the chat template over the system prompt and the whole stored
history plus the new user message, so turn N+1 starts with exactly the tokens of turns
1..N and the engine's prefix cache serves their KV blocks instead of recomputing them.

Nothing is lost: the user message is stored before generation starts, the reply is
stored at once as ``partial`` and saved as it grows, then marked ``complete`` (with
metrics), ``error`` (with the reason), or left ``partial`` when stopped; the engine's
finish reason is stored with it, so a reply cut off by a token limit says so later.

How long a reply may run: a call may pass SamplingParams, used as given. Without them a turn
uses the session's ``sampling`` (temperature, top_p, top_k, seed) and its ``max_tokens`` limit;
with no limit (the default) the reply runs until the model stops or the context is full, and
nothing beyond what the prompt needs is reserved. This differs on purpose from SamplingParams'
own default of 256 tokens, which is for ``LLM.generate``: a chat should not cut an answer short
unless the user asked it to. A chat may set its own temperature, top_p, top_k, max_tokens and seed
(``settings``, stored with the session, copied by a fork); each one it sets overrides the session's
``sampling``/``max_tokens`` (the app's defaults), and every turn, regenerate and continue use them.

A reply that stopped at a token limit can be continued (``continue_reply``): the same stored message
grows from the reply's own stored token ids, so the engine's prefix cache serves the whole prompt.

A local engine gets token ids (the chat template's, as the prefix cache keys them); a remote one
(``engine.info.capabilities.token_prompts`` False) gets the messages, counted through the server's
/tokenize where it has one, else sent as they are for the server to judge. There, continue sends the
reply so far as a final assistant message, on servers that can go on from one.

Tools: ``send``/``stream`` and their twins take ``tools`` (chat/tools.py: Python functions or MCP tools),
an ``approve`` callback and ``tool_choice``; ``stream_events``/``astream_events`` yield the turn's events
(text, calls, results: chat/tool_turn.py). Calls and results are stored messages (an assistant message's
``tool_calls``, role "tool" with its ``tool_call_id``), so every later prompt, fork, regenerate, export and
search sees them; the prompt renders them through the model's tool format (chat/tool_calls.py), the same
rendering every round, so a turn's rounds and later turns extend one prefix the engine's cache serves.

This module imports no torch at import time (the CLI exports sessions without a model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from contextlib import aclosing, closing, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localpaged.chat.reply_format import ReplyFormat, reply_format
from localpaged.chat.store import ChatStore, MessageRecord, SessionRecord
from localpaged.chat.tool_calls import (
    ContentDelta,
    Delta,
    ToolCallParser,
    ToolFormat,
    ToolPlan,
    call_schema,
    collect,
    detect_format,
    for_format,
    generic_round_schema,
    render,
    schema_constraint,
)
from localpaged.chat.tool_turn import (
    DENIED,
    MAX_ROUND_TOKENS,
    MAX_TOOL_ROUNDS,
    STOPPED,
    Approve,
    Ask,
    Emit,
    Generate,
    Run,
    Step,
    TextDelta,
    ToolCallEvent,
    ToolCallRequest,
    ToolResultEvent,
    TurnEvent,
    approval,
)
from localpaged.chat.tools import Tool, as_tools
from localpaged.engine.output import FINISH_REASONS
from localpaged.errors import ConfigError, RequestError, ToolError
from localpaged.sampling import MAX_TOKENS_LIMIT, SamplingParams
from localpaged.unicode_text import check_text

if TYPE_CHECKING:
    from localpaged.engine.output import RequestMetrics, RequestOutput
    from localpaged.engine.protocol import EngineClient, Prompt
    from localpaged.sampling import StructuredOutputs

log = logging.getLogger(__name__)

TITLE_CHARS = 50
SAVE_EVERY_S = 0.5  # a growing reply is written at most this often: crash safety without write storms


def title_from(text: str) -> str:
    """A one-line title of at most TITLE_CHARS characters from the first user message."""
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


class Session:
    """One conversation. Create with Session.new or Session.load, not the constructor."""

    def __init__(
        self,
        engine: EngineClient,
        store: ChatStore,
        record: SessionRecord,
        *,
        truncate: bool = False,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.id = record.id
        self.title = record.title or ""
        self.system = record.system
        self.prompt_name = record.prompt_name
        self.parent_id = record.parent_id
        # When True, turns too long for the context drop their oldest exchanges instead of failing.
        self.truncate = truncate
        # Turns without their own SamplingParams sample with these (its max_tokens is not used)...
        self.sampling = sampling if sampling is not None else SamplingParams()
        # ...and stop after max_tokens; None: until the model stops or the context is full.
        self.max_tokens = None if max_tokens is None else SamplingParams(max_tokens=max_tokens).max_tokens
        # This chat's own settings (CHAT_SETTINGS), stored with it; a missing one uses the two above.
        self.settings = _checked_settings(store.session_settings(record.id), strict=False)
        self.generating = False
        self.last_metrics: RequestMetrics | None = None
        self.last_reply: MessageRecord | None = None  # the assistant message of the latest turn
        self.warning: str | None = None  # set when the latest turn's prompt had to drop old turns
        self._request_id: str | None = None
        self._in_tool_turn = False  # between the rounds of a turn with tools (waiting on approve, a tool)
        self._stop_requested = False  # stop() during a turn with tools: no further round or call
        self._turn_prompt_tokens: int | None = 0  # the prompt of the reply in flight (None: its size is unknown)
        self._turn_generated = 0  # and the tokens it has generated so far

    @classmethod
    def new(
        cls,
        engine: EngineClient,
        store: ChatStore,
        system: str | None = None,
        title: str | None = None,
        prompt_name: str | None = None,
        *,
        truncate: bool = False,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> Session:
        """Start a stored, empty session; without a title, the first user message names it."""
        check_text("system", system, RequestError, optional=True)
        check_text("title", title, RequestError, optional=True)
        record = store.create_session(title=title, system=system, prompt_name=prompt_name, model=engine.info.model_name)
        return cls(engine, store, record, truncate=truncate, sampling=sampling, max_tokens=max_tokens)

    @classmethod
    def load(
        cls,
        engine: EngineClient,
        store: ChatStore,
        session_id: str,
        *,
        truncate: bool = False,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> Session:
        """Reopen a stored session; UnknownSessionError if there is none with that id."""
        record = store.get_session(session_id)
        return cls(engine, store, record, truncate=truncate, sampling=sampling, max_tokens=max_tokens)

    @property
    def history(self) -> list[MessageRecord]:
        """The stored user, assistant and tool messages, oldest first."""
        return [m for m in self.store.messages(self.id) if m.role in ("user", "assistant", "tool")]

    # ----- turns -----------------------------------------------------------------------

    def send(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        schema: object = None,
        response_format: object = None,
        tools: list[Any] | None = None,
        approve: Approve | None = None,
        tool_choice: str = "auto",
        max_tool_rounds: int = MAX_TOOL_ROUNDS,
    ) -> MessageRecord:
        """Send a user message and wait for the whole reply; returns the stored assistant message.

        schema (a JSON schema dict or a pydantic model class) or response_format (StructuredOutputs, or
        OpenAI's dict) constrains the reply; then it is a ParsedMessage whose ``parsed`` is the dict or
        the model's instance (reply_format.py).

        tools (Python functions, or Tools: chat/tools.py) may be called by the model: each call goes to
        ``approve(call, tool)`` ("once", "chat", "deny", or True/False; without it every call runs), runs,
        and its result goes back to the model, round after round, at most ``max_tool_rounds`` (then the
        model must answer in text). tool_choice ("auto", "required", "none", or a tool's name) holds the
        first round; later ones are "auto". Returns the turn's last assistant message, its answer.
        """
        form = reply_format(schema, response_format)
        if tools:
            for _ in self.stream_events(
                text, params, tools=tools, approve=approve, tool_choice=tool_choice, max_tool_rounds=max_tool_rounds
            ):
                pass
        else:
            for _ in self._reply(*self._begin_turn(text, params, form)):
                pass
        assert self.last_reply is not None
        return form.parse(self.last_reply)

    async def asend(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        schema: object = None,
        response_format: object = None,
        tools: list[Any] | None = None,
        approve: Approve | None = None,
        tool_choice: str = "auto",
        max_tool_rounds: int = MAX_TOOL_ROUNDS,
    ) -> MessageRecord:
        """The twin of send, in an event loop."""
        form = reply_format(schema, response_format)
        if tools:
            async for _ in self.astream_events(
                text, params, tools=tools, approve=approve, tool_choice=tool_choice, max_tool_rounds=max_tool_rounds
            ):
                pass
        else:
            async for _ in self._areply(*self._begin_turn(text, params, form)):
                pass
        assert self.last_reply is not None
        return form.parse(self.last_reply)

    def stream(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        schema: object = None,
        response_format: object = None,
        tools: list[Any] | None = None,
        approve: Approve | None = None,
        tool_choice: str = "auto",
        max_tool_rounds: int = MAX_TOOL_ROUNDS,
    ) -> Iterator[str]:
        """Send a user message and yield the reply's text as it is generated (blocking); schema and
        response_format constrain it as in send (``last_reply`` holds the text; send parses it). With
        tools, the text of every round (stream_events has the calls and results too)."""
        if tools:
            for event in self.stream_events(
                text, params, tools=tools, approve=approve, tool_choice=tool_choice, max_tool_rounds=max_tool_rounds
            ):
                if isinstance(event, TextDelta):
                    yield event.text
            return
        prompt, params = self._begin_turn(text, params, reply_format(schema, response_format))
        yield from self._reply(prompt, params)

    async def astream(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        schema: object = None,
        response_format: object = None,
        tools: list[Any] | None = None,
        approve: Approve | None = None,
        tool_choice: str = "auto",
        max_tool_rounds: int = MAX_TOOL_ROUNDS,
    ) -> AsyncIterator[str]:
        """Send a user message and yield the reply's text as it is generated (in an event loop)."""
        if tools:
            async for event in self.astream_events(
                text, params, tools=tools, approve=approve, tool_choice=tool_choice, max_tool_rounds=max_tool_rounds
            ):
                if isinstance(event, TextDelta):
                    yield event.text
            return
        prompt, params = self._begin_turn(text, params, reply_format(schema, response_format))
        async for delta in self._areply(prompt, params):
            yield delta

    def stream_events(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        tools: list[Any],
        approve: Approve | None = None,
        tool_choice: str = "auto",
        max_tool_rounds: int = MAX_TOOL_ROUNDS,
    ) -> Iterator[TurnEvent]:
        """A turn with tools as its events: TextDelta, ToolCallEvent, ToolResultEvent (blocking); see send."""
        body = self._tool_turn(text, params, as_tools(tools), tool_choice, max_tool_rounds)
        answer: Any = None
        with closing(body):
            while True:
                try:
                    step = body.send(answer)
                except StopIteration:
                    return
                answer = None
                if isinstance(step, Emit):
                    yield step.event
                elif isinstance(step, Generate):
                    for delta in self._reply(step.prompt, step.params, parser=step.parser):
                        yield TextDelta(delta)
                    answer = self.last_reply
                elif isinstance(step, Ask):
                    answer = "once" if approve is None else approve(step.call, step.tool)
                    if inspect.isawaitable(answer):
                        answer = asyncio.run(_awaited(answer))
                    answer = approval(answer)
                else:
                    answer = asyncio.run(_run_tool(step))

    async def astream_events(
        self,
        text: str,
        params: SamplingParams | None = None,
        *,
        tools: list[Any],
        approve: Approve | None = None,
        tool_choice: str = "auto",
        max_tool_rounds: int = MAX_TOOL_ROUNDS,
    ) -> AsyncIterator[TurnEvent]:
        """The twin of stream_events, in an event loop: the same body, its steps awaited."""
        body = self._tool_turn(text, params, as_tools(tools), tool_choice, max_tool_rounds)
        answer: Any = None
        with closing(body):
            while True:
                try:
                    step = body.send(answer)
                except StopIteration:
                    return
                answer = None
                if isinstance(step, Emit):
                    yield step.event
                elif isinstance(step, Generate):
                    async for delta in self._areply(step.prompt, step.params, parser=step.parser):
                        yield TextDelta(delta)
                    answer = self.last_reply
                elif isinstance(step, Ask):
                    answer = "once" if approve is None else approve(step.call, step.tool)
                    if inspect.isawaitable(answer):
                        answer = await answer
                    answer = approval(answer)
                else:
                    answer = await _run_tool(step)

    def regenerate(self, params: SamplingParams | None = None) -> MessageRecord:
        """Replace the last assistant reply with a new one; returns it."""
        prompt, params = self._begin_regenerate(params)
        for _ in self._reply(prompt, params):
            pass
        assert self.last_reply is not None
        return self.last_reply

    async def aregenerate(self, params: SamplingParams | None = None) -> AsyncIterator[str]:
        """Replace the last assistant reply, yielding the new one's text as it is generated."""
        prompt, params = self._begin_regenerate(params)
        async for delta in self._areply(prompt, params):
            yield delta

    def continue_reply(self, params: SamplingParams | None = None) -> MessageRecord:
        """Let the last reply, cut off by a token limit, go on where it stopped; returns the same message, grown.

        The prompt is the turn's prompt plus the reply's own token ids, without an end-of-turn token, so
        the engine's prefix cache serves all of it but the last, partly filled block.
        """
        prompt, params, message = self._begin_continue(params)
        for _ in self._reply(prompt, params, message):
            pass
        assert self.last_reply is not None
        return self.last_reply

    async def acontinue_reply(self, params: SamplingParams | None = None) -> AsyncIterator[str]:
        """The twin of continue_reply, yielding the new text as it is generated."""
        prompt, params, message = self._begin_continue(params)
        async for delta in self._areply(prompt, params, message):
            yield delta

    def continuable(self) -> MessageRecord | None:
        """The last reply if it can be continued: it ended on a token limit, the context has room, the
        engine can go on from it (a local one needs the reply's stored token ids), and nothing follows
        it; else None."""
        history = self.history
        if not history or history[-1].role != "assistant":
            return None
        reply = history[-1]
        if reply.status != "complete" or reply.finish_reason != "length":
            return None
        if filled_context(reply, self.engine.info.max_model_len):
            return None  # the context is full
        capabilities = self.engine.info.capabilities
        if not capabilities.continue_reply:
            return None  # a remote server that cannot go on from a partial reply
        if capabilities.token_prompts and self.store.token_ids(reply.id) is None:
            return None  # the reply's tokens are unknown (an older reply, or one from a remote engine)
        return reply

    def reply_sampling(self) -> tuple[SamplingParams, int | None]:
        """What a turn without its own params uses: the app's sampling and limit, with this chat's settings on top."""
        own = {k: v for k, v in self.settings.items() if k in CHAT_SETTINGS and k != "max_tokens"}
        return dataclasses.replace(self.sampling, **own), self.settings.get("max_tokens", self.max_tokens)

    def set_settings(self, settings: dict) -> None:
        """Store this chat's own settings (CHAT_SETTINGS; None: the app's default); ConfigError if one is bad.
        Its tool choices (TOOL_SETTINGS) stay unless ``settings`` names them."""
        kept = {k: v for k, v in self.settings.items() if k in TOOL_SETTINGS}
        checked = checked_settings({**kept, **settings})
        self.store.set_session_settings(self.id, checked)
        self.settings = checked

    async def stop(self) -> None:
        """Abort the reply in flight, if any; what it said so far stays stored as ``partial``. In a turn
        with tools, no further call runs and no further round starts."""
        if self._in_tool_turn:
            self._stop_requested = True
        request_id = self._request_id
        if request_id is None:
            return
        try:
            await self.engine.abort(request_id)
        except RequestError:
            pass  # it finished on its own meanwhile: nothing left to stop

    # ----- branching -------------------------------------------------------------------

    def fork(self, at: int) -> Session:
        """A new session holding this one's history up to and including message `at`.

        Its prompts start with the same tokens, so its KV blocks come from the prefix cache.
        """
        return self._sibling(self.store.fork_session(self.id, at))

    def fork_before(self, message_id: int) -> Session:
        """A new session holding the history strictly before `message_id` (to edit and resend it)."""
        ids = [m.id for m in self.history]
        if message_id not in ids:
            raise RequestError(f"message {message_id} is not part of session {self.id}; pick one from its history")
        index = ids.index(message_id)
        if index > 0:
            return self.fork(ids[index - 1])
        record = self.store.create_session(
            title=f"{self.title} (fork)" if self.title else None,
            system=self.system,
            prompt_name=self.prompt_name,
            model=self.engine.info.model_name,
            parent_id=self.id,
        )
        return self._sibling(record)

    def with_system(self, system: str | None) -> Session:
        """This chat under another system prompt (None or "": none).

        With messages, a fork holding the whole history under the new prompt: every cached block
        and every reply after the system prompt depend on it, so the original chat stays as it was.
        A chat with no messages yet is simply changed, and returned.
        """
        check_text("system prompt", system, RequestError, optional=True)
        system = system or None
        self._check_idle()
        history = self.history
        if not history:
            self.store.set_session_system(self.id, system)
            self.system, self.prompt_name = system, None
            return self
        return self._sibling(self.store.fork_session(self.id, history[-1].id, system=system))

    def _sibling(self, record: SessionRecord) -> Session:
        """A session for ``record`` with this one's engine, store and reply settings."""
        return Session(
            self.engine,
            self.store,
            record,
            truncate=self.truncate,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
        )

    # ----- housekeeping ----------------------------------------------------------------

    def engine_messages(self) -> list[dict]:
        """The stored chat as the model reads it (``chat_messages``, tool turns in the model's tool format):
        what the next turn's prompt starts from."""
        return render(chat_messages(self.system, self.history), None, self.tool_format())[0]

    def tool_format(self) -> ToolFormat:
        """How this engine's model reads tools and writes calls: its chat template's format for a local
        engine; for a remote one the generic format, whose prompts and JSON-schema replies every server takes."""
        if not self.engine.info.capabilities.token_prompts:
            return "generic"
        vocabulary = self.engine.vocabulary()
        return detect_format(vocabulary.chat_template if vocabulary is not None else None)

    @property
    def tools_chosen(self) -> list[str]:
        """The keys of the tools this chat may use (Tool.key), stored with it; [] by default."""
        return list(self.settings.get("tools", []))

    def set_tools(self, keys: list[str]) -> None:
        """Store which tools (by Tool.key) this chat may use; those allowed "for this chat" stay allowed."""
        self._set_setting("tools", list(dict.fromkeys(keys)) or None)

    def _allow_for_chat(self, key: str) -> None:
        allowed = self.settings.get("tools_allowed", [])
        if key not in allowed:
            self._set_setting("tools_allowed", [*allowed, key])

    def _set_setting(self, name: str, value: object) -> None:
        settings = {**self.settings, name: value}
        checked = checked_settings(settings)
        self.store.set_session_settings(self.id, checked)
        self.settings = checked

    def context_tokens(self) -> int:
        """How many tokens the next turn's prompt uses before the new message: template over the history."""
        messages = self.engine_messages()
        return len(self.engine.encode_chat(messages)) if messages else 0

    @property
    def live_context_tokens(self) -> int | None:
        """What the model sees for the reply in flight: its whole prompt (system prompt, history, the new
        message) plus the reply so far, in tokens; None when no reply is in flight."""
        if not self.generating or self._turn_prompt_tokens is None:
            return None
        return self._turn_prompt_tokens + self._turn_generated

    def rename(self, title: str) -> None:
        check_text("title", title, RequestError)
        self.store.rename_session(self.id, title)
        self.title = title

    def delete(self) -> None:
        self.store.delete_session(self.id)

    def export_markdown(self) -> str:
        return export_markdown(self.store.get_session(self.id), self.history)

    # ----- internals -------------------------------------------------------------------

    def _begin_turn(
        self,
        text: str,
        params: SamplingParams | None,
        form: ReplyFormat,
        plan: ToolPlan | None = None,
        grammar: StructuredOutputs | None = None,
    ) -> tuple[_Prompt, SamplingParams]:
        """Check the turn fits, then store the user message (before any generation); the prompt ids and params.

        plan and grammar: the first round's tools (served) and the constraint they hold the reply to."""
        self._check_idle()
        check_text("message", text, RequestError)
        if not text.strip():
            raise RequestError("the message is empty; type something to send")
        turns = _replayable(self.history) + [{"role": "user", "content": text}]
        prompt, params = self._fit(turns, params, plan=plan)
        params = _constrained(params, form.structured or grammar)
        self.store.add_message(self.id, "user", text)
        if not self.title:
            self.rename(title_from(text))
        return prompt, params

    def _begin_regenerate(self, params: SamplingParams | None) -> tuple[_Prompt, SamplingParams]:
        """Drop everything after the last user message; the prompt ids (and params) that answer it again."""
        self._check_idle()
        history = self.history
        users = [i for i, m in enumerate(history) if m.role == "user"]
        if not users:
            raise RequestError(f"session {self.id} has no user message to answer again; send one first")
        last_user = users[-1]
        prompt, params = self._fit(_replayable(history[: last_user + 1]), params)
        self.store.delete_messages_after(self.id, history[last_user].id)
        return prompt, params

    def _begin_continue(self, params: SamplingParams | None) -> tuple[_Prompt, SamplingParams, MessageRecord]:
        """The prompt (the turn's prompt + the reply so far), params and message of a continue."""
        self._check_idle()
        reply = self.continuable()
        if reply is None:
            raise RequestError(
                f"session {self.id}: only a last reply that stopped at a token limit, with room left in the "
                "context, can be continued; send a new message or regenerate instead"
            )
        history = self.history
        turns = _replayable(history[:-1])
        prompt, params = self._fit(turns, params, reply)
        return prompt, params, reply

    def _tool_turn(
        self, text: str, params: SamplingParams | None, tools: list[Tool], choice: str, max_rounds: int
    ) -> Generator[Step, Any, None]:
        """The one body of a turn with tools (chat/tool_turn.py): the rounds of replies, calls and results."""
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ConfigError(f"max_tool_rounds={max_rounds!r}: use a whole number of rounds, at least 1")
        capabilities = self.engine.info.capabilities
        if not capabilities.tools:
            raise RequestError(f"this engine takes no tools: {capabilities.why_off('tools')}; send without tools=")
        by_name = {tool.name: tool for tool in tools}
        fmt = self.tool_format()
        prompt_plan, parse_plan, grammar = self._round(tools, choice, fmt)
        prompt, round_params = self._begin_turn(text, params, reply_format(None, None), prompt_plan, grammar)
        # With no limit of the user's, a round stops at MAX_ROUND_TOKENS: a small model's JSON string (a call's
        # argument, an answer) may otherwise run on until the context is full.
        unbounded = params is None and self.reply_sampling()[1] is None
        round_params = _bounded(round_params) if unbounded else round_params
        self._in_tool_turn, self._stop_requested = True, False
        allowed = set(self.settings.get("tools_allowed", []))
        made: dict[tuple[str, str], str] = {}  # this turn's calls (tool, arguments) and what they returned
        last = False
        try:
            for round_ in range(1, max_rounds + 2):
                parser = ToolCallParser(fmt, parse_plan) if parse_plan is not None else None
                record = yield Generate(prompt, round_params, parser)
                calls = [
                    ToolCallRequest(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in record.calls
                ]
                if not calls or last:  # the answer round's grammar admits no call: an engine that ignored it
                    return
                # A small model given a result often makes the same call again: it is answered with the
                # first one's result (not asked about, not run again), and the model must answer next.
                repeats = all(_call_key(call) in made for call in calls)
                pending = list(calls)
                try:
                    for call in calls:
                        yield Emit(ToolCallEvent(call, record.id))
                    while pending:
                        call = pending[0]
                        if _call_key(call) in made:
                            content, error = made[_call_key(call)], None
                        else:
                            content, error = yield from self._settle(call, by_name.get(call.name), allowed)
                            if error is None:
                                made[_call_key(call)] = content
                        status = "error" if error else "complete"
                        stored = self.store.add_message(
                            self.id, "tool", content, status=status, error=error, tool_call_id=call.id
                        )
                        pending.pop(0)
                        yield Emit(ToolResultEvent(call, content, error, stored.id))
                finally:  # stopped, failed or abandoned midway: every call still gets its answer stored
                    for call in pending:
                        self.store.add_message(
                            self.id, "tool", STOPPED, status="error", error="stopped", tool_call_id=call.id
                        )
                if self._stop_requested:
                    return
                last = repeats or round_ >= max_rounds
                prompt_plan, parse_plan, grammar = self._round(tools, "none" if last else "auto", fmt)
                prompt, round_params = self._fit(_replayable(self.history), params, plan=prompt_plan)
                round_params = _constrained(round_params, grammar)
                round_params = _bounded(round_params) if unbounded else round_params
        finally:
            self._in_tool_turn = False

    def _round(
        self, tools: list[Tool], choice: str, fmt: ToolFormat
    ) -> tuple[ToolPlan, ToolPlan | None, StructuredOutputs | None]:
        """A round's (prompt plan, plan its reply is read by or None, grammar). The prompt describes the
        tools as "auto" does in every round, so that all the turn's rounds (and later turns) share one
        prefix; the choice only narrows the grammar. A local engine gets it as EBNF, a remote one as the
        JSON schema."""
        ebnf = self.engine.info.capabilities.token_prompts
        auto = for_format(_tool_plan(tools, "auto"), fmt)
        plan = for_format(_tool_plan(tools, choice), fmt)
        if fmt == "generic":
            return auto, auto, schema_constraint(generic_round_schema(auto, plan.choice, plan.name), ebnf=ebnf)
        if plan.choice == "none":
            return auto, None, None
        schema = call_schema(plan, fmt)
        return auto, plan, schema_constraint(schema, ebnf=ebnf) if schema is not None else None

    def _settle(
        self, call: ToolCallRequest, tool: Tool | None, allowed: set[str]
    ) -> Generator[Step, Any, tuple[str, str | None]]:
        """A call's (content, error): refused, asked about, run; the model reads content either way."""
        if tool is None:
            return f"There is no tool named {call.name!r}.", "unknown tool"
        if tool.key not in allowed:
            if self._stop_requested:
                return STOPPED, "stopped"
            decision = yield Ask(call, tool)
            if decision == "deny":
                return DENIED, "denied"
            if decision == "chat":
                allowed.add(tool.key)
                self._allow_for_chat(tool.key)
        if self._stop_requested:
            return STOPPED, "stopped"
        return (yield Run(call, tool))

    def _check_idle(self) -> None:
        if self.generating or self._in_tool_turn:
            raise RequestError(f"session {self.id} is already generating a reply; wait for it or stop() it first")

    def _fit(
        self,
        turns: list[dict],
        params: SamplingParams | None,
        continuing: MessageRecord | None = None,
        plan: ToolPlan | None = None,
    ) -> tuple[_Prompt, SamplingParams]:
        """The prompt for system + turns within max_model_len, and the SamplingParams of the reply.

        Room is left for the reply's max_tokens: the params' own if given, else the session's limit;
        with no limit, only the prompt must fit (and one token of reply), and the reply may use all
        the context left. Too long: a RequestError that says by how much, or with truncate=True, drop
        the oldest user/assistant exchanges (never the system prompt or the newest message). A reply
        being continued follows the turns. A prompt whose size cannot be known here (a remote server
        without /tokenize) is sent as it is, for the server to judge.
        """
        limit = self.engine.info.max_model_len
        sampling, default_max = self.reply_sampling()
        max_tokens = params.max_tokens if params is not None else default_max
        room = max_tokens if max_tokens is not None else 1
        dropped = 0
        while True:
            prompt = self._prompt(_with_system(self.system, turns), continuing, plan)
            if prompt.size is None or limit is None:
                break
            over = prompt.size + room - limit
            if over <= 0:
                break
            if not self.truncate or len(turns) <= 1:
                if max_tokens is None:
                    size = f"the prompt has {prompt.size} tokens, {over} over the limit of {limit} (with one to reply)."
                else:
                    size = (
                        f"the prompt has {prompt.size} tokens and max_tokens is {max_tokens}, "
                        f"{over} tokens over the limit of {limit}."
                    )
                raise RequestError(
                    f"the conversation is too long for the model's context: {size} "
                    + (
                        "Even the newest message alone does not fit: shorten it"
                        + (" or lower max_tokens." if max_tokens is not None else ".")
                        if self.truncate
                        else "Start a new session, fork an earlier message, "
                        + ("lower max_tokens, " if max_tokens is not None else "")
                        + "or let the oldest turns drop (truncate=True in Python, --truncate for localpaged run)."
                    )
                )
            turns = _drop_oldest_exchange(turns)
            dropped += 1
        self.warning = None
        if dropped:
            self.warning = (
                f"the conversation outgrew the model's context of {limit} tokens: the oldest {dropped} "
                "exchange(s) were left out of this turn's prompt (they stay stored)"
            )
            log.warning("session %s: %s", self.id, self.warning)
        if params is None:
            if max_tokens is None:  # the context left; where that is unknown, no limit (the server's own)
                known = limit is not None and prompt.size is not None
                max_tokens = limit - prompt.size if known else limit or MAX_TOKENS_LIMIT
            params = dataclasses.replace(sampling, max_tokens=max_tokens)
        return prompt, params

    def _prompt(self, messages: list[dict], continuing: MessageRecord | None, plan: ToolPlan | None = None) -> _Prompt:
        """What the engine gets for ``messages`` (and a reply being continued), and its size in tokens.

        A local engine takes token ids: the template's, then the continued reply's own stored ids (its
        text re-encoded might not give them back, and the prefix cache keys the ids). A remote one takes
        the messages, a continued reply as the final assistant message, counted by the server if it can.
        Tools (``plan``) and tool turns are rendered in the model's tool format first (tool_calls.render).
        """
        engine = self.engine
        messages, definitions = render(messages, plan, self.tool_format())
        if engine.info.capabilities.token_prompts:
            ids = engine.encode_chat(messages, definitions)
            ids += (self.store.token_ids(continuing.id) or []) if continuing else []
            return _Prompt(ids, len(ids))
        size = len(engine.encode_chat(messages, definitions)) if engine.info.capabilities.tokenize else None
        if continuing is not None:
            messages = messages + [{"role": "assistant", "content": continuing.content}]
            size = None if size is None else size + (continuing.completion_tokens or 0)
        return _Prompt(messages, size)

    def _reply(
        self,
        prompt: _Prompt,
        params: SamplingParams,
        continuing: MessageRecord | None = None,
        parser: ToolCallParser | None = None,
    ) -> Iterator[str]:
        with (
            self._replying(prompt, continuing, parser) as take,
            closing(self.engine.iter_stream(prompt.value, params, self._request_id)) as outputs,
        ):
            for output in outputs:
                if delta := take(output):
                    yield delta

    async def _areply(
        self,
        prompt: _Prompt,
        params: SamplingParams,
        continuing: MessageRecord | None = None,
        parser: ToolCallParser | None = None,
    ) -> AsyncIterator[str]:
        """The twin of _reply: the same body, driven by ``async for``."""
        with self._replying(prompt, continuing, parser) as take:
            async with aclosing(self.engine.stream(prompt.value, params, self._request_id)) as outputs:
                async for output in outputs:
                    if delta := take(output):
                        yield delta

    @contextmanager
    def _replying(
        self, prompt: _Prompt, continuing: MessageRecord | None = None, parser: ToolCallParser | None = None
    ) -> Iterator[Callable[[RequestOutput], str]]:
        """Store the reply as it streams: yields ``take(output) -> delta``; the end stores its status.

        An exception (the engine died, a bad request) is stored as ``error`` with its message; leaving
        early (stop, break, close) keeps what was said as ``partial``. ``parser``: a reply that may call
        tools, read into its text (the deltas) and its calls (stored with it).
        """
        keep_ids = self.engine.info.capabilities.token_prompts and parser is None  # a tool reply is not continued
        recorder = _ReplyRecorder(
            self.store, self.id, self.engine.info.model_name, continuing, keep_ids=keep_ids, parser=parser
        )
        self.generating = True
        self._request_id = f"{self.id}-{recorder.message.id}" + (f"-c{recorder.base_tokens}" if continuing else "")
        self._turn_prompt_tokens = None if prompt.size is None else prompt.size - recorder.base_tokens
        self._turn_generated = recorder.base_tokens

        def take(output: RequestOutput) -> str:
            delta = recorder.update(output)
            self.last_metrics = output.metrics
            self._turn_generated = output.metrics.generated_tokens + recorder.base_tokens
            return delta

        error: BaseException | None = None
        try:
            yield take
        except Exception as exc:
            error = exc
            raise
        finally:
            try:
                self.last_reply = recorder.finish(error)
            finally:
                self.generating = False
                self._request_id = None


@dataclass(frozen=True)
class _Prompt:
    """A turn's prompt as the engine takes it (token ids or messages), and its size in tokens."""

    value: Prompt
    size: int | None  # None: unknown here (a remote server without /tokenize)


class _ReplyRecorder:
    """Keeps the stored assistant message in step with a streaming reply.

    keep_ids: store the reply's token ids (for a local continue); a remote engine sends none.
    parser: the reply may call tools: its text is what the parser reads as content, its calls are stored.
    """

    def __init__(
        self,
        store: ChatStore,
        session_id: str,
        model: str,
        continuing: MessageRecord | None = None,
        *,
        keep_ids: bool = True,
        parser: ToolCallParser | None = None,
    ) -> None:
        self.store = store
        self.keep_ids = keep_ids
        self.parser = parser
        self.parsed: list[Delta] = []
        # A continued reply grows the stored message: its text and token ids so far come first.
        self.base_text = continuing.content if continuing is not None else ""
        self.base_ids = (store.token_ids(continuing.id) or []) if continuing is not None and keep_ids else []
        # How many tokens it had: its ids, or (remote) the count the server reported.
        self.base_tokens = len(self.base_ids) if keep_ids or continuing is None else continuing.completion_tokens or 0
        if continuing is None:
            self.message = store.add_message(session_id, "assistant", "", status="partial", model=model)
        else:
            self.message = continuing
            store.update_message(continuing.id, status="partial")
        self.output: RequestOutput | None = None
        self._saved_at = time.monotonic()

    def update(self, output: RequestOutput) -> str:
        """Remember the newest output; write its text if the last write is SAVE_EVERY_S old. Returns the
        new text: the output's delta, or what the parser read as content in it."""
        self.output = output
        delta = output.delta
        if self.parser is not None:
            found = self.parser.feed(output.delta) if output.delta else []
            if output.finished:
                found += self.parser.finish()
            self.parsed += found
            delta = "".join(d.text for d in found if isinstance(d, ContentDelta))
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self.store.update_message(self.message.id, content=self.text())
            self._saved_at = time.monotonic()
        return delta

    def text(self) -> str:
        if self.parser is not None:
            return self.base_text + collect(self.parsed)[0]
        return self.base_text + (self.output.text if self.output is not None else "")

    def finish(self, error: BaseException | None) -> MessageRecord:
        """Write the final text, status and metrics; returns the stored message."""
        output = self.output
        if error is not None:
            status = "error"
        elif output is not None and output.finished and output.finish_reason != "abort":
            status = "complete"
        else:
            status = "partial"  # stopped, aborted, or the consumer walked away
        if error is not None:
            reason = "error"
        elif output is not None and output.finished and output.finish_reason in FINISH_REASONS:
            reason = output.finish_reason
        else:
            reason = "abort"
        metrics = {}
        if output is not None:
            m = output.metrics
            metrics = {  # of the whole reply: a continue's prompt holds the reply's first part
                "prompt_tokens": max(m.prompt_tokens - self.base_tokens, 0),
                "cached_tokens": m.cached_tokens,
                "completion_tokens": m.generated_tokens + self.base_tokens,
                "ttft_s": m.ttft_s,
                "tokens_per_s": m.decode_tokens_per_s,
            }
        calls = collect(self.parsed)[1] if status == "complete" and reason == "stop" else []
        text = self.text()
        self.store.update_message(
            self.message.id,
            content=text if text.strip() or not calls else "",
            tool_calls=[
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
            or None,
            status=status,
            error=(str(error) or type(error).__name__) if error is not None else None,
            finish_reason=reason,
            **metrics,
        )
        if output is not None and self.keep_ids:
            self.store.set_token_ids(self.message.id, self.base_ids + list(output.token_ids))
        return self.store.get_message(self.message.id)


def limit_note(message: object, max_model_len: int | None = None) -> str:
    """'stopped at 40 tokens' for a reply that ended on a token limit, else "".

    Given the model's context length, a reply that filled it says so instead ('stopped: the context
    of 8192 tokens is full'): a longer limit or continue would not help there, a new chat or a fork
    would. The one wording of it, for the app's message header, `run`, `sessions show` and the export.
    """
    if getattr(message, "finish_reason", None) != "length":
        return ""
    if filled_context(message, max_model_len):
        return f"stopped: the context of {max_model_len} tokens is full"
    tokens = getattr(message, "completion_tokens", None)
    return f"stopped at {tokens} tokens" if tokens is not None else "stopped at the token limit"


def filled_context(message: object, max_model_len: int | None) -> bool:
    """True when a reply's prompt and its tokens took the whole context: nothing can continue it.
    False where the context length is unknown (a remote server that does not say)."""
    prompt, tokens = getattr(message, "prompt_tokens", None), getattr(message, "completion_tokens", None)
    return None not in (max_model_len, prompt, tokens) and prompt + tokens >= max_model_len


CHAT_SETTINGS = ("temperature", "top_p", "top_k", "max_tokens", "seed")  # what a chat may set for itself
# ...and the tools it may use and those the user allowed for the whole chat (lists of Tool.key)
TOOL_SETTINGS = ("tools", "tools_allowed")


def checked_settings(settings: dict) -> dict:
    """The non-None CHAT_SETTINGS of ``settings`` as SamplingParams reads them; ConfigError for a bad one."""
    return _checked_settings(settings, strict=True)


def settings_summary(settings: dict) -> str:
    """A chat's own settings in a few words for its title line ("temp 0.3, max 40 tokens"); "" when it has none."""
    words = {"temperature": "temp {}", "top_p": "top-p {}", "top_k": "top-k {}", "max_tokens": "max {} tokens"}
    words["seed"] = "seed {}"
    parts = [words[name].format(settings[name]) for name in CHAT_SETTINGS if settings.get(name) is not None]
    if settings.get("tools"):
        parts.append("tools " + " ".join(key.rpartition("/")[2] for key in settings["tools"]))
    return ", ".join(parts)


def _checked_settings(settings: dict, *, strict: bool) -> dict:
    """The non-None CHAT_SETTINGS of ``settings``, each checked by SamplingParams.

    strict: a bad value or unknown name raises ConfigError (the user is typing them); else it is
    dropped, so a hand-edited database never stops a chat from opening.
    """
    kept = {}
    for name, value in settings.items():
        if value is None:
            continue
        if name in TOOL_SETTINGS:
            if isinstance(value, list) and all(isinstance(key, str) and key for key in value):
                kept[name] = value
            elif strict:
                raise ConfigError(f"{name}: a list of tool keys (SERVER/TOOL), e.g. ['files/read_file']")
            continue
        if name not in CHAT_SETTINGS:
            if strict:
                raise ConfigError(f"{name}: not a chat setting; use any of {', '.join(CHAT_SETTINGS + TOOL_SETTINGS)}")
            continue
        try:
            kept[name] = getattr(SamplingParams(**{name: value}), name)
        except ConfigError:
            if strict:
                raise
    return kept


def chat_messages(system: str | None, history: list[MessageRecord]) -> list[dict]:
    """What the model reads of a stored chat: the system prompt, then ``_replayable(history)``.

    The one answer to that question: Session's prompts, and the app's context count, KV-map highlight
    and disk prefetch, all come from here, so they count and warm the very prompt that is sent.
    """
    return _with_system(system, _replayable(history))


def _with_system(system: str | None, turns: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + turns


def _parsed(calls: list[dict]) -> list[dict]:
    """Calls with their arguments as JSON objects, as the chat templates take them (vLLM and our server
    parse them too); arguments that are not a JSON object stay text."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            call = {**call, "function": {**call["function"], "arguments": arguments}}
        out.append(call)
    return out


def _constrained(params: SamplingParams, structured: StructuredOutputs | None) -> SamplingParams:
    """``params`` held to ``structured`` (a schema's or the tools'); ConfigError if they carry another one."""
    if structured is None:
        return params
    if params.structured not in (None, structured):
        raise ConfigError("the params carry a structured constraint of their own; pass it once, in params or schema=")
    return dataclasses.replace(params, structured=structured)


def _tool_plan(tools: list[Tool], choice: str) -> ToolPlan:
    """The plan of a round: the tools' definitions and the choice ("auto", "required", "none", a tool's name)."""
    definitions = [tool.definition() for tool in tools]
    if choice in ("auto", "required", "none"):
        return ToolPlan(definitions, choice)  # type: ignore[arg-type]
    if any(tool.name == choice for tool in tools):
        return ToolPlan(definitions, "named", name=choice)
    names = ", ".join(tool.name for tool in tools)
    raise ConfigError(f"tool_choice={choice!r}: use auto, required, none, or the name of one of the tools ({names})")


def _bounded(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, MAX_ROUND_TOKENS))


def _call_key(call: ToolCallRequest) -> tuple[str, str]:
    """A call's tool and arguments, the arguments' JSON normalised, so that one call made twice is seen."""
    try:
        arguments = json.dumps(json.loads(call.arguments), sort_keys=True)
    except ValueError:
        arguments = call.arguments
    return call.name, arguments


async def _awaited(value: Any) -> Any:
    return await value


async def _run_tool(step: Run) -> tuple[str, str | None]:
    """A Run step's (content, error): the tool's cleaned result, or its error as the model reads it."""
    try:
        return await step.tool.acall(step.call.arguments), None
    except ToolError as exc:
        return f"Error: {exc}", str(exc)


def _replayable(history: list[MessageRecord]) -> list[dict]:
    """The messages a prompt replays: user messages, assistant text that was stored complete or partial
    (a reply that ended in an error is shown to the user but never sent to the model), and tool rounds as
    OpenAI has them: an assistant's ``tool_calls``, then a "tool" message with each one's result. A call
    without its result (a fork cut between them) is left out, as is a result without its call."""
    answered = {m.tool_call_id for m in history if m.role == "tool"}
    names: dict[str, str] = {}
    out: list[dict] = []
    for m in history:
        if m.role == "user":
            out.append({"role": "user", "content": m.content})
        elif m.role == "tool":
            if m.tool_call_id in names:
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "name": names[m.tool_call_id]})
                out[-1]["content"] = m.content
        elif m.status in ("complete", "partial"):
            calls = [c for c in m.calls if c["id"] in answered]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            if calls:
                out.append({"role": "assistant", "content": m.content or None, "tool_calls": _parsed(calls)})
            elif m.content:
                out.append({"role": "assistant", "content": m.content})
    return out


def _drop_oldest_exchange(turns: list[dict]) -> list[dict]:
    """Drop the first message and the replies that follow it, keeping at least the newest message."""
    rest = 1
    while rest < len(turns) - 1 and turns[rest]["role"] != "user":
        rest += 1
    return turns[rest:]


# A line of message text that reads like one of the export's own turn headings.
_TURN_HEADING = re.compile(r"^(\s{0,3}#{1,6}\s*(?:user|assistant|system|tool)\b)", re.IGNORECASE | re.MULTILINE)


def _unambiguous(text: str) -> str:
    """Message text whose heading-like lines are escaped (``\\## Assistant``), so no message can forge a turn."""
    return _TURN_HEADING.sub(r"\\\1", text)


def export_markdown(session: SessionRecord, messages: list[MessageRecord]) -> str:
    """The conversation as Markdown: title, system prompt, then each message under its role.

    The only ``## User`` / ``## Assistant`` / ``## System`` headings are the export's own: such lines
    inside a message are escaped, and the title is kept to one line.
    """
    title = " ".join((session.title or "Untitled session").split())
    lines = [f"# {title}", "", f"Session `{session.id}`"]
    if session.model:
        lines[-1] += f", model `{session.model}`"
    if session.system:
        lines += ["", "## System", "", _unambiguous(session.system)]
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.calls}
    for m in messages:
        if m.role == "tool":
            outcome = f" (error: {m.error})" if m.status == "error" else ""
            lines += ["", f"## Tool result: {names.get(m.tool_call_id or '', 'unknown call')}{outcome}", ""]
            lines.append(_fenced(m.content, "text"))
            continue
        if m.role not in ("user", "assistant"):
            continue
        heading = "## User" if m.role == "user" else "## Assistant"
        if m.status == "partial":
            heading += " (partial)"
        elif m.status == "error":
            heading += f" (error: {m.error})"
        elif note := limit_note(m):
            heading += f" ({note})"
        lines += ["", heading]
        if m.content or not m.calls:
            lines += ["", _unambiguous(m.content)]
        for call in m.calls:
            lines += [
                "",
                f"Tool call `{call['function']['name']}`:",
                "",
                _fenced(_pretty(call["function"]["arguments"]), "json"),
            ]
    return "\n".join(lines) + "\n"


def _pretty(arguments: str) -> str:
    """A call's arguments indented for reading; as they are where they are not JSON."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        return arguments


def _fenced(text: str, language: str) -> str:
    """``text`` in a code fence longer than any backtick run inside it, so no text can close it early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"

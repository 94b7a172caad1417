"""Tools in a Session: Python-function tools, MCP servers through the SDK, the approve/deny/stop rounds, and
the calls and results stored, replayed, forked, exported and searched.

The rounds run on the FakeLLM (its tokenizer has no chat template: the generic format), whose scripted
replies call a tool until the prompt holds a tool result; MCP tests start tests/mcp_test_server.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from localpaged.chat.session import Session
from localpaged.chat.store import ChatStore
from localpaged.chat.tool_turn import DENIED, STOPPED, TextDelta, ToolCallEvent, ToolResultEvent
from localpaged.chat.tools import MAX_RESULT_CHARS, McpServers, as_tools, clean_output, function_tool
from localpaged.config_file import McpServerConfig, load_settings
from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import ConfigError, ToolError
from localpaged.sampling import SamplingParams
from tests.engine.fake_llm import FakeLLM

SERVER = str(Path(__file__).resolve().parent.parent / "mcp_test_server.py")


def add(a: int, b: int = 2) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def broken(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"broken because {reason}")


def caller(name: str, arguments: dict, answer: str = "The sum is 5."):
    """A scripted reply: call ``name`` until the prompt holds a tool result, then answer."""

    def reply(ids: list[int]) -> str:
        if "tool_response" in "".join(chr(i) for i in ids):
            return json.dumps({"response": answer})
        return json.dumps({"tool_call": {"name": name, "arguments": arguments}})

    return reply


@pytest.fixture
def store(tmp_path: Path):
    with ChatStore(tmp_path / "chats.db") as store:
        yield store


def turn(reply, store: ChatStore, **kwargs):
    with AsyncLLM(llm=FakeLLM(reply=reply)) as engine:
        session = Session.new(engine, store)
        events = list(session.stream_events("what is 2+3?", **kwargs))
        return session, events


# ----- tools from Python functions ------------------------------------------------------------


def test_a_function_becomes_a_tool_with_its_signature_and_docstring() -> None:
    tool = function_tool(add)
    assert tool.definition() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two whole numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number"},
                    "b": {"type": "integer", "description": "the second number", "default": 2},
                },
                "required": ["a"],
            },
        },
    }
    assert asyncio.run(tool.acall('{"a": 3}')) == "5"
    with pytest.raises(ToolError, match="a: Input should be a valid integer"):
        asyncio.run(tool.acall('{"a": "three"}'))
    with pytest.raises(ToolError, match="not valid JSON"):
        asyncio.run(tool.acall("{"))
    with pytest.raises(ToolError, match="broken because x"):
        asyncio.run(function_tool(broken).acall('{"reason": "x"}'))


def test_bad_tools_are_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="more than one tool is named add"):
        as_tools([add, add])
    with pytest.raises(ConfigError, match="neither a Tool nor a function"):
        as_tools(["add"])
    with pytest.raises(ConfigError, match="a tool's name must be"):
        function_tool(lambda a: a)

    def total(*numbers: int) -> int:
        return sum(numbers)

    with pytest.raises(ConfigError, match=r"\*args"):
        function_tool(total)


def test_tool_output_is_plain_bounded_text() -> None:
    assert clean_output("a\x1b[31mred\x07\nline\ttab") == "a\\x1b[31mred\\x07\nline\ttab"
    long = clean_output("x" * (MAX_RESULT_CHARS + 10))
    assert long.startswith("x" * MAX_RESULT_CHARS) and long.endswith("[… 10 more characters left out]")


# ----- the rounds ------------------------------------------------------------------------------


def test_a_call_is_approved_run_stored_and_answered(store: ChatStore) -> None:
    asked = []
    session, events = turn(
        caller("add", {"a": 2, "b": 3}), store, tools=[add], approve=lambda call, tool: asked.append(call) or "once"
    )
    kinds = [type(e) for e in events if not isinstance(e, TextDelta)]
    assert kinds == [ToolCallEvent, ToolResultEvent]
    call, result = (e for e in events if not isinstance(e, TextDelta))
    assert asked == [call.call] and call.call.name == "add" and json.loads(call.call.arguments) == {"a": 2, "b": 3}
    assert (result.content, result.error) == ("5", None)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The sum is 5."
    _user, calling, tool, answer = session.history
    assert calling.role == "assistant" and calling.content == "" and calling.calls[0]["id"] == call.call.id
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", call.call.id, "5")
    assert answer.content == "The sum is 5." and session.last_reply.id == answer.id


def test_a_denied_call_tells_the_model_and_it_goes_on(store: ChatStore) -> None:
    session, events = turn(caller("add", {"a": 2}), store, tools=[add], approve=lambda call, tool: "deny")
    result = next(e for e in events if isinstance(e, ToolResultEvent))
    assert (result.content, result.error) == (DENIED, "denied")
    assert session.history[2].status == "error" and session.last_reply.content == "The sum is 5."


def test_allow_for_this_chat_is_stored_and_asks_no_more(store: ChatStore) -> None:
    asked = []
    with AsyncLLM(llm=FakeLLM(reply=caller("add", {"a": 1}))) as engine:
        session = Session.new(engine, store)
        session.send("one", tools=[add], approve=lambda call, tool: asked.append(call) or "chat")
        session.send("two", tools=[add], approve=lambda call, tool: asked.append(call) or "deny")
        assert len(asked) == 1 and Session.load(engine, store, session.id).settings["tools_allowed"] == ["python/add"]


def test_a_failing_tool_is_an_error_result_the_model_reads(store: ChatStore) -> None:
    _session, events = turn(caller("broken", {"reason": "x"}), store, tools=[broken])
    result = next(e for e in events if isinstance(e, ToolResultEvent))
    assert result.error == "broken failed: broken because x" and result.content == f"Error: {result.error}"


def test_a_call_of_no_such_tool_is_answered_not_run(store: ChatStore) -> None:
    _session, events = turn(caller("nope", {}), store, tools=[add])
    result = next(e for e in events if isinstance(e, ToolResultEvent))
    assert result.error == "unknown tool" and "no tool named 'nope'" in result.content


def test_the_rounds_stop_at_the_limit_and_the_model_must_answer(store: ChatStore) -> None:
    count = iter(range(100))

    def always(ids: list[int]) -> str:  # a new call every round; held to an answer it answers
        return json.dumps({"tool_call": {"name": "add", "arguments": {"a": next(count)}}})

    session, events = turn(always, store, tools=[add], max_tool_rounds=2)
    assert sum(isinstance(e, ToolResultEvent) for e in events) == 2
    assert [m.role for m in session.history].count("assistant") == 3


def test_the_same_call_again_is_answered_from_the_first_and_ends_the_rounds(store: ChatStore) -> None:
    def again(ids: list[int]) -> str:
        return json.dumps({"tool_call": {"name": "add", "arguments": {"a": 1}}})

    runs = []

    def counted(a: int) -> int:
        """Count."""
        runs.append(a)
        return a

    counted.__name__ = "add"
    _session, events = turn(again, store, tools=[counted])
    results = [e for e in events if isinstance(e, ToolResultEvent)]
    assert runs == [1] and [r.content for r in results] == ["1", "1"]


def test_stop_while_asked_runs_nothing_more(store: ChatStore) -> None:
    async def main() -> Session:
        with AsyncLLM(llm=FakeLLM(reply=caller("add", {"a": 1}))) as engine:
            session = Session.new(engine, store)

            async def approve(call, tool):
                await session.stop()
                return "once"

            async for _ in session.astream_events("go", tools=[add], approve=approve):
                pass
            return session

    session = asyncio.run(main())
    roles = [(m.role, m.content) for m in session.history]
    assert roles[-1] == ("tool", STOPPED) and len(roles) == 3  # no run, no further round


def test_leaving_a_turn_midway_still_answers_every_call(store: ChatStore) -> None:
    with AsyncLLM(llm=FakeLLM(reply=caller("add", {"a": 1}))) as engine:
        session = Session.new(engine, store)
        for event in session.stream_events("go", tools=[add], approve=lambda c, t: "once"):
            if isinstance(event, ToolCallEvent):
                break
        assert [m.role for m in session.history] == ["user", "assistant", "tool"]
        assert session.history[-1].error == "stopped"
        session.send("again", tools=[add])  # the chat goes on


def test_sync_and_async_twins_take_the_same_turn(tmp_path: Path) -> None:
    def shape(session: Session) -> list[tuple]:
        return [(m.role, m.content, [c["function"] for c in m.calls], m.status) for m in session.history]

    with (
        ChatStore(tmp_path / "a.db") as a,
        ChatStore(tmp_path / "b.db") as b,
        AsyncLLM(llm=FakeLLM(reply=caller("add", {"a": 2, "b": 3}))) as engine,
    ):
        sync = Session.new(engine, a)
        sync.send("what is 2+3?", tools=[add])

        async def run() -> Session:
            session = Session.new(engine, b)
            await session.asend("what is 2+3?", tools=[add])
            return session

        assert shape(sync) == shape(asyncio.run(run()))


def test_bad_tool_arguments_to_send_store_nothing(store: ChatStore) -> None:
    with AsyncLLM(llm=FakeLLM(reply=caller("add", {"a": 1}))) as engine:
        session = Session.new(engine, store)
        with pytest.raises(ConfigError, match="tool_choice='sum'"):
            session.send("hi", tools=[add], tool_choice="sum")
        with pytest.raises(ConfigError, match="max_tool_rounds=0"):
            session.send("hi", tools=[add], max_tool_rounds=0)
        assert session.history == []
        with pytest.raises(ConfigError, match="approve returned 'yes'"):
            session.send("hi", tools=[add], approve=lambda c, t: "yes")
        assert session.history[-1].error == "stopped"  # the call that was never approved is answered


# ----- stored and replayed ---------------------------------------------------------------------


def test_a_reopened_chat_replays_its_tool_rounds(store: ChatStore) -> None:
    prompts = []
    reply = caller("add", {"a": 2, "b": 3})

    def recording(ids: list[int]) -> str:
        prompts.append("".join(chr(i) for i in ids))
        return reply(ids)

    with AsyncLLM(llm=FakeLLM(reply=recording)) as engine:
        first = Session.new(engine, store)
        first.send("what is 2+3?", tools=[add])
        call_id = first.history[1].calls[0]["id"]
    with AsyncLLM(llm=FakeLLM(reply=recording)) as engine:
        again = Session.load(engine, store, first.id)
        again.send("and now?", tools=[add])
        assert call_id in prompts[-1] and '"tool_response"' in prompts[-1]
        assert prompts[-1].startswith(prompts[1].removesuffix("<assistant>"))  # the earlier rounds, as they were
        fork = again.fork(again.history[2].id)
        assert [m.role for m in fork.history] == ["user", "assistant", "tool"]
        again.regenerate()
        assert [m.role for m in again.history][-2:] == ["user", "assistant"]
        markdown = again.export_markdown()
        assert "Tool call `add`:" in markdown and "## Tool result: add" in markdown and '"b": 3' in markdown
        assert any(hit.role == "tool" for hit in store.search("5"))


def test_a_fork_between_a_call_and_its_result_replays_neither(store: ChatStore) -> None:
    with AsyncLLM(llm=FakeLLM(reply=caller("add", {"a": 1}))) as engine:
        session = Session.new(engine, store)
        session.send("go", tools=[add])
        fork = session.fork(session.history[1].id)
        assert fork.engine_messages() == [{"role": "user", "content": "go"}]


def test_the_store_checks_tool_fields(store: ChatStore) -> None:
    from localpaged.errors import StoreError

    session = store.create_session()
    with pytest.raises(StoreError, match="tool_call_id"):
        store.add_message(session.id, "tool", "x")
    with pytest.raises(StoreError, match="Only an assistant"):
        store.add_message(session.id, "user", "x", tool_calls=[{"id": "c", "function": {"name": "a", "arguments": ""}}])
    with pytest.raises(StoreError, match="OpenAI"):
        store.add_message(session.id, "assistant", "", tool_calls=[{"id": 1}])


def test_the_tools_migration_keeps_old_messages_ids_and_search(tmp_path: Path) -> None:
    from sqlite_utils import Database

    from localpaged.chat import migrations

    db_path = tmp_path / "old.db"
    db = Database(db_path)
    db.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at FLOAT NOT NULL)")
    for fn in migrations.MIGRATIONS[:-1]:
        fn(db)
        db.execute("INSERT INTO _migrations VALUES (?, 0)", [fn.__name__])
    db.execute("INSERT INTO sessions (id, created, updated) VALUES ('s1', 0, 0)")
    for i in range(3):
        db.execute(
            "INSERT INTO messages (session_id, role, content, created, updated) VALUES ('s1', 'user', ?, 0, 0)",
            [f"hello number {i}"],
        )
    db.execute("DELETE FROM messages WHERE id = 3")
    db.conn.close()
    with ChatStore(db_path) as store:
        assert [m.id for m in store.messages("s1")] == [1, 2]
        assert [h.message_id for h in store.search("number")] == [2, 1]
        new = store.add_message("s1", "tool", "a result", tool_call_id="call_1")
        assert new.id == 4 and store.search("result")[0].role == "tool"  # no id is reused


# ----- chat settings ---------------------------------------------------------------------------


def test_a_chat_stores_its_tools_and_keeps_them_through_other_settings(store: ChatStore) -> None:
    from localpaged.chat.session import settings_summary

    with AsyncLLM(llm=FakeLLM()) as engine:
        session = Session.new(engine, store)
        session.set_tools(["test/answer", "python/add"])
        session.set_settings({"temperature": 0.5})
        again = Session.load(engine, store, session.id)
        assert again.tools_chosen == ["test/answer", "python/add"]
        assert settings_summary(again.settings) == "temp 0.5, tools answer add"
        with pytest.raises(ConfigError, match="tool keys"):
            again.set_settings({"tools": "answer"})


# ----- MCP servers -----------------------------------------------------------------------------


def test_mcp_settings_are_checked_once(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        '[mcp.servers.t]\ncommand = "python"\nargs = ["server.py"]\n\n[mcp.servers.web]\nurl = "http://h:1/mcp"\n'
    )
    servers = load_settings(path).mcp_servers
    assert servers["t"].args == ("server.py",) and servers["web"].url == "http://h:1/mcp"
    for text, message in [
        ('[mcp.servers.t]\nargs = ["x"]\n', "exactly one of command"),
        ('[mcp.servers.t]\ncommand = "x"\nport = 3\n', "unknown key"),
        ('[mcp.servers.t]\ncommand = "x"\nargs = "y"\n', "args must be a list"),
        ('[mcp.servers."a b"]\ncommand = "x"\n', "name the server"),
        ('[mcp.servers.t]\nurl = "ftp://x"\n', "http"),
        ("[mcp]\nport = 1\n", "only server tables"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_settings(path)


def test_mcp_servers_list_run_and_fail_their_tools() -> None:
    configs = {
        "test": McpServerConfig("test", sys.executable, (SERVER,)),
        "dead": McpServerConfig("dead", sys.executable, (SERVER, "--die")),
    }
    servers = McpServers(configs)
    servers.start()
    try:
        assert servers.wait(60)
        tools = {tool.name: tool for tool in servers.tools()}
        assert set(tools) == {"answer", "fail"} and tools["answer"].key == "test/answer"
        assert tools["answer"].parameters["required"] == ["question"]
        assert "fixed fact" in tools["answer"].description
        assert asyncio.run(tools["answer"].acall('{"question": "life"}')) == "The answer to 'life' is 42."
        with pytest.raises(ToolError, match="fail was asked to fail: because"):
            asyncio.run(tools["fail"].acall('{"reason": "because"}'))
        [error] = servers.errors()
        assert "'dead'" in error and "broken on purpose" in error
    finally:
        servers.close()
    assert all(state.status in ("stopped", "failed") for state in servers.states.values())
    with pytest.raises(ToolError, match="not running"):
        asyncio.run(tools["answer"].acall('{"question": "x"}'))


def test_clashing_tool_names_are_prefixed_by_their_server() -> None:
    configs = {name: McpServerConfig(name, sys.executable, (SERVER,)) for name in ("one", "two")}
    servers = McpServers(configs)
    servers.start()
    try:
        assert servers.wait(60)
        assert sorted(t.name for t in servers.tools()) == ["one__answer", "one__fail", "two__answer", "two__fail"]
    finally:
        servers.close()


def test_an_mcp_tool_in_a_session_turn(store: ChatStore) -> None:
    servers = McpServers({"test": McpServerConfig("test", sys.executable, (SERVER,))})
    servers.start()
    try:
        assert servers.wait(60)
        session, events = turn(caller("answer", {"question": "life"}, "It is 42."), store, tools=servers.tools())
        result = next(e for e in events if isinstance(e, ToolResultEvent))
        assert result.content == "The answer to 'life' is 42." and session.last_reply.content == "It is 42."
    finally:
        servers.close()


# ----- the default model -----------------------------------------------------------------------


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: the city's name
    """
    return f"18 C and sunny in {city}"


@pytest.mark.model
def test_the_default_model_calls_a_python_function(default_llm, store: ChatStore) -> None:
    with AsyncLLM(llm=default_llm) as engine:
        session = Session.new(engine, store)
        params = SamplingParams(max_tokens=60, temperature=0.0)
        reply = session.send("What is the weather in Paris?", params, tools=[get_weather], tool_choice="required")
        calling, result = session.history[1:3]
        assert calling.calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calling.calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert result.content == "18 C and sunny in Paris"
        assert reply.status == "complete" and reply.content and not reply.calls
        second = session.send("And in Rome?", params, tools=[get_weather], tool_choice="required")
        first_round = session.history[len(session.history) - 3]
        assert first_round.cached_tokens >= (reply.prompt_tokens or 0) // 16 * 16  # the replayed rounds, cached
        assert second.status == "complete"

"""RemoteEngine behind Session: our own server as the remote (tiny model), and llama.cpp's where it is built.

The server runs in this process on a thread (tests/server/running.py) over an AsyncLLM whose core is
a process of its own, as `localpaged serve` runs; the session talks to it only over HTTP. Where
``make bench-peers`` has built llama.cpp's ``llama-server``, the same session tests run against it
too (on the default model's GGUF); elsewhere they are skipped with a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localpaged.chat.session import Session, chat_messages
from localpaged.chat.store import ChatStore
from localpaged.cli import main
from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.protocol import EngineClient
from localpaged.engine.remote import RemoteEngine
from localpaged.errors import RemoteEngineError, RequestError
from localpaged.sampling import SamplingParams
from tests.server.running import running_server
from tests.support import free_port, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers import LlamaServer, llama_bin_dir  # llama-server, started as the benchmarks start it

TINY = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "64MiB", "max_model_len": 1024}
KEY = "sk-remote-test"
GREEDY = SamplingParams(max_tokens=12, temperature=0)
# Long enough to be stopped: the tiny model would otherwise end at a random EOS.
ENDLESS = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)


class StubHandler(http.server.BaseHTTPRequestHandler):
    """A scripted OpenAI-compatible server's handler: JSON replies, nothing logged."""

    def send_json(self, status: int, reply: dict) -> None:
        body = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def stub_server(handler: type[StubHandler]) -> Iterator[str]:
    """The URL of ``handler`` served on a thread for the block's length."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def local_engine(tiny_model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(tiny_model_path), **TINY)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ours(local_engine: AsyncLLM) -> Iterator[str]:
    """The base URL of our server (with an API key) over the tiny model."""
    with running_server(local_engine, api_key=KEY) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def llama_cpp() -> Iterator[str]:
    bin_dir = llama_bin_dir()
    if bin_dir is None:
        pytest.skip("llama.cpp's llama-server is not built here (make bench-peers builds it)")
    from localpaged.models.loader import default_model_path

    with LlamaServer(bin_dir, default_model_path(), 1, "-np", "2", "-c", "4096") as server:
        yield f"http://127.0.0.1:{server.port}/v1"


@pytest.fixture(params=["localpaged", "llama.cpp"])
def remote(request: pytest.FixtureRequest) -> Iterator[RemoteEngine]:
    """A RemoteEngine on each server that can run here."""
    if request.param == "localpaged":
        engine = RemoteEngine(request.getfixturevalue("ours"), api_key=KEY)
    else:
        engine = RemoteEngine(request.getfixturevalue("llama_cpp"))
    yield engine
    engine.shutdown()


@pytest.fixture
def store() -> Iterator[ChatStore]:
    with ChatStore(":memory:") as store:
        yield store


# ----- connecting ----------------------------------------------------------------------------


def test_connects_and_says_what_it_can(remote: RemoteEngine) -> None:
    assert isinstance(remote, EngineClient)
    assert remote.info.model_name and remote.info.max_model_len
    caps = remote.info.capabilities
    assert not caps.token_prompts and not caps.kv_pool  # messages go out; the pool stays on the server
    assert caps.tokenize and caps.continue_reply  # both servers count (/tokenize) and continue
    assert remote.kv_map().states == []


def test_our_server_reports_its_context_and_counts_as_the_engine_does(ours: str, local_engine: AsyncLLM) -> None:
    remote = RemoteEngine(ours, api_key=KEY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert remote.info.max_model_len == local_engine.info.max_model_len == 1024
    assert remote.info.model_name == local_engine.info.model_name and remote.server == "localpaged"
    assert remote.encode_chat(messages) == local_engine.encode_chat(messages)


def test_a_dead_url_is_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RemoteEngineError, match=rf"^cannot reach {url}: connection refused$"):
        RemoteEngine(url)


def test_a_wrong_key_says_so(ours: str) -> None:
    with pytest.raises(RemoteEngineError, match="refused the API key.*--api-key"):
        RemoteEngine(ours, api_key="wrong")


def test_a_model_it_does_not_serve_is_named(ours: str, local_engine: AsyncLLM) -> None:
    with pytest.raises(Exception, match=f"does not serve the model 'nope'; it serves '{local_engine.info.model_name}'"):
        RemoteEngine(ours, api_key=KEY, model="nope")


def test_a_request_the_server_refuses_keeps_its_words(ours: str) -> None:
    remote = RemoteEngine(ours, api_key=KEY)
    bad = SamplingParams()
    bad.top_p = 1.5  # past SamplingParams' own check, so that the server is the one to refuse it
    with pytest.raises(RequestError, match=r"refused the request \(400\): top_p=1.5"):
        list(remote.iter_stream([{"role": "user", "content": "hi"}], bad))


def test_more_than_one_sample_is_refused_here(ours: str) -> None:
    remote = RemoteEngine(ours, api_key=KEY)
    with pytest.raises(RequestError, match="n=3: a remote engine streams one sample per request"):
        list(remote.iter_stream("hi", SamplingParams(n=3)))


def test_request_ids_are_kept_as_the_local_engine_keeps_them(ours: str) -> None:
    """One request an id at a time, an abort of an id not in flight named, nothing taken after shutdown."""
    remote = RemoteEngine(ours, api_key=KEY)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main() -> None:
        with pytest.raises(RequestError, match="no request 'nobody' is in flight"):
            await remote.abort("nobody")
        first = remote.stream("the first one", long, request_id="same")
        await first.__anext__()
        with pytest.raises(RequestError, match="request id 'same' is already in flight"):
            await anext(remote.stream("the second one", long, request_id="same"))
        await remote.abort("same")
        assert [out.finish_reason async for out in first][-1] == "abort"
        assert remote.stats().running == 0
        second = [out async for out in remote.stream("again", SamplingParams(max_tokens=2), request_id="same")]
        assert second[-1].finished

    asyncio.run(main())
    remote.shutdown()
    with pytest.raises(RequestError, match="has been shut down"):
        list(remote.iter_stream("hi"))


# ----- a session on a remote engine --------------------------------------------------------


def test_session_streams_persists_and_reloads(remote: RemoteEngine, store: ChatStore) -> None:
    session = Session.new(remote, store, system="Be brief.")
    text = "".join(session.stream("What is a paged KV cache?", GREEDY))
    assert text
    user, reply = session.history
    assert (user.role, user.content) == ("user", "What is a paged KV cache?")
    assert (reply.content, reply.status, reply.model) == (text, "complete", remote.info.model_name)
    assert reply.finish_reason in ("stop", "length") and reply.completion_tokens and reply.prompt_tokens
    assert reply.prompt_tokens == len(remote.encode_chat(chat_messages(session.system, [user])))
    assert store.token_ids(reply.id) is None  # the server sends text, not ids
    again = Session.load(remote, store, session.id)
    assert [(m.role, m.content) for m in again.history] == [("user", user.content), ("assistant", text)]
    assert store.search("paged")[0].session_id == session.id
    assert text in again.export_markdown()


def test_fork_and_regenerate(remote: RemoteEngine, store: ChatStore) -> None:
    session = Session.new(remote, store)
    first = session.send("Name a colour.", GREEDY)
    session.send("And another one?", GREEDY)
    fork = session.fork(at=first.id)
    assert [m.content for m in fork.history] == [m.content for m in session.history[:2]]
    again = fork.regenerate(GREEDY)
    assert again.status == "complete" and again.content == first.content  # greedy: the same answer
    assert len(fork.history) == 2 and len(session.history) == 4


def test_stopping_a_remote_reply_keeps_the_partial(remote: RemoteEngine, store: ChatStore) -> None:
    session = Session.new(remote, store)

    async def main() -> str:
        got = ""
        async for delta in session.astream("Go on for a long time.", ENDLESS):
            got += delta
            if len(got) >= 8:
                await session.stop()
        return got

    text = asyncio.run(main())
    reply = session.history[-1]
    assert reply.status == "partial" and reply.content == text and len(text) >= 8
    assert reply.finish_reason == "abort" and not session.generating


def test_closing_the_stream_frees_the_servers_blocks(ours: str, local_engine: AsyncLLM, store: ChatStore) -> None:
    session = Session.new(RemoteEngine(ours, api_key=KEY), store)
    with pytest.raises(StopIteration):
        deltas = session.stream("Go on.", ENDLESS)
        next(deltas)
        deltas.close()  # a blocking consumer walking away closes the HTTP stream: the server aborts
        next(deltas)
    wait_until(lambda: local_engine.stats().blocks_used == 0, timeout=10)
    assert session.history[-1].status == "partial"


def test_continue_goes_on_in_the_same_message(remote: RemoteEngine, store: ChatStore) -> None:
    session = Session.new(remote, store)
    cut = session.send("Count from one to twenty in words.", SamplingParams(max_tokens=6, temperature=0))
    assert cut.finish_reason == "length" and session.continuable() is not None
    grown = session.continue_reply(SamplingParams(max_tokens=6, temperature=0))
    assert grown.id == cut.id and len(session.history) == 2
    assert grown.content.startswith(cut.content) and len(grown.content) > len(cut.content)
    assert grown.completion_tokens == 12  # the reply's tokens, both parts
    # The turn's prompt, not the reply it grew from; the server re-encodes the reply's text, which need
    # not give back the ids it was generated as (the tiny model writes random tokens), hence a margin.
    assert abs(grown.prompt_tokens - cut.prompt_tokens) <= 3


def test_continue_is_off_where_the_server_cannot(ours: str, store: ChatStore) -> None:
    remote = RemoteEngine(ours, api_key=KEY)
    session = Session.new(remote, store)
    session.send("Count.", SamplingParams(max_tokens=4, temperature=0))
    assert session.continuable() is not None
    capabilities = dataclasses.replace(
        remote.info.capabilities, continue_reply=False, notes={"continue_reply": "not this one"}
    )
    remote.info = dataclasses.replace(remote.info, capabilities=capabilities)
    assert session.continuable() is None
    with pytest.raises(RequestError, match="only a last reply that stopped at a token limit"):
        session.continue_reply()
    with pytest.raises(RequestError, match="cannot continue a reply: not this one"):
        list(remote.iter_stream([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]))


# ----- the command line ------------------------------------------------------------------


def test_run_on_a_backend_stores_the_turn(ours: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = tmp_path / "chats.db"
    argv = ["run", "--backend", ours, "--api-key", KEY, "--max-tokens", "6", "--temperature", "0", "--db", str(db)]
    assert main([*argv, "Hello over HTTP"]) == 0
    out = capsys.readouterr().out.strip()
    with ChatStore(db) as store:
        (summary,) = store.list_sessions()
        user, reply = store.messages(summary.id)
    assert user.content == "Hello over HTTP" and reply.content.strip() == out and reply.status == "complete"


def test_run_on_a_dead_backend_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("LOCALPAGED_BACKEND", url)
    assert main(["run", "--db", str(tmp_path / "chats.db"), "hello"]) == 2
    assert capsys.readouterr().err == f"error: cannot reach {url}: connection refused\n"


def test_a_stream_cut_off_keeps_the_partial_and_says_why(store: ChatStore) -> None:
    """A server that sends part of a reply and hangs up: the text so far is stored, marked as an error."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    class HalfServer(StubHandler):
        def do_GET(self) -> None:  # /v1/models
            self.send_json(200, {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "half"}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/chat/completions":
                return self.send_json(404, {"error": {"message": "no such route"}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in ("Hel", "lo"):
                delta = {**chunk, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(delta)}\n\n".encode())
            self.wfile.flush()
            self.close_connection = True  # and no finish, no [DONE]

    with stub_server(HalfServer) as url:
        remote = RemoteEngine(url)
        assert not remote.info.capabilities.tokenize and not remote.info.capabilities.continue_reply
        notes = remote.info.capabilities.notes
        assert "no /tokenize" in notes["tokenize"] and "'half'" in notes["continue_reply"] and "tools" not in notes
        session = Session.new(remote, store)
        with pytest.raises(RemoteEngineError, match="closed the stream before the reply finished"):
            session.send("hi")
    reply = session.history[-1]
    assert (reply.content, reply.status) == ("Hello", "error") and "closed the stream" in reply.error


@pytest.mark.parametrize("takes_tools", [True, False])
def test_a_server_that_refuses_schema_replies_turns_tools_off_with_its_words(
    takes_tools: bool, store: ChatStore
) -> None:
    """A one-token probe for a JSON-schema reply at connect (tools reach a remote model in the generic
    format): a server that refuses it turns tools off with its words, and a Session
    asked for tools then says so before storing anything; a server that answers keeps them on."""

    class ToolServer(StubHandler):
        def do_GET(self) -> None:  # /v1/models
            self.send_json(200, {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "llamacpp"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions":
                return self.send_json(404, {"error": {"message": "no such route"}})
            if "response_format" in body and not takes_tools:
                refusal = "only response_format {'type': 'text'} is supported"
                return self.send_json(400, {"error": {"message": refusal}})
            choice = {"index": 0, "message": {"role": "assistant", "content": "h"}, "finish_reason": "length"}
            self.send_json(
                200, {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
            )

    with stub_server(ToolServer) as url:
        capabilities = RemoteEngine(url).info.capabilities
        assert capabilities.tools is takes_tools
        said = "it refuses JSON-schema replies, which tools need (only response_format {'type': 'text'} is supported)"
        assert capabilities.notes.get("tools") == (None if takes_tools else said)
        if not takes_tools:
            session = Session.new(RemoteEngine(url), store)

            def probe() -> str:
                """A tool for the test."""
                return "x"

            with pytest.raises(RequestError, match="this engine takes no tools: .*only response_format"):
                session.send("hi", tools=[probe])
            assert session.history == []

"""A Messages API stream that fails once it has begun ends with Anthropic's ``error`` event, which the SDK raises.

The failure is the server stopping (SIGTERM, Ctrl-C) mid-reply, over a scripted engine slow enough to be caught
in the middle; its blocks go back and the stream ends at once.
"""

from __future__ import annotations

import threading

import anthropic
import pytest

from localpaged.engine.async_llm import AsyncLLM
from localpaged.server.app import build_app
from localpaged.server.listen import listen
from localpaged.server.runner import Server
from tests.engine.fake_llm import FakeLLM
from tests.support import wait_until


def test_stopping_mid_stream_is_an_error_event_the_sdk_raises() -> None:
    engine = AsyncLLM(llm=FakeLLM(lambda ids: "word " * 2000, step_delay=0.005))
    sock = listen("127.0.0.1", 0)
    server = Server(build_app(engine))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30)
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", api_key="x", max_retries=0)
        received = []
        with (
            pytest.raises(anthropic.APIStatusError) as caught,
            client.messages.stream(
                model="fake-llm", max_tokens=4000, messages=[{"role": "user", "content": "Go"}]
            ) as s,
        ):
            for text in s.text_stream:
                received.append(text)
                if len(received) == 3:
                    server.stop()
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "api_error"
        assert "shutting down" in caught.value.body["error"]["message"]
        assert 3 <= len(received) < 2000
        wait_until(lambda: engine.stats().blocks_used == 0, timeout=10)
    finally:
        server.stop()
        thread.join(timeout=10)
        sock.close()
        engine.shutdown()

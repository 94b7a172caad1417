"""The app reads a chat as the model will: LiveChat's messages are Session's, error replies left out."""

from __future__ import annotations

from localpaged.chat.session import Session
from localpaged.chat.store import ChatStore
from localpaged.tui.live import LiveChat
from tests.tui.fake_engine import FakeEngine


def test_the_app_and_the_session_agree_on_what_the_model_reads() -> None:
    with ChatStore(":memory:") as store:
        session = Session.new(FakeEngine(), store, system="Be brief.")
        store.add_message(session.id, "user", "first question")
        store.add_message(session.id, "assistant", "half an answer", status="error", error="the engine died")
        store.add_message(session.id, "user", "second question")
        store.add_message(session.id, "assistant", "a partial answer", status="partial")
        live = LiveChat(session, app=None, target=None)  # type: ignore[arg-type]
        expected = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "first question"},
            {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "a partial answer"},
        ]
        assert live.engine_messages() == session.engine_messages() == expected
        # What the app counts and prefetches is the prompt Session sends for the next turn.
        assert session.context_tokens() == len(session.engine.encode_chat(expected))

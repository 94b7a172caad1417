"""Continue against regenerate and a cold send, on a ~2,500-token chat: the prefix cache at work.

A chat with the coding system prompt (prompts/coding.md) and one question gets a 64-token reply cut
at its limit; then it is regenerated, and then continued (the rest lands in the same message, the
prompt being the chat plus the reply's own stored token ids). Each line gives the prompt and cached
tokens the engine reports and the time to the first token, all from one run.

    python benchmarks/continue_speed.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from localpaged import AsyncLLM, ChatStore, SamplingParams, Session
from localpaged.chat.prompts import get_prompt

QUESTION = "Write a Python class for a bank account with deposits, withdrawals and a statement."
LIMIT = 64


def main() -> None:
    params = SamplingParams(max_tokens=LIMIT, temperature=0.0)
    with (
        tempfile.TemporaryDirectory() as folder,
        AsyncLLM(kv_disk=False) as engine,
        ChatStore(Path(folder) / "chats.db") as store,
    ):
        session = Session.new(engine, store, system=get_prompt("coding").text)
        rows = [("the first send, cold", session.send(QUESTION, params))]
        rows.append(("regenerate", session.regenerate(params)))
        session.set_settings({"max_tokens": LIMIT, "temperature": 0.0})
        rows.append(("continue (same message)", session.continue_reply()))
    print(f"{'':26} {'prompt':>7} {'cached':>7} {'TTFT s':>8}")
    for name, reply in rows:
        print(f"{name:26} {reply.prompt_tokens:>7} {reply.cached_tokens:>7} {reply.ttft_s:>8.3f}")


if __name__ == "__main__":
    main()

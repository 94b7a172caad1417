"""Sessions sharing the long coding system prompt: time to first token warm vs cold, and KV blocks held.

1. TTFT of a new session whose 1,500+-token system prompt is already cached, against the same
   first turn on a fresh engine (cold), through Session and a ChatStore, in one run.
2. Blocks held by 8 live sessions sharing that prompt, against the same 8 on an engine without
   prefix caching.

    python benchmarks/sessions.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kv_folder import own_kv_folder

from localpaged import LLM, AsyncLLM, ChatStore, SamplingParams, Session, load_prompt

QUESTIONS = [
    "How do I reverse a list?",
    "What is a closure?",
    "Explain list comprehensions.",
    "How do I read a file?",
    "What does yield do?",
    "How do I sort a dict by value?",
    "What is a decorator?",
    "How do I time code?",
]
REPLY = SamplingParams(max_tokens=8, temperature=0.0)


def first_turn_ttft(engine: AsyncLLM, store: ChatStore, question: str) -> tuple[float, int]:
    session = Session.new(engine, store, system=load_prompt("coding"), prompt_name="coding")
    reply = session.send(question, REPLY)
    return reply.ttft_s, reply.cached_tokens or 0


def live_blocks(llm: LLM, system: str, generate: int = 16) -> int:
    """Blocks in use once all 8 sessions have their prompt in the pool and are decoding."""
    for q in QUESTIONS:
        llm.add_request(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            SamplingParams(max_tokens=generate, temperature=0.0, ignore_eos=True),
        )
    peak = 0
    while llm.has_unfinished_requests():
        llm.step()
        peak = max(peak, llm.pool.num_used_blocks)  # not stats(): it walks every block, each step
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    system = load_prompt("coding")
    with tempfile.TemporaryDirectory() as tmp:
        store = ChatStore(Path(tmp) / "chats.db")
        cold_engine = AsyncLLM(device=args.device)
        n_system = len(cold_engine.encode_chat([{"role": "system", "content": system}]))
        cold, _ = first_turn_ttft(cold_engine, store, QUESTIONS[0])
        warm, cached = first_turn_ttft(cold_engine, store, QUESTIONS[1])
        cold_engine.shutdown()
    print(f"coding system prompt: {n_system} tokens")
    print(f"TTFT cold (fresh engine):       {cold * 1000:8.1f} ms")
    print(f"TTFT warm (prompt cached):      {warm * 1000:8.1f} ms   ({cached} prompt tokens from the cache)")
    print(f"warm is {cold / warm:.1f}x faster")

    shared = LLM(device=args.device)
    with_sharing = live_blocks(shared, system)
    bytes_per_block = shared.block_bytes
    shared.close()  # the disk tier's last writes, before own_kv_folder removes its folder
    del shared
    unshared = LLM(device=args.device, enable_prefix_caching=False)
    without = live_blocks(unshared, system)
    unshared.close()
    mib = 2**20
    print(
        f"8 live sessions, blocks held with prefix sharing:    {with_sharing:5d} ({with_sharing * bytes_per_block / mib:.1f} MiB)"
    )
    print(
        f"8 live sessions, blocks held without prefix sharing: {without:5d} ({without * bytes_per_block / mib:.1f} MiB)"
    )
    print(f"sharing holds {without / with_sharing:.1f}x fewer blocks")


if __name__ == "__main__":
    with own_kv_folder():  # cold means cold: no blocks from earlier runs
        main()

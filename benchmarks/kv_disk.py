"""The disk KV tier: time to first token cold, from disk in a new process, and warm in memory.

Two cases, each (a) cold on a fresh engine with an empty tier, (b) in a new engine process whose
tier an earlier process filled (page cache warm, then dropped where we may), (c) warm in memory.
(b) and (c) are the median of ROUNDS tries each (three new processes; three new questions), as
a single time to first token of ~0.1 s moves by +-30% from one try to the next here:

1. a first chat with the coding system prompt (prompts/coding.md, ~2,500 tokens);
2. reopening a ~4,000-token stored chat and sending one more message.

Also: disk bytes per block, the writer's throughput, and decode tok/s of a batch whose requests
finish (and are written) while others decode, with the tier on against off (goal >= 0.95x).
Writes benchmarks/results/kv_disk.json.

    python benchmarks/kv_disk.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from localpaged import AsyncLLM, SamplingParams, load_prompt

RESULTS = Path(__file__).parent / "results" / "kv_disk.json"
README = Path(__file__).parent.parent / "README.md"
REPLY = SamplingParams(max_tokens=4, temperature=0.0)
LONG_CHAT_TOKENS = 4000
ROUNDS = 3
QUESTIONS = ["How do I read a file?", "What does yield do?", "How do I sort a dict by value?"]
FOLLOW_UPS = ["Go on.", "Thanks.", "Why?"]


def coding_chat(question: str) -> list[dict]:
    return [{"role": "system", "content": load_prompt("coding")}, {"role": "user", "content": question}]


def long_chat(engine: AsyncLLM) -> list[dict]:
    """A stored chat of about LONG_CHAT_TOKENS tokens: turns of real prose (the README), no system prompt."""
    paragraphs = [p for p in README.read_text().split("\n\n") if len(p) > 200]
    messages: list[dict] = []
    i = 0
    while not messages or len(engine.encode_chat(messages)) < LONG_CHAT_TOKENS:
        messages.append(
            {"role": "user", "content": f"Explain this part of the docs:\n{paragraphs[i % len(paragraphs)]}"}
        )
        messages.append({"role": "assistant", "content": paragraphs[(i + 1) % len(paragraphs)]})
        i += 2
    return messages


def ttft(engine: AsyncLLM, messages: list[dict]) -> dict:
    out = engine.generate_text(messages, REPLY)
    m = out.metrics
    return {
        "ttft_s": m.ttft_s,
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "disk_tokens": m.disk_tokens,
    }


def median(tries: list[dict]) -> dict:
    """The try of the median time to first token, with every try's time beside it."""
    middle = sorted(tries, key=lambda t: t["ttft_s"])[len(tries) // 2]
    return {**middle, "tries_ttft_s": [t["ttft_s"] for t in tries]}


def decode_rate(engine: AsyncLLM, n: int = 8) -> float:
    """Generated tokens per second of ``n`` concurrent requests of staggered lengths (finishes write blocks)."""
    import asyncio

    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 500} in words, one per line."}] for i in range(n)]

    async def one(messages: list[dict], tokens: int) -> int:
        last = None
        async for last in engine.stream(messages, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
            pass
        return len(last.token_ids) if last else 0

    async def all_of_them() -> int:
        return sum(await asyncio.gather(*(one(p, 32 + 16 * i) for i, p in enumerate(prompts))))

    start = time.perf_counter()
    tokens = asyncio.run(all_of_them())
    return tokens / (time.perf_counter() - start)


def drop_page_cache() -> bool:
    """Drop the OS page cache (root only), so the next reads come from the device."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    results: dict = {"note": "one run; other work on the machine at the same time makes every figure noisy"}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LOCALPAGED_KV_CACHE"] = tmp  # the engine core processes inherit it
        with AsyncLLM(device=args.device) as engine:  # (a) cold, then (c) warm in memory
            chat = long_chat(engine)
            results["coding (a) cold"] = ttft(engine, coding_chat("How do I reverse a list?"))
            results["coding (c) warm in memory"] = median([ttft(engine, coding_chat(q)) for q in QUESTIONS])
            results["long chat (a) cold"] = ttft(engine, chat + [{"role": "user", "content": "Summarise that."}])
            results["long chat (c) warm in memory"] = median(
                [ttft(engine, chat + [{"role": "user", "content": q}]) for q in FOLLOW_UPS]
            )
            on = decode_rate(engine)
            stats = engine.stats()
        results["block_bytes"] = stats["block_bytes"]
        results["disk bytes per block"] = stats["disk_bytes"] / max(stats["disk_blocks"], 1)
        results["disk write MB/s (writer thread)"] = (
            stats["disk_bytes_written"] / 1e6 / max(stats["disk_write_s"], 1e-9)
        )
        results["disk bytes after the runs"] = stats["disk_bytes"]

        coding, longer = [], []
        for i in range(ROUNDS):  # (b): each a new process, the tier's files in the page cache
            with AsyncLLM(device=args.device) as engine:
                coding.append(ttft(engine, coding_chat(f"Try {i}: how do I open a socket?")))
                longer.append(ttft(engine, chat + [{"role": "user", "content": f"Try {i}: go on."}]))
        results["coding (b) new process, page cache warm"] = median(coding)
        results["long chat (b) new process, page cache warm"] = median(longer)
        dropped = drop_page_cache()
        results["page cache dropped for (b) cold"] = dropped
        if dropped:
            with AsyncLLM(device=args.device) as engine:
                results["coding (b) new process, page cache dropped"] = ttft(
                    engine, coding_chat("Cache dropped: what is a generator?")
                )
                results["long chat (b) new process, page cache dropped"] = ttft(
                    engine, chat + [{"role": "user", "content": "Cache dropped: go on."}]
                )
        with AsyncLLM(device=args.device, kv_disk=False) as engine:
            off = decode_rate(engine)
    results["decode tok/s, tier on"] = on
    results["decode tok/s, tier off"] = off
    results["decode on/off"] = on / off
    for case in ("coding", "long chat"):
        a = results[f"{case} (a) cold"]["ttft_s"]
        b = results[f"{case} (b) new process, page cache warm"]["ttft_s"]
        c = results[f"{case} (c) warm in memory"]["ttft_s"]
        results[f"{case}: (a)/(b)"] = a / b
        results[f"{case}: (b)/(c)"] = b / c
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    for name, value in results.items():
        print(f"{name:50s} {value}")


if __name__ == "__main__":
    main()

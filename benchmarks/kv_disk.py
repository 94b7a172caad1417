"""The disk KV tier: time to first token cold, from disk in a new process, and warm in memory.

Two cases, each (a) cold on a fresh engine with an empty tier, (b) in a new engine process whose
tier an earlier process filled (page cache warm, then dropped where we may), (c) warm in memory.
(b) and (c) are the median of ROUNDS tries each (new processes; new questions), as
a single time to first token of ~0.1 s moves by +-30% from one try to the next here:

1. a first chat with the coding system prompt (prompts/coding.md, ~2,500 tokens);
2. reopening a ~4,000-token stored chat and sending one more message.

Also: disk bytes per block, the writer's throughput, and decode tok/s of a batch whose requests
finish (and are written) while others decode, with the tier on against off (goal >= 0.95x), the
median of DECODE_ROUNDS interleaved rounds on two engines alive at once, each round's order swapped.
Writes benchmarks/results/kv_disk.json.

    python benchmarks/kv_disk.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from kv_folder import own_kv_folder

from localpaged import AsyncLLM, SamplingParams, load_prompt

RESULTS = Path(__file__).parent / "results" / "kv_disk.json"
README = Path(__file__).parent.parent / "README.md"
REPLY = SamplingParams(max_tokens=4, temperature=0.0)
LONG_CHAT_TOKENS = 4000
ROUNDS = 5
# A decode round lasts ~2 s and these machines drift by +-20%: five rounds, tier on always first, gave
# 0.90x once where twelve alternating rounds gave 0.97x a minute later on the same machine.
DECODE_ROUNDS = 12


def question(n: int) -> str:
    """The n-th new question (n < 100): every one the same number of tokens, no two alike.

    (b) and (c) must prefill tails of the same length: past the cached prefix, each new token at this
    context costs ~3 ms here (9 tail tokens 84 ms, 43 tokens 188 ms), so one more word in (b)'s
    question than in (c)'s would move their ratio by 5-10%. The digits differ, and this tokenizer
    splits numbers into digits, so the lengths match while no question shares a block with another.
    """
    return f"Question {n:02d}: how do I open a socket?"


def follow_up(n: int) -> str:
    """The n-th message after the stored chat, as ``question``."""
    return f"Follow-up {n:02d}: go on."


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


def decode_rate(engine: AsyncLLM, round_: int, n: int = 8) -> float:
    """Generated tokens per second of ``n`` concurrent requests of staggered lengths (finishes write blocks).

    Each round asks new questions, so that the tier has new blocks to write in every round."""
    import asyncio

    prompts = [
        [{"role": "user", "content": f"Round {round_}: count from {i} to {i + 500} in words, one per line."}]
        for i in range(n)
    ]

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
    with own_kv_folder():  # the engine core processes inherit it
        with AsyncLLM(device=args.device) as engine:  # (a) cold, then (c) warm in memory
            chat = long_chat(engine)
            results["coding (a) cold"] = ttft(engine, coding_chat(question(0)))
            results["coding (c) warm in memory"] = median(
                [ttft(engine, coding_chat(question(10 + i))) for i in range(ROUNDS)]
            )
            results["long chat (a) cold"] = ttft(engine, chat + [{"role": "user", "content": follow_up(0)}])
            results["long chat (c) warm in memory"] = median(
                [ttft(engine, chat + [{"role": "user", "content": follow_up(10 + i)}]) for i in range(ROUNDS)]
            )
            stats = engine.stats()
        results["block_bytes"] = stats.block_bytes
        results["disk bytes per block"] = stats.disk_bytes / max(stats.disk_blocks, 1)
        results["disk bytes after the runs"] = stats.disk_bytes

        coding, longer = [], []
        for i in range(ROUNDS):  # (b): each a new process, the tier's files in the page cache
            with AsyncLLM(device=args.device) as engine:
                coding.append(ttft(engine, coding_chat(question(30 + i))))
                longer.append(ttft(engine, chat + [{"role": "user", "content": follow_up(30 + i)}]))
        results["coding (b) new process, page cache warm"] = median(coding)
        results["long chat (b) new process, page cache warm"] = median(longer)
        dropped = drop_page_cache()
        results["page cache dropped for (b) cold"] = dropped
        if dropped:
            with AsyncLLM(device=args.device) as engine:
                results["coding (b) new process, page cache dropped"] = ttft(engine, coding_chat(question(50)))
                results["long chat (b) new process, page cache dropped"] = ttft(
                    engine, chat + [{"role": "user", "content": follow_up(50)}]
                )
        with AsyncLLM(device=args.device) as tier_on, AsyncLLM(device=args.device, kv_disk=False) as tier_off:
            on, off = [], []
            for i in range(DECODE_ROUNDS):  # interleaved, first one then the other, so drift hits both alike
                pair = [(on, tier_on), (off, tier_off)]
                for rates, engine in pair if i % 2 == 0 else reversed(pair):
                    rates.append(decode_rate(engine, i))
            written = tier_on.stats()
        results["disk write MB/s (writer thread, during decode)"] = (
            written.disk_bytes_written / 1e6 / max(written.disk_write_s, 1e-9)
        )
    results["decode tok/s, tier on"] = statistics.median(on)
    results["decode tok/s, tier off"] = statistics.median(off)
    results["decode tok/s, tier on, each round"] = on
    results["decode tok/s, tier off, each round"] = off
    results["decode on/off"] = results["decode tok/s, tier on"] / results["decode tok/s, tier off"]
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

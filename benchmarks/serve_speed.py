"""What does HTTP cost? 32 streaming clients against `localpaged serve`, against the same 32 requests in-process.

- ``http``: `localpaged serve` started here as a subprocess on a free loopback port, and 32 clients
  at once through the official async OpenAI client (one event loop, streaming, with usage).
- ``in-process``: the same 32 requests through ``AsyncLLM.stream`` in this process. The engine core
  runs in its own process in both cases (the default), so they differ by the HTTP layer alone:
  the server's front end, SSE encoding, the sockets and the client's parsing.

Every request is greedy, shares one system prompt (so the prefix cache serves it after the first
round) and generates exactly ``--tokens`` tokens (EOS ignored: the server takes vLLM's extra body
field ``ignore_eos``). Rounds alternate between the two, ``--repeat`` times each; every round asks
new questions (so only the system prompt is cached, as with real clients), and each contender's
best round counts: these machines drift by +-20% from minute to minute.

Reported per contender: aggregate tok/s (all generated tokens / the round's wall time) and time to
first token p50/p99 (from sending a request to its first token arriving); then HTTP against
in-process as ratios (the goal: tok/s at least 0.9x). Wall-clock figures swing with whatever else
runs on the machine, so each round also records the CPU time of everything but the engine core:
this process (in-process: the front end and its consumers; http: the 32 clients) plus, for http,
the server's front end. Per generated token, that is the HTTP layer's cost in CPU, which other load
on the machine moves far less than it moves wall time. Results go to benchmarks/results/serve_speed.json.

    python benchmarks/serve_speed.py [--clients 32] [--tokens 128] [--repeat 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from kv_folder import own_kv_folder

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "serve_speed.json"
SYSTEM = (
    "You are a patient assistant for a team of engineers. Answer in plain words, explain each step, "
    "prefer short examples, say when you are unsure, and never invent facts, names or numbers."
)
TOPICS = [
    "hash tables", "virtual memory", "TCP handshakes", "garbage collection", "B-trees", "DNS", "mutexes",
    "page caches", "RAID levels", "Bloom filters", "consistent hashing", "TLS certificates", "compilers",
    "the Linux scheduler", "SSDs", "bit rot", "load balancers", "CRDTs", "vector clocks", "JIT compilers",
    "copy-on-write", "file systems", "UTF-8", "floating point", "RSA", "interrupts", "DMA", "NUMA",
    "cache coherence", "branch prediction", "SIMD", "the OOM killer",
]  # fmt: skip


def conversations(clients: int, round_no: int) -> list[list[dict]]:
    """One conversation per client: the shared system prompt and a question of its own, new each round."""
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Round {round_no}: explain {TOPICS[i % len(TOPICS)]} (client {i})."},
        ]
        for i in range(clients)
    ]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with 32 samples, p99 is the slowest request."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (every thread), or of process ``pid`` (Linux: /proc)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def summary(started: float, ends: list[float], ttfts: list[float], tokens: list[int], cpu: dict[str, float]) -> dict:
    """A round's figures; ``cpu``: CPU seconds by part ("front" is everything but the engine core)."""
    wall = max(ends) - started
    return {
        "tok_s": sum(tokens) / wall,
        "wall_s": wall,
        "tokens": sum(tokens),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        **{f"{part}_cpu_ms_per_token": 1000 * seconds / sum(tokens) for part, seconds in cpu.items()},
    }


# ----- the two contenders ---------------------------------------------------------------------------


async def in_process_round(engine, convs: list[list[dict]], tokens: int) -> dict:
    from localpaged import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started, cpu = time.perf_counter(), cpu_s()

    async def one(messages: list[dict]) -> tuple[float, float, int]:
        sent = time.perf_counter()
        first = None
        async for out in engine.stream(messages, params):
            if first is None and out.token_ids:
                first = time.perf_counter() - sent
        return first, time.perf_counter(), len(out.token_ids)

    results = await asyncio.gather(*(one(c) for c in convs))
    cpu = {"front": cpu_s() - cpu}
    return summary(started, [r[1] for r in results], [r[0] for r in results], [r[2] for r in results], cpu)


async def http_round(client, server_pid: int, model: str, convs: list[list[dict]], tokens: int) -> dict:
    started, client_cpu, server_cpu = time.perf_counter(), cpu_s(), cpu_s(server_pid)

    async def one(messages: list[dict]) -> tuple[float, float, int]:
        sent = time.perf_counter()
        first, generated = None, 0
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - sent
            if chunk.usage is not None:
                generated = chunk.usage.completion_tokens
        return first, time.perf_counter(), generated

    results = await asyncio.gather(*(one(c) for c in convs))
    client_cpu, server_cpu = cpu_s() - client_cpu, cpu_s(server_pid) - server_cpu
    cpu = {"front": client_cpu + server_cpu, "server": server_cpu, "client": client_cpu}
    return summary(started, [r[1] for r in results], [r[0] for r in results], [r[2] for r in results], cpu)


# ----- the server -----------------------------------------------------------------------------------


def start_server(*flags: str) -> tuple[subprocess.Popen, str, str]:
    """`localpaged serve` with ``flags`` on a free port; returns the process, its base URL and the served model's
    name once it serves."""
    command = [sys.executable, "-P", "-m", "localpaged.cli", "serve", "--port", "0", *flags]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    lines = []
    for line in server.stderr:  # "serving NAME at http://127.0.0.1:PORT/v1 (...)"
        lines.append(line)
        if line.startswith("serving "):
            break
    else:
        raise RuntimeError("localpaged serve did not start:\n" + "".join(lines))
    threading.Thread(target=server.stderr.read, daemon=True).start()  # keep its pipe from filling up
    name, url = line.removeprefix("serving ").split(" (", 1)[0].rsplit(" at ", 1)
    return server, url.removesuffix("/v1"), name


async def run(args: argparse.Namespace) -> dict:
    import openai

    from localpaged.engine.async_llm import AsyncLLM

    flags = ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(max(64, args.clients))]
    server, url, _ = start_server(*flags, *(["--model", args.model] if args.model else []))
    engine = AsyncLLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(64, args.clients))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        # A full-size first batch on each engine (its first 32-wide steps ran slower: allocations), and
        # the system prompt into both prefix caches.
        warm = conversations(args.clients, -1)
        await in_process_round(engine, warm, 8)
        await http_round(client, server.pid, model, warm, 8)
        rounds: dict[str, list[dict]] = {"in-process": [], "http": []}
        for r in range(args.repeat):
            convs = conversations(args.clients, r)
            order = ["in-process", "http"] if r % 2 == 0 else ["http", "in-process"]
            for name in order:
                if name == "http":
                    result = await http_round(client, server.pid, model, convs, args.tokens)
                else:
                    result = await in_process_round(engine, convs, args.tokens)
                rounds[name].append(result)
                print(
                    f"  round {r + 1} {name:<11} {result['tok_s']:7.1f} tok/s"
                    f"  {result['front_cpu_ms_per_token']:6.2f} ms CPU/token outside the core",
                    flush=True,
                )
    finally:
        await client.close()
        engine.shutdown()
        server.terminate()
        code = server.wait(timeout=30)
    if code != 0:
        raise RuntimeError(f"localpaged serve exited {code} on SIGTERM (expected 0)")
    return {
        name: max(results, key=lambda x: x["tok_s"])
        | {"front_cpu_ms_per_token": min(x["front_cpu_ms_per_token"] for x in results), "rounds": results}
        for name, results in rounds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2, help="rounds of each contender; each one's best counts")
    parser.add_argument("--model", help="default: the default model")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="the same for both engines")
    args = parser.parse_args()

    print(f"{args.clients} streaming clients, {args.tokens} greedy tokens each, one shared system prompt")
    results = asyncio.run(run(args))
    local, http = results["in-process"], results["http"]
    print(f"\n{'':<12}{'tok/s':>9}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'CPU ms/tok':>12}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['tok_s']:>9.1f}{r['ttft_p50_s']:>12.3f}{r['ttft_p99_s']:>12.3f}"
            f"{r['front_cpu_ms_per_token']:>12.2f}"
        )
    ratios = {
        "tok_s": http["tok_s"] / local["tok_s"],
        "ttft_p50": http["ttft_p50_s"] / local["ttft_p50_s"],
        "ttft_p99": http["ttft_p99_s"] / local["ttft_p99_s"],
    }
    print(
        f"{'http/in-proc':<12}{ratios['tok_s']:>8.2f}x{ratios['ttft_p50']:>11.2f}x{ratios['ttft_p99']:>11.2f}x"
        f"{http['front_cpu_ms_per_token'] - local['front_cpu_ms_per_token']:>+11.2f}   (goal: tok/s >= 0.90x)"
    )
    print("CPU ms/tok: CPU time outside the engine core per generated token (its least over the rounds)")
    print(
        f"  of which, for http: the server's front end {http['server_cpu_ms_per_token']:.2f}, "
        f"the {args.clients} OpenAI clients {http['client_cpu_ms_per_token']:.2f} (best round)"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"clients": args.clients, "tokens": args.tokens, "results": results, "ratios": ratios}, indent=2)
        + "\n"
    )
    print(f"\nwrote {RESULTS.relative_to(HERE.parent)}")


if __name__ == "__main__":
    with own_kv_folder():  # cold means cold: no blocks from earlier runs
        main()

"""Soak: many sessions on a pool too small for them, random aborts and disconnects; then SIGKILLed writers.

1. ``--sessions`` (200) conversations in one AsyncLLM for ``--minutes``, on a block pool that holds a
   quarter of them at half the context (their average size), so the scheduler preempts all along. Every turn is one of: read
   to the end, abort after a few tokens (``AsyncLLM.abort``), walk away mid-stream (close the stream,
   as a client that hangs up), or be cancelled while waiting (a task cancelled by a timeout). When
   time is up every session finishes its turn, the engine drains, and the pool is checked: blocks
   still used (leaked) and ``check_integrity()``.
2. ``--kills`` (20) ``localpaged run`` processes, four at a time, writing to one chat database, each
   SIGKILLed after a random part of its reply has reached stdout. Then every run's turn is read back:
   its user message must be stored, and its reply stored as complete, partial or error, with text
   that agrees with what was streamed (one is a prefix of the other). Text streamed in the last
   moments before a kill is counted apart: replies are saved every ``SAVE_EVERY_S`` (0.5 s) while
   they stream, so up to that much of a reply's tail can be lost to SIGKILL by design.

3. ``--hostile`` (on by default; 0 skips): ``--clients`` (32) clients stream from ``localpaged serve`` for
   ``--hostile-seconds`` (20) alone, then as long again while one more client sends the worst requests it can,
   in turn: a body just under the server's limit, the most and longest stop strings allowed on a long prompt,
   and a prompt at the context's limit. The others' inter-token latency p99 with the hostile client must stay
   within 2x of the p99 without it; blocks left used once the server drains, and streams of the others that
   failed (their replies lost), must both be 0.

The model is a tiny random Llama on the default model's tokenizer (fast enough to churn many turns
on a laptop CPU) unless ``--model`` names another. Not part of ``make test``::

    python benchmarks/soak.py [--minutes 1] [--sessions 200] [--kills 20] [--hostile 1] [--clients 32]
        [--hostile-seconds 20] [--model PATH] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from localpaged import LLM, AsyncLLM, SamplingParams
from localpaged.chat.session import SAVE_EVERY_S
from localpaged.errors import LocalpagedError, RequestError

BLOCK_TOKENS = 16
MAX_MODEL_LEN = 256
SYSTEM = "You are a terse assistant. Answer in one short paragraph, plainly, without lists."
SYSTEM_TOKENS, TURN_TOKENS = 40, 8  # generous: the system prompt in its template, one turn's markers
WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "orange",
    "copper",
    "winter",
    "garden",
    "signal",
    "paper",
    "engine",
    "quiet",
    "thunder",
]


@dataclass
class Tally:
    turns: int = 0
    completed: int = 0
    aborted: int = 0
    walked_away: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)


def write_tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer (the tests' tiny model)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from localpaged.models.loader import resolve_model

    source = resolve_model(None).folder
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


# -- 1. sessions on a small pool --------------------------------------------------------------------


async def converse(engine: AsyncLLM, rng: random.Random, until: float, tally: Tally, index: int) -> None:
    """One session: turns until time is up; each turn read fully, aborted, walked away from, or cancelled."""
    history = [{"role": "system", "content": SYSTEM}]
    # The context's length, over-estimated without the tokenizer (encode_chat is a blocking call to the
    # core thread here, which would serialise every session through it): 2 tokens a word or reply token.
    used = SYSTEM_TOKENS
    turn = 0
    while time.monotonic() < until:
        turn += 1
        words = rng.randint(3, 30)
        history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=words))})
        used += 2 * words + TURN_TOKENS
        if used > MAX_MODEL_LEN - 80:
            history = [history[0], history[-1]]  # a new conversation on the same system prompt
            used = SYSTEM_TOKENS + 2 * words + TURN_TOKENS
        kind = rng.choices(["complete", "abort", "walk_away", "cancel"], weights=[70, 10, 10, 10])[0]
        # A turn to be cut runs to the context's end unless cut: a short one would often be over in the
        # engine before a consumer 200 tasks deep reads its first tokens, and the abort would find nothing.
        max_tokens = rng.randint(4, 64) if kind in ("complete", "cancel") else MAX_MODEL_LEN
        params = SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]), ignore_eos=True)
        request_id = f"s{index}-t{turn}"
        cut = rng.randint(1, 8)
        tally.turns += 1
        text, generated = "", 64
        try:
            if kind == "cancel":
                await asyncio.wait_for(_read_all(engine, history, params, request_id), timeout=rng.uniform(0.01, 1.0))
                kind = "complete"  # it finished before the timeout
            else:
                stream = engine.stream(history, params, request_id=request_id)
                async for out in stream:
                    text, generated = text + out.delta, len(out.token_ids)
                    if len(out.token_ids) >= cut and not out.finished and kind == "abort":
                        try:
                            await engine.abort(request_id)
                            kind = "aborted"
                        except RequestError:  # it finished in the engine before the abort arrived
                            pass
                    elif len(out.token_ids) >= cut and not out.finished and kind == "walk_away":
                        await stream.aclose()
                        kind = "walked_away"
                        break
            tally.completed += kind in ("complete", "abort", "walk_away")  # the reply ended before the cut
            tally.aborted += kind == "aborted"
            tally.walked_away += kind == "walked_away"
        except TimeoutError:
            tally.cancelled += 1
        except LocalpagedError as exc:
            tally.errors.append(f"{request_id}: {type(exc).__name__}: {exc}")
        history.append({"role": "assistant", "content": text})
        used += 2 * generated + TURN_TOKENS


async def _read_all(engine: AsyncLLM, history: list[dict], params: SamplingParams, request_id: str) -> None:
    async for _ in engine.stream(history, params, request_id=request_id):
        pass


async def drained(engine: AsyncLLM, timeout: float = 60.0) -> dict:
    """The engine's stats once nothing runs or waits (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats.running == 0 and stats.waiting == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def soak_sessions(model: str, device: str, sessions: int, minutes: float, seed: int) -> dict:
    probe = LLM(model, dtype="float32", device=device, kv_cache_memory="1MiB", max_model_len=MAX_MODEL_LEN)
    block_bytes = probe.block_bytes
    del probe
    # A quarter of the sessions at half the context, about a conversation's average size here.
    blocks = sessions // 4 * (MAX_MODEL_LEN // 2 // BLOCK_TOKENS)
    llm = LLM(
        model,
        dtype="float32",
        device=device,
        kv_cache_memory=blocks * block_bytes,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=sessions,
    )
    engine = AsyncLLM(llm=llm)  # the core on a thread of this process, so the pool can be checked at the end
    tally = Tally()
    started = time.monotonic()

    async def run() -> dict:
        until = time.monotonic() + minutes * 60
        rngs = [random.Random(seed * 100_003 + i) for i in range(sessions)]
        await asyncio.gather(*(converse(engine, rngs[i], until, tally, i) for i in range(sessions)))
        return await drained(engine)

    try:
        stats = asyncio.run(run())
        llm.pool.check_integrity()
    finally:
        engine.shutdown()
    return {
        "sessions": sessions,
        "minutes": (time.monotonic() - started) / 60,
        "blocks_total": stats.blocks_total,
        "turns": tally.turns,
        "completed": tally.completed,
        "aborted": tally.aborted,
        "walked_away": tally.walked_away,
        "cancelled": tally.cancelled,
        "preemptions": stats.preemptions,
        "blocks_leaked": stats.blocks_used,
        "errors": tally.errors,
    }


# -- 2. SIGKILLed writers ------------------------------------------------------------------------------


@dataclass
class Killed:
    message: str
    streamed: str
    killed: bool


def run_and_kill(model: str, db: Path, message: str, home: Path) -> subprocess.Popen:
    """Start ``localpaged run MESSAGE`` on ``db``, in ``home`` (its config.toml, not the user's, applies)."""
    command = [sys.executable, "-m", "localpaged.cli", "run", message, "--db", str(db), "--model", model]
    command += ["--max-tokens", "400", "--temperature", "0.8"]
    env = {**os.environ, "LOCALPAGED_HOME": str(home)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)


def watch(process: subprocess.Popen, message: str, chars: int, deadline: float) -> Killed:
    """Read the reply as it streams; SIGKILL the process once ``chars`` characters are out (or it ends)."""
    data = b""
    fd = process.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break  # it finished before we got to kill it
            data += chunk
            if len(data.decode("utf-8", "ignore")) >= chars:
                process.send_signal(signal.SIGKILL)
                process.wait()
                return Killed(message, data.decode("utf-8", "ignore"), True)
    process.kill()
    process.wait()
    return Killed(message, data.decode("utf-8", "ignore").rstrip("\n"), False)


def soak_kills(model: str, kills: int, seed: int, folder: Path) -> dict:
    db = folder / "chats.db"
    (folder / "config.toml").write_text('[engine]\nkv_cache_memory = "64MiB"\nmax_model_len = 1024\n')
    rng = random.Random(seed)
    results: list[Killed] = []
    started = time.monotonic()
    for wave in range(0, kills, 4):
        batch = []
        for i in range(wave, min(wave + 4, kills)):
            message = f"soak {i}: " + " ".join(rng.choices(WORDS, k=8))
            batch.append((run_and_kill(model, db, message, folder), message, rng.randint(1, 300)))
        deadline = time.monotonic() + 120
        results += [watch(process, message, chars, deadline) for process, message, chars in batch]
    conn = sqlite3.connect(db)
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    lost, unsaved_chars, unsaved_turns = [], 0, 0
    for result in results:
        user = conn.execute(
            "SELECT session_id, id FROM messages WHERE role = 'user' AND content = ?", (result.message,)
        )
        row = user.fetchone()
        if row is None:
            lost.append(f"{result.message!r}: the user message is not stored")
            continue
        reply = conn.execute(
            "SELECT content, status FROM messages WHERE session_id = ? AND role = 'assistant' AND id > ?", row
        ).fetchone()
        if reply is None:
            lost.append(f"{result.message!r}: no reply stored, {len(result.streamed)} characters were streamed")
            continue
        content, status = reply
        if status not in ("complete", "partial", "error"):
            lost.append(f"{result.message!r}: reply stored with status {status!r}")
        elif not (result.streamed.startswith(content) or content.startswith(result.streamed)):
            lost.append(
                f"{result.message!r}: stored text {content[:40]!r} disagrees with streamed {result.streamed[:40]!r}"
            )
        elif len(content) < len(result.streamed):
            unsaved_turns += 1
            unsaved_chars += len(result.streamed) - len(content)
    conn.close()
    return {
        "kills": sum(r.killed for r in results),
        "runs": len(results),
        "minutes": (time.monotonic() - started) / 60,
        "integrity": integrity,
        "messages_lost": lost,
        "unsaved_tail_turns": unsaved_turns,
        "unsaved_tail_chars": unsaved_chars,
    }


# -- 3. one hostile client among many ---------------------------------------------------------------


async def hostile_check(url: str, model: str, clients: int, seconds: float) -> dict:
    """Inter-token gaps of ``clients`` streams without, then with, a client sending the worst requests it can."""
    import json
    import urllib.error
    import urllib.request

    import openai

    from localpaged.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
    from localpaged.server.guard import MAX_BODY_BYTES

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    gaps: dict[str, list[float]] = {"alone": [], "hostile": []}
    phase, failed, hostile_sent = ["alone"], [], [0]
    stop = time.monotonic() + 2 * seconds

    async def stream(index: int) -> None:
        while time.monotonic() < stop:
            messages = [{"role": "user", "content": f"{WORDS[index % len(WORDS)]} number {index}: say more"}]
            try:
                chunks = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=48, stream=True, extra_body={"ignore_eos": True}
                )
                last = None
                async for chunk in chunks:
                    now = time.perf_counter()
                    if chunk.choices and chunk.choices[0].delta.content:
                        if last is not None:
                            gaps[phase[0]].append(now - last)
                        last = now
            except openai.APIError as exc:
                failed.append(f"client {index}: {exc}")

    async def hostile() -> None:
        worst = [
            ("/v1/completions", {"model": model, "prompt": "x" * (MAX_BODY_BYTES - 4096), "max_tokens": 8}),
            (
                "/v1/completions",
                {
                    "model": model,
                    "prompt": "paging " * 1500,
                    "stop": [f"{i}" * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)],
                    "max_tokens": 48,
                },
            ),
            ("/v1/completions", {"model": model, "prompt": "word " * (MAX_MODEL_LEN - 2), "max_tokens": 1}),
        ]

        def post(path: str, body: dict) -> None:
            request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST")
            request.add_header("Content-Type", "application/json")
            try:
                urllib.request.urlopen(request, timeout=120).read()
            except urllib.error.HTTPError as refused:  # the 400s it earns: what matters is what the others see
                refused.read()

        while time.monotonic() < stop:
            for path, body in worst:
                await asyncio.to_thread(post, path, body)
                hostile_sent[0] += 1

    async def switch() -> None:
        await asyncio.sleep(seconds)
        phase[0] = "hostile"
        await hostile()

    await asyncio.gather(switch(), *(stream(i) for i in range(clients)))
    await client.close()

    def p99(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")

    return {"p99_alone_s": p99(gaps["alone"]), "p99_hostile_s": p99(gaps["hostile"]), "failed": failed,
            "hostile_requests": hostile_sent[0], "gaps": {k: len(v) for k, v in gaps.items()}}  # fmt: skip


def soak_hostile(model: str, clients: int, seconds: float, folder: Path) -> dict:
    """``localpaged serve`` (its own home and KV folder) under ``hostile_check``; then the blocks left used."""
    import urllib.request

    env = {**os.environ, "LOCALPAGED_HOME": str(folder / "serve-home"), "LOCALPAGED_KV_CACHE": str(folder / "kv")}
    (folder / "serve-home").mkdir(exist_ok=True)
    (folder / "serve-home" / "config.toml").write_text(f"[engine]\nmax_model_len = {MAX_MODEL_LEN}\n")
    command = [sys.executable, "-m", "localpaged.cli", "serve", "--port", "0", "--model", model]
    command += ["--max-num-seqs", str(clients + 4), "--no-kv-disk"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in server.stderr:  # "serving NAME at http://127.0.0.1:PORT/v1 (...)"
            if line.startswith("serving "):
                break
        else:
            raise RuntimeError("localpaged serve did not start")
        name, url = line.split()[1], line.split(" at ", 1)[1].split("/v1", 1)[0]
        result = asyncio.run(hostile_check(url, name, clients, seconds))

        def metric(lines: list[str], name: str) -> float:
            return next(float(line.split()[-1]) for line in lines if line.startswith(name))

        deadline = time.monotonic() + 60
        while True:
            lines = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode().splitlines()
            if metric(lines, "localpaged_requests_running") == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return {**result, "blocks_leaked": int(metric(lines, "localpaged_kv_blocks_used"))}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="how long the sessions run (part 1)")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--kills", type=int, default=20, help="localpaged run processes to SIGKILL (part 2; 0 skips)")
    ap.add_argument("--model", help="HF folder or .gguf (default: a tiny random Llama on the default tokenizer)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hostile", type=int, default=1, help="part 3: one hostile client among many (0 skips)")
    ap.add_argument("--clients", type=int, default=32, help="streaming clients beside the hostile one (part 3)")
    ap.add_argument("--hostile-seconds", type=float, default=20.0, help="each half of part 3, without and with it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="localpaged-soak-") as tmp:
        model = args.model or str(write_tiny_model(Path(tmp) / "tiny"))
        first = soak_sessions(model, args.device, args.sessions, args.minutes, args.seed)
        second = soak_kills(model, args.kills, args.seed, Path(tmp)) if args.kills else None
        third = soak_hostile(model, args.clients, args.hostile_seconds, Path(tmp)) if args.hostile else None
    print(
        f"sessions {first['sessions']}  turns {first['turns']}  (completed {first['completed']}, aborted "
        f"{first['aborted']}, walked away {first['walked_away']}, cancelled {first['cancelled']})  "
        f"pool {first['blocks_total']} blocks  preemptions {first['preemptions']}  minutes {first['minutes']:.1f}  "
        f"blocks leaked {first['blocks_leaked']}  errors {len(first['errors'])}"
    )
    for error in first["errors"][:10]:
        print(f"  error: {error}")
    if second:
        print(
            f"kills {second['kills']} of {second['runs']} runs  minutes {second['minutes']:.1f}  "
            f"database {second['integrity']}  messages lost {len(second['messages_lost'])}  "
            f"(tails streamed in the last {SAVE_EVERY_S} s before a kill, not yet saved: "
            f"{second['unsaved_tail_chars']} characters in {second['unsaved_tail_turns']} replies)"
        )
        for problem in second["messages_lost"]:
            print(f"  lost: {problem}")
    if third:
        ratio = third["p99_hostile_s"] / third["p99_alone_s"]
        print(
            f"hostile client: {args.clients} streams, inter-token p99 {third['p99_alone_s'] * 1e3:.1f} ms alone, "
            f"{third['p99_hostile_s'] * 1e3:.1f} ms beside {third['hostile_requests']} hostile requests "
            f"({ratio:.2f}x; goal <= 2x)  gaps {third['gaps']}  blocks leaked {third['blocks_leaked']}  "
            f"streams failed (replies lost) {len(third['failed'])}"
        )
        for problem in third["failed"][:10]:
            print(f"  failed: {problem}")
    failed = (
        first["blocks_leaked"]
        or first["errors"]
        or (second and (second["messages_lost"] or second["integrity"] != "ok"))
        or (third and (third["blocks_leaked"] or third["failed"] or third["p99_hostile_s"] > 2 * third["p99_alone_s"]))
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

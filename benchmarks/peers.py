"""localpaged against llama.cpp on the same GGUF, on the same CPU, in one run.

The program our users would otherwise run is llama.cpp, so every speed figure here is a ratio
against it, measured minutes apart (these machines drift by +-20% from minute to minute; only
figures from one run are compared). Both engines get the same GGUF (the default model's), the same
thread count, the same context per session, the same prompt token ids (ours, sent to llama-server
as ids so both compute exactly the same tokens), greedy sampling, EOS ignored.

- **Sessions** (1, 4, 16, 64; 128 new tokens each, 64 at 64 sessions): aggregate tok/s from the
  first request sent to the last reply. Ours in-process (``LLM.generate``); llama-server started
  here on loopback and driven over its HTTP API, one client thread per session, with its default
  settings (``-np N``, cold) and tuned for the workload (``-fa on``, and ``-kvu -fa on`` up to 16
  sessions, slots warm with the system prompt); plus ``llama-batched-bench -pps -kvu -fa on``'s
  decode-only figure. Ratios are against llama-server's best of those at each point.
- **One chat**: decode tok/s after the first token, 256 tokens.
- **Prefill**: cold prefill tok/s of the 2,500-token coding prompt (time to one token on a fresh
  engine without the disk tier, as in the next part), and TTFT of a new question once that system
  prompt is cached.
- **Prefill by length** (``--only prefill`` runs it alone, in a few minutes): cold prefill tok/s of
  fresh prompts of 300, 1,000, 2,500 and 4,000 tokens, ours with the native chunked prefill and
  with torch's gather + SDPA interleaved in one process, llama-server on the same prompts; each
  round runs every length, and the 4,000/300 ratio (the goal: at least 0.7) is the median of the
  rounds' own ratios; and the warm TTFT by route.
- **KV memory at 200 sessions**: a 2,000-token shared system prompt and 300 private tokens each,
  from the block pool's own accounting (the real scheduler and pool, run without a model: they
  never import torch), against the minimum (the shared part once plus the private parts), paged
  without sharing, and what llama.cpp allocates for the same sessions (its KV bytes per token read
  from its own log on a small run; ``-np 200`` without ``-kvu`` reserves each slot's whole context,
  with ``-kvu`` one buffer sized to the total).
- **Latency under load**: inter-token latency p50/p99 of 8 streaming chats while a 4,000-token
  prompt arrives, with chunked prefill (the default 512-token step budget) and without (a budget
  that takes the whole prompt in one step).

Writes benchmarks/results/peers.json and two plots (peers_throughput.png, peers_kv_memory.png;
matplotlib, from the ``bench`` extra). Needs the binaries of ``make bench-peers``; without them it
prints one line saying so and exits 0.

    python benchmarks/peers.py [--sessions 1,4,16,64] [--skip-llama] [--only prefill]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from kv_accounting import llama_cells, llama_kvu_tokens, llama_np_tokens
from kv_folder import own_kv_folder
from throughput import QUESTIONS, SYSTEM  # the 16-session workload of throughput.py

LLAMA_CPP_PYTHON_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
CTX_PER_SESSION = 1024  # the sessions workload needs under 500 tokens each
CTX_LONG = 4096  # one chat, the coding prompt
MEMORY_SESSIONS = 200
SHARED_TOKENS, PRIVATE_PROMPT_TOKENS, PRIVATE_REPLY_TOKENS = 2000, 44, 256  # 300 private tokens each
LOAD_PROMPT_TOKENS, LOAD_CHATS = 4000, 8
PREFILL_LENGTHS = (300, 1000, 2500, 4000)  # cold prompts by length; the goal: tok/s at 4,000 >= 0.7x at 300
# Cold prefills run without the disk tier (own_kv_folder already keeps other runs' blocks out): a prompt's blocks,
# written in the background once it is prefilled, took CPU from the prompt measured next (a 300-token prompt right
# after a 4,000-token one: 684-772 tok/s against ~1,000), so a length's figure depended on the one before it.
COLD_ENGINE = {"kv_disk": False}
PREFILL_ROUNDS = 5  # medians; 5 for the 4,000/300 ratio, which 3 left at the mercy of one slow round
ONE_CHAT_ROUNDS = 3
# llama-server tuned for many sessions, each run with its slots warm (the system prompt in every
# slot); its best at each point is the highest of these and its defaults. With -kvu, 64 slots ran
# at 21.5, 28.8 and 33.5 tok/s here (with --no-cache-idle-slots, --cache-ram 0) against 185 without
# it, and each such point takes five minutes, so -kvu runs up to 16 sessions.
# Another file is often one of benchmarks/random_gguf.py's random-weight models, whose greedy text repeats itself:
# speculation would guess it far better than a real model's, so such runs measure decoding without it.
RANDOM_WEIGHTS = {"speculative": "off"}
LLAMA_TUNED = {"llama_fa": ("-fa", "on"), "llama_kvu_fa": ("-kvu", "-fa", "on")}
KVU_MAX_SESSIONS = 16
LABELS = {
    "localpaged": "localpaged",
    "llama_default": "llama-server defaults",
    "llama_fa": "-fa on",
    "llama_kvu_fa": "-kvu -fa on",
}


# ----- llama.cpp ------------------------------------------------------------------------------


def llama_bin_dir() -> Path | None:
    """Where ``make bench-peers`` put the binaries, or None if it has not been run."""
    from localpaged import locations

    folder = locations.peers_cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "bin"
    needed = ("llama-server", "llama-batched-bench")
    return folder if all(os.access(folder / b, os.X_OK) for b in needed) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``llama-server`` on loopback for the length of a ``with`` block; its log kept for reading."""

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, *args: str) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")  # noqa: SIM115
        cmd = [
            str(bin_dir / "llama-server"),
            *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-t", str(threads), "-tb", str(threads), "--no-webui"),
            *args,
        ]
        self.args = " ".join(args)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server {self.args} exited with {self.proc.returncode}:\n{self.log_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server {self.args} did not become ready in 120 s")
            time.sleep(0.2)

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def complete(self, prompt: list[int], n_predict: int) -> tuple[float, dict]:
        """One greedy completion of exactly ``n_predict`` tokens: (wall seconds, the server's reply)."""
        body = json.dumps(
            {
                "prompt": prompt,
                "n_predict": n_predict,
                "temperature": 0.0,
                "ignore_eos": True,
                "cache_prompt": True,
                "stream": False,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", body, {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            reply = json.loads(r.read())
        return time.perf_counter() - start, reply

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def llama_sessions(server: LlamaServer, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate tok/s of ``prompts`` sent at once, one client thread each."""
    produced = [0] * len(prompts)

    def one(i: int) -> None:
        _, reply = server.complete(prompts[i], tokens)
        produced[i] = reply["tokens_predicted"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if sum(produced) != len(prompts) * tokens:
        raise RuntimeError(f"llama-server produced {sum(produced)} tokens, expected {len(prompts) * tokens}")
    return sum(produced) / elapsed


def llama_kv_bytes_per_token(bin_dir: Path, gguf: Path, threads: int) -> tuple[float, str]:
    """KV bytes per token (cell) from llama.cpp's own log line on a small server, and that line.

    The line is logged at verbosity 4 only, so a server is started just for it: verbose logging
    never runs while anything is timed.
    """
    with LlamaServer(bin_dir, gguf, threads, "-np", "1", "-c", "4096", "-lv", "4") as server:
        log = server.log_text()
    m = re.search(r"llama_kv_cache: size\s*=\s*([\d.]+)\s*MiB\s*\(\s*(\d+)\s*cells.*", log)
    if not m:
        raise RuntimeError("no 'llama_kv_cache: size = ... MiB (N cells' line in llama-server's log")
    return float(m.group(1)) * 2**20 / int(m.group(2)), m.group(0).strip()


def batched_bench(
    bin_dir: Path,
    gguf: Path,
    threads: int,
    prompt_len: int,
    tokens: int,
    sessions: list[int],
    flags: tuple[str, ...] = ("-pps", "-kvu", "-fa", "on"),
) -> dict:
    """``llama-batched-bench`` with ``flags``: decode-only tok/s (S_TG) per batch size."""
    ctx = prompt_len + max(sessions) * tokens + 256
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        *("-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads), "-tb", str(threads)),
        *("-npp", str(prompt_len), "-ntg", str(tokens), "-npl", ",".join(map(str, sessions)), *flags),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            batch, s_tg = int(cells[2]), float(cells[7])
            rows[batch] = s_tg
    return rows


# ----- localpaged ------------------------------------------------------------------------------


def read_bandwidth(seconds: float = 3.0) -> float:
    """This machine's streaming read bandwidth in bytes a second: a vectorised sum over 1 GiB on every thread (no
    dependent loads), the best pass of those that fit in ``seconds``. The GiB lies on 2 MiB pages where Linux gives
    them, as the engine's weights do (localpaged/models/huge_pages.py): 4 KiB pages read slower, a bound below what
    the engine reaches."""
    import torch

    from localpaged.models.huge_pages import huge_page_buffer

    data = huge_page_buffer(2**30).view(torch.float32)
    data.fill_(1.0)
    data.sum()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def settled(llm):
    """``llm`` once its packed weights are on huge pages (copied by a thread of their own after a start): what a
    timed figure should see, not the first seconds' copy."""
    llm.settle()
    return llm


def weight_bytes(llm) -> int:
    """The bytes of the loaded model's weights (its packed blocks and float tensors): what a decode step reads."""
    model = llm.runner.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def one_chat_bound(
    llm, bin_dir: Path | None, gguf: Path, threads: int, bandwidth: float, context: int | None = None
) -> dict:
    """One chat's decode (128 tokens) as a fraction of this machine's bound, bandwidth / bytes read a token (the
    weights, and the KV of the context at mid-reply), ours against llama-batched-bench's decode-only figure, the
    better of its defaults and ``-fa on`` (on some CPUs one, on others the other). Ours is the best of
    ONE_CHAT_ROUNDS replies, as the bandwidth is the best of its passes: the machine drifts within a minute.
    ``context``: a chat with that many tokens before the reply (the chat prompt's tokens repeated), a long history."""
    prompt = llm.encode_chat(conversations(1)[0])
    if context is not None:
        prompt = (prompt * (context // len(prompt) + 1))[:context]
    llm.generate([prompt], greedy(2))
    decode = max(llm.generate([prompt], greedy(128))[0].metrics.decode_tokens_per_s for _ in range(ONE_CHAT_ROUNDS))
    kv = llm.block_bytes / llm.resolved.block_size * (len(prompt) + 64)
    ours_bytes = weight_bytes(llm) + kv
    row = {"localpaged": decode, "localpaged_bytes": ours_bytes, "localpaged_bound": decode * ours_bytes / bandwidth}
    if bin_dir is not None:
        peer = max(batched_bench(bin_dir, gguf, threads, len(prompt), 128, [1], f)[1] for f in ((), ("-fa", "on")))
        peer_bytes = gguf.stat().st_size + kv  # llama.cpp reads the file's blocks as they are
        row |= {"llama_decode_only": peer, "llama_bytes": peer_bytes, "llama_bound": peer * peer_bytes / bandwidth}
    return row


def greedy(tokens: int):
    from localpaged import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def ours_sessions(llm, prompts: list[list[int]], tokens: int) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(tokens))
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def conversations(n: int, offset: int = 0) -> list[list[dict]]:
    return [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[(i + offset) % len(QUESTIONS)]}]
        for i in range(n)
    ]


def sessions_point(llm, bin_dir: Path | None, gguf: Path, threads: int, n: int) -> dict:
    tokens = 64 if n >= 64 else 128
    prompts = [llm.encode_chat(c) for c in conversations(n)]
    warm = [llm.encode_chat(c) for c in conversations(n, offset=len(QUESTIONS) // 2)]
    row: dict = {"sessions": n, "tokens_each": tokens}
    llm.generate(warm[:1], greedy(2))  # the system prompt cached, as in llama.cpp's warm slots
    row["localpaged"] = ours_sessions(llm, prompts, tokens)
    if bin_dir is not None:
        ctx = ("-np", str(n), "-c", str(n * CTX_PER_SESSION))
        with LlamaServer(bin_dir, gguf, threads, *ctx) as server:
            row["llama_default"] = llama_sessions(server, prompts, tokens)
        for name, flags in LLAMA_TUNED.items():
            if name == "llama_kvu_fa" and n > KVU_MAX_SESSIONS:
                continue
            with LlamaServer(bin_dir, gguf, threads, *ctx, *flags) as server:
                llama_sessions(server, warm, 2)  # every slot holds the system prompt
                row[name] = llama_sessions(server, prompts, tokens)
        row["llama_best"] = max(row[k] for k in ("llama_default", *LLAMA_TUNED) if k in row)
    peers = ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.startswith("llama_"))
    print(f"  {n:>3} sessions x {tokens}: localpaged {row['localpaged']:.1f} tok/s; {peers}", flush=True)
    return row


def one_chat_and_prefill(bin_dir: Path | None, gguf: Path, threads: int) -> dict:
    """Single-chat decode tok/s, cold prefill tok/s of the coding prompt, and warm-system-prompt TTFT."""
    from localpaged import LLM, load_prompt

    coding = load_prompt("coding")
    cold = [{"role": "system", "content": coding}, {"role": "user", "content": "How do I reverse a list?"}]
    warm = [{"role": "system", "content": coding}, {"role": "user", "content": "What is a closure?"}]
    chat = conversations(1)[0]
    llm = LLM(max_model_len=CTX_LONG, **COLD_ENGINE)
    cold_ids, warm_ids, chat_ids = llm.encode_chat(cold), llm.encode_chat(warm), llm.encode_chat(chat)
    result: dict = {"coding_prompt_tokens": len(cold_ids)}

    ours: dict = {}
    start = time.perf_counter()
    llm.generate(cold_ids, greedy(1))
    ours["cold_prefill_tok_s"] = len(cold_ids) / (time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate(warm_ids, greedy(1))
    ours["warm_ttft_s"] = time.perf_counter() - start
    out = llm.generate(chat_ids, greedy(256))[0]
    ours["decode_tok_s"] = out.metrics.decode_tokens_per_s
    result["localpaged"] = ours
    del llm

    if bin_dir is not None:
        for name, flags in (("llama_default", ()), ("llama_kvu_fa", LLAMA_TUNED["llama_kvu_fa"])):
            peer: dict = {}
            with LlamaServer(bin_dir, gguf, threads, "-np", "1", "-c", str(CTX_LONG), *flags) as server:
                wall, _ = server.complete(cold_ids, 1)
                peer["cold_prefill_tok_s"] = len(cold_ids) / wall
                peer["warm_ttft_s"], _ = server.complete(warm_ids, 1)
                _, reply = server.complete(chat_ids, 256)
                peer["decode_tok_s"] = reply["timings"]["predicted_per_second"]
            result[name] = peer
        result["llama_kv_bytes_per_token"], result["llama_kv_log_line"] = llama_kv_bytes_per_token(
            bin_dir, gguf, threads
        )
    return result


def fresh_prompt(llm, length: int, number: int) -> list[int]:
    """``length`` token ids of plain text (no chat template, whose fixed opening would be a shared first block): a
    numbered line, then the coding prompt repeated. Each number starts a first block of its own, so no two prompts
    share a cached prefix (block hashes chain from the first)."""
    from localpaged import load_prompt

    text = f"Request {number}.\n" + load_prompt("coding")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def prefill_by_length(bin_dir: Path | None, gguf: Path, threads: int) -> dict:
    """Cold prefill tok/s by prompt length (time to one token of a fresh prompt), and warm-system-prompt TTFT.

    Ours with the native chunked prefill and with torch's gather + SDPA (``TorchAttention.native_prefill``) in one
    process; llama-server on the same prompts, a fresh server per setting (nothing cached), defaults and ``-fa on``.
    Each of PREFILL_ROUNDS rounds runs every length (by every route): tok/s are medians over rounds, and the
    longest/shortest ratio is the median of the rounds' own (``median_ratio``).
    """
    from localpaged import LLM, load_prompt

    llm = LLM(str(gguf), max_model_len=CTX_LONG, **COLD_ENGINE)
    path = llm.runner.attention
    routes = {"native": True, "torch": False} if getattr(path, "native_prefill", False) else {"torch": False}
    prompts = {
        n: [fresh_prompt(llm, n, n * 100 + i) for i in range(PREFILL_ROUNDS * len(routes))] for n in PREFILL_LENGTHS
    }
    warmup = fresh_prompt(llm, 64, 0)
    llm.generate(warmup, greedy(1))  # first-call costs (kernel build, allocator) off the clock
    rates: dict = {route: {str(n): [] for n in PREFILL_LENGTHS} for route in routes}
    fresh = {n: iter(prompts[n]) for n in PREFILL_LENGTHS}
    for i in range(PREFILL_ROUNDS):
        for n in PREFILL_LENGTHS:
            for route, native in routes.items():
                path.native_prefill = native
                start = time.perf_counter()
                llm.generate(next(fresh[n]), greedy(1))
                rates[route][str(n)].append(n / (time.perf_counter() - start))
        this_round = [by_length(route, {n: r[i] for n, r in rates[route].items()}) for route in routes]
        print(f"  round {i + 1}, ours: " + "; ".join(this_round) + " tok/s", flush=True)
    ours = {route: {n: statistics.median(r) for n, r in rates[route].items()} for route in routes}
    long_over_short = {route: median_ratio(rates[route]) for route in routes}

    system = {"role": "system", "content": load_prompt("coding")}
    llm.generate(llm.encode_chat([system, {"role": "user", "content": "Hello."}]), greedy(1))  # cached from here on
    ttft: dict = {route: [] for route in routes}
    for i in range(PREFILL_ROUNDS):
        for route, native in routes.items():
            path.native_prefill = native
            question = {"role": "user", "content": f"What is closure number {i} in {route}?"}  # never cached
            ids = llm.encode_chat([system, question])
            start = time.perf_counter()
            llm.generate(ids, greedy(1))
            ttft[route].append(time.perf_counter() - start)
    result: dict = {
        "localpaged": ours,
        "long_over_short": long_over_short,
        "localpaged_warm_ttft_s": {r: statistics.median(t) for r, t in ttft.items()},
    }
    del llm

    if bin_dir is not None:
        for name, flags in (("llama_default", ()), ("llama_fa", LLAMA_TUNED["llama_fa"])):
            peer_rates: dict = {str(n): [] for n in PREFILL_LENGTHS}
            with LlamaServer(bin_dir, gguf, threads, "-np", "1", "-c", str(CTX_LONG), *flags) as server:
                server.complete(warmup, 1)
                for i in range(PREFILL_ROUNDS):
                    for n in PREFILL_LENGTHS:
                        peer_rates[str(n)].append(n / server.complete(prompts[n][i], 1)[0])
            result[name] = {n: statistics.median(r) for n, r in peer_rates.items()}
            result["long_over_short"][name] = median_ratio(peer_rates)
            label = f"llama-server {' '.join(flags) or 'defaults'}"
            print("  " + by_length(label, result[name]) + " tok/s (medians)", flush=True)
    return result


def by_length(label: str, tok_s: dict) -> str:
    """``label`` and tok/s by prompt length, on one line."""
    return f"{label} " + ", ".join(f"{n} {rate:.0f}" for n, rate in tok_s.items())


def median_ratio(rates: dict) -> float:
    """The median over rounds of tok/s at the longest prompt over tok/s at the shortest, each round's pair measured a
    few seconds apart: this machine drifts by 20% from minute to minute, so a ratio of two medians taken minutes
    apart (every round of one length, then of the next) swung from 0.58 to 0.75 between runs."""
    lengths = list(rates)
    return statistics.median(long / short for long, short in zip(rates[lengths[-1]], rates[lengths[0]]))


# ----- KV memory from the pool's accounting ---------------------------------------------------


def pool_blocks_for(sessions: int, block_size: int, sharing: bool) -> int:
    """Blocks the real scheduler and pool hold once ``sessions`` chats have their 300 private tokens.

    Every chat's prompt is the shared 2,000-token prefix plus 44 private tokens, then 256 tokens
    are "generated" (appended, as the engine appends sampled tokens). No model runs: the
    scheduler and pool decide which blocks each sequence holds, exactly as in the engine.
    """
    from localpaged.engine.block_pool import BlockPool
    from localpaged.engine.kv_cache_manager import KVCacheManager, cdiv
    from localpaged.engine.scheduler import Scheduler
    from localpaged.engine.sequence import Sequence

    per_seq = cdiv(SHARED_TOKENS + PRIVATE_PROMPT_TOKENS + PRIVATE_REPLY_TOKENS, block_size)
    pool = BlockPool(sessions * per_seq + 16, block_size, enable_prefix_caching=sharing)
    scheduler = Scheduler(KVCacheManager(pool), max_num_seqs=sessions, max_num_batched_tokens=512)
    shared = [1000 + (i * 7919) % 40000 for i in range(SHARED_TOKENS)]
    seqs = []
    for s in range(sessions):
        private = [50000 + s * 1000 + i for i in range(PRIVATE_PROMPT_TOKENS)]
        seq = Sequence(f"s{s}", shared + private, params=None)
        seqs.append(seq)
        scheduler.add(seq)
    peak = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.on_step_done(batch)
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:  # its prompt is done: it samples a token
                if seq.num_output_tokens == PRIVATE_REPLY_TOKENS:
                    continue
                seq.append_token(7)
        peak = max(peak, pool.num_used_blocks)
        if all(s.num_output_tokens == PRIVATE_REPLY_TOKENS and s.num_uncomputed_tokens <= 1 for s in seqs):
            break
    if scheduler.num_preemptions:
        raise RuntimeError(f"the pool preempted {scheduler.num_preemptions} sequences; give it more blocks")
    return peak


def kv_memory(sessions_list: list[int], block_size: int, ours_bytes_per_token: float, llama_bpt: float | None) -> list:
    rows = []
    total_each = SHARED_TOKENS + PRIVATE_PROMPT_TOKENS + PRIVATE_REPLY_TOKENS
    for n in sessions_list:
        held = pool_blocks_for(n, block_size, sharing=True) * block_size
        unshared = pool_blocks_for(n, block_size, sharing=False) * block_size
        minimum = SHARED_TOKENS + n * (PRIVATE_PROMPT_TOKENS + PRIVATE_REPLY_TOKENS)
        row = {
            "sessions": n,
            "held_tokens": held,
            "minimum_tokens": minimum,
            "unshared_tokens": unshared,
            "waste": (held - minimum) / held,
            "held_bytes": held * ours_bytes_per_token,
            "minimum_bytes": minimum * ours_bytes_per_token,
            "unshared_bytes": unshared * ours_bytes_per_token,
        }
        if llama_bpt is not None:
            row["llama_np_tokens"] = llama_np_tokens(n, total_each)
            row["llama_np_8192_tokens"] = llama_np_tokens(n, 8192)
            row["llama_kvu_tokens"] = llama_kvu_tokens(n * total_each)
            for key in ("llama_np", "llama_np_8192", "llama_kvu"):
                row[f"{key}_bytes"] = row[f"{key}_tokens"] * llama_bpt
        rows.append(row)
    return rows


# ----- latency under load ----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_under_load(chunked: bool) -> dict:
    """Inter-token latency of 8 streaming chats, alone and while a 4,000-token prompt is prefilled.

    "Under load" covers every gap that overlaps the long prompt's prefill: from its arrival to its
    first token. Alone: the 8 steps before it arrives.
    """
    from localpaged import LLM, load_prompt

    budget = 512 if chunked else LOAD_PROMPT_TOKENS + 64
    # No disk tier: the second engine would read the long prompt the first one wrote instead of computing it.
    llm = LLM(max_model_len=8192, max_num_batched_tokens=budget, kv_disk=False)
    long_ids = llm.encode_chat([{"role": "user", "content": load_prompt("coding")}])
    while len(long_ids) < LOAD_PROMPT_TOKENS:
        long_ids = long_ids + long_ids
    long_ids = long_ids[:LOAD_PROMPT_TOKENS]
    chats = [llm.add_request(c, greedy(4000)) for c in conversations(LOAD_CHATS)]
    last: dict[str, float] = {}
    alone: list[float] = []
    while len(last) < len(chats) or len(alone) < 8 * len(chats):  # every chat decoding, then 8 steps
        for out in llm.step():
            now = time.perf_counter()
            if out.request_id in last:
                alone.append(now - last[out.request_id])
            last[out.request_id] = now
    arrival = time.perf_counter()
    long_id = llm.add_request(long_ids, greedy(1))
    loaded: list[float] = []
    long_done = None
    while long_done is None:
        outputs = llm.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == long_id:
                long_done = now
            else:
                loaded.append(now - last[out.request_id])
                last[out.request_id] = now
    for r in chats:
        llm.abort(r)
    return {
        "step_budget": budget,
        "alone_itl_p50_ms": 1000 * statistics.median(alone),
        "itl_p50_ms": 1000 * statistics.median(loaded),
        "itl_p99_ms": 1000 * percentile(loaded, 0.99),
        "itl_max_ms": 1000 * max(loaded),
        "long_prompt_ttft_s": long_done - arrival,
    }


# ----- report ------------------------------------------------------------------------------------


def plot(results: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plots: matplotlib is missing (pip install -e '.[bench]')")
        return []
    paths = []
    rows = results["sessions"]
    x = [r["sessions"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, [r["localpaged"] for r in rows], "o-", label="localpaged")
    if "llama_best" in rows[0]:
        ax.plot(x, [r["llama_best"] for r in rows], "s-", label="llama-server, best of its settings")
        ax.plot(x, [r["llama_default"] for r in rows], "^--", label="llama-server, defaults")
    if results.get("batched_bench"):
        bb = results["batched_bench"]
        ax.plot(x, [bb.get(str(n), float("nan")) for n in x], "x:", label="llama-batched-bench, decode only")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(n) for n in x])
    ax.set_xlabel("chat sessions at once")
    ax.set_ylabel("output tokens/s, all sessions")
    ax.set_title(f"Same GGUF, same CPU ({results['machine']['cpus']} threads)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(RESULTS / "peers_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    mem = results["kv_memory"]
    x = [r["sessions"] for r in mem]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    gib = 2**30
    ax.plot(x, [r["held_bytes"] / gib for r in mem], "o-", label="localpaged pool, prefix shared")
    ax.plot(x, [r["unshared_bytes"] / gib for r in mem], "^--", label="localpaged pool, no sharing")
    if "llama_kvu_bytes" in mem[0]:
        ax.plot(x, [r["llama_kvu_bytes"] / gib for r in mem], "s-", label="llama.cpp -kvu (f16 KV)")
        ax.plot(x, [r["llama_np_8192_bytes"] / gib for r in mem], "x:", label="llama.cpp -np N, 8192 per slot")
    ax.set_xscale("log")
    ax.set_xticks(x, [str(n) for n in x])
    ax.set_yscale("log")
    ax.set_xlabel("chat sessions (2,000 shared + 300 private tokens each)")
    ax.set_ylabel("KV cache, GiB")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(RESULTS / "peers_kv_memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", default="1,4,16,64", help="comma-separated session counts")
    ap.add_argument("--skip-llama", action="store_true", help="our figures only (no ratios)")
    ap.add_argument(
        "--model", help="another GGUF (e.g. a Q4_K_M requantisation): the sessions table only, speculation off"
    )
    ap.add_argument(
        "--only", choices=["prefill"], help="one part alone: prefill, cold prefill tok/s by length (a few minutes)"
    )
    args = ap.parse_args()
    bin_dir = None if args.skip_llama else llama_bin_dir()
    if bin_dir is None and not args.skip_llama:
        print("peers.py: skipped, llama.cpp is not built here; run `make bench-peers` once (about 10 minutes)")
        return
    with own_kv_folder():  # cold means cold: no blocks of an earlier run, none left behind
        run(args, bin_dir)


def run(args: argparse.Namespace, bin_dir: Path | None) -> None:
    import torch

    from localpaged import LLM
    from localpaged.models.loader import default_model_path

    threads = torch.get_num_threads()
    gguf = Path(args.model).expanduser() if args.model else default_model_path()
    points = [int(n) for n in args.sessions.split(",")]
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads},
        "model": gguf.name,
        "llama_cpp": f"vendored in llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}" if bin_dir else None,
    }
    print(f"{gguf.name}, {threads} threads on {cpu_name()}, greedy, EOS ignored")
    if args.only == "prefill":
        print("prefill by length:", flush=True)
        results["prefill_by_length"] = prefill_by_length(bin_dir, gguf, threads)
        report_prefill(results["prefill_by_length"])
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / "peers-prefill.json"
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {out.relative_to(HERE.parent)}")
        return

    print("sessions (aggregate output tok/s):", flush=True)
    llm = settled(LLM(str(gguf), max_model_len=CTX_PER_SESSION, **(RANDOM_WEIGHTS if args.model else {})))
    block_size, ours_bpt = llm.resolved.block_size, llm.block_bytes / llm.resolved.block_size
    prompt_len = len(llm.encode_chat(conversations(1)[0]))
    results["read_bytes_per_s"] = read_bandwidth()
    results["one_chat_bound"] = one_chat_bound(llm, bin_dir, gguf, threads, results["read_bytes_per_s"])
    results["sessions"] = [sessions_point(llm, bin_dir, gguf, threads, n) for n in points]
    llm.close()  # the disk tier's last writes, before own_kv_folder removes its folder
    del llm
    if bin_dir is not None:
        bb = batched_bench(bin_dir, gguf, threads, prompt_len, 128, points)
        results["batched_bench"] = {str(k): v for k, v in bb.items()}
    if args.model:  # another file: its sessions table, beside the default model's full results
        report(results, sessions_only=True)
        out = RESULTS / f"peers-{gguf.stem}.json"
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {out.relative_to(HERE.parent)}")
        return

    print("one chat and prefill:", flush=True)
    results["one_chat"] = one_chat_and_prefill(bin_dir, gguf, threads)
    llama_bpt = results["one_chat"].get("llama_kv_bytes_per_token")

    print("prefill by length:", flush=True)
    results["prefill_by_length"] = prefill_by_length(bin_dir, gguf, threads)

    print("latency under load:", flush=True)
    results["latency"] = {"chunked": latency_under_load(True), "unchunked": latency_under_load(False)}

    results["kv_memory"] = kv_memory([1, 2, 5, 10, 20, 50, 100, MEMORY_SESSIONS], block_size, ours_bpt, llama_bpt)
    results["ours_kv_bytes_per_token"] = ours_bpt

    report(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "peers.json").write_text(json.dumps(results, indent=2) + "\n")
    for path in plot(results):
        print(f"plot: {path.relative_to(HERE.parent)}")
    print(f"results: {(RESULTS / 'peers.json').relative_to(HERE.parent)}")


def report(results: dict, sessions_only: bool = False) -> None:
    bound, gbs = results["one_chat_bound"], results["read_bytes_per_s"] / 1e9
    print(f"\n## One chat against this machine's bound ({gbs:.1f} GB/s read, all threads)")
    print("| | decode tok/s | GB read a token | bound tok/s | fraction of the bound |")
    print("|---|---|---|---|---|")
    for name, label in (("localpaged", "localpaged"), ("llama", "llama-batched-bench, decode only")):
        if f"{name}_bytes" in bound:
            tok_s = bound["localpaged" if name == "localpaged" else "llama_decode_only"]
            read = bound[f"{name}_bytes"]
            print(
                f"| {label} | {tok_s:.1f} | {read / 1e9:.2f} | {gbs * 1e9 / read:.1f} | **{bound[f'{name}_bound']:.0%}** |"
            )
    rows = results["sessions"]
    bb = results.get("batched_bench", {})
    have_llama = "llama_best" in rows[0]
    print("\n## Sessions: aggregate output tok/s")
    if have_llama:
        print(
            "| sessions x tokens | localpaged | llama-server defaults | -fa on, warm | -kvu -fa on, warm"
            " | batched-bench decode only | vs llama-server's best | vs decode only |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            n, decode_only = r["sessions"], bb.get(str(r["sessions"]), float("nan"))
            kvu = f"{r['llama_kvu_fa']:.1f}" if "llama_kvu_fa" in r else "not run"
            print(
                f"| {n} x {r['tokens_each']} | {r['localpaged']:.1f} | {r['llama_default']:.1f} | {r['llama_fa']:.1f}"
                f" | {kvu} | {decode_only:.1f} | **{r['localpaged'] / r['llama_best']:.2f}x** |"
                f" {r['localpaged'] / decode_only:.2f}x |"
            )
    else:
        for r in rows:
            print(f"| {r['sessions']} x {r['tokens_each']} | {r['localpaged']:.1f} |")

    if sessions_only:
        return
    one = results["one_chat"]
    print(f"\n## One chat, prefill, TTFT (coding prompt: {one['coding_prompt_tokens']} tokens)")
    names = [k for k in ("localpaged", "llama_default", "llama_kvu_fa") if k in one]
    print("| | " + " | ".join(LABELS[n] for n in names) + (" | vs llama.cpp's best |" if have_llama else " |"))
    print("|---" * (len(names) + 1 + have_llama) + "|")
    for key, label, better_high in (
        ("decode_tok_s", "one chat, decode tok/s", True),
        ("cold_prefill_tok_s", "cold prefill tok/s", True),
        ("warm_ttft_s", "TTFT, system prompt warm (s)", False),
    ):
        cells = [f"{one[n][key]:.3f}" if key == "warm_ttft_s" else f"{one[n][key]:.1f}" for n in names]
        line = f"| {label} | " + " | ".join(cells)
        if have_llama:
            ours = one["localpaged"][key]
            peer = [one["llama_default"][key], one["llama_kvu_fa"][key]]
            best = max(peer) if better_high else min(peer)
            line += f" | **{(ours / best) if better_high else (best / ours):.2f}x** |"
        print(line + ("" if have_llama else " |"))
    if have_llama:
        print("(above 1 means localpaged is better; for TTFT, llama.cpp's best time over ours)")

    mem = results["kv_memory"][-1]
    mib = 2**20
    print(f"\n## KV memory, {mem['sessions']} sessions: {SHARED_TOKENS} shared + 300 private tokens each")
    print("| | tokens held | MiB |")
    print("|---|---|---|")
    print(
        f"| minimum (shared once + private), our {results['ours_kv_bytes_per_token']:.0f} bytes a token |"
        f" {mem['minimum_tokens']} | {mem['minimum_bytes'] / mib:.0f} |"
    )
    print(f"| localpaged pool, prefix shared | {mem['held_tokens']} | {mem['held_bytes'] / mib:.0f} |")
    print(f"| localpaged pool, no sharing | {mem['unshared_tokens']} | {mem['unshared_bytes'] / mib:.0f} |")
    if "llama_kvu_tokens" in mem:
        print(
            f"| llama.cpp -np 200 -kvu (one buffer, f16) | {mem['llama_kvu_tokens']} | {mem['llama_kvu_bytes'] / mib:.0f} |"
        )
        print(
            f"| llama.cpp -np 200, {llama_cells(SHARED_TOKENS + PRIVATE_PROMPT_TOKENS + PRIVATE_REPLY_TOKENS)} per slot"
            f" (f16) | {mem['llama_np_tokens']} | {mem['llama_np_bytes'] / mib:.0f} |"
        )
        print(
            f"| llama.cpp -np 200, 8192 per slot (f16) | {mem['llama_np_8192_tokens']} | {mem['llama_np_8192_bytes'] / mib:.0f} |"
        )
        print(f"(llama.cpp's KV bytes per token from its log: {results['one_chat']['llama_kv_log_line']})")
    print(f"waste = (held - minimum) / held = {100 * mem['waste']:.2f}% (goal under 4%)")
    print(
        f"tokens held: localpaged {mem['held_tokens']} vs llama.cpp's best {mem.get('llama_kvu_tokens', 'n/a')}: "
        + (f"{mem['llama_kvu_tokens'] / mem['held_tokens']:.1f}x fewer" if "llama_kvu_tokens" in mem else "")
    )

    report_prefill(results["prefill_by_length"])

    lat = results["latency"]
    print(f"\n## Latency under load: {LOAD_CHATS} chats streaming while a {LOAD_PROMPT_TOKENS}-token prompt arrives")
    print("| | step budget | ITL p50 alone, ms | ITL p50 under load | p99 | max | long prompt TTFT s |")
    print("|---|---|---|---|---|---|---|")
    for name in ("chunked", "unchunked"):
        r = lat[name]
        print(
            f"| {name} prefill | {r['step_budget']} | {r['alone_itl_p50_ms']:.0f} | {r['itl_p50_ms']:.0f} | "
            f"{r['itl_p99_ms']:.0f} | {r['itl_max_ms']:.0f} | {r['long_prompt_ttft_s']:.1f} |"
        )


def report_prefill(result: dict) -> None:
    ours = result["localpaged"]
    peers = [name for name in ("llama_default", "llama_fa") if name in result]
    lengths = list(next(iter(ours.values())))
    print("\n## Cold prefill tok/s by prompt length (medians; ours: routes interleaved in one process)")
    header = [f"localpaged {route}" for route in ours] + [LABELS[name] for name in peers]
    extra = ["native / torch"] * ("native" in ours and "torch" in ours) + ["vs llama.cpp's best"] * bool(peers)
    print("| tokens | " + " | ".join(header + extra) + " |")
    print("|---" * (1 + len(header) + len(extra)) + "|")
    best_ours = ours.get("native", ours["torch"])
    for n in lengths:
        cells = [f"{ours[route][n]:.0f}" for route in ours] + [f"{result[name][n]:.0f}" for name in peers]
        if "native" in ours and "torch" in ours:
            cells.append(f"{ours['native'][n] / ours['torch'][n]:.2f}x")
        if peers:
            cells.append(f"**{best_ours[n] / max(result[name][n] for name in peers):.2f}x**")
        print(f"| {n} | " + " | ".join(cells) + " |")
    first, last = lengths[0], lengths[-1]
    ratio = result["long_over_short"]
    ratios = [f"localpaged {route} {ratio[route]:.2f}" for route in ours]
    ratios += [f"{LABELS[name]} {ratio[name]:.2f}" for name in peers]
    print(
        f"tok/s at {last} tokens / at {first}, the median of each round's (goal >= 0.7 for ours): " + ", ".join(ratios)
    )
    ttft = result["localpaged_warm_ttft_s"]
    print(
        "TTFT of a new question, coding system prompt cached (s): "
        + ", ".join(f"{route} {seconds:.3f}" for route, seconds in ttft.items())
    )


if __name__ == "__main__":
    main()

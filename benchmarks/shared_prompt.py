"""Many users at once with one long system prompt, with cascade (shared-prefix) attention on and off, in one run.

The workload shared-prefix attention is for: U users arrive together, each with the same S-token
system prompt and a short question of their own (distinct per user), and each gets T new tokens,
greedy, EOS ignored. For each number of users, two engines (``EngineConfig.cascade_attention``
True and False) run it in turn, each run on a system prompt of its own so that nothing is cached
(the disk tier is off: cold means cold, and its background writes would take CPU from the run
measured next); rounds alternate which engine goes first. Per configuration:

- the first user's prefill (its time to first token: the whole system prompt computed), the time
  until every user has its first token (the last TTFT) and the median TTFT;
- aggregate decode tok/s over decode-only steps (every scheduled sequence one token), and the mean
  time of the decode-only steps that run the most users (all U, unless the first users finish before
  the last are admitted, as with few new tokens each) (the goal: a step at 64 users at most 2x one
  at 8);
- the pool's KV at its peak (used blocks just after a step is scheduled) against (a) the minimum
  for the tokens the live users hold at that step: the system prompt's full blocks once plus each
  user's own tokens in whole blocks (users finish a few steps apart, and later ones are admitted
  while the first decode, so no step need hold every whole context: the pool is judged against
  what it holds); (b) the same users without sharing, each its whole context (prompt + T) in
  blocks; (c) what llama.cpp reserves for them, each with its whole context: llama-server ``-np U``
  (a slot each, all reserved) and ``-kvu`` (one buffer). The JSON has (a) for whole contexts and
  (b) at the peak step too.

Ratios on/off are the medians of each round's own ratio (the two measured a minute apart: these
machines drift by 20% from minute to minute). Writes benchmarks/results/shared_prompt.json (with
``--model``: shared_prompt-<file>.json) and prints a Markdown table.

    python benchmarks/shared_prompt.py [--users 8,64] [--shared-tokens 8000] [--new-tokens 32]
        [--model PATH] [--rounds 2] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from kv_accounting import f16_kv_bytes_per_token, llama_kvu_tokens, llama_np_tokens
from kv_folder import own_kv_folder
from peers import cpu_name, llama_bin_dir, llama_kv_bytes_per_token
from step_trace import run_traced
from throughput import QUESTIONS

DEFAULTS = {"users": "8,64", "shared_tokens": 8000, "new_tokens": 32, "rounds": 2}
QUICK = {"users": "2,4", "shared_tokens": 256, "new_tokens": 4, "rounds": 1}  # a smoke run, a minute or so
PROMPT_NAMES = ("coding", "general", "tutor", "concise")  # the shipped prompts: the system prompt's text
# One token a step: this measures shared-prefix attention alone (spec_decode.py measures speculation).
ENGINE = {"kv_disk": False, "speculative": "off"}
# Pool room past every user's whole context: one step's tokens at the largest default budget, which a
# user admitted while the system prompt's last chunk runs computes again (those blocks were not cached yet).
MARGIN_TOKENS = 8192
CONFIGS = {"on": True, "off": False}
TIMES = ("first_prefill_s", "ttft_last_s", "ttft_median_s", "decode_step_ms")
RATES = ("decode_tok_s",)
MIB = 2**20


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----- the workload ---------------------------------------------------------------------------


def system_prompt(tokenizer, tokens: int, run: int) -> str:
    """About ``tokens`` tokens of the shipped prompts' text, repeated, after a line naming the run: each run's
    first block is its own, so no run finds another's blocks cached (block hashes chain from the first)."""
    from localpaged import load_prompt

    text = "\n\n".join(load_prompt(name) for name in PROMPT_NAMES)
    body = tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(f"Run {run}.\n", add_special_tokens=False)
    while len(ids) < tokens:
        ids += body
    return tokenizer.decode(ids[:tokens])


def user_prompts(tokenizer, shared_tokens: int, users: int, run: int) -> list[list[int]]:
    """Every user's chat prompt: the run's system prompt and a question of the user's own."""
    from localpaged.engine.tokenizer import encode_chat

    system = {"role": "system", "content": system_prompt(tokenizer, shared_tokens, run)}
    questions = [f"I am user {i + 1}. {QUESTIONS[i % len(QUESTIONS)]}" for i in range(users)]
    return [encode_chat(tokenizer, [system, {"role": "user", "content": q}]) for q in questions]


def common_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (the whole prompt for one user)."""
    n = len(prompts[0])
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(prompts[0][:n], p)) if a != b), min(n, len(p)))
    return n


# ----- KV accounting --------------------------------------------------------------------------


def minimum_blocks(held: list[int], shared_full: int, block: int) -> int:
    """Blocks for ``held`` tokens per user when the first ``shared_full`` (whole blocks) are held once."""
    shared = max(min(h, shared_full) for h in held)
    return cdiv(shared, block) + sum(cdiv(h - min(h, shared_full), block) for h in held)


def whole_context_blocks(prompts: list[list[int]], new_tokens: int, block: int) -> tuple[int, int]:
    """Blocks for every user at its whole context (prompt + new tokens): the minimum, sharing the common prefix's
    whole blocks, and without sharing."""
    shared_full = common_prefix(prompts) // block * block
    whole = [len(p) + new_tokens for p in prompts]
    return minimum_blocks(whole, shared_full, block), sum(cdiv(n, block) for n in whole)


def pool_blocks_needed(prompts: list[list[int]], new_tokens: int, block: int) -> int:
    """The minimum for every user's whole context, plus MARGIN_TOKENS."""
    return whole_context_blocks(prompts, new_tokens, block)[0] + cdiv(MARGIN_TOKENS, block)


# ----- engines and runs -----------------------------------------------------------------------


def make_engines(model: str | None, files, blocks: int, block_bytes: int, max_model_len: int, max_seqs: int) -> dict:
    """An engine per configuration, each with a pool of ``blocks`` blocks and warmed up.

    ``block_bytes`` is a 16-bit KV's; where the engine's KV dtype differs, the first engine is made
    again with its own block size.
    """
    from localpaged import LLM, SamplingParams

    def make(cascade: bool, size: int) -> LLM:
        return LLM(
            model,
            model_files=files,
            cascade_attention=cascade,
            kv_cache_memory=blocks * size,
            max_model_len=max_model_len,
            max_num_seqs=max_seqs,
            **ENGINE,
        )

    engines = {}
    for name, cascade in CONFIGS.items():
        llm = make(cascade, block_bytes)
        if llm.block_bytes != block_bytes:
            block_bytes = llm.block_bytes
            llm.close()
            del llm
            llm = make(cascade, block_bytes)
        # First-call costs off the clock: a batch of two, as the first run's first batched prefill and decode
        # otherwise took seconds more than the next.
        warmup = [[1000 + i for i in range(64)], [2000 + i for i in range(64)]]
        llm.generate(warmup, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        engines[name] = llm
    return engines


def measure(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """One run of the workload on ``llm``: timings, and the KV accounting in blocks at the pool's peak step."""
    from localpaged import SamplingParams

    trace = run_traced(llm, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    if trace.preemptions:
        raise RuntimeError(f"the pool preempted {trace.preemptions} sequences; give it more blocks")
    short = [r for r in trace.request_ids if trace.token_counts.get(r) != new_tokens]
    if short:
        raise RuntimeError(f"{len(short)} users got fewer than {new_tokens} tokens")
    block = llm.config.block_size
    shared = common_prefix(prompts)
    ttfts = trace.ttfts()
    decode = [s for s in trace.steps if s.decode_only]
    widest = max((s.seqs for s in decode), default=0)
    widest_steps = [s for s in decode if s.seqs == widest]
    peak = max(trace.steps, key=lambda s: s.used_blocks)
    minimum_whole, unshared_whole = whole_context_blocks(prompts, new_tokens, block)
    return {
        "shared_prefix_tokens": shared,
        "context_max": max(map(len, prompts)) + new_tokens,
        "context_total": sum(map(len, prompts)) + len(prompts) * new_tokens,
        "first_prefill_s": ttfts[0],
        "ttft_median_s": statistics.median(ttfts),
        "ttft_last_s": max(ttfts),
        "wall_s": trace.steps[-1].end - trace.start,
        "decode_tok_s": sum(s.seqs for s in decode) / sum(s.end - s.start for s in decode) if decode else None,
        "decode_step_ms": 1000 * statistics.mean(s.end - s.start for s in widest_steps) if widest_steps else None,
        "decode_batch": widest,
        "decode_steps": len(decode),
        "peak_blocks": peak.used_blocks,
        "minimum_blocks": minimum_blocks(peak.held, shared // block * block, block),
        "unshared_blocks": sum(cdiv(h, block) for h in peak.held),
        "minimum_whole_blocks": minimum_whole,
        "unshared_whole_blocks": unshared_whole,
    }


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def summarize(users: int, runs: dict[str, list[dict]], block_bytes: int, llama_bpt: float) -> dict:
    """Medians per configuration, the median per-round ratio on/off, and the KV figures in bytes."""
    point: dict = {"users": users, "shared_prefix_tokens": runs["on"][0]["shared_prefix_tokens"], "runs": runs}
    for name, rs in runs.items():
        m = {key: median_of(rs, key) for key in rs[0] if key != "shared_prefix_tokens"}
        for key in ("peak", "minimum", "unshared", "minimum_whole", "unshared_whole"):
            m[f"{key}_bytes"] = m[f"{key}_blocks"] * block_bytes
        m["waste"] = (m["peak_blocks"] - m["minimum_blocks"]) / m["peak_blocks"]
        point[name] = m
    ratios = {}
    for key in (*TIMES, *RATES, "peak_blocks"):
        pairs = [on[key] / off[key] for on, off in zip(runs["on"], runs["off"]) if on[key] and off[key]]
        ratios[key] = statistics.median(pairs) if pairs else None
    point["on_over_off"] = ratios
    first = runs["on"][0]  # every run's users hold the same contexts, to a token
    point["llama_np_tokens"] = llama_np_tokens(users, first["context_max"])
    point["llama_kvu_tokens"] = llama_kvu_tokens(first["context_total"])
    point["llama_np_bytes"] = point["llama_np_tokens"] * llama_bpt
    point["llama_kvu_bytes"] = point["llama_kvu_tokens"] * llama_bpt
    return point


# ----- the run ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", help=f"comma-separated numbers of users (default {DEFAULTS['users']})")
    ap.add_argument("--shared-tokens", type=int, help=f"system prompt tokens (default {DEFAULTS['shared_tokens']})")
    ap.add_argument("--new-tokens", type=int, help=f"new tokens per user (default {DEFAULTS['new_tokens']})")
    ap.add_argument("--model", help="a GGUF (e.g. one of benchmarks/random_gguf.py's, for a longer context)")
    ap.add_argument("--rounds", type=int, help=f"rounds of on and off (default {DEFAULTS['rounds']})")
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes for a smoke run: {QUICK}")
    ap.add_argument("--out", type=Path, help="the JSON file (default benchmarks/results/shared_prompt*.json)")
    args = ap.parse_args(argv)
    for key, default in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    args.users = [int(n) for n in str(args.users).split(",")]
    if min(args.users) < 1 or args.shared_tokens < 1 or args.new_tokens < 2 or args.rounds < 1:
        ap.error("users, --shared-tokens and --rounds must be at least 1, --new-tokens at least 2")
    if args.out is None:
        stem = "shared_prompt" + (f"-{Path(args.model).stem}" if args.model else "") + ("-quick" if args.quick else "")
        args.out = RESULTS / f"{stem}.json"
    return args


def run(args: argparse.Namespace) -> dict:
    import torch

    from localpaged.config import BLOCK_SIZE
    from localpaged.engine.tokenizer import load_tokenizer
    from localpaged.models.loader import load_config, resolve_model

    files = resolve_model(args.model)
    tokenizer, hf_config = load_tokenizer(files.folder), load_config(files.folder)
    threads = torch.get_num_threads()
    sizing = user_prompts(tokenizer, args.shared_tokens, max(args.users), 0)
    context = max(map(len, sizing)) + args.new_tokens
    limit = hf_config.max_position_embeddings
    if context > limit:
        raise SystemExit(
            f"a user's context is {context} tokens (system prompt, question and {args.new_tokens} new tokens) but "
            f"{files.name} holds {limit}; lower --shared-tokens, or pass --model a GGUF with a longer context "
            "(benchmarks/random_gguf.py writes one)"
        )
    block = BLOCK_SIZE
    f16_bpt = f16_kv_bytes_per_token(hf_config)
    bin_dir = llama_bin_dir() if files.gguf else None
    if bin_dir is not None:
        llama_bpt, llama_source = llama_kv_bytes_per_token(bin_dir, files.gguf, threads)
    else:
        llama_bpt, llama_source = f16_bpt, "computed from the model's shape (f16 K and V), llama.cpp not built here"
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads},
        "model": files.name,
        "shared_tokens": args.shared_tokens,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "llama_kv_bytes_per_token": llama_bpt,
        "llama_kv_source": llama_source,
    }
    print(
        f"{files.name}, {threads} threads on {cpu_name()}: users {args.users}, {args.shared_tokens}-token system "
        f"prompt, {args.new_tokens} new tokens each, greedy, {args.rounds} rounds of cascade_attention on and off",
        flush=True,
    )
    engines = make_engines(
        args.model,
        files,
        pool_blocks_needed(sizing, args.new_tokens, block),
        f16_bpt * block,
        min(limit, context + 64),  # room for the run number's digits
        max(args.users),
    )
    results["block_bytes"] = block_bytes = engines["on"].block_bytes
    runs: dict[int, dict[str, list[dict]]] = {n: {name: [] for name in CONFIGS} for n in args.users}
    run_number = itertools.count(1)
    try:
        for r in range(args.rounds):
            for users in args.users:
                for name in list(CONFIGS)[:: 1 if r % 2 == 0 else -1]:
                    prompts = user_prompts(tokenizer, args.shared_tokens, users, next(run_number))
                    m = measure(engines[name], prompts, args.new_tokens)
                    runs[users][name].append(m)
                    print(f"  round {r + 1}, {users} users, cascade {name}: " + one_line(m), flush=True)
    finally:
        for llm in engines.values():
            llm.close()
    results["points"] = [summarize(n, runs[n], block_bytes, llama_bpt) for n in args.users]
    if len(args.users) > 1:
        results["step_ratio"] = step_ratio(results["points"])
    return results


def step_ratio(points: list[dict]) -> dict:
    """The decode step at the most users over the step at the fewest, per configuration."""
    small, large = min(points, key=lambda p: p["users"]), max(points, key=lambda p: p["users"])
    ratio: dict = {"users": [small["users"], large["users"]]}
    for name in CONFIGS:
        a, b = small[name]["decode_step_ms"], large[name]["decode_step_ms"]
        ratio[name] = b / a if a and b else None
    return ratio


def one_line(m: dict) -> str:
    step = f"{m['decode_step_ms']:.0f} ms at {m['decode_batch']} users" if m["decode_step_ms"] is not None else "n/a"
    rate = f"{m['decode_tok_s']:.1f}" if m["decode_tok_s"] is not None else "n/a"
    return (
        f"first prefill {m['first_prefill_s']:.2f} s, all first tokens {m['ttft_last_s']:.2f} s, "
        f"decode {rate} tok/s, step {step}, KV peak {m['peak_blocks']} blocks (minimum {m['minimum_blocks']})"
    )


# ----- report ---------------------------------------------------------------------------------


def cell(value: float | None, digits: int, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def report(results: dict) -> None:
    print(
        f"\n## {results['shared_tokens']}-token system prompt, {results['new_tokens']} new tokens per user "
        f"({results['model']}; medians of {results['rounds']} rounds)"
    )
    print(
        "| users | cascade | first user's prefill s | every first token s | TTFT median s | decode tok/s"
        " | decode step ms (its users) | KV MiB: pool peak | minimum then | unshared | llama.cpp -np U | -kvu |"
    )
    print("|---" * 12 + "|")
    for p in results["points"]:
        for name in CONFIGS:
            m = p[name]
            print(
                f"| {p['users']} | {name} | {cell(m['first_prefill_s'], 2)} | {cell(m['ttft_last_s'], 2)}"
                f" | {cell(m['ttft_median_s'], 2)} | {cell(m['decode_tok_s'], 1)}"
                f" | {cell(m['decode_step_ms'], 0)} ({m['decode_batch']:.0f})"
                f" | {m['peak_bytes'] / MIB:.1f} | {m['minimum_bytes'] / MIB:.1f} | {m['unshared_whole_bytes'] / MIB:.1f}"
                f" | {p['llama_np_bytes'] / MIB:.1f} | {p['llama_kvu_bytes'] / MIB:.1f} |"
            )
        q = p["on_over_off"]
        print(
            f"| {p['users']} | on/off | {cell(q['first_prefill_s'], 2, 'x')} | {cell(q['ttft_last_s'], 2, 'x')}"
            f" | {cell(q['ttft_median_s'], 2, 'x')} | {cell(q['decode_tok_s'], 2, 'x')}"
            f" | {cell(q['decode_step_ms'], 2, 'x')} | {cell(q['peak_blocks'], 2, 'x')} | | | | |"
        )
    print("(on/off: times below 1 and tok/s above 1 mean cascade attention is faster)")
    for p in results["points"]:
        waste = ", ".join(f"{name} {100 * p[name]['waste']:.2f}%" for name in CONFIGS)
        print(
            f"{p['users']} users, {p['shared_prefix_tokens']} tokens shared: KV waste (peak - minimum) / peak {waste}"
        )
    if ratio := results.get("step_ratio"):
        small, large = ratio["users"]
        print(
            f"decode step at {large} users / at {small}: "
            + ", ".join(f"{name} {cell(ratio.get(name), 2, 'x')}" for name in CONFIGS)
            + " (the goal: at most 2x from 8 to 64)"
        )
    print(f"llama.cpp's KV bytes per token: {results['llama_kv_bytes_per_token']:.0f} ({results['llama_kv_source']})")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with own_kv_folder():  # the disk tier is off; this keeps the user's own tier out of reach all the same
        results = run(args)
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {args.out}")
    return results


if __name__ == "__main__":
    main()

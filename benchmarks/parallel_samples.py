"""Parallel sampling (n = 8 of one prompt) against 8 separate requests of the same prompt, in one run.

The workload: one ~1,000-token prompt (the shipped system prompts' text), 8 samples of it at
temperature 0.8, each its own seed stream, EOS ignored, on the default model with prefix caching on
(as users run it; the disk tier off, so that cold means cold). Two contenders run it in turn, each
run on a prompt of its own (its first line names the run) so that nothing is cached before it starts:

- ``n=8``: one request with ``SamplingParams(n=8)``: the prompt is prefilled once, its full blocks
  shared by the 8 samples, its partial last block copied for each;
- ``8 requests``: the same prompt sent 8 times with n = 1 (seeds 0..7), all at once: the prefix cache
  shares what is cached by the time each is admitted.

Per contender: the pool's used blocks at their peak (just after a step is scheduled), the prompt
tokens the model computed (prefill), the wall time from adding the requests to the last sample's
end and the aggregate tok/s (generated tokens over that time). Rounds alternate which contender
goes first; ratios are the medians of each round's own ratio. Writes
benchmarks/results/parallel_samples.json and prints a Markdown table.

    python benchmarks/parallel_samples.py [--prompt-tokens 1000] [--new-tokens 64] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from peers import cpu_name

SAMPLES = 8
PROMPT_NAMES = ("coding", "general", "tutor", "concise")
CONTENDERS = ("n=8", "8 requests")
FIGURES = ("peak_blocks", "prefill_tokens", "wall_s", "tok_s")


def prompt_ids(tokenizer, tokens: int, run: int) -> list[int]:
    """About ``tokens`` tokens of the shipped prompts' text after a line naming the run (its own first block)."""
    from localpaged import load_prompt

    body = tokenizer.encode("\n\n".join(load_prompt(name) for name in PROMPT_NAMES), add_special_tokens=False)
    ids = tokenizer.encode(f"Run {run}.\n", add_special_tokens=False)
    while len(ids) < tokens:
        ids += body
    return ids[:tokens]


def run_one(llm, contender: str, prompt: list[int], new_tokens: int) -> dict:
    """Run the contender's requests to the end on ``llm``'s own step loop; its figures."""
    from localpaged import SamplingParams

    scheduler = llm.scheduler
    schedule = scheduler.schedule
    peak, prefill = 0, 0

    def schedule_and_count():
        nonlocal peak, prefill
        batch = schedule()
        peak = max(peak, llm.pool.num_used_blocks)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            prefill += max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens)
        return batch

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=new_tokens, temperature=0.8, seed=seed, ignore_eos=True)

    scheduler.schedule = schedule_and_count
    try:
        start = time.perf_counter()
        if contender == "n=8":
            llm.add_request(prompt, params(SAMPLES, 0))
        else:
            for seed in range(SAMPLES):
                llm.add_request(prompt, params(1, seed))
        generated = 0
        while llm.has_unfinished_requests():
            for out in llm.step():
                assert out.error is None, out.error
                generated += out.finished * len(out.token_ids)
        wall = time.perf_counter() - start
    finally:
        del scheduler.schedule  # the instance attribute goes; the class's method is back
    assert llm.stats().blocks_used == 0
    return {"peak_blocks": peak, "prefill_tokens": prefill, "wall_s": wall, "tok_s": generated / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 200-token prompt, 8 new tokens, 1 round")
    ap.add_argument("--out", type=Path, default=RESULTS / "parallel_samples.json")
    args = ap.parse_args()
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.rounds = 200, 8, 1

    from localpaged import LLM

    llm = LLM(kv_disk=False)
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
        for i, contender in enumerate(order):
            prompt = prompt_ids(llm.tokenizer, args.prompt_tokens, 2 * r + i)
            runs[contender].append(run_one(llm, contender, prompt, args.new_tokens))

    best = {c: {f: statistics.median(run[f] for run in runs[c]) for f in FIGURES} for c in CONTENDERS}
    ratios = {
        f: statistics.median(a[f] / b[f] for a, b in zip(runs["n=8"], runs["8 requests"]) if b[f]) for f in FIGURES
    }
    data = {
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": __import__("torch").get_num_threads()},
        "date": time.strftime("%Y-%m-%d"),
        "model": llm.model_name,
        "device": str(llm.device),
        "samples": SAMPLES,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "block_size": llm.resolved.block_size,
        "max_num_batched_tokens": llm.resolved.max_num_batched_tokens,
        "rounds": args.rounds,
        "medians": best,
        "ratios_n8_to_separate": ratios,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{SAMPLES} samples of a {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens each, {llm.device}")
    print("| | peak blocks | prefill tokens | wall s | aggregate tok/s |\n|---|---|---|---|---|")
    for c in CONTENDERS:
        m = best[c]
        print(f"| {c} | {m['peak_blocks']:.0f} | {m['prefill_tokens']:.0f} | {m['wall_s']:.2f} | {m['tok_s']:.1f} |")
    print("| n=8 / 8 requests | " + " | ".join(f"{ratios[f]:.2f}x" for f in FIGURES) + " |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

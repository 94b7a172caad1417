"""What a draft row costs: one decode step's time with k draft tokens per sequence against none, by batch size.

Speculative decoding pays where checking k drafts costs less than the tokens they win. This times the
engine's own decode step (``LLM.step``) for B sequences of a 300-token prompt, each with k forced draft
tokens (refused, so every step does the same work), against the same step without drafts: the ratio is
what a step with drafts costs. It decided ``engine.speculative``'s ``K_MAX`` and ``AUTO_MAX_ROWS`` on
the CPU (the native matmul runs up to four rows straight from the packed weights). Median of the steps.

    python benchmarks/spec_step_cost.py [--model PATH] [--batches 1,2,4,8] [--drafts 1,3] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from localpaged import LLM, SamplingParams

PROMPT_TOKENS = 300


def step_time(llm: LLM, batch: int, drafts: int, steps: int) -> float:
    """The median time of ``steps`` decode steps of ``batch`` sequences with ``drafts`` forced drafts each."""
    llm.speculator.drafts = lambda seq, room: [100] * min(drafts, room)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1000 + 7 * b, 1000 + 7 * b + PROMPT_TOKENS)) for b in range(batch)]
    ids = [llm.add_request(p, params) for p in prompts]
    running = llm.scheduler.running
    while len(running) < batch or any(s.num_uncomputed_tokens > 1 for s in running):
        llm.step()  # prefill, untimed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        llm.abort(request_id)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[int, dict[int, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF or model folder (default: the default model)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--drafts", default="1,3")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    llm = LLM(args.model, speculative="ngram", kv_disk=False, kv_cache_memory="2GiB", max_model_len=1024)
    llm.speculator.verified = lambda seq, proposed, accepted: None  # the forced drafts leave k as it is
    drafts = [int(k) for k in args.drafts.split(",")]
    table: dict[int, dict[int, float]] = {}
    print(f"{'sequences':>9} {'one row ms':>10} " + " ".join(f"{f'k={k}':>7}" for k in drafts))
    for batch in (int(b) for b in args.batches.split(",")):
        table[batch] = {k: step_time(llm, batch, k, args.steps) for k in [0, *drafts]}
        ratios = " ".join(f"{table[batch][k] / table[batch][0]:>6.2f}x" for k in drafts)
        print(f"{batch:>9} {1000 * table[batch][0]:>10.1f} {ratios}")
    return table


if __name__ == "__main__":
    main()

"""What a draft row costs: one decode step's time with k draft tokens per sequence against none, by batch size.

Speculative decoding pays where checking k drafts costs less than the tokens they win. This times the
engine's own decode step (``LLM.step``) for B sequences of a 300-token prompt, each with k forced draft
tokens (refused, so every step does the same work), against the same step without drafts: the ratio is
what a step with drafts costs. It decided ``engine.speculative``'s ``K_MAX`` and ``AUTO_MAX_ROWS`` on
the CPU (the native matmul runs up to four rows straight from the packed weights). Median of the steps.

With ``--draft MODEL`` the drafts come from that draft model (``speculative={"draft": MODEL}``), every step
k of them, and the table gives the draft model's part of each step too (its catch-up and k - 1 one-token
steps, ``DraftModel.propose``) against the target's own step: what a draft model costs, whatever its drafts'
acceptance (a random-weight target refuses them all).

    python benchmarks/spec_step_cost.py [--model PATH] [--draft MODEL] [--batches 1,2,4,8] [--drafts 1,3]
        [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from localpaged import LLM, SamplingParams

PROMPT_TOKENS = 300


def step_time(llm: LLM, clock: DraftClock, batch: int, drafts: int, steps: int) -> tuple[float, float]:
    """The median time of ``steps`` decode steps of ``batch`` sequences with ``drafts`` forced drafts each, and the
    median time of the draft model's part of them (0 without one)."""
    if llm.runner.drafter is not None:  # the draft model's own slots, k of them for each new sequence
        llm.speculator.k_start = drafts
    else:
        llm.speculator.drafts = lambda seq, room: [100] * min(drafts, room)
    # room for every step to keep all its drafts (a draft model may well propose the very tokens)
    params = SamplingParams(max_tokens=steps * (drafts + 1) + 8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(1000 + 7 * b, 1000 + 7 * b + PROMPT_TOKENS)) for b in range(batch)]
    ids = [llm.add_request(p, params) for p in prompts]
    running = llm.scheduler.running
    while len(running) < batch or any(s.num_uncomputed_tokens > 1 for s in running):
        llm.step()  # prefill, untimed
    times, draft_times = [], []
    for _ in range(steps):
        before = clock.seconds
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
        draft_times.append(clock.seconds - before)
    for request_id in ids:
        llm.abort(request_id)
    return statistics.median(times), statistics.median(draft_times)


class DraftClock:
    """The time the engine's draft model has spent on its proposals so far (none without one)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        drafter = llm.runner.drafter
        if drafter is None:
            return
        propose = drafter.propose

        def timed(batch) -> None:
            start = time.perf_counter()
            propose(batch)
            self.seconds += time.perf_counter() - start

        drafter.propose = timed


def main(argv: list[str] | None = None) -> dict[int, dict[int, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF or model folder (default: the default model)")
    parser.add_argument("--draft", default=None, help="drafts from this draft model (a GGUF or model folder)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--drafts", default="1,3")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    drafts = [int(k) for k in args.drafts.split(",")]
    speculative = {"draft": args.draft, "k": max(drafts)} if args.draft else "ngram"
    llm = LLM(args.model, speculative=speculative, kv_disk=False, kv_cache_memory="2GiB", max_model_len=1024)
    llm.speculator.verified = lambda seq, proposed, accepted: None  # the forced drafts leave k as it is
    clock = DraftClock(llm)
    table: dict[int, dict[int, float]] = {}
    drafted: dict[int, dict[int, float]] = {}  # the draft model's part of each
    header = " ".join(f"{f'k={k}':>7}" + (f" {'draft ms':>8}" if args.draft else "") for k in drafts)
    print(f"{'sequences':>9} {'one row ms':>10} {header}")
    for batch in (int(b) for b in args.batches.split(",")):
        times = {k: step_time(llm, clock, batch, k, args.steps) for k in [0, *drafts]}
        table[batch] = {k: t for k, (t, _) in times.items()}
        drafted[batch] = {k: d for k, (_, d) in times.items()}
        cells = " ".join(
            f"{table[batch][k] / table[batch][0]:>6.2f}x" + (f" {1000 * drafted[batch][k]:>8.1f}" if args.draft else "")
            for k in drafts
        )
        print(f"{batch:>9} {1000 * table[batch][0]:>10.1f} {cells}")
    return table


if __name__ == "__main__":
    main()

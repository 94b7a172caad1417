"""What penalties, logit_bias, min_p and logprobs cost: the sampler's time and the whole step's at 64 running requests.

On the default model, 64 requests with distinct prompts, every one sampled (temperature 0.8, top_p 0.95,
seeded, EOS ignored), run to the end in five scenarios, in one run:

- none: no feature (the path every request took before these features);
- penalties: repetition_penalty 1.1, presence and frequency 0.5, min_p 0.05 and a logit_bias of 8 tokens;
- logprobs: logprobs=5 (the chosen token's and the 5 likeliest);
- mixed: half the requests as in none, half with every penalty and logprobs=5;
- defaults: the app's own sampling (temperature 0.7, no top-p): every row drawn over the whole vocabulary.

Per scenario the median over the decode-only steps that run every request: the time ``sample`` takes
and the time of ``LLM.step``; each scenario's ratio against none. Rounds alternate the scenarios'
order and the ratios are the medians of each round's own (these machines drift from minute to minute).

Also, at 64 rows, three ways to apply presence and frequency penalties over each row's reply: (a) counts
over the vocabulary built again each step (a scatter_add over the padded reply ids); (b) a count tensor
over the vocabulary per request, grown by each accepted token and stacked each step; (c) the sampler's,
each request's ids kept on the device and only the logits of its tokens touched: each the least of its
repeats on one thread. Writes
benchmarks/results/sampling_cost.json and prints Markdown tables.

    python benchmarks/sampling_cost.py [--requests 64] [--tokens 64] [--rounds 2] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from kv_folder import own_kv_folder
from peers import cpu_name
from throughput import QUESTIONS

BASE = {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True}
PENALTIES = {
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "min_p": 0.05,
    "logit_bias": {t: -5.0 for t in range(100, 108)},
}
SCENARIOS = {
    "none": lambda i: {},
    "penalties": lambda i: PENALTIES,
    "logprobs": lambda i: {"logprobs": 5},
    "mixed": lambda i: {**PENALTIES, "logprobs": 5} if i % 2 else {},
    "defaults": lambda i: {"temperature": 0.7, "top_p": 1.0},  # the app's: every token in the draw
}
COUNT_LENGTHS = (64, 512, 2048)  # reply tokens a row holds when its counts are built
QUICK = {"requests": 8, "tokens": 8, "rounds": 1}


def run_scenario(llm, name: str, requests: int, tokens: int, round_: int) -> dict:
    """Run ``requests`` requests of scenario ``name`` to the end; the sampler's and the step's times per full decode step."""
    import torch

    from localpaged import SamplingParams
    from localpaged.engine import runner as runner_module

    sampler_s: list[float] = []
    step_s: list[float] = []
    last = SimpleNamespace(decode=False, rows=0, sample_s=0.0)
    real_sample, real_run = runner_module.sample, llm.runner.run

    def timed_sample(logits, seqs, mask=None):
        sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        out = real_sample(logits, seqs, mask=mask)
        sync()
        last.sample_s, last.rows = time.perf_counter() - start, len(seqs)
        return out

    def traced_run(batch):
        last.decode = sum(batch.num_new_tokens) == len(batch.seqs)
        return real_run(batch)

    runner_module.sample, llm.runner.run = timed_sample, traced_run
    try:
        for i in range(requests):
            question = QUESTIONS[i % len(QUESTIONS)]
            params = SamplingParams(max_tokens=tokens, seed=i, **{**BASE, **SCENARIOS[name](i)})
            llm.add_request(f"[{name} {round_} #{i}] {question}", params)
        while llm.has_unfinished_requests():
            last.rows = 0
            start = time.perf_counter()
            llm.step()
            elapsed = time.perf_counter() - start
            if last.decode and last.rows == requests:
                sampler_s.append(last.sample_s)
                step_s.append(elapsed)
    finally:
        runner_module.sample, llm.runner.run = real_sample, real_run
    return {
        "sampler_ms": 1e3 * statistics.median(sampler_s),
        "step_ms": 1e3 * statistics.median(step_s),
        "steps": len(step_s),
    }


def time_counts(rows: int, vocab: int, length: int, repeats: int) -> dict:
    """Per step at ``rows`` rows of ``length`` reply tokens, each one token longer than at the last step, the
    presence/frequency pass three ways: (a) counts over the vocabulary built again each step, one scatter_add
    over the padded reply ids; (b) a count tensor over the vocabulary per request, grown by its new token and
    stacked; (c) the sampler's own: each request's ids kept on the device, only the logits of its tokens touched."""
    import torch

    from localpaged import SamplingParams
    from localpaged.engine.sampler import apply_penalties
    from localpaged.engine.sequence import Sequence

    g = torch.Generator().manual_seed(length)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5)
    seqs = []
    for _ in range(rows):
        seq = Sequence("r", [1], params)
        seq.token_ids.extend(torch.randint(0, vocab, (length,), generator=g).tolist())
        seq.extra = SimpleNamespace(history=None)
        seqs.append(seq)
    logits = torch.randn(rows, vocab, generator=g)
    presence = torch.full((rows, 1), 0.5)
    frequency = torch.full((rows, 1), 0.5)
    kept = [torch.zeros(vocab).index_add_(0, torch.tensor(s.output_token_ids), torch.ones(length)) for s in seqs]

    def rebuilt() -> None:
        outputs = [seq.output_token_ids for seq in seqs]
        width = max(len(o) for o in outputs)
        ids = torch.tensor([o + [0] * (width - len(o)) for o in outputs])
        real = torch.arange(width) < torch.tensor([len(o) for o in outputs]).unsqueeze(1)
        counts = torch.zeros(rows, vocab).scatter_add_(1, ids, real.float())
        logits.clone().sub_(presence * (counts > 0) + frequency * counts)

    def per_request() -> None:
        for seq, counts in zip(seqs, kept):
            counts[seq.token_ids[-1]] += 1
        counts = torch.stack(kept)
        logits.clone().sub_(presence * (counts > 0) + frequency * counts)

    def sampler() -> None:
        apply_penalties(logits.clone(), seqs)

    def clone() -> None:  # the copy all three include, for scale
        logits.clone()

    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: what each way costs, without waiting on a thread another process holds
    try:
        ways = (("rebuilt_ms", rebuilt), ("per_request_counts_ms", per_request), ("sampler_ms", sampler))
        for label, fn in (*ways, ("clone_ms", clone)):
            times = []
            for _ in range(repeats + 1):  # the first makes the sampler's per-request ids: not timed
                for seq in seqs:
                    seq.token_ids.append(int(torch.randint(0, vocab, (1,), generator=g)))
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out[label] = 1e3 * min(times[1:])  # the least disturbed by other processes
    finally:
        torch.set_num_threads(threads)
    return {"reply_tokens": length, **out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", help="a model other than the default")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few requests and tokens, one round")
    ap.add_argument("--out", type=Path, default=RESULTS / "sampling_cost.json")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)

    import torch

    from localpaged import LLM

    with own_kv_folder():
        llm = LLM(args.model, kv_disk=False, max_num_seqs=args.requests)
        names = list(SCENARIOS)
        rounds = []
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            rounds.append({})
            for name in order:
                rounds[-1][name] = run_scenario(llm, name, args.requests, args.tokens, r)
                print(f"round {r + 1}: {name} done", file=sys.stderr, flush=True)
        assert llm.stats().blocks_used == 0
        vocab = llm.runner.model.config.vocab_size
    scenarios = {
        name: {key: statistics.median(rd[name][key] for rd in rounds) for key in ("sampler_ms", "step_ms", "steps")}
        for name in names
    }
    ratios = {
        name: {
            key: statistics.median(rd[name][f"{key}_ms"] / rd["none"][f"{key}_ms"] for rd in rounds)
            for key in ("sampler", "step")
        }
        for name in names
    }
    counts = [time_counts(args.requests, vocab, length, 5 if args.quick else 20) for length in COUNT_LENGTHS]
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads()},
        "model": llm.model_name,
        "device": str(llm.device),
        "requests": args.requests,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "scenarios": scenarios,
        "ratios": ratios,
        "counts": counts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{args.requests} requests, {args.tokens} tokens each, {llm.model_name} on {llm.device}\n")
    print("| scenario | sampler ms/step | x none | step ms/step | x none |\n|---|---|---|---|---|")
    for name in names:
        s, q = scenarios[name], ratios[name]
        print(f"| {name} | {s['sampler_ms']:.2f} | {q['sampler']:.2f}x | {s['step_ms']:.1f} | {q['step']:.2f}x |")
    print("\n| reply tokens | (a) rebuilt counts ms | (b) per-request counts ms | (c) sampler ms | clone ms |")
    print("|---|---|---|---|---|")
    for c in counts:
        cells = (c["rebuilt_ms"], c["per_request_counts_ms"], c["sampler_ms"], c["clone_ms"])
        print(f"| {c['reply_tokens']} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
    print(f"\nwrote {args.out}")
    return data


if __name__ == "__main__":
    main()

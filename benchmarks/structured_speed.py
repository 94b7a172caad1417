"""What a JSON schema costs: decode with a grammar against without, and the grammar's compile, on the default model.

In one run, on the default model with its default settings (the disk tier off):

- one chat: decode tok/s of a reply under a JSON schema against a free reply of the same length (the goal:
  at least 0.9x); the schema asks for an array of at least 100 objects, so both run to ``--tokens``;
- 16 chats at once, each under a schema of its own (compiled before, as a server's clients' are after their
  first request), against 16 free ones: aggregate tok/s (the goal: at least 0.85x);
- the grammar's own work a step (filling and applying the bitmask, advancing the matchers), timed inside the
  schema runs, against the run's time: a figure that the machine's drift between runs does not blur;
- the compile of a typical schema (an object of 10 fields): the check (xgrammar's parse, in the front end and
  before queueing), the compile cold (a schema not seen before, its token masks over the vocabulary) and
  cached (the same schema again), medians over distinct schemas.

Rounds alternate which goes first; each ratio is the median of the rounds' own ratios (these machines drift
from minute to minute). Writes benchmarks/results/structured_speed.json.

    python benchmarks/structured_speed.py [--tokens 128] [--sessions 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from localpaged import LLM, SamplingParams
from localpaged.engine import structured
from localpaged.engine.structured import check_structured
from localpaged.sampling import StructuredOutputs

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = "List people with their name, age and city as a JSON array."


def many_people(tag: str) -> dict:
    """A schema whose replies run past any ``--tokens``: an array of at least 100 objects; ``tag`` names its fields."""
    person = {
        "type": "object",
        "properties": {
            f"name_{tag}": {"type": "string"},
            f"age_{tag}": {"type": "integer"},
            "city": {"type": "string"},
        },
        "required": [f"name_{tag}", f"age_{tag}", "city"],
    }
    return {"type": "array", "items": person, "minItems": 100}


def ten_fields(tag: str) -> dict:
    kinds = ["string", "integer", "boolean", "number", {"enum": ["a", "b", "c"]}]
    props = {f"{tag}_{i}": (k if isinstance(k := kinds[i % 5], dict) else {"type": k}) for i in range(10)}
    return {"type": "object", "properties": props, "required": sorted(props)[:6]}


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"{QUESTION} (list {i})"}]


def tok_s(outs) -> float:
    """Aggregate decode rate: the tokens after each first one, over the time from the first first-token to the end."""
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    start = min(o.metrics.ttft_s for o in outs)
    end = max(o.metrics.ttft_s + (len(o.token_ids) - 1) / o.metrics.decode_tokens_per_s for o in outs)
    return tokens / (end - start)


class GrammarClock:
    """Time spent in the grammar's per-step work (bitmask and matchers)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for cls, name in (
            (structured.StructuredOutputManager, "apply_bitmask"),
            (structured.StructuredOutputRequest, "accept"),
        ):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return timed

    def take(self) -> float:
        taken, self.seconds = self.seconds, 0.0
        return taken


def run(llm: LLM, n: int, tokens: int, schemas: list[dict] | None) -> float:
    if schemas is None:
        params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)] * n
    else:
        params = [
            SamplingParams(max_tokens=tokens, temperature=0.0, structured=StructuredOutputs(json=s)) for s in schemas
        ]
    outs = llm.chat([chat(i) for i in range(n)], params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == tokens for o in outs), [o.text for o in outs]
    return tok_s(outs)


def compile_times(llm: LLM, count: int) -> dict:
    checks, cold, cached = [], [], []
    llm._grammar(SamplingParams(structured=StructuredOutputs(json=ten_fields("warm")))).future.result()
    for i in range(count):
        spec = StructuredOutputs(json=ten_fields(f"c{i}"))
        t = time.perf_counter()
        check_structured(spec)
        checks.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammar = llm._grammar(SamplingParams(structured=spec))
        grammar.future.result()
        grammar.start()
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammar = llm._grammar(SamplingParams(structured=spec))
        grammar.start()
        cached.append(time.perf_counter() - t)
    return {
        "check_ms": 1e3 * statistics.median(checks),
        "cold_ms": 1e3 * statistics.median(cold),
        "cached_ms": 1e3 * statistics.median(cached),
        "schemas": count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "structured_speed.json")
    args = parser.parse_args()
    llm = LLM(kv_disk=False)
    clock = GrammarClock()
    schemas = [many_people(f"s{i}") for i in range(args.sessions)]
    for s in schemas:  # compiled before the runs: the steady state of clients that come back
        llm._grammar(SamplingParams(structured=StructuredOutputs(json=s))).future.result()
    run(llm, 1, 8, None)  # warm-up
    one: dict[str, list[float]] = {"free": [], "schema": []}
    many: dict[str, list[float]] = {"free": [], "schema": []}
    share: dict[str, list[float]] = {"one_chat": [], "sessions": []}  # grammar time / run time, schema runs
    for r in range(args.rounds):
        order = ["free", "schema"] if r % 2 == 0 else ["schema", "free"]
        for results, n, key in ((one, 1, "one_chat"), (many, args.sessions, "sessions")):
            for kind in order:
                clock.take()
                t = time.perf_counter()
                results[kind].append(run(llm, n, args.tokens, None if kind == "free" else schemas[:n]))
                if kind == "schema":
                    share[key].append(clock.take() / (time.perf_counter() - t))
        print(
            f"round {r + 1}: one {one['schema'][-1]:.1f} / {one['free'][-1]:.1f} tok/s, "
            f"{args.sessions} sessions {many['schema'][-1]:.1f} / {many['free'][-1]:.1f} tok/s (schema / free)"
        )
    compiled = compile_times(llm, 8)
    ratio = {
        "one_chat": statistics.median(s / f for s, f in zip(one["schema"], one["free"])),
        "sessions": statistics.median(s / f for s, f in zip(many["schema"], many["free"])),
    }
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d"),
        "model": llm.model_name,
        "tokens": args.tokens,
        "sessions": args.sessions,
        "rounds": args.rounds,
        "one_chat_tok_s": {k: statistics.median(v) for k, v in one.items()},
        "sessions_tok_s": {k: statistics.median(v) for k, v in many.items()},
        "ratios": ratio,
        "goals": {"one_chat": 0.9, "sessions": 0.85},
        "compile_10_fields": compiled,
        "grammar_share_of_run": {k: statistics.median(v) for k, v in share.items()},
    }
    print(
        f"one chat: {ratio['one_chat']:.2f}x of free (goal 0.9x); {args.sessions} sessions: "
        f"{ratio['sessions']:.2f}x (goal 0.85x)"
    )
    print(
        f"grammar work: {100 * result['grammar_share_of_run']['one_chat']:.1f}% of the time of one chat, "
        f"{100 * result['grammar_share_of_run']['sessions']:.1f}% of {args.sessions} at once"
    )
    print(
        f"10-field schema: check {compiled['check_ms']:.2f} ms, compile cold {compiled['cold_ms']:.1f} ms, "
        f"cached {compiled['cached_ms']:.3f} ms"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Speculative decoding: decode tok/s with it off and on, on the workloads it is for and on those it must not slow.

All greedy (temperature 0), on the default model (``--model``: another file), the disk tier off. The
engine's modes (``LLM(speculative=...)``): "ngram" drafts from the request's own prompt and output,
"suffix" from what the engine generated before across requests, "auto" picks. Workloads:

- **code edit**: one chat holding a ~40-line Python function and asking for it back with one variable
  renamed and one parameter added; ~200 new tokens. Off against "ngram" and "auto" (the goal: 1.8x).
- **regenerate** and **continue** a stored reply: a reply is generated once, then the same chat again
  (a regenerate, which greedy makes the same reply: "suffix" and "auto" have seen it), then the chat's
  token ids and the first half of the reply's as the prompt (a continue, which greedy makes the second
  half). Off against "ngram", "suffix" and "auto" (the goal: 1.5x).
- **chat**: ordinary questions (throughput.py's system prompt and questions), one chat at a time, 128
  tokens each: nothing to copy, so speculation must not cost (the goal: 1.0x).
- **sessions**: 16 and 64 chats at once, each its own question, 128 tokens each: aggregate decode tok/s,
  off against "auto" (the goal: 1.0x).

Every measurement of every mode runs on a fresh engine: no earlier run's replies are there to draw on
except where the workload puts them (the regenerate's first reply), and every mode starts from the same
empty prefix cache (an engine kept from round to round had every session's prompt cached, so its
sessions decoded without the others' prefills between their steps and looked faster than the same
code in a fresh engine). Each round runs every mode
once, off first in even rounds and last in odd ones (these machines drift by 20% from minute to
minute); a mode's figure is its best round, and the ratio is best on over best off. Per row: the
acceptance rate (accepted / proposed draft tokens, from ``llm.stats()``'s ``spec_proposed_tokens`` and
``spec_accepted_tokens`` around the measured requests) and ``identical``: whether every run's greedy
token ids equal the off run's. An engine without speculative decoding (``LLM`` refuses the argument)
runs the off side only and says so.

The peer is llama-server (``make bench-peers``) on the same GGUF, same prompt token ids, same thread
count: its draftless speculation, ``--spec-type ngram-simple`` (the last earlier match of the last
12 tokens in the slot's own context, llama.cpp's prompt lookup) and ``--spec-default`` (``ngram-mod``:
a hash pool of n-grams shared by every slot and request, so a regenerate can draw on the first reply),
against its defaults, on the code-edit, regenerate and continue workloads; its tok/s is the server's
own ``predicted_per_second``, its acceptance its ``draft_n_accepted / draft_n``. A fresh server for each
workload and round (``ngram-mod``'s pool outlives requests). Without the binaries that part is recorded
as not run; llama.cpp's ``llama-lookup`` is not needed (the server has these).

With ``--draft MODEL`` every workload also runs mode "draft": drafts from that draft model
(``speculative={"draft": MODEL, "k": --draft-k}``), on fresh engines as every mode.

Writes benchmarks/results/spec_decode.json and prints a table.

    python benchmarks/spec_decode.py [--rounds 3] [--modes ngram,suffix,auto] [--sessions 16,64]
        [--model PATH] [--draft MODEL [--draft-k 3]] [--skip-llama] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from kv_folder import own_kv_folder
from peers import LLAMA_CPP_PYTHON_VERSION, LlamaServer, cpu_name, llama_bin_dir
from throughput import QUESTIONS, SYSTEM

MODES = ("ngram", "suffix", "auto")
DRAFT = "draft"  # the mode of --draft MODEL: a draft model's drafts, on every workload
# The modes each workload compares with off, and its goal (best on / best off).
WORKLOAD_MODES = {
    "code_edit": ("ngram", "auto"),
    "regenerate": ("ngram", "suffix", "auto"),
    "continue": ("ngram", "suffix", "auto"),
    "chat": ("ngram", "auto"),
    "sessions": ("auto",),
}
GOALS = {"code_edit": 1.8, "regenerate": 1.5, "continue": 1.5, "chat": 1.0, "sessions": 1.0}
DEFAULTS = {"edit_tokens": 200, "reply_tokens": 200, "chat_tokens": 128, "chat_questions": 4, "session_tokens": 128}
DEFAULTS |= {"rounds": 3, "sessions": "16,64"}
QUICK = {"edit_tokens": 24, "reply_tokens": 24, "chat_tokens": 12, "chat_questions": 1, "session_tokens": 8}
QUICK |= {"rounds": 1, "sessions": "4"}  # a smoke run: well under a minute on the tiny model
# The pool's size fixed (64 sessions' contexts fit in float32 KV), so that every engine sizes alike.
ENGINE = {"kv_disk": False, "kv_cache_memory": "2GiB"}
STAT_FIELDS = ("spec_proposed_tokens", "spec_accepted_tokens")
NOT_IN_ENGINE = "speculative not in this engine"
# llama-server's draftless speculation: the closest it has to our "ngram", and its default (shared across requests).
LLAMA_MODES = {"off": (), "ngram-simple": ("--spec-type", "ngram-simple"), "ngram-mod": ("--spec-default",)}
LLAMA_CTX = 4096
# Framings that make 64 distinct questions of throughput.py's 16.
FRAMINGS = ("", " Answer in three sentences.", " Give one concrete example.", " Explain it to a new team member.")

CODE = '''def summarize_orders(orders, tax_rate):
    """Group paid orders by customer and return one summary line per customer."""
    totals = {}
    counts = {}
    latest = {}
    for order in orders:
        if order.get("status") != "paid":
            continue
        customer = order["customer"]
        amount = 0.0
        for item in order["items"]:
            price = item["price"]
            quantity = item.get("quantity", 1)
            if item.get("discount"):
                price = price * (1 - item["discount"])
            amount += price * quantity
        amount = amount * (1 + tax_rate)
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        placed = order["placed_at"]
        if customer not in latest or placed > latest[customer]:
            latest[customer] = placed
    lines = []
    for customer in sorted(totals):
        total = round(totals[customer], 2)
        average = round(total / counts[customer], 2)
        line = (
            f"{customer}: {counts[customer]} orders, "
            f"total {total:.2f}, average {average:.2f}, "
            f"last order {latest[customer]}"
        )
        lines.append(line)
    if not lines:
        return "no paid orders"
    header = f"{len(lines)} customers, tax rate {tax_rate:.0%}"
    return "\\n".join([header, *lines])
'''
EDIT_ASK = (
    "Rewrite this Python function with the variable `amount` renamed to `order_total`, and add a parameter "
    '`currency` (default "EUR") that is printed after every amount. Keep everything else exactly as it is. '
    "Reply with the whole function in one code block.\n\n```python\n" + CODE + "```"
)
REPLY_QUESTION = "Write a Python class for a bank account with deposits, withdrawals and a statement."


# ----- localpaged --------------------------------------------------------------------------------


def greedy(tokens: int):
    from localpaged import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0)


def open_engine(mode: str, model: str | None, draft: dict | None = None) -> Any:
    """A fresh engine with ``speculative=mode`` (``draft``, the draft model's setting, for "draft"); None if this
    engine has no speculative decoding.

    The off side falls back to an engine without the argument, so that it runs on an engine from before it.
    """
    from localpaged import LLM
    from localpaged.errors import ConfigError

    try:
        return LLM(model, speculative=draft if mode == DRAFT else mode, **ENGINE)
    except (ConfigError, TypeError) as exc:
        if "speculative" not in str(exc):  # another setting's error, not this one's absence
            raise
        if mode != "off":
            return None
    return LLM(model, **ENGINE)


def spec_counts(llm: Any) -> tuple[int | None, int | None]:
    stats = llm.stats()
    proposed, accepted = (getattr(stats, name, None) for name in STAT_FIELDS)
    return proposed, accepted


def decode_rate(outs: list) -> float:
    """Decode tok/s of requests run together: the tokens after each first one, from the first first-token to
    the last token (one request: its own ``decode_tokens_per_s``)."""
    timed = [o for o in outs if len(o.token_ids) > 1 and o.metrics.decode_tokens_per_s]
    if not timed:
        raise RuntimeError("no request produced two tokens: nothing to time (raise the token counts)")
    tokens = sum(len(o.token_ids) - 1 for o in timed)
    start = min(o.metrics.ttft_s for o in timed)
    end = max(o.metrics.ttft_s + (len(o.token_ids) - 1) / o.metrics.decode_tokens_per_s for o in timed)
    return tokens / (end - start)


def measured(llm: Any, prompts: list, tokens: int) -> dict:
    """Run ``prompts`` together and return their decode tok/s, token ids and the draft counts of the run."""
    before = spec_counts(llm)
    outs = llm.generate(prompts, greedy(tokens))
    after = spec_counts(llm)
    bad = [o.error for o in outs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"a request failed: {bad[0]}")
    drafts = [None if b is None or a is None else a - b for b, a in zip(before, after)]
    return {
        "tok_s": decode_rate(outs),
        "tokens": [list(o.token_ids) for o in outs],
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "proposed": drafts[0],
        "accepted": drafts[1],
    }


def serial(llm: Any, prompts: list, tokens: int) -> dict:
    """Run ``prompts`` one at a time: total decode tokens over total decode time, and the counts summed."""
    runs = [measured(llm, [p], tokens) for p in prompts]
    decode_tokens = sum(len(r["tokens"][0]) - 1 for r in runs)
    decode_s = sum((len(r["tokens"][0]) - 1) / r["tok_s"] for r in runs)
    return {
        "tok_s": decode_tokens / decode_s,
        "tokens": [r["tokens"][0] for r in runs],
        "prompt_tokens": sum(r["prompt_tokens"] for r in runs),
        "proposed": None if any(r["proposed"] is None for r in runs) else sum(r["proposed"] for r in runs),
        "accepted": None if any(r["accepted"] is None for r in runs) else sum(r["accepted"] for r in runs),
    }


def edit_chat() -> list[dict]:
    return [{"role": "user", "content": EDIT_ASK}]


def reply_chat() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": REPLY_QUESTION}]


def chats(n: int) -> list[list[dict]]:
    """``n`` distinct conversations: throughput.py's system prompt, its questions under each framing in turn."""
    if n > len(QUESTIONS) * len(FRAMINGS):
        raise SystemExit(f"at most {len(QUESTIONS) * len(FRAMINGS)} distinct sessions")
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + FRAMINGS[i // len(QUESTIONS)]},
        ]
        for i in range(n)
    ]


def warm_up(llm: Any) -> None:
    """The engine's first steps (threads, buffers) before anything is timed; a prompt no workload shares."""
    llm.generate("Hi.", greedy(4))


def unit_code_edit(llm: Any, args: argparse.Namespace) -> dict:
    return {"code_edit": measured(llm, [edit_chat()], args.edit_tokens)}


def unit_reply(llm: Any, args: argparse.Namespace) -> dict:
    """The first reply (not timed), its regenerate, and its continue from the first half, on one engine."""
    ids = llm.encode_chat(reply_chat())
    first = llm.generate(ids, greedy(args.reply_tokens))[0]
    reply = list(first.token_ids)
    half = len(reply) // 2
    regenerate = measured(llm, [ids], args.reply_tokens)
    cont = measured(llm, [ids + reply[:half]], args.reply_tokens - half)
    return {"regenerate": regenerate, "continue": cont, "first_reply_tokens": reply}


def unit_chat(llm: Any, args: argparse.Namespace) -> dict:
    return {"chat": serial(llm, chats(args.chat_questions), args.chat_tokens)}


def unit_sessions(n: int) -> Callable[[Any, argparse.Namespace], dict]:
    def run(llm: Any, args: argparse.Namespace) -> dict:
        return {f"sessions_{n}": measured(llm, chats(n), args.session_tokens)}

    return run


def run_ours(args: argparse.Namespace, modes: list[str]) -> tuple[dict, bool]:
    """Every workload, every mode, ``args.rounds`` rounds; (the rows, whether the engine has speculation)."""
    units: list[tuple[str, tuple[str, ...], Callable]] = [
        ("code_edit", WORKLOAD_MODES["code_edit"], unit_code_edit),
        ("regenerate and continue", WORKLOAD_MODES["regenerate"], unit_reply),
        ("chat", WORKLOAD_MODES["chat"], unit_chat),
    ]
    units += [(f"{n} sessions", WORKLOAD_MODES["sessions"], unit_sessions(n)) for n in args.session_counts]
    runs: dict[str, dict[str, list[dict]]] = {}  # row -> mode -> one measurement a round
    missing: set[str] = set()  # modes the engine refused
    extra: dict[str, Any] = {}
    for r in range(args.rounds):
        for name, wanted, unit in units:
            on = [m for m in (*wanted, DRAFT) if m in modes and m not in missing]
            order = ["off", *on] if r % 2 == 0 else [*reversed(on), "off"]
            for mode in order:
                llm = open_engine(mode, args.model, args.draft_setting)
                if llm is None:
                    print(f"  {mode}: {NOT_IN_ENGINE}", flush=True)
                    missing.add(mode)
                    continue
                warm_up(llm)
                extra.setdefault("model", llm.model_name)
                extra.setdefault("resolved", {})[mode] = {
                    name: getattr(llm.resolved, name, None)
                    for name in ("speculative", "speculative_max_rows", "speculative_draft", "speculative_k")
                }
                got = unit(llm, args)
                llm.close()
                del llm
                gc.collect()  # a fresh engine's pool goes before the next one is made
                if "first_reply_tokens" in got:
                    extra.setdefault("first_reply_tokens", got.pop("first_reply_tokens"))
                for row, m in got.items():
                    runs.setdefault(row, {}).setdefault(mode, []).append(m)
                    print(f"  round {r + 1}, {row}, {mode}: {m['tok_s']:.1f} tok/s", flush=True)
    has_spec = bool(set(modes) - missing)  # some mode ran
    rows = {row: summarize(row, by_mode, missing) for row, by_mode in runs.items()}
    first = extra.get("first_reply_tokens")
    if first is not None and "regenerate" in rows:
        rows["regenerate"]["off"]["same_as_first_reply"] = all(t == [first] for t in _ids(runs["regenerate"]["off"]))
    return {"model": extra.get("model"), "resolved": extra.get("resolved"), "rows": rows}, has_spec


def _ids(measurements: list[dict]) -> list[list[list[int]]]:
    return [m["tokens"] for m in measurements]


def summarize(row: str, by_mode: dict[str, list[dict]], missing: set[str]) -> dict:
    workload = row.split("_")[0] if row.startswith("sessions") else row
    off = by_mode["off"]
    reference = off[0]["tokens"]
    out: dict[str, Any] = {
        "goal": GOALS[workload],
        "prompts": len(reference),
        "prompt_tokens": off[0]["prompt_tokens"],
        "new_tokens": sum(len(t) for t in reference),
        "off": {
            "tok_s": max(m["tok_s"] for m in off),
            "rounds_tok_s": [m["tok_s"] for m in off],
            "identical": all(m["tokens"] == reference for m in off),  # off against itself, round to round
        },
    }
    for mode in (*WORKLOAD_MODES[workload], DRAFT):
        if mode in missing:
            out[mode] = NOT_IN_ENGINE
            continue
        if mode not in by_mode:
            continue
        ms = by_mode[mode]
        best = max(m["tok_s"] for m in ms)
        proposed = None if any(m["proposed"] is None for m in ms) else sum(m["proposed"] for m in ms)
        accepted = None if any(m["accepted"] is None for m in ms) else sum(m["accepted"] for m in ms)
        out[mode] = {
            "tok_s": best,
            "rounds_tok_s": [m["tok_s"] for m in ms],
            "ratio": best / out["off"]["tok_s"],
            "met_goal": best / out["off"]["tok_s"] >= GOALS[workload],
            "proposed": proposed,
            "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "identical": all(m["tokens"] == reference for m in ms),
        }
    return out


# ----- llama-server ------------------------------------------------------------------------------


def llama_complete(server: LlamaServer, prompt: list[int], n_predict: int) -> dict:
    """One greedy completion that stops where the model does: its tok/s, token ids and draft counts."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "cache_prompt": True}
    body |= {"return_tokens": True, "stream": False}
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        reply = json.loads(r.read())
    timings = reply.get("timings") or {}
    return {
        "tok_s": timings["predicted_per_second"],
        "tokens": [list(reply.get("tokens") or [])],
        "proposed": timings.get("draft_n", 0),
        "accepted": timings.get("draft_n_accepted", 0),
    }


def run_llama(args: argparse.Namespace, bin_dir: Path, threads: int) -> dict:
    """llama-server off and with each draftless speculation on the code edit, regenerate and continue."""
    from localpaged import LLM
    from localpaged.models.loader import default_model_path

    gguf = Path(args.model).expanduser() if args.model else default_model_path()
    small = {"kv_cache_memory": "256MiB", "max_model_len": LLAMA_CTX}
    tokenizer_engine = LLM(args.model, **(ENGINE | small))  # for the chat template's ids
    edit_ids = tokenizer_engine.encode_chat(edit_chat())
    reply_ids = tokenizer_engine.encode_chat(reply_chat())
    tokenizer_engine.close()
    del tokenizer_engine
    ctx = ("-np", "1", "-c", str(LLAMA_CTX))
    runs: dict[str, dict[str, list[dict]]] = {}
    names = list(LLAMA_MODES)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for mode in order:
            with LlamaServer(bin_dir, gguf, threads, *ctx, *LLAMA_MODES[mode]) as server:
                llama_complete(server, [1, 2, 3], 4)  # warm-up
                got = {"code_edit": llama_complete(server, edit_ids, args.edit_tokens)}
            with LlamaServer(bin_dir, gguf, threads, *ctx, *LLAMA_MODES[mode]) as server:
                llama_complete(server, [1, 2, 3], 4)
                first = llama_complete(server, reply_ids, args.reply_tokens)["tokens"][0]
                half = len(first) // 2
                got["regenerate"] = llama_complete(server, reply_ids, args.reply_tokens)
                got["regenerate"]["same_as_first"] = got["regenerate"]["tokens"] == [first]
                got["continue"] = llama_complete(server, reply_ids + first[:half], args.reply_tokens - half)
            for row, m in got.items():
                runs.setdefault(row, {}).setdefault(mode, []).append(m)
                print(f"  round {r + 1}, llama-server {row}, {mode}: {m['tok_s']:.1f} tok/s", flush=True)
    rows = {}
    for row, by_mode in runs.items():
        off = by_mode["off"]
        reference = off[0]["tokens"]
        out: dict[str, Any] = {
            "off": {
                "tok_s": max(m["tok_s"] for m in off),
                "rounds_tok_s": [m["tok_s"] for m in off],
                "identical": all(m["tokens"] == reference for m in off),  # off against itself, round to round
            }
        }
        if row == "regenerate":  # llama.cpp's greedy reply need not repeat once its prompt is cached
            out["off"]["same_as_first_reply"] = all(m["same_as_first"] for m in off)
        for mode in names[1:]:
            ms = by_mode[mode]
            best = max(m["tok_s"] for m in ms)
            proposed, accepted = sum(m["proposed"] for m in ms), sum(m["accepted"] for m in ms)
            out[mode] = {
                "tok_s": best,
                "rounds_tok_s": [m["tok_s"] for m in ms],
                "ratio": best / out["off"]["tok_s"],
                "proposed": proposed,
                "accepted": accepted,
                "acceptance": accepted / proposed if proposed else None,
                "identical": all(m["tokens"] == reference for m in ms),
            }
        rows[row] = out
    return {
        "available": True,
        "llama_cpp": f"vendored in llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}",
        "flags": {mode: " ".join((*ctx, *flags)) for mode, flags in LLAMA_MODES.items()},
        "rows": rows,
    }


# ----- report ------------------------------------------------------------------------------------


def report(results: dict) -> None:
    print("\n## localpaged: decode tok/s, best of the rounds")
    print("| workload | off | mode | on | on / off | goal | acceptance | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for row, r in results["rows"].items():
        modes = [m for m in (*MODES, DRAFT) if m in r]
        if not modes:
            print(f"| {row} | {r['off']['tok_s']:.1f} | - | - | - | {r['goal']:.1f}x | - | - |")
        for m in modes:
            on = r[m]
            if isinstance(on, str):
                print(f"| {row} | {r['off']['tok_s']:.1f} | {m} | {on} | - | {r['goal']:.1f}x | - | - |")
                continue
            acc = f"{on['acceptance']:.0%}" if on["acceptance"] is not None else "-"
            print(
                f"| {row} | {r['off']['tok_s']:.1f} | {m} | {on['tok_s']:.1f} | **{on['ratio']:.2f}x** |"
                f" {r['goal']:.1f}x | {acc} | {on['identical']} |"
            )
    peer = results["llama_server"]
    if not peer.get("available"):
        print(f"\nllama-server: {peer.get('note')}")
        return
    print("\n## llama-server: decode tok/s, best of the rounds")
    print("| workload | off | mode | on | on / off | acceptance | identical |")
    print("|---|---|---|---|---|---|---|")
    for row, r in peer["rows"].items():
        for m in (k for k in r if k != "off"):
            on = r[m]
            acc = f"{on['acceptance']:.0%}" if on["acceptance"] is not None else "-"
            print(
                f"| {row} | {r['off']['tok_s']:.1f} | {m} | {on['tok_s']:.1f} | **{on['ratio']:.2f}x** | {acc} |"
                f" {on['identical']} |"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--modes", default=",".join(MODES), help="speculative modes to compare with off; '' for off only")
    ap.add_argument("--sessions", help="session counts, comma-separated (default 16,64)")
    ap.add_argument("--model", help="another model (a GGUF or HF folder); the default model otherwise")
    ap.add_argument("--draft", help="also run mode 'draft': drafts from this draft model (a GGUF or HF folder)")
    ap.add_argument("--draft-k", type=int, default=3, help="the draft model's drafts a step at most (default 3)")
    ap.add_argument("--skip-llama", action="store_true", help="ours only, no llama-server")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few tokens, one round, small sessions")
    ap.add_argument("--out", type=Path, default=RESULTS / "spec_decode.json")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.session_counts = [int(n) for n in args.sessions.split(",") if n]
    modes = [m.strip() for m in args.modes.split(",") if m.strip() and m.strip() != "off"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; pick from {', '.join(MODES)}")
    args.draft_setting = {"draft": args.draft, "k": args.draft_k} if args.draft else None
    args.mode_list = modes + ([DRAFT] if args.draft else [])
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    results: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads},
        "date": time.strftime("%Y-%m-%d"),
        "model": None,
        "quick": args.quick,
        "rounds": args.rounds,
        "tokens": {k: getattr(args, k) for k in ("edit_tokens", "reply_tokens", "chat_tokens", "session_tokens")},
        "modes": args.mode_list,
        "draft": args.draft_setting,  # mode "draft"'s setting, None without --draft
    }
    with own_kv_folder():
        print("localpaged:", flush=True)
        ours, has_spec = run_ours(args, args.mode_list)
        results["model"] = ours["model"]
        results["speculative_in_engine"] = has_spec if args.mode_list else None
        if args.mode_list and not has_spec:
            results["note"] = f"{NOT_IN_ENGINE}: LLM(speculative=...) was refused, so only the off side ran"
        results["resolved"] = ours["resolved"]  # what each mode settled on (``auto``: a proposer and its batch limit)
        results["rows"] = ours["rows"]
        bin_dir = None if args.skip_llama else llama_bin_dir()
        if args.skip_llama:
            results["llama_server"] = {"available": False, "note": "not run (--skip-llama)"}
        elif bin_dir is None:
            results["llama_server"] = {
                "available": False,
                "note": "not run: llama.cpp is not built here; run `make bench-peers` once (about 10 minutes)",
            }
        else:
            print("llama-server (a fresh server for each run):", flush=True)
            try:
                results["llama_server"] = run_llama(args, bin_dir, threads)
                results["llama_cpp"] = results["llama_server"]["llama_cpp"]
            except (RuntimeError, OSError, KeyError) as exc:  # ours are measured: keep them, and say what failed
                results["llama_server"] = {"available": False, "note": f"llama-server failed: {exc}"}
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {args.out}")
    return results


if __name__ == "__main__":
    main()

"""Write docs/benchmarks.md, and the README's results block, from benchmarks/results/*.json.

The figures live in the results files the benchmarks write and nowhere else: this script turns
each file into a section (what it measures, how to rerun it, its tables, its plots, the machine
and date the file records where it does), so the docs cannot drift from the runs. A results file
it has no renderer for gets a generic section with its figures as recorded, and the scripts under
benchmarks/ that write no results file are listed at the end from their own docstrings.
`make docs` runs it; tests/test_docs.py fails when the committed files differ from what it writes.

    python tools/benchmarks_doc.py           # rewrite docs/benchmarks.md and README.md's results block
    python tools/benchmarks_doc.py --check   # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN = "<!-- results: written by tools/benchmarks_doc.py from benchmarks/results/peers.json and shapes.json; `make docs` -->"
END = "<!-- /results -->"
HELPERS = {"kv_folder", "random_model"}  # modules under benchmarks/ that are not benchmarks
GENERIC_ROWS = 60


# -- formatting ---------------------------------------------------------------------------------


def num(value: object, digits: int = 1) -> str:
    if value is None:
        return "not run"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    return f"**{ours / theirs:.2f}x**"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def recorded(data: dict) -> str:
    """The machine and date a results file records, in one line (empty if it records neither)."""
    parts = []
    machine = data.get("machine")
    if isinstance(machine, dict):
        cpu, cpus, threads = machine.get("cpu"), machine.get("cpus"), machine.get("threads")
        words = [f"{cpu}" if cpu else "", f"{cpus} CPUs" if cpus else "", f"{threads} threads" if threads else ""]
        parts.append("machine: " + ", ".join(w for w in words if w))
    elif machine:
        parts.append(f"machine: {machine}")
    for key, label in (("date", "date"), ("model", "model"), ("llama_cpp", "llama.cpp")):
        if data.get(key):
            parts.append(f"{label}: {data[key]}")
    return ("*Recorded in the file: " + "; ".join(parts) + ".*") if parts else ""


# -- renderers of the results files we know ----------------------------------------------------


def peers_sessions(data: dict) -> str:
    rows = []
    for r in data.get("sessions", []):
        bb = (data.get("batched_bench") or {}).get(str(r.get("sessions")))
        rows.append(
            [
                f"{r.get('sessions')} x {r.get('tokens_each')}",
                num(r.get("localpaged")),
                num(r.get("llama_default")),
                num(r.get("llama_fa")),
                num(r.get("llama_kvu_fa")),
                num(bb),
                ratio(r.get("localpaged"), r.get("llama_best")),
            ]
        )
    header = ["sessions x tokens", "localpaged", "llama-server defaults", "`-fa on`, warm", "`-kvu -fa on`, warm"]
    header += ["`llama-batched-bench` decode only", "vs llama-server's best"]
    return "**Many chats at once** (aggregate output tok/s):\n\n" + table(header, rows)


def peers_one_chat(data: dict) -> str:
    one = data.get("one_chat")
    if not one:
        return ""
    peers = [k for k in ("llama_default", "llama_kvu_fa") if k in one]
    names = {"llama_default": "llama-server defaults", "llama_kvu_fa": "`-kvu -fa on`"}
    rows = []
    for key, label, digits, higher in (
        ("decode_tok_s", "decode tok/s, one chat", 1, True),
        ("cold_prefill_tok_s", "cold prefill tok/s", 1, True),
        ("warm_ttft_s", "time to first token, system prompt cached (s)", 3, False),
    ):
        ours = one.get("localpaged", {}).get(key)
        theirs = [one[p].get(key) for p in peers if one[p].get(key)]
        best = (max(theirs) if higher else min(theirs)) if theirs else None
        r = ratio(ours, best) if higher else ratio(best, ours)
        rows.append([label, num(ours, digits), *(num(one[p].get(key), digits) for p in peers), r])
    tokens = one.get("coding_prompt_tokens")
    head = f"**One chat** (the {num(tokens, 0)}-token coding system prompt for the prefill and the first token):"
    return head + "\n\n" + table(["", "localpaged", *(names[p] for p in peers), "vs llama.cpp's best"], rows)


def peers_prefill(data: dict) -> str:
    p = data.get("prefill_by_length")
    if not p:
        return ""
    native = p.get("localpaged", {}).get("native", {})
    torch_ = p.get("localpaged", {}).get("torch", {})
    rows = []
    for length in native:
        theirs = [p.get(k, {}).get(length) for k in ("llama_default", "llama_fa")]
        best = max((t for t in theirs if t), default=None)
        rows.append(
            [num(int(length), 0), num(native[length], 0), num(torch_.get(length), 0)]
            + [num(t, 0) for t in theirs]
            + [ratio(native[length], best)]
        )
    header = ["prompt tokens", "localpaged (native)", "localpaged (torch)", "llama-server defaults", "`-fa on`"]
    out = "**Cold prefill by prompt length** (tok/s, medians of the rounds):\n\n" + table(
        [*header, "vs llama.cpp's best"], rows
    )
    los = p.get("long_over_short") or {}
    if los:
        words = {"native": "localpaged native", "torch": "localpaged torch", "llama_default": "llama-server"}
        words["llama_fa"] = "llama-server `-fa on`"
        cells = ", ".join(f"{words.get(k, k)} {v:.2f}x" for k, v in los.items())
        out += f"\n\nLongest against shortest prompt, tok/s (the median of the rounds' own ratios): {cells}."
    return out


def peers_kv_memory(data: dict) -> str:
    mem = data.get("kv_memory")
    if not mem:
        return ""
    mib = 2**20
    rows = [
        [
            num(r.get("sessions"), 0),
            num(r.get("minimum_bytes", 0) / mib, 0),
            num(r.get("held_bytes", 0) / mib, 0),
            num(r.get("unshared_bytes", 0) / mib, 0),
            num(r["llama_kvu_bytes"] / mib, 0) if "llama_kvu_bytes" in r else "-",
            num(r["llama_np_8192_bytes"] / mib, 0) if "llama_np_8192_bytes" in r else "-",
            f"{r.get('waste', 0):.1%}",
        ]
        for r in mem
    ]
    header = ["sessions", "minimum", "localpaged's pool, prefix shared", "the pool without sharing"]
    header += ["llama.cpp `-np N -kvu`", "llama.cpp `-np N`, 8,192 a slot", "pool over the minimum"]
    head = (
        "**KV memory** (MiB; each session a 2,000-token shared system prompt and 300 tokens of its own, "
        "from the block pool's own accounting; the minimum is the shared part once plus the private parts):"
    )
    return head + "\n\n" + table(header, rows)


def peers_latency(data: dict) -> str:
    lat = data.get("latency")
    if not lat:
        return ""
    labels = {"chunked": "chunked prefill (the default)", "unchunked": "no chunking"}
    rows = [
        [
            labels.get(name, name),
            num(r.get("step_budget"), 0),
            num(r.get("alone_itl_p50_ms"), 0) + " ms",
            num(r.get("itl_p50_ms", 0) / 1000, 2) + " s",
            num(r.get("itl_p99_ms", 0) / 1000, 2) + " s",
            num(r.get("long_prompt_ttft_s"), 1) + " s",
        ]
        for name, r in lat.items()
    ]
    header = [
        "",
        "step budget (tokens)",
        "time between tokens, alone (p50)",
        "while a 4,000-token prompt prefills: p50",
    ]
    return "**Latency under load** (8 chats streaming while a 4,000-token prompt arrives):\n\n" + table(
        [*header, "p99", "the long prompt's first token"], rows
    )


def bound_rows(rows: list[dict]) -> list[list[str]]:
    """Each one-chat row of peers.py's ``one_chat_bound`` or shapes.py's ``rows``: tok/s and fraction of the bound,
    ours then llama.cpp's, and the ratio."""
    out = []
    for r in rows:
        cells = [num(r.get("localpaged")), f"{r['localpaged_bound']:.0%}" if "localpaged_bound" in r else "-"]
        cells += [num(r.get("llama_decode_only")), f"{r['llama_bound']:.0%}" if "llama_bound" in r else "-"]
        out.append([*cells, ratio(r.get("localpaged"), r.get("llama_decode_only"))])
    return out


BOUND_HEADER = ["localpaged tok/s", "of its bound", "llama.cpp tok/s (decode only)", "of its bound", "ratio"]


def peers_bound(data: dict) -> str:
    bound = data.get("one_chat_bound")
    if not bound:
        return ""
    head = (
        f"**One chat against this machine's bound** ({num(data['read_bytes_per_s'] / 1e9)} GB/s read; the bound is "
        "that over the bytes a token reads, each engine's weights and the KV at mid-reply):"
    )
    return head + "\n\n" + table(BOUND_HEADER, bound_rows([bound]))


def render_shapes(data: dict) -> str:
    rows = [
        [r["shape"], r["type"], num(r["file_bytes"] / 2**20, 0), *cells]
        for r, cells in zip(data["rows"], bound_rows(data["rows"]), strict=True)
    ]
    head = f"**One chat, decode tok/s** ({read_rates(data)} on this machine):"
    return head + "\n\n" + table(["shape", "type", "file MiB", *BOUND_HEADER], rows)


def read_rates(data: dict) -> str:
    """The read bandwidth a shapes.json run held its rows to, each row's own, measured just before it."""
    rates = [r["read_bytes_per_s"] / 1e9 for r in data["rows"]]
    return f"{num(min(rates))}-{num(max(rates))} GB/s read, measured before each row"


def render_start_time(data: dict) -> str:
    medians = data["median_s"]
    rows = [
        [name, num(medians[key], 2), ", ".join(num(t, 2) for t in data["seconds"][key])]
        for key, name in (("localpaged", "`localpaged serve`"), ("llama_server", "`llama-server`"))
        if key in medians
    ]
    head = f"**Start to first token** on {data['model']} ({num(data['model_mib'], 0)} MiB), page cache warm:"
    out = head + "\n\n" + table(["server", "median s", "each start, s"], rows)
    if "ratio" in data:
        out += f"\n\nOurs takes **{data['ratio']:.2f}x** llama-server's time (the goal: at most 1.5x)."
    if "first_start_s" in data:
        out += (
            f" The file's first start with ours took {num(data['first_start_s'], 2)} s: its metadata read, its weights"
            " packed and kept, its tokenizer record written (later starts map and read them)."
        )
    return out


def shared_prompt_table(data: dict) -> str:
    mib = 2**20
    header = ["users", "cascade", "first user's prefill s", "every first token s", "decode tok/s"]
    header += ["decode step ms (users)", "KV MiB: pool peak", "minimum then", "unshared", "llama.cpp `-np U`"]
    rows = []
    for p in data["points"]:
        for name in ("on", "off"):
            m = p[name]
            step = f"{num(m['decode_step_ms'], 0)} ({num(m['decode_batch'], 0)})"
            rows.append(
                [num(p["users"], 0), name, num(m["first_prefill_s"], 2), num(m["ttft_last_s"], 2)]
                + [num(m["decode_tok_s"]), step, num(m["peak_bytes"] / mib), num(m["minimum_bytes"] / mib)]
                + [num(m["unshared_whole_bytes"] / mib), num(p["llama_np_bytes"] / mib)]
            )
        q = p["on_over_off"]
        cells = [q.get(k) for k in ("first_prefill_s", "ttft_last_s", "decode_tok_s", "decode_step_ms")]
        rows.append([num(p["users"], 0), "on/off", *(f"{c:.2f}x" if c else "-" for c in cells), "", "", "", ""])
    rounds = "one round" if data["rounds"] == 1 else f"medians of {num(data['rounds'], 0)} rounds"
    return (
        f"**{num(data['shared_tokens'], 0)}-token system prompt, {num(data['new_tokens'], 0)} new tokens a user** "
        f"({data['model']}; {rounds}; on/off: times under 1x and tok/s over 1x mean shared-prefix attention is "
        "faster):\n\n" + table(header, rows)
    )


def shared_prompt_kv(point: dict) -> str:
    on = point["on"]
    return (
        f"At {point['users']} users the pool's peak is {on['peak_blocks'] / on['minimum_blocks']:.3f}x the minimum"
        f" for what it holds then, {1 - on['peak_bytes'] / on['unshared_bytes']:.2%} less than the same users'"
        " paged KV unshared."
    )


def render_shared_prompt(data: dict) -> str:
    """The default run, with its goals: aggregate decode on/off and the step's growth with users."""
    most = max(data["points"], key=lambda p: p["users"])
    out = shared_prompt_table(data) + "\n\n"
    if most["on_over_off"].get("decode_tok_s"):
        out += (
            f"Aggregate decode at {most['users']} users with shared-prefix attention on: "
            f"**{most['on_over_off']['decode_tok_s']:.2f}x** off (the goal: at least 4x). "
        )
    steps = data.get("step_ratio") or {}
    small, large = steps.get("users", [0, 0])
    if small != large and steps.get("on") and steps.get("off"):
        out += (
            f"The decode step at {large} users takes **{steps['on']:.2f}x** the step at {small} with it on "
            f"({steps['off']:.2f}x off; the goal: at most 2x). "
        )
    return out + shared_prompt_kv(most)


SEED_WORKLOAD = {"users": 200, "shared_tokens": 30000, "new_tokens": 16}  # the run the seed-scale goals are for


def render_shared_prompt_seed(data: dict) -> str:
    """A ``--model`` run: its command line from the figures it records, and the seed's goals where it is the seed's
    workload (200 users, 30,000 shared tokens, 16 new each): every first token within 3 minutes, every reply
    within 6."""
    most = max(data["points"], key=lambda p: p["users"])
    on = most["on"]
    users = ",".join(str(p["users"]) for p in data["points"])
    rerun = (
        f"Rerun: `python benchmarks/shared_prompt.py --model {data['model']} --users {users} --shared-tokens "
        f"{data['shared_tokens']} --new-tokens {data['new_tokens']} --rounds {data['rounds']}`"
    )
    seed = {"users": most["users"], "shared_tokens": data["shared_tokens"], "new_tokens": data["new_tokens"]}
    first, last = f"{num(on['ttft_last_s'], 0)} s after they arrived", f"{num(on['wall_s'], 0)} s"
    if seed == SEED_WORKLOAD:
        first, last = f"{first} (the goal: within 180 s)", f"{last} (the goal: within 360 s)"
    return (
        f"{rerun}\n\n{shared_prompt_table(data)}\n\nWith shared-prefix attention on, every user's first token came "
        f"{first} and the last reply ended at {last}. {shared_prompt_kv(most)}"
    )


def render_peers(data: dict) -> str:
    parts = [peers_bound(data), peers_sessions(data), peers_one_chat(data), peers_prefill(data), peers_kv_memory(data)]
    parts.append(peers_latency(data))
    return "\n\n".join(p for p in parts if p)


def render_app_speed(data: dict) -> str:
    res = data.get("results", {})
    base = res.get("script", {}).get("tok_s")
    base8 = res.get("script", {}).get("eight_tok_s")
    rows = [["`LLM.chat` on a plain script: the engine's own speed", num(base), "1.00x", num(base8), "1.00x", "-"]]
    for key, label in (
        ("process", "`AsyncLLM`, the core in its own process (the default)"),
        ("process+ui", "the same, with a UI-like thread in the front end"),
        ("thread", "`AsyncLLM`, the core on a thread of the caller's process"),
        ("thread+ui", "the same, with a UI-like thread"),
    ):
        if key in res:
            tok = res[key].get("tok_s")
            rows.append([label, num(tok), ratio(tok, base).strip("*"), "-", "-", "-"])
    for key, label in (
        ("app/process", "the app, headless, core in its own process"),
        ("app/thread", "the app, headless, core on a thread"),
        ("app/pty", "the app drawing to a pty"),
        ("app/tmux", "the app in tmux"),
    ):
        app = res.get(key)
        if not app:
            continue
        one, eight = app.get("one_chat", {}), app.get("eight_chats", {})
        tok = statistics.median(one["decode_tok_s"]) if one.get("decode_tok_s") else None
        agg = eight.get("aggregate_tok_s")
        share = one.get("front_end_cpu_share")
        cells = [label, num(tok), ratio(tok, base).strip("*"), num(agg), ratio(agg, base8).strip("*")]
        rows.append([*cells, f"{share:.0%}" if share is not None else "-"])
    header = ["contender", "one chat tok/s", "vs the engine", "eight chats tok/s", "vs the engine", "front end CPU"]
    out = f"Replies of {num(data.get('tokens'), 0)} greedy tokens; each figure the best of the rounds.\n\n"
    out += table(header, rows)
    starts = [
        (label, res[key].get(field))
        for key, field, label in (
            ("run/process", "seconds", '`localpaged run "hi" --max-tokens 1`, start to exit'),
            ("app/process", "start_to_chat_s", "the app, start to the loading screen closing"),
        )
        if key in res
    ]
    if starts:
        out += "\n\n" + table(["start-up", "seconds"], [[label, num(s, 1)] for label, s in starts])
    return out


def render_serve_speed(data: dict) -> str:
    res = data.get("results", {})
    rows = []
    for key, label in (("in-process", "`AsyncLLM.stream` in-process"), ("http", "`localpaged serve` over HTTP")):
        r = res.get(key)
        if r:
            cpu = r.get("front_cpu_ms_per_token")
            rows.append(
                [label, num(r.get("tok_s")), num(r.get("ttft_p50_s"), 2), num(r.get("ttft_p99_s"), 2), num(cpu, 3)]
            )
    header = ["", "aggregate tok/s", "first token p50 (s)", "p99 (s)", "CPU outside the core, ms a token"]
    out = f"{num(data.get('clients'), 0)} streaming clients, {num(data.get('tokens'), 0)} tokens each; "
    out += "each contender's best round.\n\n" + table(header, rows)
    ratios = data.get("ratios") or {}
    if "tok_s" in ratios:
        out += f"\n\nHTTP against in-process: {ratios['tok_s']:.2f}x the tok/s (the goal: at least 0.9x)."
    return out


def render_kv_disk(data: dict) -> str:
    cases = [("coding", "first chat with the coding prompt"), ("long chat", "reopening a long chat, one more message")]
    columns = ["(a) cold", "(b) new process, page cache warm", "(b) new process, page cache dropped"]
    columns.append("(c) warm in memory")
    rows = []
    for case, label in cases:
        cells = [data.get(f"{case} {c}", {}).get("ttft_s") for c in columns]
        tokens = next((data[f"{case} {c}"].get("prompt_tokens") for c in columns if f"{case} {c}" in data), None)
        if any(cells):
            rows.append([f"{label} ({num(tokens, 0)} tokens)", *(num(c, 3) + " s" if c else "-" for c in cells)])
    out = "Time to first token:\n\n" + table(
        ["", "cold", "new process, from disk", "the same, OS page cache dropped", "warm in memory"], rows
    )
    facts = []
    if "disk bytes per block" in data:
        facts.append(f"a block takes {num(data['disk bytes per block'], 0)} bytes on disk")
    if "disk write MB/s (writer thread, during decode)" in data:
        facts.append(f"the writer wrote {num(data['disk write MB/s (writer thread, during decode)'], 0)} MB/s")
    if "decode on/off" in data:
        facts.append(f"decode with the tier on ran at {data['decode on/off']:.2f}x of decode with it off (goal 0.95x)")
    if facts:
        text = "; ".join(facts)
        out += "\n\n" + text[0].upper() + text[1:] + "."
    return out


def render_parallel_samples(data: dict) -> str:
    medians, ratios = data.get("medians", {}), data.get("ratios_n8_to_separate", {})
    figures = ("peak_blocks", "prefill_tokens", "wall_s", "tok_s")
    digits = {"peak_blocks": 0, "prefill_tokens": 0, "wall_s": 2, "tok_s": 1}
    rows = [[c, *(num(m.get(f), digits[f]) for f in figures)] for c, m in medians.items()]
    if ratios:
        rows.append(["n=8 / 8 requests", *(f"**{ratios[f]:.2f}x**" if f in ratios else "-" for f in figures)])
    out = (
        f"{num(data.get('samples'), 0)} samples of a {num(data.get('prompt_tokens'), 0)}-token prompt, "
        f"{num(data.get('new_tokens'), 0)} new tokens each, on {data.get('device', 'the CPU')}; medians of "
        f"{num(data.get('rounds'), 0)} rounds (ratios: the median of each round's own).\n\n"
    )
    return out + table(["", "peak KV blocks", "prompt tokens computed", "wall (s)", "aggregate tok/s"], rows)


def render_structured_speed(data: dict) -> str:
    one, many = data.get("one_chat_tok_s") or {}, data.get("sessions_tok_s") or {}
    goals, ratios = data.get("goals") or {}, data.get("ratios") or {}
    sessions = num(data.get("sessions"), 0)
    rows = []
    for key, label, rates in (("one_chat", "one chat", one), ("sessions", f"{sessions} chats at once", many)):
        if rates:
            got, goal = ratios.get(key), goals.get(key)
            verdict = "-" if got is None or goal is None else ("met" if got >= goal else "missed")
            goal_text = f"{goal:.2f}x ({verdict})" if goal is not None else "-"
            rows.append(
                [
                    label,
                    num(rates.get("free")),
                    num(rates.get("schema")),
                    ratio(rates.get("schema"), rates.get("free")),
                    goal_text,
                ]
            )
    out = f"Decode tok/s, {num(data.get('tokens'), 0)} tokens a reply, greedy; median of {num(data.get('rounds'), 0)} rounds.\n\n"
    out += table(["", "free", "JSON schema", "schema / free", "goal"], rows)
    shares = data.get("grammar_share_of_run") or {}
    if shares:
        out += (
            f"\n\nThe grammar's own work (bitmask fill and apply, matcher advance) took "
            f"{num(100 * shares.get('one_chat', 0), 1)}% of a schema run's time for one chat and "
            f"{num(100 * shares.get('sessions', 0), 1)}% for {sessions} at once, timed inside the runs."
        )
    c = data.get("compile_10_fields") or {}
    if c:
        out += (
            f"\n\nA 10-field object schema: checked (parsed) in {num(c.get('check_ms'), 2)} ms, compiled cold in "
            f"{num(c.get('cold_ms'), 1)} ms, cached in {num(c.get('cached_ms'), 3)} ms (medians of {num(c.get('schemas'), 0)} schemas)."
        )
    return out


def render_sampling_cost(data: dict) -> str:
    scenarios, ratios = data.get("scenarios", {}), data.get("ratios", {})
    rows = []
    for name, s in scenarios.items():
        q = ratios.get(name, {})
        rows.append([name, num(s.get("sampler_ms"), 2), f"{q.get('sampler', 0):.2f}x", num(s.get("step_ms"), 1)])
        rows[-1].append(f"{q.get('step', 0):.2f}x")
    out = (
        f"{num(data.get('requests'), 0)} requests of {num(data.get('tokens'), 0)} tokens on {data.get('device', '?')}; "
        "medians over the decode steps that run every request.\n\n"
    )
    out += table(["scenario", "sampler ms a step", "x none", "step ms", "x none"], rows)
    counts = data.get("counts") or []
    if counts:
        header = ["reply tokens", "(a) counts rebuilt", "(b) counts per request", "(c) the sampler's", "a clone"]
        keys = ("rebuilt_ms", "per_request_counts_ms", "sampler_ms", "clone_ms")
        body = [[num(c.get("reply_tokens"), 0), *(num(c.get(k), 2) + " ms" for k in keys)] for c in counts]
        out += "\n\nPresence and frequency penalties at the same number of rows, one thread:\n\n" + table(header, body)
    return out


def render_tool_rounds(data: dict) -> str:
    screen = data.get("first_screen_s") or {}
    rows = [[name, num(seconds, 2)] for name, seconds in screen.items()]
    if data.get("first_screen_ratio") is not None:
        rows.append(["three servers / none", f"**{data['first_screen_ratio']:.2f}x**"])
    out = table(["MCP servers configured", "first screen (s)"], rows)
    replay = data.get("replay") or {}
    turns = replay.get("turns") or []
    rows = [[str(i), num(t.get("prompt_tokens"), 0), num(t.get("cached_tokens"), 0)] for i, t in enumerate(turns, 1)]
    out += "\n\nEach turn's first prompt, replaying the earlier turns' tool rounds:\n\n"
    out += table(["turn", "prompt tokens", "served by the prefix cache"], rows)
    if replay.get("third_turn_cached_share") is not None:
        out += f"\n\nThe third turn: **{replay['third_turn_cached_share']:.0%}** of its prompt from the cache."
    return out


SPEC_ROWS = {
    "code_edit": "code edit, one chat",
    "regenerate": "regenerate a stored reply",
    "continue": "continue a stored reply",
    "chat": "ordinary chat, one at a time",
}


def spec_row_label(row: str) -> str:
    if row.startswith("sessions_"):
        return f"{row.removeprefix('sessions_')} chats at once (aggregate)"
    return SPEC_ROWS.get(row, row)


def spec_cells(on: object, off: float | None) -> list[str]:
    """A mode's tok/s, ratio to off, acceptance and identical-tokens cells (a mode not run: its reason)."""
    if not isinstance(on, dict):
        return [str(on), "-", "-", "-"]
    acceptance = on.get("acceptance")
    identical = on.get("identical")
    return [
        num(on.get("tok_s")),
        ratio(on.get("tok_s"), off),
        f"{acceptance:.0%}" if acceptance is not None else ("no drafts" if on.get("proposed") == 0 else "-"),
        "-" if identical is None else ("yes" if identical else "**no**"),
    ]


def render_spec_decode(data: dict) -> str:
    modes = ("ngram", "suffix", "auto", "draft")
    rows = []
    for name, r in (data.get("rows") or {}).items():
        off = (r.get("off") or {}).get("tok_s")
        goal = r.get("goal")
        goal_text = f"{goal:.1f}x" if goal is not None else "-"
        ran = [m for m in modes if isinstance(r.get(m), dict)]
        if not ran:  # off alone: no mode asked for, or the engine refused them (their reason, once)
            why = next((r[m] for m in modes if isinstance(r.get(m), str)), "off only")
            rows.append([spec_row_label(name), num(off), "-", why, "-", "-", "-", goal_text])
        for mode in ran:
            rows.append([spec_row_label(name), num(off), f"`{mode}`", *spec_cells(r[mode], off), goal_text])
    tokens = data.get("tokens") or {}
    head = (
        f"Decode tok/s, greedy, the best of {num(data.get('rounds'), 0)} round(s) (off and on alternating); "
        f"new tokens at most {num(tokens.get('edit_tokens'), 0)} for the code edit, "
        f"{num(tokens.get('reply_tokens'), 0)} for the stored reply, {num(tokens.get('chat_tokens'), 0)} a chat "
        f"and {num(tokens.get('session_tokens'), 0)} a session. Acceptance: accepted over proposed draft tokens; "
        "identical: every run's greedy token ids equal speculation off's."
    )
    draft = data.get("draft")
    if draft:
        name = ((data.get("resolved") or {}).get("draft") or {}).get("speculative_draft") or draft.get("draft")
        head += f" `draft`: drafts from the draft model {name}, k = {draft.get('k')}, for {data.get('model')}."
    if data.get("quick"):
        head += " A `--quick` run: smoke-test figures."
    header = ["workload", "off", "mode", "on", "on / off", "acceptance", "identical", "goal"]
    out = head + "\n\n" + table(header, rows)
    if data.get("note"):
        out += f"\n\n{data['note'][0].upper()}{data['note'][1:]}."
    peer = data.get("llama_server") or {}
    if not peer.get("available"):
        return out + (f"\n\nllama-server: {peer['note']}." if peer.get("note") else "")
    rows = []
    for name, r in (peer.get("rows") or {}).items():
        off = (r.get("off") or {}).get("tok_s")
        for mode, on in r.items():
            if mode != "off":
                rows.append([spec_row_label(name), num(off), f"`{mode}`", *spec_cells(on, off)])
    regen_off = ((peer.get("rows") or {}).get("regenerate") or {}).get("off") or {}
    note = ""
    if regen_off.get("same_as_first_reply") is False:
        note = (
            "\n\nllama-server's own greedy regenerate, speculation off, differed from its first reply (its prompt "
            "cached the second time): its identical column compares with that regenerate."
        )
    flags = peer.get("flags") or {}
    words = "; ".join(f"{mode}: `{flag}`" for mode, flag in flags.items())
    out += "\n\nllama-server on the same prompt ids, its own tok/s (`predicted_per_second`)"
    out += (f" ({words})" if words else "") + ":\n\n"
    return out + table(["workload", "off", "mode", "on", "on / off", "acceptance", "identical"], rows) + note


def render_generic(data: object) -> str:
    """Any other results file: its figures as recorded, one row a value (lists as their median)."""
    rows: list[list[str]] = []

    def walk(value: object, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path} / {key}" if path else str(key))
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            rows.append([path, f"{statistics.median(value):,.4g} (median of {len(value)})"])
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path} / {i}")
        else:
            rows.append([path or "(value)", f"{value:,.4g}" if isinstance(value, float) else str(value)])

    walk(data, "")
    note = "No renderer in tools/benchmarks_doc.py knows this file yet: its figures as recorded."
    if len(rows) > GENERIC_ROWS:
        note += f" The first {GENERIC_ROWS} of {len(rows)}."
    return note + "\n\n" + table(["figure", "value"], rows[:GENERIC_ROWS])


# -- what each benchmark is ---------------------------------------------------------------------


class Spec:
    def __init__(self, title: str, about: str, rerun: str, render: Callable[[dict], str]) -> None:
        self.title, self.about, self.rerun, self.render = title, about, rerun, render


PEERS_ABOUT = (
    "localpaged against llama.cpp, the program our users would otherwise run, on the same GGUF, the same CPU "
    "and thread count, in one run (these machines drift by up to 20% from minute to minute, so only figures of "
    "one run are compared). Both get the same prompt token ids (sent to llama-server as ids), greedy, end of "
    "turn ignored. Sessions share a ~300-token system prompt and each asks its own question; llama-server is "
    "started for each point with `-np N` and 1,024 tokens of context a slot and driven over HTTP, with its "
    "defaults (cold) and tuned (`-fa on`, and `-kvu -fa on` up to 16 sessions; warm: every slot already holds "
    "the system prompt). The cold prefills run without the disk tier."
)
KNOWN: dict[str, Spec] = {
    "peers": Spec(
        "localpaged against llama.cpp",
        PEERS_ABOUT,
        "`make bench-peers` once (builds llama.cpp into the cache folder, about 10 minutes on two cores), then "
        "`python benchmarks/peers.py` (part of `make bench`).",
        render_peers,
    ),
    "shapes": Spec(
        "Real sizes: one chat on popular models' shapes",
        "Random-weight GGUFs of real models' shapes (speed does not depend on the weights' values), each file read "
        "by both engines in one run: our one-chat decode (the best of 3 replies of 128 tokens) against "
        "`llama-batched-bench`'s decode-only figure (the better of its two attention settings), each as a fraction "
        "of this machine's bound (its read bandwidth, the best pass of a streaming read just before the row, over "
        "the bytes a token reads: the weights as each engine holds them and the KV at mid-reply).",
        "`make bench-peers` once, then `python benchmarks/shapes.py [--shapes ...] [--types Q4_K_M,...]` (the files "
        "are written into the cache on first use).",
        render_shapes,
    ),
    "start_time": Spec(
        "Start to first token",
        "A server started from nothing until its first one-token reply: `localpaged serve` (its engine core in "
        "a process of its own, the kernels already compiled) against `llama-server` with the same threads, "
        "alternating in one run after a start of each that is not in the medians; ours' first start of the "
        "file (what it leaves in the cache removed first) is timed on its own.",
        "`make bench-peers` once, then `python benchmarks/start_time.py [--model F.gguf] [--rounds 3]`.",
        render_start_time,
    ),
    "app_speed": Spec(
        "Does the app stream at the engine's speed?",
        "One chat, and eight at once, through each front end against `LLM.chat` on a plain script, every "
        "contender in a fresh interpreter in one run. The front end's CPU share is what the app takes from the "
        "engine on a small machine.",
        "`python benchmarks/app_speed.py [--tokens 128]` (part of `make bench`).",
        render_app_speed,
    ),
    "serve_speed": Spec(
        "What does HTTP cost?",
        "Streaming clients against `localpaged serve` through the official OpenAI client, against the same "
        "requests through `AsyncLLM` in-process; the engine core runs in its own process in both, so they differ "
        "by the HTTP layer alone. Every request shares one system prompt and generates exactly the same tokens.",
        "`python benchmarks/serve_speed.py [--clients 32] [--tokens 128]` (part of `make bench`).",
        render_serve_speed,
    ),
    "structured_speed": Spec(
        "What a JSON schema costs",
        "Decode under a JSON schema (xgrammar's token masks applied to the constrained rows) against free decode "
        "of the same length, for one chat and for many at once, each with a schema of its own, on the default "
        "model in one run; and the compile of a typical schema, cold and cached.",
        "`python benchmarks/structured_speed.py [--tokens 128] [--sessions 16]` (part of `make bench`).",
        render_structured_speed,
    ),
    "kv_disk": Spec(
        "The disk KV tier",
        "Time to first token cold, from the disk tier in a new process, and warm in memory: (b) and (c) are "
        "the median of five new processes and five new questions. Also the tier's bytes per block, its "
        "writer's speed, and decode with the tier on against off.",
        "`python benchmarks/kv_disk.py` (part of `make bench`).",
        render_kv_disk,
    ),
    "parallel_samples": Spec(
        "Parallel samples: n = 8 against 8 requests",
        "One request for 8 samples of a ~1,000-token prompt (prefilled once, its full KV blocks shared, its "
        "partial block copied per sample) against 8 separate requests of the same prompt sent at once, prefix "
        "caching on, each run on a prompt of its own (cold).",
        "`python benchmarks/parallel_samples.py [--prompt-tokens 1000] [--new-tokens 64]` (part of `make bench`).",
        render_parallel_samples,
    ),
    "tool_rounds": Spec(
        "Tools: MCP servers at start, and replayed tool rounds",
        "The app's time from start to its chat screen with no MCP server and with three (one five seconds slow "
        "to start), the default model loading for real, medians of alternating rounds; then a chat of three "
        "turns of one grammar-held tool call each (tool_choice required) and what the prefix cache serves of "
        "each turn's first prompt.",
        "`python benchmarks/tool_rounds.py [--rounds 2]` (part of `make bench`).",
        render_tool_rounds,
    ),
    "spec_decode": Spec(
        "Speculative decoding",
        "Decode with speculative decoding off and on (the engine's `ngram`, `suffix` and `auto` drafts, no draft "
        "model) on what it is for (a code edit that copies its prompt, a regenerated and a continued reply) and on "
        "what it must not slow (ordinary chats, many chats at once), on the default model in one run; and "
        "llama-server's draftless speculation (`ngram-simple`, and `ngram-mod` of `--spec-default`) against its "
        "defaults on the same prompts.",
        "`make bench-peers` once for the llama-server side, then `python benchmarks/spec_decode.py [--rounds 3]` "
        "(`--quick`: a smoke run in under a minute).",
        render_spec_decode,
    ),
    "shared_prompt": Spec(
        "One long system prompt, many users: shared-prefix attention",
        "U users arrive together, each with the same system prompt and a question of its own, T new tokens each, "
        "greedy; one engine with shared-prefix (cascade) attention and one without, in turn in one run, each round "
        "on a system prompt of its own (cold, the disk tier off). The KV columns are the pool's peak, the minimum "
        "for the tokens the users hold at that step (the prompt's blocks once, each user's own), the same users "
        "without sharing, and what llama-server reserves for them with a slot each.",
        "`python benchmarks/shared_prompt.py [--users 8,64] [--shared-tokens 8000] [--new-tokens 32]` (part of "
        "`make bench`).",
        render_shared_prompt,
    ),
    "sampling_cost": Spec(
        "What penalties and logprobs cost",
        "The sampler's time and the whole step's with penalties, logit_bias and min_p, with logprobs=5, and with "
        "half the requests asking for both, and at the app's own sampling (temperature 0.7, no top-p: a draw over "
        "the whole vocabulary), against none, at 64 running requests on the default model in one run; and three "
        "ways to apply presence and frequency penalties over each row's reply.",
        "`python benchmarks/sampling_cost.py [--requests 64] [--tokens 64]` (part of `make bench`).",
        render_sampling_cost,
    ),
}


def spec_for(stem: str) -> Spec:
    if stem in KNOWN:
        return KNOWN[stem]
    if stem.startswith("peers-"):  # peers.py --model FILE (sessions table only) or --only prefill
        return Spec(
            f"localpaged against llama.cpp: {stem.removeprefix('peers-')}",
            "The sessions of the section above, measured the same way on another file, in a separate run, with "
            "speculation off (such a file is often a random-weight one, whose repeating text speculation would "
            "flatter), and one chat against the machine's bound.",
            f"`python benchmarks/peers.py --model {stem.removeprefix('peers-')}.gguf`"
            if stem != "peers-prefill"
            else "`python benchmarks/peers.py --only prefill`",
            render_peers,
        )
    if stem.startswith("shapes-context-"):  # shapes.py --context N: a chat with a long history
        tokens = stem.removeprefix("shapes-context-")
        return Spec(
            f"Real sizes: one chat with a {int(tokens):,}-token history",
            "The one chat of the section above after a long conversation: the chat prompt's tokens repeated to "
            f"{int(tokens):,} before the reply, so that each step reads that history's KV beside the weights; "
            "llama.cpp's decode-only figure at the same depth (`llama-batched-bench -npp`).",
            f"`python benchmarks/shapes.py --shapes ... --context {tokens}`",
            render_shapes,
        )
    if stem.startswith("shared_prompt-"):  # shared_prompt.py --model FILE: a longer context
        return Spec(
            f"One long system prompt, many users: {stem.removeprefix('shared_prompt-')}",
            "The workload of the section above on another GGUF: at the seed's scale (200 users, a 30,000-token "
            "prompt), a random-weight GGUF of the default model's shape with a 32k context (`benchmarks/random_gguf.py "
            "default FILE --context 32768`; speed does not depend on the weights' values).",
            "",  # the section's own figures give its command line (render_shared_prompt_seed)
            render_shared_prompt_seed,
        )
    if stem == "spec_decode-draft":  # spec_decode.py --draft on a target deepened by random_gguf.py
        return Spec(
            "Speculative decoding with a draft model",
            "The workloads of the section above with drafts from a draft model (mode `draft`) against none, in one "
            "run. No larger model of the default model's vocabulary can be had offline, so the target is the "
            "default model requantised to Q8_0 with 270 layers added that add nothing (`random_gguf.py --deepen`): "
            "it answers as the 135M model does at the cost of a model of about 1.1B parameters; the draft is the "
            "default model's own Q4_1 file. The acceptance is therefore that of two quantisations of one model, "
            "higher than a small model drafting for a larger one would get.",
            "`llama-quantize --allow-requantize DEFAULT.gguf Q8.gguf Q8_0`, `python benchmarks/random_gguf.py Q8.gguf "
            "TARGET.gguf --deepen 270`, then `python benchmarks/spec_decode.py --model TARGET.gguf --draft "
            "DEFAULT.gguf --modes '' --skip-llama --rounds 2 --sessions 16 --out "
            "benchmarks/results/spec_decode-draft.json`",
            render_spec_decode,
        )
    script = ROOT / "benchmarks" / f"{stem}.py"
    about, rerun = "", ""
    if script.is_file():
        about = first_line(script)
        rerun = f"`python benchmarks/{stem}.py`"
    return Spec(stem, about, rerun, render_generic)


def first_line(script: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(script.read_text()))
    except (OSError, SyntaxError, ValueError):
        return ""
    return doc.strip().splitlines()[0] if doc else ""


def usage_lines(script: Path) -> list[str]:
    try:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    except (OSError, SyntaxError, ValueError):
        return []
    lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("python benchmarks/")]
    return [re.split(r"\s{2,}", line)[0] for line in lines]  # a usage line's comment after a wide gap


# -- the documents --------------------------------------------------------------------------------


def order(stems: list[str]) -> list[str]:
    known = [s for s in KNOWN if s in stems]
    peers_more = sorted(s for s in stems if s.startswith("peers-"))
    return known[:1] + peers_more + known[1:] + sorted(s for s in stems if s not in KNOWN and s not in peers_more)


def plots_by_stem(stems: list[str], results: Path) -> tuple[dict[str, list[str]], list[str]]:
    """Each PNG goes to the results file whose name is the longest prefix of its own (``peers_kv_memory`` -> peers)."""
    owned: dict[str, list[str]] = {s: [] for s in stems}
    loose = []
    for png in sorted(results.glob("*.png")):
        owners = [s for s in stems if png.stem == s or png.stem.startswith((s + "_", s + "-"))]
        if owners:
            owned[max(owners, key=len)].append(png.name)
        else:
            loose.append(png.name)
    return owned, loose


def render_doc(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*.json"))
    stems = order([f.stem for f in files])
    plots, loose = plots_by_stem(stems, results)
    out = [
        "# Benchmarks",
        "",
        "<!-- Written by tools/benchmarks_doc.py from benchmarks/results/: edit those, then `make docs`. -->",
        "",
        (
            "Every figure below is read from a results file under [benchmarks/results/](../benchmarks/results/), "
            "written by the benchmark's last run; `make bench` reruns them all "
            "(llama.cpp's side once `make bench-peers` has built it) and `make docs` rewrites this page. "
            "Each benchmark compares its contenders within one run: these shared "
            "machines drift by up to 20% from minute to minute, so figures from different runs, or different "
            "machines, are not compared. How the two engines compare depends on the CPU: compare on yours."
        ),
    ]
    for stem in stems:
        path = results / f"{stem}.json"
        spec = spec_for(stem)
        out += ["", f"## {spec.title}", "", f"Results file: [`{path.name}`](../benchmarks/results/{path.name})."]
        if spec.about:
            out += ["", spec.about]
        if spec.rerun:
            out += ["", f"Rerun: {spec.rerun}"]
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            out += ["", f"The file could not be read ({type(exc).__name__}): no figures."]
            continue
        note = recorded(data) if isinstance(data, dict) else ""
        if note:
            out += ["", note]
        try:
            body = spec.render(data) if isinstance(data, dict) else render_generic(data)
        except (KeyError, TypeError, ValueError, AttributeError, statistics.StatisticsError):
            body = render_generic(data)  # a file whose shape moved on from its renderer: still every figure
        out += ["", body]
        for png in plots.get(stem, []):
            out += ["", f"![{png}](../benchmarks/results/{png})"]
    for png in loose:
        out += ["", f"![{png}](../benchmarks/results/{png})"]
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in HELPERS and p.stem not in stems)
    if scripts:
        out += [
            "",
            "## Benchmarks that print their figures",
            "",
            "These write no results file: they print their comparison, and their figures are not kept here.",
            "",
        ]
        for script in scripts:
            usage = "; ".join(f"`{u}`" for u in usage_lines(script)) or f"`python benchmarks/{script.name}`"
            out.append(f"- [`{script.name}`](../benchmarks/{script.name}): {first_line(script)} {usage}")
    return "\n".join(out) + "\n"


def render_readme_block(results: Path = RESULTS) -> str:
    """The README's headline tables: peers.json's sessions and one-chat figures, and shapes.json's one chat at real
    sizes where it is there, each with the machine it records."""
    data = json.loads((results / "peers.json").read_text())
    rows = []
    for r in data.get("sessions", []):
        n = r["sessions"]
        label = f"{n} chat{'s' if n > 1 else ''} at once, {r['tokens_each']} tokens each: output tok/s"
        rows.append(
            [label, num(r["localpaged"]), num(r.get("llama_best")), ratio(r["localpaged"], r.get("llama_best"))]
        )
    one = data.get("one_chat") or {}
    ours = one.get("localpaged", {})
    peers = [v for k, v in one.items() if k.startswith("llama_") and isinstance(v, dict)]
    if ours and peers:
        tokens = num(one.get("coding_prompt_tokens"), 0)
        best = max(p["cold_prefill_tok_s"] for p in peers)
        rows.append([f"cold prefill of a {tokens}-token prompt: tok/s", num(ours["cold_prefill_tok_s"], 0)])
        rows[-1] += [num(best, 0), ratio(ours["cold_prefill_tok_s"], best)]
        best = min(p["warm_ttft_s"] for p in peers)
        rows.append(["first token, system prompt cached: s", num(ours["warm_ttft_s"], 3), num(best, 3)])
        rows[-1].append(ratio(best, ours["warm_ttft_s"]))
    mem = (data.get("kv_memory") or [{}])[-1]
    if "llama_kvu_bytes" in mem:
        mib = 2**20
        label = f"KV memory of {mem['sessions']} chats sharing a 2,000-token system prompt: MiB"
        rows.append([label, num(mem["held_bytes"] / mib, 0), num(mem["llama_kvu_bytes"] / mib, 0)])
        rows[-1].append(f"**{mem['llama_kvu_bytes'] / mem['held_bytes']:.1f}x less**")
    lines = [
        BEGIN,
        table(["the default model's GGUF, greedy", "localpaged", "llama.cpp's best", ""], rows),
        "",
        f"*{where(data)}; llama.cpp {data.get('llama_cpp')}, built with `-march=native`.*",
    ]
    if (results / "shapes.json").is_file():
        shapes = json.loads((results / "shapes.json").read_text())
        rows = [
            [f"{r['shape']} `{r['type']}`", *cells]
            for r, cells in zip(shapes["rows"], bound_rows(shapes["rows"]), strict=True)
        ]
        about = (
            "At real sizes, one chat (random-weight files of these models' shapes; the bound is this machine's read "
            "bandwidth over the bytes a token reads):"
        )
        lines += ["", about, "", table(["model shape, type", *BOUND_HEADER], rows)]
        lines += ["", f"*{where(shapes)}; {read_rates(shapes)}.*"]
    return "\n".join([*lines, END])


def where(data: dict) -> str:
    machine = data.get("machine") or {}
    return f"{machine.get('cpu')}, {machine.get('cpus')} CPUs, {machine.get('threads')} threads for each engine"


def readme_with_block(readme: str, block: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no results block ({BEGIN!r} ... {END!r})")
    return readme[:start] + block + readme[end + len(END) :]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md or README.md is out of date")
    args = ap.parse_args()
    doc = render_doc()
    readme = readme_with_block(README.read_text(), render_readme_block())
    stale = [p for p, text in ((DOC, doc), (README, readme)) if not p.is_file() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in ((DOC, doc), (README, readme)):
        if path in stale:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

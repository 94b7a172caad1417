"""Start to first token: a server started from nothing until its first reply, ours against llama-server.

What a user waits for after typing the command: the process starts, maps and prepares the GGUF, serves, and
answers a first one-token completion. ``localpaged serve --model F`` (its core in its own process, the kernels
already compiled) against ``llama-server -m F`` with the same thread count, alternating in one run, each
started ``--rounds`` times after one start of each that is not in the medians (so the file is in the page cache
for both, the "second start" a returning user sees). Ours' first start is timed on its own: the file's first
use, everything it leaves in the cache removed before it (its metadata, its packed weights, its tokenizer
record). Reports the medians and the ratio; writes benchmarks/results/start_time.json. Needs
``make bench-peers``'s llama-server; without it, ours alone.

    python benchmarks/start_time.py [--model F.gguf] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peers import LlamaServer, cpu_name, llama_bin_dir
from serve_speed import start_server

RESULTS = HERE / "results" / "start_time.json"
PROMPT = "Hello"


def first_completion(url: str, body: dict) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        reply.read()


def ours(model: Path) -> float:
    """Seconds from spawning ``localpaged serve`` to its first one-token completion."""
    start = time.perf_counter()
    server, url, name = start_server("--model", str(model), "--kv-cache-memory", "512MiB", "--max-model-len", "2048")
    try:
        first_completion(f"{url}/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
        return time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)


def llama(bin_dir: Path, model: Path, threads: int) -> float:
    """Seconds from spawning ``llama-server`` to its first one-token completion."""
    start = time.perf_counter()
    with LlamaServer(bin_dir, model, threads, "-c", "2048") as server:
        first_completion(
            f"http://127.0.0.1:{server.port}/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0.0}
        )
        return time.perf_counter() - start


def forget(model: Path) -> None:
    """Remove what a first start of ``model`` leaves in the cache: its metadata, packed weights, tokenizer record."""
    from localpaged.engine.engine_tokenizer import record_folder
    from localpaged.locations import models_cache_dir
    from localpaged.models.loader import resolve_model

    files = resolve_model(str(model))
    shutil.rmtree(record_folder(files.folder), ignore_errors=True)
    for folder in models_cache_dir().glob(f"{files.fingerprint[:32]}-*"):
        shutil.rmtree(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF (default: the default model's)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from localpaged.models.loader import default_model_path

        args.model = default_model_path()
    threads = os.cpu_count() or 1
    bin_dir = llama_bin_dir()
    if bin_dir is None:
        print("no llama-server (run `make bench-peers`): measuring ours alone")
    runners = {"localpaged": lambda: ours(args.model)}
    if bin_dir is not None:
        runners["llama_server"] = lambda: llama(bin_dir, args.model, threads)
    forget(args.model)
    first_start = ours(args.model)  # its packing and tokenizer record written, the file read into the page cache
    if bin_dir is not None:
        runners["llama_server"]()  # the page cache for it too
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            times[name].append(run())
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads},
        "model": args.model.name,
        "model_mib": args.model.stat().st_size / 2**20,
        "first_start_s": first_start,
        "seconds": times,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
    }
    if "llama_server" in times:
        result["ratio"] = result["median_s"]["localpaged"] / result["median_s"]["llama_server"]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  localpaged: first start {first_start:.2f} s")
    for name, t in times.items():
        print(f"{name:>12}: median {statistics.median(t):.2f} s  ({', '.join(f'{x:.2f}' for x in t)})")
    if "ratio" in result:
        print(f"ours / llama-server: {result['ratio']:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()

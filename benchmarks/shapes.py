"""One chat on real-size models: random-weight GGUFs of popular shapes, ours against llama.cpp, against the bound.

For each shape of ``random_gguf.SHAPES`` (Llama 3.2, Qwen2.5, Qwen3, SmolLM2 and Phi-3.5/4-mini bodies, each in
its family's tensor layout with its own vocabulary size) and each llama.cpp type mix asked for, the file is
written once into the cache (``<cache>/shapes/``; random weights, since speed does not depend on their values;
the seconds it took are kept in the row of the run that wrote it) and one chat's decode (128 greedy tokens after
a short chat prompt) is measured, ours (``LLM.generate``, default settings but speculation, which a random
model's repeating text would flatter) against ``llama-batched-bench``'s decode-only figure, each also as a
fraction of this machine's bound: its read bandwidth (measured just before each row, since it drifts over a run)
over the bytes a token reads (the weights as each engine holds them, and the KV of the context at mid-reply). Writes
benchmarks/results/shapes.json, which the README's table of real sizes is made from (``make docs``). Needs
``make bench-peers``'s binaries for the ratios. ``--context N`` measures a chat with an N-token history instead (a
long conversation, whose KV a step reads beside the weights), into benchmarks/results/shapes-context-N.json.

    python benchmarks/shapes.py [--shapes qwen2.5-0.5b,llama-3.2-1b,...] [--types Q4_K_M,Q6_K,...] [--context 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "shapes.json"
sys.path.insert(0, str(HERE))
from peers import RANDOM_WEIGHTS, cpu_name, llama_bin_dir, one_chat_bound, read_bandwidth, settled
from random_gguf import MIXES, SHAPES, write_shaped_gguf


def shape_file(shape: str, mix: str) -> tuple[Path, float | None]:
    """The cached random-weight GGUF of ``shape`` in ``mix``, written first where it is missing, and the seconds
    the writing took (None where the cache had it)."""
    from localpaged.locations import cache_dir
    from localpaged.models.loader import default_model_path

    folder = cache_dir() / "shapes"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{shape}-{mix.lower()}.gguf"
    if path.exists():
        return path, None
    start = time.perf_counter()
    partial = path.with_suffix(".partial")
    write_shaped_gguf(default_model_path(), partial, SHAPES[shape], mix)
    partial.rename(path)
    seconds = time.perf_counter() - start
    print(f"  wrote {path.name} ({path.stat().st_size / 2**20:,.0f} MiB) in {seconds:.0f} s")
    return path, seconds


# Unless told otherwise: every shape in Q4_K_M, the type most files people download have, and one mid-size shape
# in each other type llama.cpp users pick.
TYPES_SHAPE = "qwen2.5-1.5b"
OTHER_TYPES = ("Q4_0", "Q5_K_M", "Q6_K", "Q8_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--types", help=f"comma-separated, of {', '.join(MIXES)} (default: Q4_K_M)")
    ap.add_argument("--context", type=int, help="tokens of history before the reply (default: a short chat prompt)")
    args = ap.parse_args()
    if args.context is not None and args.context < 1:  # above a shape's own context, LLM says so
        ap.error(f"--context {args.context}: a history of at least 1 token")
    shapes = args.shapes.split(",") if args.shapes else list(SHAPES)
    mixes = args.types.split(",") if args.types else ["Q4_K_M"]
    for name, asked, known in (("shape", shapes, SHAPES), ("type", mixes, MIXES)):
        if unknown := [v for v in asked if v not in known]:
            ap.error(f"unknown {name} {', '.join(unknown)}: choose from {', '.join(known)}")
    files = [(shape, mix) for shape in shapes for mix in mixes]
    if not args.shapes and not args.types and args.context is None:
        files += [(TYPES_SHAPE, mix) for mix in OTHER_TYPES]
    from localpaged import LLM

    bin_dir = llama_bin_dir()
    if bin_dir is None:
        print("no llama.cpp binaries (run `make bench-peers`): ours alone")
    threads = os.cpu_count() or 1
    print(f"{threads} threads on {cpu_name()}")
    rows = []
    for shape, mix in files:
        path, write_s = shape_file(shape, mix)
        context = args.context or 0  # the room the chat needs beyond the short prompt's 1,024 tokens
        kv = "512MiB" if args.context is None else "2GiB"
        llm = settled(LLM(str(path), max_model_len=max(1024, context + 256), kv_cache_memory=kv, **RANDOM_WEIGHTS))
        row = {"shape": shape, "type": mix, "file_bytes": path.stat().st_size}
        if args.context is not None:
            row["context"] = args.context
        if write_s is not None:
            row["write_s"] = write_s
        # This machine's read rate drifts over a run's minutes, so each row is held to the rate just before it.
        row["read_bytes_per_s"] = read_bandwidth()
        row |= one_chat_bound(llm, bin_dir, path, threads, row["read_bytes_per_s"], args.context)
        llm.close()
        del llm
        peer = f", llama.cpp {row['llama_decode_only']:.1f} ({row['llama_bound']:.0%})" if bin_dir else ""
        gbs = row["read_bytes_per_s"] / 1e9
        print(
            f"  {shape} {mix}: ours {row['localpaged']:.1f} tok/s ({row['localpaged_bound']:.0%}){peer}; {gbs:.1f} GB/s"
        )
        rows.append(row)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads},
        "rows": rows,
    }
    results = RESULTS if args.context is None else RESULTS.with_name(f"shapes-context-{args.context}.json")
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {results.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()

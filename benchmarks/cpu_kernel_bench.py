"""The native CPU kernels' instruction-set paths (AVX-512, AVX2, portable) side by side, in one run.

Times each path this CPU runs on the default model's decode shapes (SmolLM2-135M: Q4_1 projections 576 -> 3072
and 1536 -> 576, the Q8_0 head 576 -> 49152, paged decode of 9 query / 3 KV heads of 64 at 512 tokens over a
float32, bfloat16 and float16 cache) for one sequence and for 16 (the projections for 64 too, int16 inputs with
and without AMX-INT8 tiles where they run), and a 512-token prefill chunk after 3,584
cached tokens (float32 products, and int16 ones: cpu.paged_prefill's activations). The machines this runs on are shared and
drift, so each figure is the best of several rounds, the paths interleaved round by round. ``--engine``
measures the engine on the default model instead, each path in a process of its own (LOCALPAGED_CPU_KERNELS
set), its KV cache of ``--kv-cache-dtype`` (default auto: float16 on the native kernels): one chat's decode
tok/s after its first token (256 tokens) and 16 sessions' aggregate tok/s (benchmarks/throughput.py's
sessions, 128 tokens each). ``--decode-step`` measures the same two figures in one process on the chosen path,
with each decode step one native call (models/llama_cpu_decode.py) and through the model's modules, round by round
in alternating order, and prints the medians.

    python benchmarks/cpu_kernel_bench.py [--rounds 5] [--context 512]
    python benchmarks/cpu_kernel_bench.py --engine [--rounds 3] [--kv-cache-dtype auto|float32|bfloat16|float16]
    python benchmarks/cpu_kernel_bench.py --decode-step [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from localpaged import LLM, SamplingParams
from localpaged.kernels import cpu, cpu_isa

PROJECTIONS = {  # name: (rows out, columns in, q range, group)
    "gate_up 576->3072 Q4_1": (3072, 576, (0, 16)),
    "down 1536->576 Q4_1": (576, 1536, (0, 16)),
    "head 576->49152 Q8_0": (49152, 576, (-128, 128)),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--engine", action="store_true", help="the engine's tok/s per path, not the kernels'")
    p.add_argument("--decode-step", action="store_true", help="the engine's tok/s with and without NativeDecode")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache type (EngineConfig.kv_cache_dtype)")
    p.add_argument("--engine-path", help=argparse.SUPPRESS)  # the child process of --engine: one path
    return p.parse_args()


def engine_figures(kv_cache_dtype: str, llm: LLM | None = None) -> dict[str, float]:
    """One chat's decode tok/s and 16 sessions' aggregate tok/s on the default model (or ``llm``), on this
    process's path."""
    from throughput import conversations, run_ours

    llm = llm or LLM(kv_cache_dtype=kv_cache_dtype, kv_disk=False)
    prompts = [llm.encode_chat(c) for c in conversations(16)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True))[0]
    sessions, _ = run_ours(llm, prompts, 128)
    return {"one_chat_decode_tok_s": out.metrics.decode_tokens_per_s, "sessions16_tok_s": sessions}


def compare_decode_step(rounds: int, kv_cache_dtype: str) -> None:
    """``engine_figures`` with NativeDecode and with the modules, alternating in one process; the medians."""
    llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_disk=False)
    native = llm.runner.native_decode
    if native is None:
        raise SystemExit("NativeDecode does not apply to the default model here (no native kernels?)")
    figures: dict[str, list[dict[str, float]]] = {"one native call": [], "modules": []}
    for i in range(rounds):
        for name in sorted(figures, reverse=i % 2 == 1):
            llm.runner.native_decode = native if name == "one native call" else None
            figures[name].append(engine_figures(kv_cache_dtype, llm))
    print(
        f"{torch.get_num_threads()} threads; default model, {cpu.chosen_path().name} kernels, KV {kv_cache_dtype}; "
        f"median of {rounds} alternating rounds"
    )
    print(f"{'decode step':18}{'one chat decode tok/s':>24}{'16 sessions tok/s':>20}")
    for name, rows in figures.items():
        print(
            f"{name:18}"
            + "".join(
                f"{statistics.median(r[key] for r in rows):{w}.1f}"
                for key, w in (("one_chat_decode_tok_s", 24), ("sessions16_tok_s", 20))
            )
        )


def compare_engines(names: list[str], rounds: int, kv_cache_dtype: str) -> None:
    """Each path's engine figures, each measured in a child process of its own; the best of ``rounds``, interleaved."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for name in names:
            env = {**os.environ, cpu_isa.ENV: name}
            child = [sys.executable, __file__, "--engine-path", name, "--kv-cache-dtype", kv_cache_dtype]
            result = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
            row = json.loads(result.stdout.strip().splitlines()[-1])
            best[name] = {key: max(value, best.get(name, {}).get(key, 0.0)) for key, value in row.items()}
    print(
        f"{torch.get_num_threads()} threads; default model, greedy, EOS ignored, KV {kv_cache_dtype}; best of {rounds}"
    )
    print(f"{'path':10}{'one chat decode tok/s':>24}{'16 sessions tok/s':>20}")
    for name, row in best.items():
        print(f"{name:10}{row['one_chat_decode_tok_s']:24.1f}{row['sessions16_tok_s']:20.1f}")


def use_path(name: str) -> None:
    """Load ``name``'s library for the calls that follow, as LOCALPAGED_CPU_KERNELS does for a process."""
    os.environ[cpu_isa.ENV] = name
    cpu.chosen_path.cache_clear()
    cpu.library.cache_clear()
    cpu.library()


def best_us(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    """The fastest call in about ``budget_s`` of calls (after one warm-up), in microseconds."""
    fn()
    best, end = float("inf"), time.perf_counter() + budget_s
    while time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def without_amx(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` with the AMX tiles switched off, as on a CPU without them."""
    with cpu.amx_off():
        return fn(*args)


def cases(context: int) -> dict[str, Callable[[], object]]:
    """Every timed call, its inputs made once."""
    gen = torch.Generator().manual_seed(0)
    calls: dict[str, Callable[[], object]] = {}
    for name, (n, k, q_range) in PROJECTIONS.items():
        q = torch.randint(*q_range, (n, k), generator=gen, dtype=torch.int8)
        # The default model's legacy types: an fp16 per run of 32 times 1 (models/gguf_weights.py's factors).
        unit, mult = (torch.rand(n, k // 32, generator=gen) * 0.02).half(), torch.ones(n, k // 32, dtype=torch.int8)
        with_min = q_range[0] == 0
        min_unit = -(torch.rand(n, k // 32, generator=gen) * 0.1).half() if with_min else torch.zeros_like(unit)
        min_mult = mult if with_min else torch.zeros_like(mult)
        for activations in cpu.ACTIVATIONS:
            packed = cpu.pack_blocks(q, unit, mult, min_unit, min_mult, activations)
            for m in (1, 16, 64):
                x = torch.randn(m, k, generator=gen)
                label = f"qgemm {name}, {m} row{'s' * (m > 1)}" + (
                    "" if activations == "float32" else f", {activations} x"
                )
                calls[label] = lambda x=x, packed=packed: cpu.qgemm(x, packed)
                if activations == "int16" and m >= 16 and cpu.amx():  # the same bits without the AMX-INT8 tiles
                    calls[label + ", AMX off"] = lambda x=x, packed=packed: without_amx(cpu.qgemm, x, packed)
    heads, kv_heads, d = 9, 3, 64
    for b in (1, 16):
        blocks = b * -(-context // 16)
        k_cache, v_cache = (torch.randn(blocks, 16, kv_heads, d, generator=gen) for _ in range(2))
        tables = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(b, -1)
        lens = torch.full((b,), context, dtype=torch.int32)
        q = torch.randn(b, heads, d, generator=gen)
        for dtype in cpu.KV_DTYPES:
            k, v = k_cache.to(dtype), v_cache.to(dtype)
            name = f"paged_decode {context} tok, {b} seq{'s' * (b > 1)}, {str(dtype).removeprefix('torch.')}"
            calls[name] = lambda q=q, k=k, v=v, t=tables, n=lens: cpu.paged_decode(q, k, v, t, n, d**-0.5)
    # A 512-token prefill chunk after 3,584 cached tokens (a long prompt's last chunk), float16 KV.
    chunk, cached = 512, 3584
    blocks = (chunk + cached) // 16
    k_cache, v_cache = (torch.randn(blocks, 16, kv_heads, d, generator=gen).half() for _ in range(2))
    tables = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    cu, lens = torch.tensor([0, chunk], dtype=torch.int32), torch.tensor([chunk + cached], dtype=torch.int32)
    q = torch.randn(chunk, heads, d, generator=gen)
    for products in ("float32", "int16"):
        label = f"paged_prefill {chunk} after {cached} tok, float16" + ("" if products == "float32" else ", int16")
        calls[label] = lambda products=products: cpu.paged_prefill(
            q, k_cache, v_cache, tables, cu, lens, d**-0.5, products
        )
    return calls


def main() -> None:
    args = parse_args()
    if args.engine_path:
        print(json.dumps(engine_figures(args.kv_cache_dtype)))
        return
    names = [path.name for path in cpu_isa.PATHS if path.cpu_flags <= cpu_isa.cpu_flags()]
    if args.decode_step:
        compare_decode_step(args.rounds, args.kv_cache_dtype)
        return
    if args.engine:
        compare_engines(names, args.rounds, args.kv_cache_dtype)
        return
    use_path(names[0])
    calls = cases(args.context)  # packed once: every path reads the same layout
    best = {(case, name): float("inf") for case in calls for name in names}
    for _ in range(args.rounds):
        for name in names:
            use_path(name)
            for case, fn in calls.items():
                best[case, name] = min(best[case, name], best_us(fn))
    print(f"{torch.get_num_threads()} threads; best of {args.rounds} rounds, microseconds per call")
    print(f"{'':56}" + "".join(f"{name:>10}" for name in names) + "   vs avx2")
    for case in calls:
        row = "".join(f"{best[case, name]:10.1f}" for name in names)
        ratios = " ".join(
            f"{best[case, 'avx2'] / best[case, n]:.2f}x" for n in names if n != "avx2" and "avx2" in names
        )
        print(f"{case:56}{row}   {ratios}")


if __name__ == "__main__":
    main()

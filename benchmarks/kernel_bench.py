"""Decode-kernel bandwidth against a device-to-device copy, in the same run.

Decode attention is bandwidth-bound, so the yardstick is the memory system itself: the kernel's
achieved bandwidth (bytes of K, V and Q read plus the output written, over its time) is divided by
that of ``Tensor.copy_`` (bytes read plus written, over its time). Goal: >= 70 %. Each split count
is timed, the default heuristic marked, so a regression in the heuristic shows too. Before timing,
the kernel's output for a few sequences is checked against the torch reference.

    python benchmarks/kernel_bench.py              # CUDA: batch 64, context 4096, 32/8 heads, d128, bf16
    python benchmarks/kernel_bench.py --cpu-smoke  # tiny sizes under the Triton interpreter
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if args.cpu_smoke:
        args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.iters = 2, 100, 4, 2, 64, 1
    return args


def time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Mean milliseconds per call after warm-up (CUDA events on the GPU, a wall clock elsewhere)."""
    for _ in range(1 if device.type != "cuda" else 3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def main() -> None:
    args = parse_args()
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("kernel_bench: CUDA is not available; use --cpu-smoke for an interpreter smoke run.")
    from localpaged.kernels import torch_attention
    from localpaged.kernels.paged_decode import MAX_SPLITS, default_num_splits, paged_decode

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, ctx, hq, hkv, d = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    blocks_per_seq = -(-ctx // 16)
    num_blocks = b * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn(num_blocks, 16, hkv, d, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, 16, hkv, d, device=device, dtype=dtype, generator=gen)
    block_tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32).view(b, blocks_per_seq)
    context_lens = torch.full((b,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(b, hq, d, device=device, dtype=dtype, generator=gen)
    scale = d**-0.5

    check = min(b, 4)
    out = paged_decode(q[:check], k_cache, v_cache, block_tables[:check], context_lens[:check], scale, num_splits=2)
    ref = torch_attention.paged_decode(
        q[:check].float(), k_cache, v_cache, block_tables[:check], context_lens[:check], scale
    )
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"check vs reference ({check} sequences): relative error {err:.2e}")
    if not err < 2e-2:
        raise SystemExit("kernel_bench: the decode kernel disagrees with the reference; not timing it.")

    kernel_bytes = (2 * b * ctx * hkv * d + 2 * b * hq * d) * q.element_size()  # K + V + Q read, output written
    src = torch.empty(kernel_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), args.iters, device)
    copy_gbs = 2 * src.numel() / copy_ms / 1e6  # read + written
    default = default_num_splits(b, hkv, block_tables.shape[1], device)

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(
        f"decode on {name}: batch {b}, context {ctx}, heads {hq}/{hkv}, head_dim {d}, {args.dtype}, "
        f"{kernel_bytes / 2**20:.1f} MiB moved per call"
    )
    print(f"{'what':<22}{'ms':>10}{'GB/s':>10}{'vs copy':>10}")
    print(f"{'copy_':<22}{copy_ms:>10.4f}{copy_gbs:>10.4g}{'100.0%':>10}")
    ratios = {}
    for splits in sorted({1, 2, 4, 8, MAX_SPLITS, default}):
        ms = time_ms(
            lambda splits=splits: paged_decode(
                q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=splits
            ),
            args.iters,
            device,
        )
        gbs = kernel_bytes / ms / 1e6
        ratios[splits] = gbs / copy_gbs
        label = f"paged_decode s={splits}" + (" *" if splits == default else "")
        print(f"{label:<22}{ms:>10.4f}{gbs:>10.4g}{ratios[splits]:>10.1%}")
    best = max(ratios, key=ratios.get)
    print(
        f"ratio at the default ({default} splits, *): {ratios[default]:.1%}; best: {ratios[best]:.1%} "
        f"at {best} splits; goal >= 70%"
    )


if __name__ == "__main__":
    main()

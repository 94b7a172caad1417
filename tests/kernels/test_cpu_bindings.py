"""The ctypes boundary of the native CPU kernels (issue 13, binding safety).

A tensor the C code cannot read raises KernelArgumentError naming the argument, before any pointer
crosses (also under ``python -O``); what only the C side can see (an index outside the cache, a
failed allocation) comes back as a status that becomes the same kind of error; every exported
kernel has its binding, on every instruction-set path this CPU runs. The ABI version check is tested with
the kernel cache in test_cache_folders.py.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys

import pytest
import torch

from localpaged.errors import KernelArgumentError, KernelError
from localpaged.kernels import cpu, cpu_isa
from localpaged.models import llama_cpu_decode  # noqa: F401  (binds lp_llama_decode, with the model it mirrors)

needs_library = pytest.mark.skipif(
    cpu.library() is None, reason="no C compiler or no 64-bit CPU: the torch path runs instead"
)
# What the C side checks runs on every path this CPU runs (the argument checks above it are Python's: once).
on_every_path = pytest.mark.usefixtures("kernel_path")


def packed_weight(rows: int = 32, cols: int = 64) -> cpu.PackedBlocks:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
    unit = torch.rand(rows, cols // 32, generator=gen).half()
    mult = torch.ones(rows, cols // 32, dtype=torch.int8)
    return cpu.pack_blocks(q, unit, mult, torch.zeros_like(unit), torch.zeros_like(mult))


def factors(rows: int, groups: int) -> tuple[torch.Tensor, ...]:
    """A scale's and a min's parts for ``rows`` rows of ``groups`` groups: fp16 units of one group, int8 ones."""
    unit, mult = torch.ones(rows, groups, dtype=torch.float16), torch.ones(rows, groups, dtype=torch.int8)
    return unit, mult, torch.zeros_like(unit), torch.zeros_like(mult)


def caches(blocks: int = 3, kv_heads: int = 2, head_dim: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(blocks, 16, kv_heads, head_dim), torch.zeros(blocks, 16, kv_heads, head_dim)


def rope_args(n: int = 2, heads: int = 4, kv_heads: int = 2, d: int = 32) -> dict:
    k_cache, v_cache = caches(kv_heads=kv_heads, head_dim=d)
    return {
        "qkv": torch.randn(n, (heads + 2 * kv_heads) * d),
        "cos": torch.ones(n, 1, d // 2),
        "sin": torch.zeros(n, 1, d // 2),
        "slot_mapping": torch.arange(n),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "num_heads": heads,
    }


def decode_args(context_lens: list[int], blocks: int = 3) -> dict:
    k_cache, v_cache = caches(blocks)
    return {
        "q": torch.randn(len(context_lens), 4, 32),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": torch.zeros(len(context_lens), 2, dtype=torch.int32),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32),
        "scale": 32**-0.5,
    }


def prefill_args(q_lens: list[int], context_lens: list[int]) -> dict:
    return {
        **decode_args(context_lens),
        "q": torch.randn(sum(q_lens), 4, 32),
        "cu_seqlens_q": torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
    }


@needs_library
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cpu.argmax_rows(torch.zeros(2, 0)), "x has rows of 0 values"),
        (lambda: cpu.argmax_rows(torch.zeros(8)), r"x has 1 dimensions \(8,\), not 2"),
        (lambda: cpu.race_rows(torch.zeros(2, 0), torch.ones(2), torch.zeros(2, dtype=torch.int64)), "rows of 0"),
        (
            lambda: cpu.race_rows(torch.zeros(2, 8), torch.ones(3), torch.zeros(2, dtype=torch.int64)),
            "scale has 3 and keys 2 values for 2 rows of x: one each",
        ),
        (
            lambda: cpu.race_rows(torch.zeros(2, 8), torch.ones(2), torch.zeros(2)),
            "keys is torch.float32, not torch.int64",
        ),
        (
            lambda: cpu.nucleus_rows(
                torch.zeros(2, 8),
                torch.ones(2),
                torch.ones(1),
                torch.zeros(2, dtype=torch.int64),
                torch.zeros(2, dtype=torch.int64),
            ),
            "scale has 2, top_p 1, top_k 2 and keys 2 values for 2 rows of x: one each",
        ),
        (lambda: cpu.silu_mul(torch.zeros(2, 32, dtype=torch.float64)), "gate_up is torch.float64, not torch.float32"),
        (lambda: cpu.silu_mul(torch.zeros(2, 24)), "gate_up has rows of 24"),
        (lambda: cpu.silu_mul(torch.zeros(32)), r"gate_up has 1 dimensions \(32,\), not 2"),
        (lambda: cpu.silu_mul(torch.zeros(2, 32, device="meta")), "gate_up is on meta, not the CPU"),
        (lambda: cpu.silu_mul([[0.0] * 32]), "gate_up must be a torch.Tensor, not list"),
        (lambda: cpu.qgemm(torch.zeros(3, 64, dtype=torch.float16), packed_weight()), "x is torch.float16"),
        (lambda: cpu.qgemm(torch.zeros(3, 96), packed_weight()), r"x has 96 columns but the packed weight takes 64"),
        (lambda: cpu.qgemm(torch.zeros(3, 64), torch.zeros(32, 64)), "w must be PackedBlocks"),
        (
            lambda: cpu.add_rms_norm(torch.zeros(2, 64), None, torch.ones(64, dtype=torch.float64), 1e-5),
            "weight is torch.float64",
        ),
        (
            lambda: cpu.add_rms_norm(torch.zeros(2, 64), None, torch.ones(128)[::2], 1e-5),
            "weight is not contiguous",
        ),
        (lambda: cpu.add_rms_norm(torch.zeros(2, 64), None, torch.ones(32), 1e-5), "x has rows of 64 and weight 32"),
        (
            lambda: cpu.add_rms_norm(torch.zeros(2, 64), torch.zeros(3, 64), torch.ones(64), 1e-5),
            r"residual has shape \(3, 64\), x \(2, 64\)",
        ),
        (
            lambda: cpu.pack_blocks(torch.zeros(4, 128, dtype=torch.int8), *factors(4, 2)),
            r"groups of \(32, 16\) weights",
        ),
        (
            lambda: cpu.pack_blocks(torch.zeros(4, 64), *factors(4, 2)),
            "q is torch.float32, not torch.int8",
        ),
        (
            lambda: cpu.pack_blocks(torch.zeros(4, 64, dtype=torch.int8), *factors(4, 2)[:2], *factors(3, 2)[2:]),
            "need q \\[N, K\\] with N > 0",
        ),
        (
            lambda: cpu.pack_blocks(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), *factors(4, 2)[1:]),
            "unit is torch.float32, not torch.float16",
        ),
        (
            lambda: cpu.PackedBlocks(
                torch.zeros(1, 640, dtype=torch.uint8),
                torch.ones(1, 2, 16, dtype=torch.float16),
                torch.ones(1, 2, 16, dtype=torch.int8),
                None,
                None,
                16,
                5,
                16,
                32,
                1,
                activations="int8",
            ),
            r"packed weights of 5 bits in groups of 32: need \(4, 8\)",
        ),
        (
            lambda: cpu.PackedBlocks(
                torch.zeros(1, 1024, dtype=torch.uint8),
                torch.ones(1, 1, 16, dtype=torch.float16),
                torch.ones(1, 2, 16, dtype=torch.int8),
                None,
                None,
                16,
                8,
                0,
                32,
                1,
            ),
            r"unit has shape \(1, 1, 16\), not \(1, 2, 16\)",
        ),
    ],
)
def test_a_tensor_the_kernel_cannot_read_is_refused_by_name(call, match):
    with pytest.raises(KernelArgumentError, match=match):
        call()


@needs_library
@pytest.mark.parametrize(
    "change,match",
    [
        ({"k_cache": torch.zeros(16, 3, 2, 32).transpose(0, 1)}, "k_cache is not contiguous"),
        ({"v_cache": torch.zeros(3, 16, 2, 16)}, r"v_cache has shape \(3, 16, 2, 16\), k_cache \(3, 16, 2, 32\)"),
        ({"k_cache": torch.zeros(3, 8, 2, 32), "v_cache": torch.zeros(3, 8, 2, 32)}, "blocks of 8 tokens"),
        ({"qkv": torch.randn(2, 7 * 32)}, "qkv has rows of 224"),
        ({"cos": torch.ones(2, 8)}, r"cos \(2, 8\) and sin \(2, 1, 16\)"),
        ({"slot_mapping": torch.arange(3)}, r"slot_mapping has shape \(3,\), expected \[2\]"),
        ({"slot_mapping": torch.zeros(2)}, "slot_mapping must be an int32 or int64 tensor"),
    ],
)
def test_rope_write_kv_checks_every_argument(change, match):
    with pytest.raises(KernelArgumentError, match=match):
        cpu.rope_write_kv(**{**rope_args(), **change})


@needs_library
@pytest.mark.parametrize(
    "change,match",
    [
        ({"q": torch.randn(3, 4, 16)}, r"q \[3, 4, 16\] against caches of 2 KV heads of 32"),
        ({"q": torch.randn(3, 3, 32)}, "a whole number of query heads per KV head"),
        ({"q": torch.randn(3, 4, 32, dtype=torch.float64)}, "q is torch.float64, not torch.float32"),
        ({"cu_seqlens_q": torch.tensor([0, 3], dtype=torch.int32)}, r"cu_seqlens_q has shape \(2,\), expected \[3\]"),
        ({"cu_seqlens_q": torch.tensor([0.0, 2, 3])}, "cu_seqlens_q must be an int32 or int64 tensor"),
        ({"context_lens": torch.tensor([[5, 1]], dtype=torch.int32)}, r"context_lens has 2 dimensions \(1, 2\), not 1"),
        ({"context_lens": torch.tensor([5.0, 1.0])}, "context_lens is torch.float32, not torch.int32 or torch.int64"),
        ({"block_tables": torch.zeros(2, dtype=torch.int32)}, r"block_tables has shape \(2,\), expected \[2, ...\]"),
        (
            {"v_cache": torch.zeros(3, 16, 2, 32, dtype=torch.float16)},
            "v_cache is torch.float16, k_cache torch.float32: one cache type for both",
        ),
        ({"activations": "int8"}, r"activations='int8': need one of \('float32', 'int16'\)"),
    ],
)
def test_paged_prefill_checks_every_argument(change, match):
    with pytest.raises(KernelArgumentError, match=match):
        cpu.paged_prefill(**{**prefill_args([2, 1], [5, 1]), **change})


@needs_library
@on_every_path
@pytest.mark.parametrize(
    "cu_seqlens_q,context_lens,table,match",
    [
        ([1, 2, 3], [5, 1], [[0, 1], [0, 1]], "cu_seqlens_q does not rise from 0 to q's number of rows"),
        ([0, 2, 2], [5, 1], [[0, 1], [0, 1]], "cu_seqlens_q does not rise from 0 to q's number of rows"),
        ([0, 4, 3], [5, 1], [[0, 1], [0, 1]], "cu_seqlens_q does not rise"),  # a chunk ends before it starts
        ([0, 2, 3], [1, 1], [[0, 1], [0, 1]], "a chunk is longer than its context"),
        ([0, 2, 3], [33, 1], [[0, 1], [0, 1]], "a context is longer than its block table row"),  # 2 blocks hold 32
        ([0, 2, 3], [20, 1], [[0, 3], [0, 1]], "a block id is outside the cache"),  # the cache has blocks 0-2
        ([0, 2, 3], [5, 1], [[0, 1], [-1, 0]], "a block id is outside the cache"),  # the decode row's
    ],
)
@pytest.mark.parametrize("activations", ["float32", "int16"])
def test_an_index_outside_q_or_the_cache_comes_back_from_paged_prefill_as_an_error(
    cu_seqlens_q, context_lens, table, match, activations
):
    args = {
        **prefill_args([2, 1], context_lens),
        "cu_seqlens_q": torch.tensor(cu_seqlens_q, dtype=torch.int32),
        "block_tables": torch.tensor(table, dtype=torch.int32),
        "activations": activations,
    }
    with pytest.raises(KernelArgumentError, match=f"lp_paged_prefill(_int16)?: .*{match}"):
        cpu.paged_prefill(**args)


@needs_library
@pytest.mark.parametrize(
    "change,match",
    [
        ({"q": torch.randn(1, 4, 16)}, r"q \[1, 4, 16\] against caches of 2 KV heads of 32"),
        ({"q": torch.randn(1, 3, 32)}, "a whole number of query heads per KV head"),
        (
            {"block_tables": torch.zeros(2, 2, dtype=torch.int32)},
            r"block_tables has shape \(2, 2\), expected \[1, ...\] of 2",
        ),
        ({"context_lens": torch.tensor([5.0])}, "context_lens must be an int32 or int64 tensor"),
        (
            {"k_cache": torch.zeros(3, 16, 2, 32, dtype=torch.float64)},
            "k_cache is torch.float64, not torch.float32 or torch.bfloat16 or torch.float16",
        ),
        (
            {"k_cache": torch.zeros(3, 16, 2, 32, dtype=torch.bfloat16)},
            "v_cache is torch.float32, k_cache torch.bfloat16: one cache type for both",
        ),
    ],
)
def test_paged_decode_checks_every_argument(change, match):
    with pytest.raises(KernelArgumentError, match=match):
        cpu.paged_decode(**{**decode_args([5]), **change})


@needs_library
@on_every_path
@pytest.mark.parametrize(
    "context_lens,table,match",
    [
        ([33], [[0, 1]], "a context length is below 1, longer than its block table row"),  # 2 blocks hold 32
        ([0], [[0, 1]], "a context length is below 1"),
        ([20], [[0, 3]], "a block id is outside the cache"),  # the cache has blocks 0-2
        ([5], [[-1, 0]], "a block id is outside the cache"),
    ],
)
def test_an_index_outside_the_cache_comes_back_from_c_as_an_error(context_lens, table, match):
    """What Python does not check per step (the values of the tables) the C side checks, and reports."""
    args = {**decode_args(context_lens), "block_tables": torch.tensor(table, dtype=torch.int32)}
    with pytest.raises(KernelArgumentError, match=f"lp_paged_decode: .*{match}"):
        cpu.paged_decode(**args)


@needs_library
@on_every_path
@pytest.mark.parametrize("slot", [3 * 16, -2])
def test_a_slot_outside_the_cache_is_not_written(slot):
    args = rope_args()
    args["slot_mapping"] = torch.tensor([0, slot])
    with pytest.raises(KernelArgumentError, match="lp_rope_write_kv: a slot_mapping entry is below -1 or past the end"):
        cpu.rope_write_kv(**args)
    assert args["k_cache"].view(-1, 2, 32)[1:].abs().sum() == 0  # only slot 0 was written


@needs_library
@on_every_path
def test_a_failed_allocation_in_c_is_a_kernel_error_and_the_kernel_still_works():
    """Paged decode's scratch is (query heads per KV head) x context floats: here 2^46 of them (256 TiB, more
    than a 47-bit address space), from a cache of one block that every table entry points at."""
    heads, context = 1 << 20, 1 << 26
    k_cache, v_cache = caches(blocks=1, kv_heads=1, head_dim=8)
    with pytest.raises(KernelError, match="lp_paged_decode: could not allocate its scratch memory"):
        cpu.paged_decode(
            torch.zeros(1, heads, 8),
            k_cache,
            v_cache,
            torch.zeros(1, context // 16, dtype=torch.int32),
            torch.tensor([context], dtype=torch.int32),
            1.0,
        )
    out = cpu.paged_decode(**decode_args([5, 20]))  # the next call allocates again
    assert torch.isfinite(out).all()


def test_the_checks_hold_under_python_dash_o():
    """``assert`` is gone under -O; these checks are not (no library needed: they run before any call)."""
    code = (
        "import torch\nfrom localpaged.kernels import cpu\n"
        "try:\n    cpu.silu_mul(torch.zeros(2, 32, dtype=torch.float64))\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-O", "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.startswith("KernelArgumentError gate_up is torch.float64"), result.stderr


@needs_library
def test_a_binding_made_after_the_library_loaded_is_declared_on_it():
    """A model's binding may be imported after the library loaded; undeclared, ctypes would pass its pointers as C
    ints."""
    lib = cpu.library()
    late = cpu.Kernel("lp_silu_mul", [cpu.POINTER, cpu.SIZE, cpu.SIZE, cpu.POINTER, cpu.INT])
    try:
        assert lib.lp_silu_mul.argtypes == late.argtypes
    finally:
        cpu.KERNELS.remove(late)
        next(k for k in cpu.KERNELS if k.name == "lp_silu_mul").declare(lib)
    assert lib.lp_silu_mul.argtypes == [cpu.POINTER, cpu.SIZE, cpu.SIZE, cpu.POINTER]


@needs_library
@on_every_path
def test_every_exported_kernel_has_its_binding_and_returns_a_status():
    exported = set(re.findall(r"^int (lp_\w+)\(", cpu_isa.HEADER.read_text(), flags=re.MULTILINE))
    # lp_abi_version and lp_amx answer a number, not a status: cpu.py calls them itself
    assert exported == {kernel.name for kernel in cpu.KERNELS} | {"lp_abi_version", "lp_amx"}
    lib = cpu.library()
    assert lib.lp_abi_version() == cpu.ABI_VERSION
    for kernel in cpu.KERNELS:
        function = getattr(lib, kernel.name)
        assert function.restype is ctypes.c_int
        assert function.argtypes == kernel.argtypes

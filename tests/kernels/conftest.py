"""Shared setup for the kernel tests: CUDA when present, else the Triton interpreter on the CPU.

``TRITON_INTERPRET`` is read when ``@triton.jit`` runs, i.e. when a kernel module is first
imported, so it is set here, before any test module imports ``localpaged.kernels``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from localpaged.kernels import cpu, cpu_isa

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton is a Linux-only dependency (pyproject); elsewhere these tests have nothing to run.
collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def _assert_close(out: torch.Tensor, ref: torch.Tensor, tolerance: float | None = None) -> None:
    """max|out - ref| / max|ref| within ``tolerance``, by default that of ``out``'s dtype; any NaN fails."""
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written, or poison was read"
    tolerance = TOLERANCE[out.dtype] if tolerance is None else tolerance
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tolerance, f"relative error {err:.2e} >= {tolerance:.0e} ({out.dtype})"


def _make_paged_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """Random K/V for sequences of ``context_lens`` tokens, scattered over a shuffled block pool.

    Everything a kernel must not read is NaN: spare blocks, slots past a sequence's length in its
    last block, and block-table entries past its length (which point at spare blocks). Returns
    ``(k_cache, v_cache, block_tables, k_ref, v_ref)``; the ``*_ref`` caches are float64 copies with
    the NaNs zeroed, for the reference (whose gather pads with slot 0).
    """
    blocks_per_seq = [-(-n // PAGE) for n in context_lens]
    used = sum(blocks_per_seq)
    num_blocks = used + 3 + used // 2
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    spare = ids[used:]
    shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    width = max(blocks_per_seq) + 2
    block_tables = spare[torch.randint(len(spare), (len(context_lens), width), generator=gen)]
    start = 0
    for b, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        mine = ids[start : start + nb].long()
        start += nb
        block_tables[b, :nb] = mine.to(torch.int32)
        slots = (mine[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64
        )
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64
        )
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    k_ref, v_ref = (c.double().nan_to_num(0.0) for c in (k_cache, v_cache))
    return (k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE), k_ref.to(DEVICE), v_ref.to(DEVICE))


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def assert_close():
    return _assert_close


@pytest.fixture
def make_paged_kv():
    return _make_paged_kv


@pytest.fixture
def nan_empty(monkeypatch):
    """Make ``torch.empty`` return NaN-filled float tensors, so an unwritten scratch element shows."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture
def amx_off():
    """The kernels without AMX tiles where this CPU would run them (cascade attention's float32 shared pass, the int16
    prefill's VNNI tile), as every CPU without them runs."""
    with cpu.amx_off():
        yield


@pytest.fixture(params=[path.name for path in cpu_isa.PATHS if path.cpu_flags <= cpu_isa.cpu_flags()])
def kernel_path(request, monkeypatch) -> str:
    """Each instruction-set build of the native kernels this CPU runs, forced as LOCALPAGED_CPU_KERNELS does."""
    monkeypatch.setenv(cpu_isa.ENV, request.param)
    cpu.chosen_path.cache_clear()
    cpu.library.cache_clear()
    yield request.param
    cpu.chosen_path.cache_clear()  # the next caller chooses again, once the variable is restored
    cpu.library.cache_clear()

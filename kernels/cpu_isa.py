"""Which build of the native CPU kernels this CPU runs: AVX-512, AVX2 or portable (plain C), chosen at load time.

Each path is a set of C sources and compiler flags; ``kernels/cpu.py`` builds the chosen one into its own
cache folder (named for sources + flags + compiler). The choice follows what the CPU reports (the ``flags``
line of /proc/cpuinfo on x86-64 Linux): the widest path whose instruction sets are all there. ARM, and any
machine that reports no flags, gets the portable path, which every 64-bit CPU with GCC 12+ runs.
``LOCALPAGED_CPU_KERNELS=avx512|avx2|portable`` forces one (``auto``, or unset, chooses).

The AVX-512 path is the portable source built with AVX-512 flags (each 16-float tile column one register);
no hand-written AVX-512 kernel is kept, only F16C's conversions for fp16 KV (cpu_kernels_avx512.c). Even on a
CPU whose 512-bit instructions run as two 256-bit halves (Zen 4) it keeps up with the hand-written AVX2 kernels,
kernel by kernel and in the engine (``benchmarks/cpu_kernel_bench.py`` and its ``--engine`` compare the paths).
It is the default where the CPU has it: CPUs with full-width AVX-512 units have more to gain, and the path
costs no kernel source of its own.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from localpaged.errors import ConfigError

HERE = Path(__file__).parent
HEADER = HERE / "cpu_kernels.h"  # the interface every build exports
QGEMM = HERE / "cpu_qgemm.h"  # lp_qgemm's panel, tiling, OpenMP and dispatch, included by both kernel sources
SCALES = HERE / "cpu_scales.h"  # packed scales (an fp16 times an int8) and their fp32 rebuild, for every qgemm
KV_DISPATCH = HERE / "cpu_kv_dispatch.h"  # lp_paged_decode's and lp_rope_write_kv's, included by both as well
ROWS = HERE / "cpu_rows.h"  # the small per-layer steps' argument checks and row loop, included by both as well
CASCADE = HERE / "cpu_cascade.h"  # shared-prefix attention's plan and merge, for the dispatch and the int16 prefill
PACK = HERE / "cpu_pack.c"
# lp_round_rows: the int8 and int16 kernels' activations, rounded per group; lp_has_vnni, their run-time test
INT_ACTIVATIONS = HERE / "cpu_activations.c"
INT_ACTIVATIONS_HEADER = HERE / "cpu_activations.h"
DECODE_STEP = HERE / "cpu_decode_step.c"  # lp_llama_decode: a decode step's layers over the path's own kernels
QGEMM_INT8 = HERE / "cpu_qgemm_int8.c"  # lp_qgemm_int8: int8 activations, plain C and AVX-512 VNNI chosen at run time
QGEMM_INT16 = HERE / "cpu_qgemm_int16.c"  # lp_qgemm_int16: int16 activations, the same way
QGEMM_AMX = HERE / "cpu_qgemm_amx.c"  # lp_qgemm_amx: a prefill's matmuls on AMX tiles, where the CPU has them
QGEMM_INT16_AMX = HERE / "cpu_qgemm_int16_amx.c"  # lp_qgemm_int16's batches on AMX-INT8 tiles, the same bits
QGEMM_PAIRS = HERE / "cpu_qgemm_pairs.h"  # a packed tile's column pairs, for the int16 and AMX matmuls
PREFILL_INT16 = HERE / "cpu_prefill_int16.c"  # lp_paged_prefill_int16: VNNI and BF16 products, where the CPU has them
CASCADE_AMX = HERE / "cpu_cascade_amx.c"  # cascade attention's shared pass on AMX tiles, where the CPU has them
AMX_HEADER = HERE / "cpu_amx.h"
# What the CPU must report for lp_qgemm_int8 and lp_qgemm_int16 to run their VNNI kernels (lp_has_vnni's test).
VNNI_FLAGS = frozenset({"avx512_vnni", "avx512vl", "avx512bw"})
# And for lp_paged_prefill_int16's (cpu_prefill_int16.c), which adds bfloat16 dot products.
PREFILL_INT16_FLAGS = VNNI_FLAGS | {"avx512_bf16"}
ENV = "LOCALPAGED_CPU_KERNELS"
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class KernelPath:
    """One build of the kernels: its sources, its flags, and the x86 CPU flags it needs (none: any CPU)."""

    name: str
    source: Path  # the inner loops; the shared sources (``sources``) and the headers go into every build
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    includes: tuple[Path, ...] = ()  # other sources the kernels' file includes
    # Whether float16 KV decodes at least as fast as float32 here, so that "auto" KV takes it: the AVX
    # paths convert with F16C. The portable path converts with integer operations, which on x86 made the
    # engine slower with float16 KV than with float32 (``benchmarks/cpu_kernel_bench.py --engine
    # --kv-cache-dtype``); ARM's native conversion is untimed, so it keeps float32 too.
    fast_float16_kv: bool = True

    @property
    def sources(self) -> tuple[Path, ...]:
        """The C files compiled together."""
        return (
            self.source,
            PACK,
            INT_ACTIVATIONS,
            DECODE_STEP,
            QGEMM_INT8,
            QGEMM_INT16,
            QGEMM_AMX,
            QGEMM_INT16_AMX,
            PREFILL_INT16,
            CASCADE_AMX,
        )

    @property
    def inputs(self) -> tuple[Path, ...]:
        """Every file whose bytes decide the library: the sources and the headers they include."""
        return (
            *self.sources,
            *self.includes,
            HEADER,
            QGEMM,
            SCALES,
            KV_DISPATCH,
            ROWS,
            CASCADE,
            INT_ACTIVATIONS_HEADER,
            AMX_HEADER,
            QGEMM_PAIRS,
        )


# Widest first: "auto" takes the first one the CPU runs. The AVX2 source is built with contraction off (its
# weight expansion must round step by step, see cpu_qgemm.h); the portable one marks those spots itself.
PATHS = (
    KernelPath(
        "avx512",
        HERE / "cpu_kernels_avx512.c",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=fast", *COMMON_FLAGS),
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
        includes=(HERE / "cpu_kernels_portable.c",),
    ),
    KernelPath(
        "avx2",
        HERE / "cpu_kernels_avx2.c",
        ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", *COMMON_FLAGS),
        frozenset({"avx2", "fma", "f16c"}),
    ),
    KernelPath(
        "portable",
        HERE / "cpu_kernels_portable.c",
        ("-ffp-contract=fast", *COMMON_FLAGS),
        frozenset(),
        fast_float16_kv=False,
    ),
)
BY_NAME = {path.name: path for path in PATHS}


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the CPU reports (/proc/cpuinfo on x86-64 Linux), or none where it reports none."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def choose_path(flags: frozenset[str] | None = None) -> KernelPath:
    """The path to build: ``LOCALPAGED_CPU_KERNELS`` where set (checked against the CPU), else the widest it runs.

    A name that is not a path, or a path whose instruction sets the CPU lacks (it would die on an illegal
    instruction), is a ConfigError naming the choices.
    """
    flags = cpu_flags() if flags is None else flags
    runnable = [path for path in PATHS if path.cpu_flags <= flags]
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted in ("", "auto"):
        return runnable[0]
    if wanted not in BY_NAME:
        raise ConfigError(f"{ENV}={wanted!r} is not a kernel path: choose one of auto, {', '.join(BY_NAME)}")
    path = BY_NAME[wanted]
    if path not in runnable:
        missing = ", ".join(sorted(path.cpu_flags - flags))
        raise ConfigError(
            f"{ENV}={wanted}: this CPU lacks {missing}, so that build cannot run here; "
            f"choose one of auto, {', '.join(p.name for p in runnable)}"
        )
    return path

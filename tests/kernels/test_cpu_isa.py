"""The instruction-set paths of the native CPU kernels (issue 13): which one a CPU gets, what forcing one does, and
the portable source on a CPU this machine is not (aarch64: cross-compiled, and run under qemu-user where present).

The kernels' numerics on each path this CPU runs are tested in test_cpu_kernels.py (the ``kernel_path`` fixture).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from localpaged.errors import ConfigError
from localpaged.kernels import cpu, cpu_isa

CHECK = Path(__file__).with_name("cpu_kernels_check.c")
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
NATIVE = shutil.which("gcc") or shutil.which("cc")
ZEN4 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
HASWELL = frozenset({"avx", "avx2", "fma", "f16c"})
needs_cross = pytest.mark.skipif(
    CROSS is None, reason="no aarch64 cross compiler: apt-get install gcc-aarch64-linux-gnu to run this check"
)


@pytest.mark.parametrize(
    "flags,expected",
    [(ZEN4, "avx512"), (HASWELL, "avx2"), (frozenset({"avx", "sse4_2"}), "portable"), (frozenset(), "portable")],
)
def test_auto_takes_the_widest_path_the_cpu_runs(flags, expected, monkeypatch):
    """An empty set is what an ARM machine (or a CPU that reports nothing) gives: the portable path."""
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.choose_path(flags).name == expected
    monkeypatch.setenv(cpu_isa.ENV, "auto")
    assert cpu_isa.choose_path(flags).name == expected


@pytest.mark.parametrize("name", ["avx512", "AVX2", " portable "])
def test_a_forced_path_the_cpu_runs_is_taken(name, monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, name)
    assert cpu_isa.choose_path(ZEN4).name == name.strip().lower()


@pytest.mark.parametrize(
    "name,flags,match",
    [
        ("sse", ZEN4, r"LOCALPAGED_CPU_KERNELS='sse' is not a kernel path: choose one of auto, avx512, avx2, portable"),
        ("avx512", HASWELL, r"this CPU lacks avx512bw, avx512f, avx512vl.*choose one of auto, avx2, portable"),
        ("avx2", frozenset(), r"this CPU lacks avx2, f16c, fma.*choose one of auto, portable"),
    ],
)
def test_a_forced_path_that_cannot_run_here_is_a_clear_error(name, flags, match, monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, name)
    with pytest.raises(ConfigError, match=match):
        cpu_isa.choose_path(flags)


def test_each_path_builds_into_its_own_cache_folder(kernel_path):
    """The library loaded is the forced path's, in a folder named for it (another path never reuses it)."""
    assert cpu.chosen_path().name == kernel_path
    assert f"cpu_kernels-{kernel_path}-" in cpu.library()._name


def check_harness(compiler: str, path: cpu_isa.KernelPath, output: Path, *extra: str) -> Path:
    """cpu_kernels_check.c linked with ``path``'s sources as an executable, built by ``compiler``."""
    flags = [f for f in path.flags if f not in ("-shared", "-fPIC")]
    command = [compiler, *flags, *extra, f"-I{cpu_isa.HEADER.parent}", str(CHECK), *map(str, path.sources), "-lm"]
    subprocess.run([*command, "-o", str(output)], check=True, capture_output=True, text=True, timeout=300)
    return output


@pytest.mark.skipif(NATIVE is None, reason="no C compiler")
def test_the_c_check_passes_on_this_cpu(kernel_path, tmp_path):
    """The harness qemu runs on aarch64, run here first on every path: its expected values are right. Linked
    against the path's library as the engine builds and loads it (compiling the sources again took a minute)."""
    library = Path(cpu.library()._name)
    flags = [f for f in cpu.chosen_path().flags if f not in ("-shared", "-fPIC")]
    binary = tmp_path / "check"
    command = [NATIVE, *flags, f"-I{cpu_isa.HEADER.parent}", str(CHECK), str(library), f"-Wl,-rpath,{library.parent}"]
    subprocess.run([*command, "-lm", "-o", str(binary)], check=True, capture_output=True, text=True, timeout=300)
    result = subprocess.run([binary], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "all kernel checks passed" in result.stdout, result.stdout + result.stderr


@needs_cross
def test_the_portable_path_cross_compiles_for_aarch64(tmp_path):
    """The library an ARM machine builds on first use: the same flags, for aarch64, an ELF for that machine."""
    portable = cpu_isa.BY_NAME["portable"]
    library = tmp_path / "cpu_kernels.so"
    command = [CROSS, *portable.flags, *map(str, portable.sources), "-o", str(library)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    header = library.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


@needs_cross
@pytest.mark.skipif(QEMU is None, reason="no qemu-aarch64: apt-get install qemu-user to run the aarch64 kernels")
def test_the_portable_kernels_pass_their_checks_on_aarch64_under_qemu(tmp_path):
    binary = check_harness(CROSS, cpu_isa.BY_NAME["portable"], tmp_path / "check", "-static")
    result = subprocess.run([QEMU, str(binary)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "all kernel checks passed" in result.stdout, result.stdout + result.stderr

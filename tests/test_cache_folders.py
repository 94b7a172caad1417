"""What localpaged builds in its cache is used only while trusted, and first starts at once never race
(issue 14, items 5 and 6): the kernel library, converted model folders and the chat database's migrations.
The kernel library is also of the ABI version kernels/cpu.py binds, or rebuilt (issue 13)."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localpaged.cache_folders import cached_folder, untrusted_reason
from localpaged.errors import ConfigError, KernelError

COMPILER = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler")
# A library whose constructor leaves a mark: loading it would be visible.
EVIL_SOURCE = '#include <stdio.h>\n__attribute__((constructor)) static void mark(void) { fopen("{mark}", "w"); }\n'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCALPAGED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def quick_path():
    """This CPU's kernel path, built at -O0: these tests check what the cache does with a build, not the kernels'
    speed, and -O0 builds the AVX-512 path in ~4 s against ~16 s (each test here builds twice)."""
    from localpaged.kernels import cpu

    path = cpu.chosen_path()
    return dataclasses.replace(path, flags=(*path.flags, "-O0"))


def built_library(cache: Path) -> Path:
    from localpaged.kernels import cpu

    folder = cpu._library_folder(COMPILER, quick_path())
    assert folder.parent == cache / "kernels"
    return folder / cpu.LIBRARY


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build for the module's tests of what a cache does with a library it finds: each starts from a copy,
    so only the rebuild it provokes compiles."""
    cache = tmp_path_factory.mktemp("prebuilt") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCALPAGED_CACHE", str(cache))
        built_library(cache)
    return cache / "kernels"


def found_library(cache: Path, prebuilt: Path) -> Path:
    """The library a first start built, in ``cache``, as a later start finds it."""
    shutil.copytree(prebuilt, cache / "kernels", symlinks=True)
    return built_library(cache)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@needs_compiler
def test_the_kernel_library_is_built_private_with_its_hash_and_reused(cache: Path) -> None:
    from localpaged.kernels import cpu

    library = built_library(cache)
    assert mode(cache / "kernels") == mode(library.parent) == mode(library) == 0o700
    assert cpu._hash_reason(library.parent) is None
    inode = library.stat().st_ino
    assert built_library(cache).stat().st_ino == inode  # a trusted library is not rebuilt
    assert [p.name for p in (cache / "kernels").iterdir()] == [library.parent.name]  # no temporary folder left


@needs_compiler
@pytest.mark.parametrize("where", ["library", "folder"])
def test_a_kernel_library_writable_by_others_is_rebuilt(cache: Path, prebuilt: Path, where: str) -> None:
    library = found_library(cache, prebuilt)
    target = library if where == "library" else library.parent
    target.chmod(mode(target) | 0o002)
    with pytest.warns(UserWarning, match="writable by group or others"):
        rebuilt = built_library(cache)
    assert mode(rebuilt) == mode(rebuilt.parent) == 0o700


@needs_compiler
def test_a_swapped_kernel_library_is_rebuilt_not_loaded(cache: Path, prebuilt: Path, tmp_path: Path) -> None:
    """A valid shared library at the path, with the user's modes, whose hash is not the recorded one."""
    from localpaged.kernels import cpu

    library = found_library(cache, prebuilt)
    mark = tmp_path / "constructor-ran"
    evil = tmp_path / "evil.c"
    evil.write_text(EVIL_SOURCE.replace("{mark}", str(mark)))
    subprocess.run([COMPILER, "-shared", "-fPIC", str(evil), "-o", str(library)], check=True)
    library.chmod(0o700)
    with pytest.warns(UserWarning, match="does not match the sha256"):
        rebuilt = built_library(cache)
    assert cpu._hash_reason(rebuilt.parent) is None
    import ctypes

    assert ctypes.CDLL(str(rebuilt)).lp_qgemm
    assert not mark.exists()  # the swapped file's constructor never ran


@needs_compiler
def test_a_kernel_library_without_its_hash_is_rebuilt(cache: Path, prebuilt: Path) -> None:
    from localpaged.kernels import cpu

    library = found_library(cache, prebuilt)
    (library.parent / cpu.HASH).unlink()
    with pytest.warns(UserWarning, match="No such file"):
        rebuilt = built_library(cache)
    assert cpu._hash_reason(rebuilt.parent) is None


def replace_with_a_recorded_build(library: Path, source: str, tmp_path: Path) -> None:
    """Put a library built from ``source`` at ``library``, its sha256 recorded as a genuine build's is."""
    from localpaged.kernels import cpu

    (tmp_path / "other.c").write_text(source)
    subprocess.run([COMPILER, "-shared", "-fPIC", str(tmp_path / "other.c"), "-o", str(library)], check=True)
    library.chmod(0o700)
    (library.parent / cpu.HASH).write_text(hashlib.sha256(library.read_bytes()).hexdigest())


@needs_compiler
@pytest.mark.parametrize(
    "source,reason",
    [
        ("int lp_abi_version(void) { return 0; }\n", r"reports ABI version 0, kernels/cpu.py binds \d"),
        ("int lp_qgemm(void) { return 0; }\n", "exports no lp_abi_version"),
    ],
)
def test_a_kernel_library_of_another_abi_version_is_rebuilt(
    cache: Path, prebuilt: Path, tmp_path: Path, source: str, reason: str
):
    """A cache folder from an older install: its sha256 matches its record, only its version tells."""
    from localpaged.kernels import cpu

    library = found_library(cache, prebuilt)
    replace_with_a_recorded_build(library, source, tmp_path)
    with pytest.warns(UserWarning, match=reason):
        lib = cpu._load(COMPILER, quick_path())
    assert lib.lp_abi_version() == cpu.ABI_VERSION and cpu._hash_reason(library.parent) is None
    gate_up, out = (ctypes.c_float * 16)(*range(16)), (ctypes.c_float * 8)()
    assert lib.lp_silu_mul(gate_up, 1, 8, out) == cpu.OK and out[1] > 0  # the rebuilt library, its kernels declared


@needs_compiler
def test_a_fresh_build_of_another_abi_version_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu.py and cpu_kernels.h disagreeing: rebuilding cannot mend it, so a clear error instead of a crash."""
    from localpaged.kernels import cpu

    monkeypatch.setattr(cpu, "ABI_VERSION", cpu.ABI_VERSION + 1)
    stale = f"reports ABI version {cpu.ABI_VERSION - 1}, kernels/cpu.py binds"
    with pytest.warns(UserWarning, match=stale), pytest.raises(KernelError, match="cpu.py binds.*reinstall it"):
        cpu._load(COMPILER, quick_path())


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown needs root")
def test_a_cached_folder_owned_by_someone_else_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "model"
    cached_folder(target, lambda f: (f / "config.json").write_text("{}"))
    os.chown(target / "config.json", 65534, 65534)
    assert "owned by user id 65534" in untrusted_reason(target)
    with pytest.warns(UserWarning, match="owned by user id 65534"):
        cached_folder(target, lambda f: (f / "config.json").write_text('{"new": 1}'))
    assert (target / "config.json").read_text() == '{"new": 1}' and (target / "config.json").stat().st_uid == 0


def test_a_converted_model_folder_is_checked_before_use(tmp_path: Path) -> None:
    """A file in it writable by others, or a symbolic link in it: set aside and rebuilt."""
    target = tmp_path / "model"
    builds = []

    def build(folder: Path) -> None:
        builds.append(folder)
        (folder / "sub").mkdir()
        (folder / "sub" / "model.safetensors").write_bytes(b"weights")

    cached_folder(target, build)
    assert cached_folder(target, build) == target and len(builds) == 1
    (target / "sub" / "model.safetensors").chmod(0o646)
    with pytest.warns(UserWarning, match="model.safetensors: writable by group or others"):
        cached_folder(target, build)
    assert len(builds) == 2 and mode(target / "sub" / "model.safetensors") == 0o600
    (target / "link").symlink_to("/etc/passwd")
    with pytest.warns(UserWarning, match="link: a symbolic link"):
        cached_folder(target, build)
    assert not (target / "link").exists() and len(builds) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing set aside is left behind


def test_a_folder_still_untrusted_after_building_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="was just built but cannot be trusted"):
        cached_folder(tmp_path / "model", lambda f: (f / "x").write_text(""), lambda f: "never good")


# -- first starts at once, in real processes ----------------------------------------------------------


def start_at_once(code: str, count: int, env: dict[str, str], go: Path) -> list[subprocess.CompletedProcess]:
    """Run ``count`` Python children that each wait for ``go`` to exist, then run ``code``, all at once."""
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
    children = [
        subprocess.Popen([sys.executable, "-c", wait + code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(count)
    ]
    time.sleep(0.5)  # every child imported and waiting
    go.touch()
    results = []
    for child in children:
        out, err = child.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(child.args, child.returncode, out.decode(), err.decode()))
    return results


def test_processes_opening_a_fresh_home_at_once_all_work(tmp_path: Path) -> None:
    """Migrations raced: the children failed with 'UNIQUE constraint failed: _migrations.name'."""
    from localpaged.chat.migrations import MIGRATIONS
    from localpaged.chat.store import ChatStore

    code = (
        "from localpaged.chat.store import ChatStore\n"
        "store = ChatStore()\nstore.add_message(store.create_session().id, 'user', 'hi')\nstore.close()\n"
    )
    for attempt in range(3):
        home = tmp_path / f"home{attempt}"
        results = start_at_once(code, 6, {**os.environ, "LOCALPAGED_HOME": str(home)}, tmp_path / f"go{attempt}")
        assert [r.stderr for r in results if r.returncode] == []
        with ChatStore(home / "chats.db") as store:
            assert len(store.list_sessions()) == 6
            applied = [row["name"] for row in store.db.query("SELECT name FROM _migrations")]
        assert applied == [fn.__name__ for fn in MIGRATIONS]


def test_processes_building_one_model_folder_at_once_all_use_it(tmp_path: Path, tiny_model_path: Path) -> None:
    """The conversion's publish step: the losers failed with 'Directory not empty'."""
    target = tmp_path / "models" / "converted"
    target.parent.mkdir()
    code = (
        "import shutil\nfrom pathlib import Path\nfrom localpaged.cache_folders import cached_folder\n"
        f"def build(folder):\n    shutil.copytree({str(tiny_model_path)!r}, folder, dirs_exist_ok=True)\n"
        f"print(cached_folder(Path({str(target)!r}), build))\n"
    )
    results = start_at_once(code, 5, dict(os.environ), tmp_path / "go")
    assert [r.stderr for r in results if r.returncode] == []
    assert {r.stdout.strip() for r in results} == {str(target)}
    assert os.listdir(target.parent) == ["converted"]  # every loser's private folder removed
    assert sorted(os.listdir(target)) == sorted(os.listdir(tiny_model_path))
    assert untrusted_reason(target) is None

    from localpaged.models.loader import load_config, load_state_dict

    assert load_config(target).model_type == "llama" and load_state_dict(target)

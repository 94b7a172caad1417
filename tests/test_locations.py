"""locations.py: where every folder goes, the variables that move them, and their modes."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from localpaged import locations
from localpaged.chat.store import ChatStore
from localpaged.errors import ConfigError
from tests.test_cache_folders import quick_path  # the kernels built at -O0: this test is about modes

REPO = Path(__file__).resolve().parent.parent
VARS = ("LOCALPAGED_HOME", "LOCALPAGED_CACHE", "LOCALPAGED_KV_CACHE")
FOLDERS = (
    locations.data_dir,
    locations.user_prompts_dir,
    locations.cache_dir,
    locations.models_cache_dir,
    locations.kernels_cache_dir,
    locations.kv_cache_dir,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def umask():
    """The usual umask, so that "created 0700" is not the umask's doing."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $HOME with none of the variables set: the platform defaults land in it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in (*VARS, "XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Every variable pointing at a folder that does not exist yet."""
    paths = {var: tmp_path / var.lower() for var in VARS}
    for var, path in paths.items():
        monkeypatch.setenv(var, str(path))
    return paths


def test_variables_move_every_folder(env: dict[str, Path]) -> None:
    home, cache, kv = env["LOCALPAGED_HOME"], env["LOCALPAGED_CACHE"], env["LOCALPAGED_KV_CACHE"]
    assert locations.data_dir() == home
    assert locations.chat_db_path() == home / "chats.db"
    assert locations.user_prompts_dir() == home / "prompts"
    assert locations.cache_dir() == cache
    assert locations.models_cache_dir() == cache / "models"
    assert locations.kernels_cache_dir() == cache / "kernels"
    assert locations.kv_cache_dir() == kv
    for folder in (home, home / "prompts", cache, cache / "models", cache / "kernels", kv):
        assert folder.is_dir() and mode(folder) == 0o700, folder
    assert not (home / "chats.db").exists()  # the folder is made, the database is ChatStore's


def test_kv_cache_defaults_under_the_cache(env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALPAGED_KV_CACHE")
    assert locations.kv_cache_dir() == env["LOCALPAGED_CACHE"] / "kv"


def test_an_empty_variable_means_the_default(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_HOME", "")
    assert locations.data_dir().is_relative_to(home)


def test_a_tilde_in_a_variable_is_the_home_folder(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_CACHE", "~/my-cache")
    assert locations.models_cache_dir() == home / "my-cache" / "models"


def test_defaults_are_the_platform_folders(home: Path) -> None:
    import platformdirs

    assert locations.data_dir() == Path(platformdirs.user_data_dir("localpaged"))
    assert locations.chat_db_path() == locations.data_dir() / "chats.db"
    assert locations.user_prompts_dir() == Path(platformdirs.user_config_dir("localpaged")) / "prompts"
    assert locations.cache_dir() == Path(platformdirs.user_cache_dir("localpaged"))
    assert locations.kv_cache_dir() == locations.cache_dir() / "kv"
    for folder in FOLDERS:
        path = folder()
        assert path.is_relative_to(home) and mode(path) == 0o700, path
    if sys.platform.startswith("linux"):  # the names existing users' files are under
        assert locations.chat_db_path() == home / ".local/share/localpaged/chats.db"
        assert locations.user_prompts_dir() == home / ".config/localpaged/prompts"
        assert locations.models_cache_dir() == home / ".cache/localpaged/models"
        assert locations.kernels_cache_dir() == home / ".cache/localpaged/kernels"
        # Folders above localpaged's own are the platform's: created as usual, not made private.
        assert mode(home / ".cache") == 0o755 and mode(home / ".local/share") == 0o755
        assert mode(home) == 0o755


def test_a_loose_folder_of_localpaged_is_tightened(home: Path) -> None:
    root = Path(locations.cache_dir())
    root.chmod(0o755)
    (root / "models").mkdir(mode=0o777)
    (root / "models").chmod(0o777)
    (root / "models" / "old-conversion").mkdir()
    assert locations.models_cache_dir() == root / "models"
    assert mode(root) == 0o700 and mode(root / "models") == 0o700
    assert mode(root / "models" / "old-conversion") == 0o755  # private anyway: inside a 0700 folder


def test_a_folder_a_variable_names_keeps_its_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user made it and may use it for other things; what localpaged adds inside is private."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    monkeypatch.setenv("LOCALPAGED_HOME", str(mine))
    monkeypatch.setenv("LOCALPAGED_CACHE", str(mine))
    assert locations.data_dir() == mine and locations.user_prompts_dir() == mine / "prompts"
    assert locations.kernels_cache_dir() == mine / "kernels"
    assert mode(mine) == 0o755
    assert mode(mine / "prompts") == 0o700 and mode(mine / "kernels") == 0o700


def test_home_itself_is_never_changed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_HOME", str(home))
    assert locations.data_dir() == home
    assert mode(home) == 0o755
    assert locations._home_or_above(home) and locations._home_or_above(home.parent)
    assert not locations._home_or_above(home / "sub")


@pytest.mark.parametrize(("var", "folder"), [(v, f) for v in VARS for f in FOLDERS if f.__name__ != "cache_dir"])
def test_a_variable_naming_a_file_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str, folder
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for other in VARS:
        monkeypatch.setenv(other, str(tmp_path / other.lower()))
    monkeypatch.setenv(var, str(blocker))
    moved_by = {
        "LOCALPAGED_HOME": {"data_dir", "user_prompts_dir"},
        "LOCALPAGED_CACHE": {"models_cache_dir", "kernels_cache_dir"},
        "LOCALPAGED_KV_CACHE": {"kv_cache_dir"},
    }[var]
    if folder.__name__ not in moved_by:
        folder()  # another variable's folder is unaffected
        return
    with pytest.raises(ConfigError) as info:
        folder()
    message = str(info.value)
    assert var in message and str(blocker) in message and "not a folder" in message
    assert "Point" in message and "unset it" in message  # what to do
    assert blocker.read_text() == "not a folder"


def test_a_folder_that_cannot_be_created_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LOCALPAGED_CACHE", str(blocker / "cache"))
    with pytest.raises(ConfigError, match="LOCALPAGED_CACHE points at .*cannot be created") as info:
        locations.cache_dir()
    assert str(blocker / "cache") in str(info.value)


def test_a_file_in_the_way_of_a_sub_folder_is_a_config_error(env: dict[str, Path]) -> None:
    cache = locations.cache_dir()
    (cache / "kernels").write_text("")
    with pytest.raises(ConfigError, match="a file is in the way") as info:
        locations.kernels_cache_dir()
    assert str(cache / "kernels") in str(info.value) and "LOCALPAGED_CACHE" in str(info.value)


def test_a_default_folder_that_cannot_be_created_says_which_variable_moves_it(home: Path) -> None:
    (home / ".cache").write_text("")
    with pytest.raises(ConfigError, match="Set LOCALPAGED_CACHE"):
        locations.cache_dir()
    (home / ".config").write_text("")
    with pytest.raises(ConfigError, match="Set LOCALPAGED_HOME"):
        locations.user_prompts_dir()


# -- files ---------------------------------------------------------------------------------------


def test_the_default_chat_database_and_its_wal_are_0600(env: dict[str, Path]) -> None:
    with ChatStore() as store:
        store.add_message(store.create_session().id, "user", "private")
        db = env["LOCALPAGED_HOME"] / "chats.db"
        assert store.path == db
        files = [db, db.with_name("chats.db-wal"), db.with_name("chats.db-shm")]
        for file in files:
            assert file.is_file() and mode(file) == 0o600, file
    assert mode(db.parent) == 0o700


def test_a_database_at_a_given_path_is_created_0600(tmp_path: Path) -> None:
    db = tmp_path / "new-folder" / "elsewhere.db"
    with ChatStore(db) as store:
        store.create_session()
        assert mode(db) == 0o600 and mode(db.with_name("elsewhere.db-wal")) == 0o600
    assert mode(db.parent) == 0o700


def test_an_older_readable_default_database_is_made_private(env: dict[str, Path]) -> None:
    with ChatStore() as store:
        session = store.create_session()
    db = env["LOCALPAGED_HOME"] / "chats.db"
    db.chmod(0o644)
    with ChatStore() as store:
        assert store.get_session(session.id) == session
        assert mode(db) == 0o600


def test_an_existing_database_at_a_given_path_keeps_its_mode(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    ChatStore(db).close()
    db.chmod(0o640)
    ChatStore(db).close()
    assert mode(db) == 0o640


def test_private_file_helpers(tmp_path: Path) -> None:
    file = tmp_path / "f"
    assert locations.create_private_file(file) and mode(file) == 0o600
    file.write_text("kept")
    assert not locations.create_private_file(file) and file.read_text() == "kept"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "weights").write_text("")
    (tree / "config.json").write_text("")
    locations.make_private_tree(tree)
    assert mode(tree) == mode(tree / "sub") == 0o700
    assert mode(tree / "config.json") == mode(tree / "sub" / "weights") == 0o600


def test_a_gguf_metadata_folder_is_private(
    env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metadata's readers and writers are stand-ins: what matters is the modes of what lands in the cache."""
    import transformers

    from localpaged.models import gguf_file, loader

    class Fake:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return cls()

        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "tokenizer.json").write_text("{}")

    class FakeConfig:
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "config.json").write_text("{}")

    monkeypatch.setattr(transformers, "PreTrainedTokenizerFast", Fake)
    monkeypatch.setattr(gguf_file, "GGUFFile", lambda path: None)
    monkeypatch.setattr(loader, "hf_config_of", lambda file: FakeConfig())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = loader._gguf_metadata(gguf, "ab" * 32, loader._quiet)
    assert target.parent == env["LOCALPAGED_CACHE"] / "models"
    assert mode(target.parent) == mode(target) == 0o700
    names = sorted(p.name for p in target.iterdir())
    assert names == ["config.json", loader.METADATA_MARKER, "tokenizer.json"]
    assert all(mode(p) == 0o600 for p in target.iterdir())


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")), reason="no C compiler")
def test_the_compiled_kernel_library_is_private_and_loads(env: dict[str, Path]) -> None:
    from localpaged.kernels import cpu

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    folder = locations.kernels_cache_dir() / "cpu_kernels-test"
    folder.mkdir()
    try:
        cpu._build(compiler, quick_path(), folder)
    except (
        OSError,
        subprocess.CalledProcessError,
    ) as exc:  # no working toolchain here: the build is not what this test is about
        pytest.skip(f"the kernels do not build here: {exc}")
    locations.make_private_tree(folder)  # as cache_folders.cached_folder does before publishing
    target = folder / cpu.LIBRARY
    assert mode(target) == 0o700 and mode(folder / cpu.HASH) == 0o600 and mode(folder.parent) == 0o700
    assert ctypes.CDLL(str(target)).lp_qgemm  # dlopen by the owner works at these modes


def test_no_other_module_decides_a_folder() -> None:
    """platformdirs is imported, and the folder variables are named in code, in locations.py only."""
    needles = ("import platformdirs", "from platformdirs", *(f'"{var}"' for var in VARS), *(f"'{var}'" for var in VARS))
    offenders = []
    for package in ("localpaged", "kernels", "tui"):
        for source in (REPO / package).rglob("*.py"):
            if source.name != "locations.py" and any(needle in source.read_text() for needle in needles):
                offenders.append(str(source.relative_to(REPO)))
    assert offenders == []

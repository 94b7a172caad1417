"""Hardening, round 3: files that are not ours are never changed, and text never drives the terminal."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from localpaged.chat.store import ChatStore
from localpaged.errors import StoreError
from localpaged.locations import make_private
from localpaged.sampling import SamplingParams


def test_a_symlinked_database_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "someone-elses-file"
    target.write_text("root:x:0:0:root:/root:/bin/bash\n")
    target.chmod(0o644)
    link = tmp_path / "chats.db"
    link.symlink_to(target)
    with pytest.raises(StoreError, match=f"the chat database {link} is a symbolic link"):
        ChatStore(link)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert target.read_text() == "root:x:0:0:root:/root:/bin/bash\n"


def test_modes_are_never_set_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("x")
    target.chmod(0o644)
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o755)
    for name, points_at in (("file-link", target), ("folder-link", folder)):
        (tmp_path / name).symlink_to(points_at)
        make_private(tmp_path / name, 0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and stat.S_IMODE(folder.stat().st_mode) == 0o755
    make_private(target)  # the file itself, ours: made private
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o600


EVIL = "title\x1b]0;pwned\x07 clear\x1b[2J clipboard\x1b]52;c;cm0gLXJmIH4=\x07 end"


def _no_controls(text: str) -> bool:
    return not any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in text)


def test_run_never_lets_a_reply_or_an_error_drive_the_terminal(tmp_path: Path, monkeypatch, capsys) -> None:
    """A model's (or a remote server's) reply with OSC 0, CSI 2J or OSC 52 reaches a terminal escaped, and so does
    an error message; a pipe gets the text as it is."""
    from localpaged import cli
    from localpaged.engine.async_llm import AsyncLLM
    from localpaged.errors import RequestError
    from tests.engine.fake_llm import FakeLLM

    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    fake = FakeLLM(lambda ids: EVIL)
    monkeypatch.setattr(cli, "open_engine", lambda model, **config: AsyncLLM(llm=fake))
    assert cli.main(["run", "hello", "--no-store"]) == 0
    assert EVIL in capsys.readouterr().out  # into a pipe: unchanged

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["run", "hello", "--no-store"]) == 0
    out = capsys.readouterr().out
    assert _no_controls(out) and "title\\x1b]0;pwned\\x07 clear\\x1b[2J" in out

    def refuse(*args, **kwargs):
        raise RequestError(f"the server said: {EVIL}")

    monkeypatch.setattr(cli, "open_engine", refuse)
    assert cli.main(["run", "hello", "--no-store"]) == 2
    err = capsys.readouterr().err
    assert _no_controls(err.replace("\x1b[31m", "").replace("\x1b[0m", "")) and "pwned\\x07" in err


def test_a_kv_folder_that_cannot_be_made_turns_the_tier_off_with_one_warning(
    tiny_model_path: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    """The disk tier is a cache: a KV folder that cannot be created (here, under a file) never stops a start."""
    from localpaged.engine.llm import LLM

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LOCALPAGED_KV_CACHE", str(tmp_path / "a-file" / "kv"))
    with caplog.at_level("WARNING", logger="localpaged.engine.setup"):
        llm = LLM(str(tiny_model_path), kv_cache_memory="64MiB")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "the disk KV tier is off for this run" in warning and "--no-kv-disk" in warning
    assert llm.kv_disk is None and not llm.resolved.kv_disk and llm.config.kv_disk  # as given, and as settled
    assert llm.generate("hello", SamplingParams(max_tokens=4))[0].finish_reason in ("stop", "length")


def test_a_home_that_cannot_be_written_still_lists_and_shows_the_shipped_prompts(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Reading never needs a write: prompts list, prompts show and the settings file work in a home nothing can be
    created in (here, a path under a file; as root a read-only mode would not bite)."""
    from localpaged import cli
    from localpaged.config_file import load_settings

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path / "a-file" / "home"))
    assert cli.main(["prompts", "list"]) == 0
    assert "coding" in capsys.readouterr().out
    assert cli.main(["prompts", "show", "coding"]) == 0
    assert capsys.readouterr().out.strip()
    assert load_settings().model is None  # no file there: the built-in defaults
    assert not (tmp_path / "a-file").is_dir()


def _gguf(metadata: bytes, kv_count: int, tensors: bytes = b"", tensor_count: int = 0) -> bytes:
    """A GGUF v3 header by hand: the magic, the counts, ``metadata`` (after general.architecture) and ``tensors``."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    arch = string("general.architecture") + struct.pack("<I", 8) + string("llama")  # 8: STRING
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count + 1) + arch + metadata + tensors


def test_crafted_gguf_headers_are_one_invalid_model_error(tmp_path: Path) -> None:
    import struct

    from localpaged.errors import InvalidModelError
    from localpaged.models.gguf_file import GGUFFile

    nested = struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9)  # 9: ARRAY
    nested += struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)  # arrays of arrays, 5000 deep
    zero_dims = struct.pack("<Q", 1) + b"t" + struct.pack("<I", 0) + struct.pack("<IQ", 0, 0)
    huge = struct.pack("<Q", 3) + b"big" + struct.pack("<I", 9) + struct.pack("<IQ", 4, 1 << 60)  # 2^60 uint32s
    cases = {
        "nested": (_gguf(nested, 1), "nests arrays more than 4 deep"),
        "zero-dims": (_gguf(b"", 0, zero_dims, 1), "tensor t has 0 dimensions"),
        "huge-array": (_gguf(huge, 1), "cut short or corrupt"),
    }
    for name, (data, why) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(InvalidModelError, match=why):
            GGUFFile(path)


def test_a_broken_model_folder_or_settings_file_is_one_error(tmp_path: Path, monkeypatch) -> None:
    import json

    from localpaged.config_file import load_settings
    from localpaged.errors import ConfigError, InvalidModelError, ModelNotFoundError
    from localpaged.models.loader import load_config, resolve_model

    not_json, no_heads = tmp_path / "not-json", tmp_path / "no-heads"
    for folder in (not_json, no_heads):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")
    (not_json / "config.json").write_text("{not json")
    shape = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0, "num_hidden_layers": 1}
    (no_heads / "config.json").write_text(json.dumps({**shape, "intermediate_size": 128, "vocab_size": 100}))
    for folder in (not_json, no_heads):
        with pytest.raises(InvalidModelError, match="config.json"):
            load_config(resolve_model(str(folder)).folder)
    with pytest.raises(ModelNotFoundError, match="cannot be opened .*File name too long"):
        resolve_model(str(tmp_path / ("x" * 300)))
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nests arrays or tables thousands deep"):
        load_settings()


def test_one_broken_file_in_another_tools_folder_never_hides_the_others(tmp_path: Path, monkeypatch) -> None:
    import struct

    from localpaged.models.catalog import find_models
    from localpaged.models.loader import default_model_path

    store = tmp_path / "home" / ".lmstudio" / "models" / "someone" / "repo"
    store.mkdir(parents=True)
    (store / "good.gguf").symlink_to(default_model_path())
    # A tensor of no dimensions: its shape's last size was read past the end (IndexError), and the listing failed.
    zero_dims = struct.pack("<Q", 1) + b"t" + struct.pack("<I", 0) + struct.pack("<IQ", 0, 0)
    (store / "odd.gguf").write_bytes(_gguf(b"", 0, zero_dims, 1))
    (store / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    found = {m.path.name: m for m in find_models()}
    assert found["odd.gguf"].architecture == "?"
    assert found["good.gguf"].architecture == "llama" and found["broken.gguf"].architecture == "?"


def test_tests_never_use_the_users_real_home_or_cache() -> None:
    """Every folder the code under test resolves is the test run's own (tests/conftest.py), not the user's."""
    import platformdirs

    from localpaged import locations
    from tests.conftest import TEST_CACHE

    assert locations.cache_dir() == TEST_CACHE and locations.kernels_cache_dir().is_relative_to(TEST_CACHE)
    real = [Path(platformdirs.user_cache_dir("localpaged")), Path(platformdirs.user_data_dir("localpaged"))]
    for folder in (locations.data_dir(), locations.kv_cache_dir(), locations.config_file_path().parent):
        assert not any(folder.is_relative_to(r) for r in real), folder


def test_run_takes_the_truncate_its_error_suggests(tmp_path: Path, monkeypatch, capsys) -> None:
    from localpaged import cli
    from localpaged.chat.store import ChatStore
    from localpaged.engine.async_llm import AsyncLLM
    from tests.engine.fake_llm import FakeLLM

    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path))
    monkeypatch.setattr(cli, "open_engine", lambda model, **config: AsyncLLM(llm=FakeLLM(lambda ids: "ok")))
    assert cli.main(["run", "x" * 5000]) == 0
    with ChatStore(tmp_path / "chats.db") as store:
        (session,) = store.list_sessions()
    capsys.readouterr()
    assert cli.main(["run", "y" * 5000, "--session", session.id]) == 2  # 10,000 characters: past the 8,192 context
    assert "--truncate for localpaged run" in capsys.readouterr().err
    assert cli.main(["run", "y" * 5000, "--session", session.id, "--truncate"]) == 0  # the oldest turn dropped

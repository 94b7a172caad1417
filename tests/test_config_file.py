"""The settings file: where it is, what it may hold, how each bad value is reported, and flag > file > built-in."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from localpaged import cli
from localpaged.chat.store import ChatStore
from localpaged.config import ResolvedConfig
from localpaged.config_file import Settings, load_settings, save_theme
from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import ConfigError
from localpaged.locations import config_file_path
from tests.engine.fake_llm import FakeLLM


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def config(home: Path) -> Path:
    return config_file_path(create=True)  # the folder made, as saving a setting makes it


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_the_file_lives_in_localpaged_home(home: Path, config: Path, capsys) -> None:
    assert config == home / "config.toml"
    assert cli.main(["config", "path"]) == 0
    assert capsys.readouterr().out == f"{config}\n"


def test_a_missing_file_is_the_built_in_defaults(config: Path) -> None:
    settings = load_settings()
    assert not config.exists()
    assert settings.path == config
    assert settings.sampling.max_tokens is None  # whole replies
    assert (settings.sampling.temperature, settings.sampling.top_p, settings.sampling.top_k) == (0.7, 1.0, 0)
    assert settings.model is None and settings.prompt is None and settings.theme is None and not settings.keys
    assert all(origin == "built-in" for _, _, origin in settings.entries())


def test_every_key_is_read(config: Path) -> None:
    write(
        config,
        """
model = "~/models/m.gguf"
prompt = "coding"
theme = "nord"

[sampling]
temperature = 0   # an int is a fine float
top_p = 0.9
top_k = 40
max_tokens = 1024
seed = 7

[engine]
kv_cache_memory = "2GiB"
max_num_seqs = 16
max_model_len = 4096

[keys]
new_chat = "ctrl+t"
""",
    )
    settings = load_settings()
    assert settings.model == str(Path("~/models/m.gguf").expanduser())
    assert (settings.prompt, settings.theme) == ("coding", "nord")
    s = settings.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed) == (0.0, 0.9, 40, 1024, 7)
    assert type(s.temperature) is float
    assert settings.engine.as_kwargs() == {"kv_cache_memory": "2GiB", "max_num_seqs": 16, "max_model_len": 4096}
    assert dict(settings.keys) == {"new_chat": "ctrl+t"}
    assert settings.origin("sampling.top_k") == str(config)
    with pytest.raises(TypeError):
        settings.keys["stop"] = "x"  # the settings are read-only copies


def test_flag_beats_file_beats_built_in(config: Path) -> None:
    write(config, "[sampling]\ntemperature = 0.2\ntop_p = 0.5\n")
    settings = load_settings().with_flags({"sampling.temperature": 1.1, "sampling.seed": None, "model": None})
    assert settings.sampling.temperature == 1.1 and settings.origin("sampling.temperature") == "flag --temperature"
    assert settings.sampling.top_p == 0.5 and settings.origin("sampling.top_p") == str(config)
    assert settings.sampling.top_k == 0 and settings.origin("sampling.top_k") == "built-in"
    assert settings.sampling.seed is None and settings.origin("sampling.seed") == "built-in"  # None: not given


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[sampling]\ntemperature = "hot"\n', ["line 2", "[sampling] temperature", "not str"]),
        ("[sampling]\ntop_p = 1.5\n", ["line 2", "[sampling] top_p", "(0, 1]"]),
        ("[sampling]\ntop_k = -1\n", ["line 2", "[sampling] top_k", "0 (off) or more"]),
        ("[sampling]\nmax_tokens = 0\n", ["line 2", "[sampling] max_tokens", "at least 1"]),
        ("[sampling]\nmax_tokens = 2.5\n", ["line 2", "[sampling] max_tokens", "not float"]),
        ("[sampling]\nseed = 18446744073709551616\n", ["line 2", "[sampling] seed", "64-bit seed"]),
        ("\n\n[engine]\nmax_num_seqs = 0\n", ["line 4", "[engine] max_num_seqs", "at least 1"]),
        ('[engine]\nmax_model_len = "8k"\n', ["line 2", "[engine] max_model_len", "whole number"]),
        ('[engine]\nkv_cache_memory = "lots"\n', ["line 2", "[engine] kv_cache_memory", "'2GiB'"]),
        ('[engine]\nkv_cache_dtype = "fp8"\n', ["line 2", "[engine] kv_cache_dtype", "'bfloat16'"]),
        ("[engine]\nkv_cache_dtype = 16\n", ["line 2", "[engine] kv_cache_dtype", "type name"]),
        ("model = 3\n", ["line 1", "model", "non-empty string"]),
        ('prompt = "no-such-prompt"\n', ["line 1", "prompt", "no-such-prompt"]),
        ('theme = "neon-pink"\n', ["line 1", "theme", "not a theme", "nord"]),
        ("[keys]\nnew_chat = 5\n", ["line 2", "[keys] new_chat", "key string"]),
        ('sampling = "hot"\n', ["line 1", "sampling", "must be a table"]),
        ("[sampling]\ntemprature = 0.2\n", ["line 2", "unknown key 'temprature'", "valid keys: temperature, top_p"]),
        ("colour = 1\n", ["unknown key(s) colour", "Valid top-level keys: model, prompt, theme"]),
        ("[engines]\nmax_num_seqs = 4\n", ["unknown table(s) [engines]", "valid tables: [sampling], [engine], [keys]"]),
        ("[sampling]\ntemperature = 0.2\ntop_p = \n", ["not valid TOML", "line 3"]),
    ],
)
def test_each_bad_value_names_the_file_the_key_and_the_line(config: Path, text: str, expected: list[str]) -> None:
    write(config, text)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    message = str(caught.value)
    assert message.startswith(str(config))
    for part in expected:
        assert part in message


def test_a_file_that_is_not_utf8_is_explained(config: Path) -> None:
    config.write_bytes(b'theme = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings()


def test_a_bad_flag_is_named(config: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--top-k: top_k=-1"):
        load_settings().with_flags({"sampling.top_k": -1})


def test_config_show_prints_each_value_and_where_it_came_from(config: Path, capsys) -> None:
    write(config, 'prompt = "coding"\n[sampling]\ntemperature = 0.2\n[keys]\nnew_chat = "ctrl+t"\n')
    assert cli.main(["config", "show", "--top-p", "0.9", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"# settings file: {config}"
    shown = {line.split(" = ")[0]: line.split(" = ", 1)[1] for line in lines if not line.startswith("#")}
    assert shown["prompt"].split() == ['"coding"', "#", str(config)]
    assert shown["sampling.temperature"].split() == ["0.2", "#", str(config)]
    assert shown["sampling.top_p"].split() == ["0.9", "#", "flag", "--top-p"]
    assert shown["sampling.seed"].split() == ["3", "#", "flag", "--seed"]
    assert shown["sampling.top_k"].split() == ["0", "#", "built-in"]
    assert shown["sampling.max_tokens"].startswith("(no limit: until the model stops or the context is full)")
    assert shown["keys.new_chat"].split() == ['"ctrl+t"', "#", str(config)]


def test_config_show_engine_prints_what_the_engine_settled_on(config: Path, tiny_model_path: Path, capsys) -> None:
    """The user's settings as given, then the engine's own record: "auto" decided, the pool sized."""
    write(config, f'model = "{tiny_model_path}"\n[engine]\nkv_cache_memory = "64MiB"\nkv_disk = false\n')
    assert cli.main(["config", "show", "--engine"]) == 0
    out = capsys.readouterr().out
    given, settled = out.split("\n\n# what the engine settled on for ")
    assert 'engine.kv_cache_memory = "64MiB"' in given and "engine.kv_cache_dtype = (auto" in given
    shown = dict(line.split(" = ", 1) for line in settled.splitlines()[1:])
    assert shown["device"] == '"cpu"' and shown["kv_disk"] == "false" and shown["block_size"] == "16"
    assert shown["kv_cache_dtype"] in ('"float16"', '"float32"', '"bfloat16"')
    assert 0 < int(shown["kv_cache_bytes"]) <= 64 * 2**20
    assert set(shown) == {field.name for field in dataclasses.fields(ResolvedConfig)}


def test_config_show_without_a_file_and_with_a_bad_one(config: Path, capsys) -> None:
    assert cli.main(["config", "show"]) == 0
    assert "(not there: built-in defaults)" in capsys.readouterr().out
    write(config, "[sampling]\ntop_p = 3\n")
    assert cli.main(["config", "show"]) == 2
    assert f"error: {config}, line 2: [sampling] top_p" in capsys.readouterr().err


def test_run_takes_its_settings_from_the_file_and_flags(config: Path, home: Path, monkeypatch, capsys) -> None:
    """The file's limit and engine settings reach `run`; --max-tokens overrides the limit."""
    opened: list[dict] = []

    def open_engine(model: str | None, **engine_config: object) -> AsyncLLM:
        opened.append({"model": model, **engine_config})
        return AsyncLLM(llm=FakeLLM(reply=lambda ids: "w" * 600))

    monkeypatch.setattr(cli, "open_engine", open_engine)
    write(config, 'model = "/m.gguf"\n[sampling]\nmax_tokens = 40\n[engine]\nmax_num_seqs = 4\n')
    assert cli.main(["run", "hello"]) == 0
    out, err = capsys.readouterr()
    assert out == "w" * 40 + "\n"
    assert "the reply stopped at 40 tokens" in err
    assert opened == [{"model": "/m.gguf", "max_num_seqs": 4}]

    assert cli.main(["run", "hello", "--max-tokens", "7", "--top-k", "3", "--top-p", "0.5", "--seed", "1"]) == 0
    assert capsys.readouterr().out == "w" * 7 + "\n"

    write(config, "")
    assert cli.main(["run", "hello"]) == 0  # no limit anywhere: the whole reply, not 256 tokens
    out, err = capsys.readouterr()
    assert out == "w" * 600 + "\n" and "stopped at" not in err

    with ChatStore(home / "chats.db") as store:
        session = store.list_sessions()[-1]  # the first run's
    assert cli.main(["sessions", "show", session.id]) == 0
    assert "[stopped at 40 tokens]" in capsys.readouterr().out


def test_run_says_when_a_reply_filled_the_context(config: Path, monkeypatch, capsys) -> None:
    """A reply that stopped because the context is full is not told to raise --max-tokens."""
    monkeypatch.setattr(
        cli, "open_engine", lambda model, **_: AsyncLLM(llm=FakeLLM(reply=lambda ids: "w" * 600, max_model_len=64))
    )
    assert cli.main(["run", "hello"]) == 0
    err = capsys.readouterr().err
    assert "the reply stopped: the context of 64 tokens is full; start a new session" in err
    assert "--max-tokens" not in err


def test_serve_takes_the_model_and_engine_settings_from_the_file(config: Path, monkeypatch) -> None:
    """`serve` reads the file as `run` does; its own flags beat the file's [engine] table."""
    opened: list[dict] = []

    def open_engine(model: str | None, **engine_config: object) -> AsyncLLM:
        opened.append({"model": model, **engine_config})
        raise ConfigError("stop before serving")  # the CLI reports it as one error line, exit 2

    monkeypatch.setattr(cli, "open_engine", open_engine)
    write(config, 'model = "/m.gguf"\n[engine]\nmax_num_seqs = 4\nkv_cache_memory = "1GiB"\n')
    assert cli.main(["serve", "--port", "0", "--max-num-seqs", "8"]) == 2
    assert opened == [{"model": "/m.gguf", "max_num_seqs": 8, "kv_cache_memory": "1GiB"}]


@pytest.fixture
def opened(monkeypatch) -> list[dict]:
    """The engine settings each command opens an engine with; the command then stops with a ConfigError (exit 2)."""
    settings: list[dict] = []

    def open_engine(model: str | None, **engine_config: object) -> AsyncLLM:
        settings.append(engine_config)
        raise ConfigError("stop before serving")

    monkeypatch.setattr(cli, "open_engine", open_engine)
    return settings


def test_no_kv_disk_beats_the_files_kv_disk_for_serve_run_and_chat(config: Path, opened: list[dict]) -> None:
    write(config, '[engine]\nkv_disk = true\nkv_disk_bytes = "1GiB"\n')
    assert cli.main(["serve", "--port", "0", "--no-kv-disk"]) == 2
    assert cli.main(["run", "--no-store", "--no-kv-disk", "hi"]) == 2
    assert cli.main(["run", "--no-store", "hi"]) == 2
    assert opened == [{"kv_disk": False, "kv_disk_bytes": "1GiB"}] * 2 + [{"kv_disk": True, "kv_disk_bytes": "1GiB"}]
    settings = cli._settings(cli.build_parser().parse_args(["chat", "--no-kv-disk"]))
    assert settings.engine.kv_disk is False and settings.origin("engine.kv_disk") == "flag --no-kv-disk"


def test_kv_cache_dtype_comes_from_the_flag_over_the_file_for_serve_run_and_chat(
    config: Path, opened: list[dict]
) -> None:
    write(config, '[engine]\nkv_cache_dtype = "float16"\n')
    assert cli.main(["serve", "--port", "0", "--kv-cache-dtype", "bfloat16"]) == 2
    assert cli.main(["run", "--no-store", "hi"]) == 2
    assert opened == [{"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "float16"}]
    settings = cli._settings(cli.build_parser().parse_args(["chat", "--kv-cache-dtype", "float32"]))
    assert settings.engine.kv_cache_dtype == "float32"
    assert settings.origin("engine.kv_cache_dtype") == "flag --kv-cache-dtype"


def test_a_bad_kv_disk_setting_names_the_key(config: Path) -> None:
    write(config, '[engine]\nkv_disk = "yes"\n')
    with pytest.raises(ConfigError, match="kv_disk"):
        load_settings()


def test_save_theme_creates_a_private_file(config: Path) -> None:
    save_theme("nord")
    assert config.read_text() == 'theme = "nord"\n'
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert load_settings().theme == "nord"


def test_save_theme_keeps_every_other_line(config: Path) -> None:
    original = '# my settings\nmodel = "/m.gguf"  # the big one\n\n[sampling]\ntemperature = 0.2\n'
    write(config, original)
    save_theme("gruvbox")
    assert config.read_text() == original.replace("[sampling]", 'theme = "gruvbox"\n[sampling]')
    save_theme("nord")
    assert config.read_text() == original.replace("[sampling]", 'theme = "nord"\n[sampling]')
    settings = load_settings()
    assert (settings.theme, settings.model, settings.sampling.temperature) == ("nord", "/m.gguf", 0.2)


def test_save_theme_leaves_a_broken_file_alone(config: Path) -> None:
    write(config, "[sampling\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        save_theme("nord")
    assert config.read_text() == "[sampling\n"


def test_built_in_settings_have_no_file() -> None:
    assert Settings().path is None and Settings().origin("model") == "built-in"


def test_a_fifo_or_a_huge_settings_file_is_an_error_not_a_hang(config: Path) -> None:
    """The settings file sits in a folder users write to: anything but a small regular file is refused unread."""
    import os

    config.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(config)  # opening it would block every command until a writer came
    with pytest.raises(ConfigError, match="not a regular file"):
        load_settings()
    config.unlink()
    with open(config, "wb") as big:
        big.truncate(2 * 1024 * 1024)  # sparse: 2 MiB of nothing
    with pytest.raises(ConfigError, match="more than the"):
        load_settings()


def test_a_draft_model_comes_from_the_files_inline_table_or_the_flags(config: Path, opened: list[dict], capsys) -> None:
    write(config, '[engine]\nspeculative = { draft = "small.gguf", k = 2 }\n')
    assert cli.main(["serve", "--port", "0"]) == 2
    assert cli.main(["run", "--no-store", "--speculative-k", "5", "hi"]) == 2  # the file's draft, another k
    assert cli.main(["run", "--no-store", "--speculative-draft", "tiny.gguf", "hi"]) == 2
    assert cli.main(["run", "--no-store", "--speculative", "off", "hi"]) == 2
    assert [s["speculative"] for s in opened] == [
        {"draft": "small.gguf", "k": 2},
        {"draft": "small.gguf", "k": 5},
        {"draft": "tiny.gguf"},
        "off",
    ]
    settings = cli._settings(
        cli.build_parser().parse_args(["chat", "--speculative-draft", "d.gguf", "--speculative-k", "4"])
    )
    assert settings.engine.speculative == {"draft": "d.gguf", "k": 4}
    assert settings.origin("engine.speculative") == "flag --speculative-draft"
    capsys.readouterr()
    assert cli.main(["config", "show"]) == 0
    assert 'engine.speculative = { draft = "small.gguf", k = 2 }' in capsys.readouterr().out


def test_bad_draft_settings_say_what_to_change(config: Path) -> None:
    parse = cli.build_parser().parse_args
    with pytest.raises(ConfigError, match="pass one"):
        cli._settings(parse(["chat", "--speculative", "ngram", "--speculative-draft", "d.gguf"]))
    with pytest.raises(ConfigError, match="--speculative-k sets a draft model's k: pass --speculative-draft"):
        cli._settings(parse(["chat", "--speculative-k", "4"]))
    with pytest.raises(ConfigError, match=r"--speculative-draft: .*'k' must be a whole number from 1 to 8"):
        cli._settings(parse(["chat", "--speculative-draft", "d.gguf", "--speculative-k", "9"]))
    write(config, '[engine]\nspeculative = { model = "small.gguf" }\n')
    with pytest.raises(ConfigError, match=r"line 2: \[engine\] speculative: .*unknown key\(s\) model"):
        load_settings()

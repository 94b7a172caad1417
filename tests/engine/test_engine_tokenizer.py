"""The engine's tokenizer: decodes as the model's transformers tokenizer does, and a later start reads its record
without importing transformers; a damaged record is set aside and written again."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from localpaged.engine import engine_tokenizer
from localpaged.engine.engine_tokenizer import RECORD, load_engine_tokenizer
from localpaged.engine.tokenizer import load_tokenizer, probe_ids


@pytest.fixture
def models(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "models"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(engine_tokenizer, "models_cache_dir", lambda: folder)
    return folder


def _records(models: Path) -> list[Path]:
    return sorted(p for p in models.glob("*-tokenizer") if not p.name.startswith("."))


def _same_as_full(tokenizer, full) -> None:
    assert tokenizer.get_vocab() == full.get_vocab()
    assert tokenizer.eos_token_id == full.eos_token_id
    assert tokenizer.probe_ids == probe_ids(full)
    rng = random.Random(1)
    special = sorted({*full.all_special_ids, *full.added_tokens_decoder})
    for _ in range(50):
        ids = rng.choices(range(len(full)), k=rng.randint(1, 40)) + rng.choices(special, k=2)
        rng.shuffle(ids)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids


def test_the_engine_decodes_as_transformers_and_a_later_load_reads_the_record(models, default_model_folder):
    first = load_engine_tokenizer(default_model_folder)
    (record,) = _records(models)
    assert (record / RECORD).stat().st_mode & 0o077 == 0
    full = load_tokenizer(default_model_folder)
    second = load_engine_tokenizer(default_model_folder)
    assert second.backend is not None and second._full is None  # from the record: transformers' is not loaded
    for tokenizer in (first, second):
        _same_as_full(tokenizer, full)
    assert second.full.get_vocab() == full.get_vocab()  # the full tokenizer on first use


def test_a_start_with_a_record_does_not_import_transformers(models, default_model_folder):
    load_engine_tokenizer(default_model_folder)
    code = (
        "import sys; from pathlib import Path; from localpaged.engine import engine_tokenizer as e; "
        f"e.models_cache_dir = lambda: Path({str(models)!r}); "
        f"t = e.load_engine_tokenizer(Path({str(default_model_folder)!r})); "
        "print(t.decode(t.probe_ids), 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False") and "Again?" in out


def test_a_tokenizer_of_its_own_settings_still_decodes_as_transformers(models, default_model_folder, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in default_model_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    _same_as_full(load_engine_tokenizer(folder), load_tokenizer(folder))
    _same_as_full(load_engine_tokenizer(folder), load_tokenizer(folder))


@pytest.mark.parametrize(
    "damage",
    [lambda f: f.write_text("{not json"), lambda f: f.write_text('{"backend": "{}"}'), lambda f: f.chmod(0o666)],
    ids=["not-json", "no-tokenizer", "writable-by-others"],
)
def test_a_damaged_record_is_set_aside_and_written_again(models, default_model_folder, damage):
    load_engine_tokenizer(default_model_folder)
    (record,) = _records(models)
    damage(record / RECORD)
    with pytest.warns(UserWarning, match=r"not using .*-tokenizer"):
        tokenizer = load_engine_tokenizer(default_model_folder)
    _same_as_full(tokenizer, load_tokenizer(default_model_folder))
    (again,) = _records(models)
    assert (again / RECORD).stat().st_mode & 0o077 == 0
    assert load_engine_tokenizer(default_model_folder)._full is None

"""The engine's tokenizer: token ids to text, the vocabulary and the ids the engine reads, without transformers.

The engine decodes every token it makes and reads its vocabulary once. Importing and loading transformers'
tokenizer takes seconds, more than the rest of a start once the weights are packed (models/packed_cache.py);
the ``tokenizers`` backend it wraps loads in a tenth of one. So the first load of a model's tokenizer
(AutoTokenizer, as ever) records that backend as transformers configured it, with the ids the engine reads of the
full tokenizer (the end-of-text id, the probe conversation's), in a private cache folder named after the tokenizer's
files and both libraries' versions; later starts read the record alone. A record is made only where the backend
decodes as the full tokenizer does (checked when it is made, over random ids and every special one, skipping
special tokens and not); elsewhere the engine decodes with the full tokenizer. What the engine needs now and then
(encoding text in process, the chat template) loads the full tokenizer on first use; a grammar's vocabulary is
read from the record's backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from localpaged.cache_folders import cached_folder, read_trusted
from localpaged.errors import ConfigError
from localpaged.locations import models_cache_dir

log = logging.getLogger(__name__)
RECORD = "engine-tokenizer.json"
# What AutoTokenizer may read in a model folder: the record's name hangs on each of them.
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
CHECK_SEQUENCES, CHECK_LENGTH = 24, 64  # random id sequences a record's decoding is checked on


class EngineTokenizer:
    """A model's tokenizer as the engine reads it: ``decode``, ``get_vocab``, ``eos_token_id`` and ``probe_ids`` from
    the record (or the full tokenizer where there is none), ``full`` (transformers') loaded on first use."""

    def __init__(
        self,
        folder: Path,
        backend: Tokenizer | None,
        eos_token_id: int | None,
        probe_ids: list[int] | None,
        full: Any = None,
    ) -> None:
        self.folder = folder
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.probe_ids = probe_ids
        self._full = full
        self._lock = threading.Lock()

    @property
    def full(self) -> Any:
        """transformers' tokenizer of the model (AutoTokenizer), loaded on the first call."""
        with self._lock:
            if self._full is None:
                from localpaged.engine.tokenizer import load_tokenizer

                self._full = load_tokenizer(self.folder)
            return self._full

    @property
    def vocabulary(self) -> Any:
        """A transformers tokenizer with the model's vocabulary and special tokens, for a library that reads one
        (xgrammar's vocabulary): the recorded backend in transformers' fast class where there is a record (a
        fraction of a second: its vocabulary and special tokens are the full tokenizer's, as the record's check
        found), else ``full``."""
        if self.backend is None:
            return self.full
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.backend)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.backend is None:
            return self.full.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Every token's string and id, added tokens included (what transformers' ``get_vocab`` gives)."""
        if self.backend is None:
            return self.full.get_vocab()
        return self.backend.get_vocab(with_added_tokens=True)


def load_engine_tokenizer(folder: Path) -> EngineTokenizer:
    """The tokenizer of the model in ``folder`` for the engine: from its record where one is kept, else the full
    tokenizer, whose record is written for later starts where it decodes as the backend alone does."""
    target = record_folder(folder)
    # Exception: tokenizers' parse errors are plain Exceptions.
    kept = read_trusted(target, lambda f: _from_record(folder, json.loads((f / RECORD).read_text())), (Exception,))
    if kept is not None:
        return kept
    from localpaged.engine.tokenizer import load_tokenizer, probe_ids

    full = load_tokenizer(folder)
    backend = getattr(full, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not _decodes_alike(full, backend):
        return EngineTokenizer(folder, None, full.eos_token_id, probe_ids(full), full)
    record = {"backend": backend.to_str(), "eos_token_id": full.eos_token_id, "probe_ids": probe_ids(full)}
    try:
        cached_folder(target, lambda f: (f / RECORD).write_text(json.dumps(record)))
    except (OSError, ConfigError) as exc:  # a cache: not keeping it costs the next start time, nothing else
        log.warning("could not keep the engine's tokenizer record (%s); the next start loads transformers'", exc)
    return _from_record(folder, record, full)


def record_folder(folder: Path) -> Path:
    """The cache folder of the record of the tokenizer in ``folder``."""
    return models_cache_dir() / f"{_files_digest(folder)[:32]}-tokenizer"


def _from_record(folder: Path, record: dict, full: Any = None) -> EngineTokenizer:
    eos, probe = record["eos_token_id"], record["probe_ids"]
    if not (eos is None or isinstance(eos, int)) or not (probe is None or all(isinstance(i, int) for i in probe)):
        raise ValueError("its end-of-text or probe ids are not whole numbers")
    return EngineTokenizer(folder, Tokenizer.from_str(record["backend"]), eos, probe, full)


def _decodes_alike(full: Any, backend: Tokenizer) -> bool:
    """Whether ``backend`` alone decodes as ``full`` does (its class may clean up spaces, or decode its own way)
    and gives the same vocabulary: checked on every special id and on random sequences."""
    if full.get_vocab() != backend.get_vocab(with_added_tokens=True):
        return False
    size = len(full)
    rng = random.Random(0)
    special = sorted({*full.all_special_ids, *full.added_tokens_decoder})
    checks = (
        [[i] for i in special] + [special] + [rng.choices(range(size), k=CHECK_LENGTH) for _ in range(CHECK_SEQUENCES)]
    )
    checks += [ids[: CHECK_LENGTH // 2] + special[:4] + ids[CHECK_LENGTH // 2 :] for ids in checks[-4:]]
    return all(
        full.decode(ids, skip_special_tokens=skip) == backend.decode(ids, skip_special_tokens=skip)
        for ids in checks
        for skip in (False, True)
    )


def _files_digest(folder: Path) -> str:
    """sha256 over the tokenizer files of ``folder`` and the versions of the libraries that read them."""
    digest = hashlib.sha256(f"transformers {version('transformers')} tokenizers {version('tokenizers')}".encode())
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(f"\0{name}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()

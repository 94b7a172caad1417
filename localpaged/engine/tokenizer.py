"""The tokenizer and the chat template: loaded by the engine core and by its front end alike.

The front end keeps its own copy so that counting and encoding a conversation (every turn, every
status refresh) never waits for an engine step in the core process. It loads the tokenizers-backed
class straight from ``tokenizer.json`` (0.6 s of imports and no torch, against 2 s and torch for
AutoTokenizer), and checks it against the core's AutoTokenizer on a probe conversation: a model
whose tokenizer class does something of its own gets AutoTokenizer in the front end too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Covers the template's roles, a multi-byte character, a turn boundary and the generation prompt.
PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, 世界! naïve café\n  two spaces"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again?"},
]


def load_tokenizer(folder: str | Path) -> Any:
    """The Hugging Face tokenizer saved in a model folder, as AutoTokenizer picks it (never fetched from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def load_front_end_tokenizer(folder: str | Path) -> Any:
    """The light tokenizer where the folder has ``tokenizer.json``, else the one AutoTokenizer picks."""
    if not (Path(folder) / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def encode_chat(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def probe_ids(tokenizer: Any) -> list[int] | None:
    """The probe conversation's ids, or None where the model has no chat template."""
    try:
        return encode_chat(tokenizer, PROBE)
    except ValueError:  # no chat template
        return None

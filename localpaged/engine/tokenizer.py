"""The tokenizer and the chat template: loaded by the engine core and by its front end alike.

The front end keeps its own copy so that counting and encoding a conversation (every turn, every
status refresh) never waits for an engine step in the core process. It loads the tokenizers-backed
class straight from ``tokenizer.json`` (a fraction of AutoTokenizer's imports, and no torch), and
checks it against the core's AutoTokenizer on a probe conversation: a model whose tokenizer class
does something of its own gets AutoTokenizer in the front end too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from localpaged.errors import RequestError
from localpaged.unicode_text import not_unicode

Prompt = str | list[int] | list[dict]

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


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a prompt that fits ``max_model_len`` tokens can have: no token is longer than the
    vocabulary's longest string (byte-level vocabularies spell each byte as one character, and a character
    is at least a byte), so a longer prompt is refused by its length, before any time is spent encoding it."""
    return max_model_len * max(map(len, tokenizer.get_vocab()), default=1)


def encode_prompt(tokenizer: Any, prompt: Prompt, max_chars: int | None = None) -> list[int]:
    """A prompt as the token ids the engine runs: text without special tokens added, chat messages under the
    template, token ids as given (the engine checks them against its vocabulary). A RequestError names what
    is wrong; text longer than ``max_chars`` (``max_prompt_chars``) is refused before it is encoded."""
    ids = token_ids(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, str):
        if reason := not_unicode(prompt):
            raise RequestError(f"the prompt cannot be encoded: {reason}")
        _check_chars(len(prompt), max_chars)
        return list(tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    if not isinstance(prompt, (list, tuple)):  # bytes would iterate as ints and pass for token ids
        raise RequestError(
            f"a prompt must be text (str), token ids (a list of int) or chat messages (a list of dict), "
            f"not {type(prompt).__name__}" + ("; decode it to str first" if isinstance(prompt, bytes) else "")
        )
    messages = check_messages(prompt)
    _check_chars(sum(len(m["content"]) for m in messages), max_chars)
    return encode_chat(tokenizer, messages)


def token_ids(prompt: Prompt) -> list[int] | None:
    """A prompt given as token ids, checked (RequestError unless each is a whole number >= 0; the engine checks them
    against its vocabulary); None for text, chat messages or anything else (``encode_prompt`` says what)."""
    if not isinstance(prompt, (list, tuple)) or (prompt and isinstance(prompt[0], dict)):
        return None
    ids = list(prompt)
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
        raise RequestError("prompt token ids must be integers in [0, the vocabulary size)")
    return ids


def _check_chars(chars: int, max_chars: int | None) -> None:
    if max_chars is not None and chars > max_chars:
        raise RequestError(
            f"the prompt has {chars} characters, more than the context could hold in tokens of this model "
            f"(at most {max_chars}); shorten the prompt"
        )


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """RequestError unless a prompt of ``num_tokens`` leaves room for a reply in the context."""
    if num_tokens == 0:
        raise RequestError("the prompt is empty; send at least one token of text")
    if num_tokens >= max_model_len:
        raise RequestError(
            f"the prompt is {num_tokens} tokens but the context holds {max_model_len} (max_model_len), with room for "
            "a reply; shorten the prompt or start the engine with a larger max_model_len"
        )


def encode_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn.

    ``tools``: OpenAI-style tool definitions (``{"type": "function", "function": {...}}``), rendered by
    the template's own tool format; a template without one ignores them (the server describes them
    itself then, see localpaged/chat/tool_calls.py).

    The roles and contents are checked first (RequestError naming the message), and a content that
    spells one of the model's control tokens (``<|im_start|>`` ...) keeps it as text: otherwise a pasted
    message could open a system turn of its own. Conversations without such strings, nearly all of them,
    go through the template exactly as before, so their ids (and the prefix cache) do not change.
    """
    messages = check_messages(messages)
    specials = _special_strings(tokenizer)
    extra = {"tools": tools} if tools else {}
    try:
        if not any(token in m["content"] for m in messages for token in specials):
            return _apply_template(tokenizer, messages, extra)
        return _encode_with_literal_content(tokenizer, messages, extra)
    except TemplateError as exc:  # the template's own raise_exception: an order of turns it does not take
        raise RequestError(f"the model's chat template refused these messages: {exc}") from None


# Roles the chat templates know; "developer" (the OpenAI API's newer name for "system", which the
# server also takes) is passed on as "system"; "tool" carries a tool's result (templates with a tool format).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages: object) -> list[dict]:
    """The messages with known roles and text content; RequestError naming the first bad one and why.

    A template given an unknown role or non-text content fails deep inside Jinja, or worse renders it.
    """
    if not isinstance(messages, (list, tuple)):
        raise RequestError(
            f"chat messages must be a list of {{'role': ..., 'content': ...}}; got {type(messages).__name__}"
        )
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(
                f"message {index} must be a dict with 'role' and 'content'; got {type(message).__name__}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"message {index} has an unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        if role == "assistant" and content is None and message.get("tool_calls"):
            message, content = {**message, "content": ""}, ""  # a turn of tool calls alone
        if not isinstance(content, str):
            raise RequestError(f"message {index} content must be text (str), not {type(content).__name__}")
        if reason := not_unicode(content):
            raise RequestError(f"message {index} content cannot be encoded: {reason}")
        checked.append({**message, "role": "system"} if role == "developer" else message)
    return checked


def _apply_template(tokenizer: Any, messages: list[dict], extra: dict) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _special_strings(tokenizer: Any) -> list[str]:
    """The texts of the tokenizer's special (control) added tokens, e.g. ``<|im_start|>``."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {token.content for token in decoder.values() if getattr(token, "special", False) and token.content}
    found.update(t for t in getattr(tokenizer, "all_special_tokens", []) if t)
    return sorted(found)


def _encode_with_literal_content(tokenizer: Any, messages: list[dict], extra: dict) -> list[int]:
    """Render the template around placeholders, then tokenize the template's own text as usual and
    each content with its special-token strings split into ordinary text tokens."""
    rendered_all = "".join(m["content"] for m in messages)
    marker = "\ue000"
    while marker in rendered_all:
        marker += "\ue001"
    placeholders = [f"{marker}{i}{marker}" for i in range(len(messages))]
    masked = [{**m, "content": placeholder} for m, placeholder in zip(messages, placeholders)]
    template = tokenizer.apply_chat_template(masked, add_generation_prompt=True, tokenize=False, **extra)
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    pieces: list[tuple[str, bool]] = []  # (text, is_content)
    rest = template
    for placeholder, message in zip(placeholders, messages):
        before, found, after = rest.partition(placeholder)
        if not found or placeholder in after:  # a template that drops, repeats or reshapes a message
            raise RequestError(
                "a message contains the model's control-token text (e.g. <|im_start|>) and this model's chat "
                "template cannot keep it as plain text; remove that text from the message"
            )
        pieces += [(before, False), (message["content"], True)]
        rest = after
    pieces.append((rest, False))
    if "".join(text for text, _ in pieces) != full:  # the template transforms contents (trims them, ...)
        raise RequestError(
            "a message contains the model's control-token text (e.g. <|im_start|>) and this model's chat "
            "template changes message text, so it cannot be kept as plain text; remove it from the message"
        )
    ids: list[int] = []
    for text, is_content in pieces:
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=is_content)
    return ids


def probe_ids(tokenizer: Any) -> list[int] | None:
    """The probe conversation's ids, or None where the model has no chat template."""
    try:
        return encode_chat(tokenizer, PROBE)
    except ValueError:  # no chat template
        return None

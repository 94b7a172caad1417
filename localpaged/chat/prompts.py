"""System prompts: the shipped ones (package ``localpaged.prompts``) and the user's own.

Each prompt is a Markdown file whose name (without ``.md``) is the prompt's name, and
which starts with a tiny front matter block::

    ---
    title: Coding assistant
    description: Careful, correct code with short explanations.
    ---
    You are ...

Only ``key: value`` lines are understood (no YAML dependency for two fields). A file
in the user's folder replaces a shipped prompt of the same name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from localpaged.errors import PromptError
from localpaged.locations import UnsafeFileError, read_regular_file, user_prompts_dir

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

_FENCE = "---"
# A prompt is a page or two of text; anything far bigger is a mistake (a log, a model file), not read into memory.
MAX_PROMPT_BYTES = 1024 * 1024
_KEY_VALUE = re.compile(r"([A-Za-z][\w-]*)\s*:\s*(.*)")


@dataclass(frozen=True)
class Prompt:
    """A parsed prompt file; ``text`` is the body, what goes into the system message."""

    name: str
    title: str
    description: str
    text: str
    path: Path
    builtin: bool


def user_prompt_dir() -> Path:
    """The user's prompt folder, :func:`localpaged.locations.user_prompts_dir`; only read here, so never created."""
    return user_prompts_dir(create=False)


def list_prompts(problems: list[PromptError] | None = None) -> list[Prompt]:
    """Every prompt that parses, shipped and the user's, sorted by name.

    One broken file must not hide the others (the shipped ones above all), so a file that cannot be
    read or parsed is skipped and its PromptError appended to ``problems``, for the caller to show.
    """
    prompts = []
    for name, (file, builtin) in sorted(_files(problems).items()):
        try:
            prompts.append(_parse(name, file, builtin))
        except PromptError as exc:
            if problems is not None:
                problems.append(exc)
    return prompts


def get_prompt(name: str) -> Prompt:
    """The prompt called ``name``; only its own file is read, so a broken neighbour is no obstacle."""
    files = _files()
    if name not in files:
        raise PromptError(
            f"No prompt named {name!r}. Available: {', '.join(sorted(files))}. "
            f"To add your own, write {user_prompt_dir() / (name + '.md')} with a title in its front matter."
        )
    file, builtin = files[name]
    return _parse(name, file, builtin)


def load_prompt(name: str) -> str:
    """The text of the prompt called ``name``, ready to be a system message."""
    return get_prompt(name).text


def _files(problems: list[PromptError] | None = None) -> dict[str, tuple[Traversable, bool]]:
    """Prompt name -> (file, builtin); the user's files are added last so they win.

    An unreadable user folder is reported in ``problems`` (when given) rather than hiding the shipped prompts.
    """
    found: dict[str, tuple[Traversable, bool]] = {}
    for file in resources.files("localpaged.prompts").iterdir():
        if file.name.endswith(".md"):
            found[file.name[: -len(".md")]] = (file, True)
    folder = user_prompt_dir()
    try:
        if folder.is_dir():
            for path in sorted(folder.glob("*.md")):
                if not path.name.startswith("."):  # editor lock and backup files
                    found[path.stem] = (path, False)
    except OSError as exc:
        if problems is not None:
            problems.append(PromptError(f"{folder}: cannot be listed ({exc.strerror or exc}); check its permissions."))
    return found


def _read_user_file(path: Path) -> bytes:
    """The bytes of a user's prompt file, refusing what would hang or flood: FIFOs, devices, folders, huge files."""
    try:
        return read_regular_file(path, MAX_PROMPT_BYTES)
    except UnsafeFileError as exc:
        raise PromptError(f"{path}: {exc}; prompts are plain .md files, shorten it or move it aside.") from exc
    except OSError as exc:
        raise PromptError(f"{path}: cannot be read ({exc.strerror or exc}).") from exc


def _parse(name: str, file: Traversable, builtin: bool) -> Prompt:
    path = Path(str(file))
    try:
        data = file.read_bytes() if builtin else _read_user_file(path)
    except OSError as exc:
        raise PromptError(f"{path}: cannot be read ({exc.strerror or exc}).") from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise PromptError(f"{path}, line {line}: not valid UTF-8 ({exc.reason}). Save the file as UTF-8.") from exc

    lines = text.splitlines()
    if not lines or lines[0].strip() != _FENCE:
        raise PromptError(
            f"{path}, line 1: a prompt file must start with front matter: a '---' line, "
            "'title: ...', optionally 'description: ...', then a closing '---' line."
        )
    meta: dict[str, str] = {}
    for number, line in enumerate(lines[1:], start=2):
        if line.strip() == _FENCE:
            break
        if not line.strip():
            continue
        match = _KEY_VALUE.fullmatch(line.strip())
        if not match:
            raise PromptError(f"{path}, line {number}: expected 'key: value' in the front matter, got {line!r}.")
        meta[match[1].lower()] = _unquote(match[2].strip())
    else:
        raise PromptError(f"{path}, line 1: the front matter that starts here has no closing '---' line.")

    if not meta.get("title"):
        raise PromptError(f"{path}, line 1: the front matter has no 'title: ...' line.")
    body = "\n".join(lines[number:]).strip()
    if not body:
        raise PromptError(f"{path}, line {number + 1}: the prompt has no text after its front matter.")
    return Prompt(name, meta["title"], meta.get("description", ""), body, path, builtin)


def _unquote(value: str) -> str:
    """Drop one pair of matching quotes, as YAML would, so ``title: "A: B"`` works."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value

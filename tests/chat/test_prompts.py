"""System prompts: the shipped files parse, the user's override them, broken files say where."""

from __future__ import annotations

from pathlib import Path

import pytest

from localpaged.chat.prompts import get_prompt, list_prompts, load_prompt, user_prompt_dir
from localpaged.errors import PromptError

SHIPPED = {"general", "coding", "concise", "tutor"}


def test_user_prompt_dir_follows_localpaged_home(user_dir: Path) -> None:
    assert user_prompt_dir() == user_dir


def test_shipped_prompts_parse(user_dir: Path) -> None:
    prompts = list_prompts()
    assert [p.name for p in prompts] == sorted(p.name for p in prompts)
    by_name = {p.name: p for p in prompts}
    assert SHIPPED <= set(by_name)
    for name in SHIPPED:
        p = by_name[name]
        assert p.builtin and p.title and p.description and p.path.name == f"{name}.md"
        assert not p.text.startswith("---") and p.text == p.text.strip()
        assert load_prompt(name) == p.text


def test_coding_prompt_is_long_enough_to_show_prefix_caching(user_dir: Path) -> None:
    # About 2,500 tokens of the SmolLM2 tokenizer; characters keep this test fast.
    assert len(load_prompt("coding")) >= 6500


def test_user_prompt_overrides_shipped_and_adds_new(user_dir: Path) -> None:
    (user_dir / "general.md").write_text("---\ntitle: My general\n---\nYou are mine.\n", encoding="utf-8")
    (user_dir / "pirate.md").write_text(
        '---\ntitle: "Pirate: the voice"\ndescription: Arr.\n\n---\n\nTalk like a pirate.\n', encoding="utf-8"
    )
    general = get_prompt("general")
    assert (general.title, general.text, general.builtin, general.path) == (
        "My general",
        "You are mine.",
        False,
        user_dir / "general.md",
    )
    pirate = get_prompt("pirate")
    assert (pirate.title, pirate.description, pirate.text) == ("Pirate: the voice", "Arr.", "Talk like a pirate.")
    names = [p.name for p in list_prompts()]
    assert names.count("general") == 1 and "pirate" in names


def test_unknown_prompt_lists_available(user_dir: Path) -> None:
    with pytest.raises(PromptError, match=r"'nope'.*coding.*general") as info:
        load_prompt("nope")
    assert str(user_dir / "nope.md") in str(info.value)


@pytest.mark.parametrize(
    ("content", "line", "why"),
    [
        (b"no front matter\n", 1, "must start with front matter"),
        (b"---\ntitle: x\ndescription: never closed\n", 1, "no closing"),
        (b"---\ntitle: x\njust some words\n---\nbody\n", 3, "key: value"),
        (b"---\ndescription: no title\n---\nbody\n", 1, "title"),
        (b"---\ntitle: x\n---\n\n  \n", 4, "no text"),
        (b"---\ntitle: x\n---\nfine\n\xff\xfe broken\n", 5, "UTF-8"),
    ],
)
def test_malformed_file_names_path_and_line(user_dir: Path, content: bytes, line: int, why: str) -> None:
    path = user_dir / "broken.md"
    path.write_bytes(content)
    with pytest.raises(PromptError, match=why) as info:
        get_prompt("broken")
    assert f"{path}, line {line}:" in str(info.value)
    problems: list[PromptError] = []
    names = [p.name for p in list_prompts(problems)]
    assert "broken" not in names and SHIPPED <= set(names)  # the broken file is skipped, the rest listed
    assert [f"{path}, line {line}:" in str(e) for e in problems] == [True]
    assert load_prompt("general")  # a broken neighbour does not stop the others loading


def test_windows_line_endings_and_bom(user_dir: Path) -> None:
    (user_dir / "win.md").write_bytes("\ufeff---\r\ntitle: Win\r\n---\r\nLine one.\r\nLine two.\r\n".encode())
    assert load_prompt("win") == "Line one.\nLine two."

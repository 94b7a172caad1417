"""Code blocks in a reply: highlighted in the language their fence names, shown as plain text where it names none.

Textual guesses a language for an unnamed block, and a guessed lexer can take minutes on text it was not made for:
a tiny random model's indented reply below, guessed to be Maple, held the app's event loop.
"""

from __future__ import annotations

import pytest
import textual.highlight
from pilot_helpers import main_screen, reply_done, send

from localpaged.tui.widgets.reply_markdown import CodeFence

pytestmark = pytest.mark.anyio

HELD = (
    "Sure:\n\n"
    '        Membersregn imperialet Westernatern depths\u2019:==" pecul ammon welfare antihistamines cabinets '
    "enticing infringe Cre controlling Herbs Constantine negligible lidsargument epbagitting\n\n    \n\n"
    "        KawRY Insurancexxxx HorizonsCharlesoices confinement Susan dissection suggests Soul\ufffd Therm"
)
NAMED = "Here:\n\n```python\ndef f(x):\n    return x + 1\n```\n\nand\n\n```\nplain = words\n```\n"


def styles(fence: CodeFence) -> set[str]:
    return {str(span.style) for span in fence._highlighted_code.spans}


@pytest.fixture
def no_guessing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a code block's language was guessed")

    monkeypatch.setattr(textual.highlight, "guess_language", refuse)


async def shown(make_app, engine, reply: str):
    """The app's bubble of ``reply`` once streamed in full, and its code blocks."""
    engine.delay, engine.replies = 0.0, {"go": reply}
    async with make_app().run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        await send(pilot, "go")
        await reply_done(pilot, screen, screen.current)
        bubble = screen.messages.bubbles[-1]
        return bubble, list(bubble.query(CodeFence))


@pytest.mark.timeout(120)
async def test_an_unnamed_block_is_plain_text_and_the_reply_ends(make_app, engine, no_guessing):
    bubble, (fence,) = await shown(make_app, engine, HELD)
    assert bubble.text == HELD and bubble.status == "complete"
    assert "Membersregn" in fence.code and styles(fence) <= {"$text"}  # shown as it is


async def test_a_named_block_is_highlighted_in_its_language(make_app, engine, no_guessing):
    _, (python, plain) = await shown(make_app, engine, NAMED)
    assert python.lexer == "python" and len(styles(python)) > 2  # keywords, names, operators ...
    assert plain.code == "plain = words" and styles(plain) <= {"$text"}

"""Pick a system prompt from the library for a new chat."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, Static
from textual.widgets.option_list import Option

# What the dialog returns: (prompt name, system text); (None, None) is a chat without one.
Choice = tuple[str | None, str | None]


class NewChatDialog(ModalScreen[Choice | None]):
    """The prompt library with a preview of the highlighted prompt's text."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="new_chat_cancel")]

    def __init__(self, prompts: list[Any]) -> None:
        super().__init__(classes="dialog")
        self.prompts = {p.name: p for p in prompts}

    def compose(self) -> ComposeResult:
        options = [Option(Content.from_markup("[b]No system prompt[/b]\n  [dim]a plain chat[/dim]"), id="")]
        options += [
            Option(
                Content.from_markup(
                    "[b]$title[/b] [dim]($name)[/dim]\n  [dim]$description[/dim]",
                    title=p.title,
                    name=p.name,
                    description=p.description,
                ),
                id=p.name,
            )
            for p in self.prompts.values()
        ]
        with Vertical(classes="dialog-box wide"):
            yield Label("New chat — pick a system prompt", classes="dialog-title")
            yield OptionList(*options, id="prompt-list")
            yield Static("", id="prompt-preview", markup=False)
            yield Label("enter to start · escape to cancel", classes="dialog-hint")

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        prompt = self.prompts.get(event.option.id or "")
        self.query_one("#prompt-preview", Static).update(prompt.text if prompt else "")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        prompt = self.prompts.get(event.option.id or "")
        self.dismiss((prompt.name, prompt.text) if prompt else (None, None))

    def action_cancel(self) -> None:
        self.dismiss(None)

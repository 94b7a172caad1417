"""One chat's own settings: temperature, top-p, top-k, max reply tokens, seed, and its system prompt.

An empty box means "the app's default" (the settings file's, shown as the placeholder). Values are
checked as SamplingParams checks them; a bad one is shown under the boxes and nothing is saved.
A changed system prompt is handed back for the screen to fork the chat with (see Session.with_system).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, TextArea

from localpaged.chat.session import CHAT_SETTINGS, checked_settings
from localpaged.errors import ConfigError

# Each setting: its label, how its text is read, and what an empty box means when the app sets no default.
FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("Temperature (0 = greedy)", float),
    "top_p": ("Top-p (0 < p ≤ 1)", float),
    "top_k": ("Top-k (0 = off)", int),
    "max_tokens": ("Max reply tokens", int),
    "seed": ("Seed", int),
}
assert tuple(FIELDS) == CHAT_SETTINGS


@dataclass(frozen=True)
class ChatSettingsChoice:
    """What Save hands back: the reply settings ({name: value}, unset ones left out) and the system prompt."""

    settings: dict[str, Any]
    system: str | None


class ChatSettingsDialog(ModalScreen[ChatSettingsChoice | None]):
    """Dismisses with a ChatSettingsChoice on Save, None on Cancel."""

    DEFAULT_CSS = """
    ChatSettingsDialog .setting { height: auto; }
    ChatSettingsDialog .setting Label { width: 26; padding: 1 0 0 0; }
    ChatSettingsDialog .setting Input { width: 1fr; }
    ChatSettingsDialog #setting-system { height: 5; }
    ChatSettingsDialog #settings-error { color: $error; height: auto; }
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="chat_settings_cancel")]

    def __init__(
        self,
        current: dict[str, Any],
        defaults: dict[str, Any],
        system: str | None = None,
        pick_tools: Callable[[], None] | None = None,
    ) -> None:
        """``pick_tools`` opens the chat's tool picker above this dialog (its own Save stores the tools)."""
        super().__init__(classes="dialog")
        self.current = current
        self.defaults = defaults
        self.system = system
        self.pick_tools = pick_tools

    def compose(self) -> ComposeResult:
        box = VerticalScroll(classes="dialog-box")  # scrolls in a short terminal: Save stays reachable
        box.can_focus = False  # tab goes from box to box, not to the frame around them
        with box:
            yield Label("Chat settings — empty: the app's default", classes="dialog-title")
            for name, (label, _) in FIELDS.items():
                value = self.current.get(name)
                default = self.defaults.get(name)
                with Horizontal(classes="setting"):
                    yield Label(label)
                    yield Input(
                        "" if value is None else str(value),
                        placeholder=f"default: {'none' if default is None else default}",
                        id=f"setting-{name}",
                        select_on_focus=False,
                    )
            yield Label("System prompt (a change forks the chat)")
            yield TextArea(self.system or "", id="setting-system", soft_wrap=True)
            yield Label("", id="settings-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                if self.pick_tools is not None:
                    yield Button("Tools…", id="settings-tools")
                yield Button("Cancel", id="settings-cancel")
                yield Button("Save", id="settings-save", variant="primary")
            yield Label("enter in a box saves · escape cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#setting-temperature", Input).focus()

    def values(self) -> dict[str, Any]:
        """The boxes' values, read and checked; ConfigError naming the first bad one."""
        values: dict[str, Any] = {}
        for name, (_, kind) in FIELDS.items():
            text = self.query_one(f"#setting-{name}", Input).value.strip()
            if not text:
                continue
            try:
                values[name] = kind(text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise ConfigError(f"{name}={text!r}: must be {what}") from None
        return checked_settings(values)

    def save(self) -> None:
        try:
            values = self.values()
        except ConfigError as err:
            self.query_one("#settings-error", Label).update(str(err))
            return
        system = self.query_one("#setting-system", TextArea).text.strip() or None
        self.dismiss(ChatSettingsChoice(values, system))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "settings-save":
            self.save()
        elif event.button.id == "settings-tools" and self.pick_tools is not None:
            self.pick_tools()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

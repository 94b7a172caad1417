"""Widgets of the TUI, one per file."""

"""Screens and dialogs of the TUI, one per file."""

"""Textual app: many chat sessions streaming at once."""

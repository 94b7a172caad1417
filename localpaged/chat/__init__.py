"""Chat layer: sessions, their SQLite store, and system prompts."""

"""Shipped system prompts: one Markdown file each, front matter for title and description."""

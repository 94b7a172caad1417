"""localpaged: many chat sessions at once against one local paged-KV LLM engine.

Public names only. They load on first use, so ``import localpaged`` (and the CLI's help, the
chat store, the prompt library) does not pay for importing torch.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "LLM": "localpaged.engine.llm",
    "AsyncLLM": "localpaged.engine.async_llm",
    "RemoteEngine": "localpaged.engine.remote",
    "SamplingParams": "localpaged.sampling",
    "RequestOutput": "localpaged.engine.output",
    "Session": "localpaged.chat.session",
    "ChatStore": "localpaged.chat.store",
    "load_prompt": "localpaged.chat.prompts",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'localpaged' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

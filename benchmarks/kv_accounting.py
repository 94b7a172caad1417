"""What llama.cpp allocates for the KV of many sessions: the accounting peers.py and shared_prompt.py compare against.

llama-server ``-np N`` splits its context (``-c``) evenly between N slots and reserves all of it, so
for every slot to hold a whole session each slot gets the longest session's context: N such slots.
With ``-kvu`` the slots share one buffer, which needs the sessions' total. llama.cpp rounds a
context up to a multiple of 256 cells (one cell: one token's K and V in every layer).
"""

from __future__ import annotations

LLAMA_CELL_PAD = 256


def llama_cells(tokens: int) -> int:
    """``tokens`` rounded up as llama.cpp rounds a context."""
    return -(-tokens // LLAMA_CELL_PAD) * LLAMA_CELL_PAD


def llama_np_tokens(sessions: int, context: int) -> int:
    """Cells ``llama-server -np sessions`` reserves for each slot to hold a ``context``-token session."""
    return sessions * llama_cells(context)


def llama_kvu_tokens(total: int) -> int:
    """Cells ``llama-server -kvu`` reserves for sessions of ``total`` tokens together."""
    return llama_cells(total)


def f16_kv_bytes_per_token(hf_config) -> int:
    """KV bytes per token of a model at llama.cpp's default cache type (f16 K and V in every layer).

    What llama.cpp logs as its cache size per cell, computed from the model's shape where its
    binaries are not built (peers.llama_kv_bytes_per_token reads the log).
    """
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * 2 * 2

"""A benchmark's disk KV tier in a folder of its run's own, deleted at the end.

In the user's cache (``~/.cache/localpaged/kv``) a prompt that an earlier run, or the user's own chats,
computed would be read back instead of computed, so a "cold" figure would not be cold; and every run
would leave its blocks behind there. Engine core processes, servers and app processes the benchmark
starts inherit the variable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VARIABLE = "LOCALPAGED_KV_CACHE"


@contextmanager
def own_kv_folder(prefix: str = "localpaged-bench-kv-") -> Iterator[Path]:
    """Point LOCALPAGED_KV_CACHE at a new temporary folder for the block; restore the variable after."""
    before = os.environ.get(VARIABLE)
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        os.environ[VARIABLE] = folder
        try:
            yield Path(folder)
        finally:
            if before is None:
                del os.environ[VARIABLE]
            else:
                os.environ[VARIABLE] = before

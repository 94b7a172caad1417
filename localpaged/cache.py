"""Where localpaged keeps what it makes once and reuses: converted models, compiled CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """$LOCALPAGED_CACHE, else the platform's user cache folder."""
    return Path(os.environ.get("LOCALPAGED_CACHE") or platformdirs.user_cache_dir("localpaged"))

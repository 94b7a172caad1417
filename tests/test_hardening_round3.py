"""Hardening, round 3: files that are not ours are never changed, and text never drives the terminal."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from localpaged.chat.store import ChatStore
from localpaged.errors import StoreError
from localpaged.locations import make_private


def test_a_symlinked_database_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "someone-elses-file"
    target.write_text("root:x:0:0:root:/root:/bin/bash\n")
    target.chmod(0o644)
    link = tmp_path / "chats.db"
    link.symlink_to(target)
    with pytest.raises(StoreError, match=f"the chat database {link} is a symbolic link"):
        ChatStore(link)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert target.read_text() == "root:x:0:0:root:/root:/bin/bash\n"


def test_modes_are_never_set_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("x")
    target.chmod(0o644)
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o755)
    for name, points_at in (("file-link", target), ("folder-link", folder)):
        (tmp_path / name).symlink_to(points_at)
        make_private(tmp_path / name, 0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and stat.S_IMODE(folder.stat().st_mode) == 0o755
    make_private(target)  # the file itself, ours: made private
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o600

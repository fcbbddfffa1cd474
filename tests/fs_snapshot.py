"""A folder's full content as a dict, to check that a refused or interrupted command changed nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`: files by sha256 of their bytes, folders as 'dir' (hidden ones too)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out

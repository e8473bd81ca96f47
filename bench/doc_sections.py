"""Generated result files (docs/results/): each benchmark owns the text between its two markers.

Re-running a benchmark with ``--doc`` replaces its own section and keeps the
rest of the file; a section not yet in the file is appended.
"""
from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, begin: str, end: str, body: str, empty: str = "") -> None:
    """Put ``body`` between ``begin`` and ``end`` in ``path`` (``empty``: the file's text if it does not exist)."""
    section = f"{begin}\n{body}\n{end}\n"
    text = path.read_text() if path.exists() else empty
    if begin in text and end in text:
        before, _, rest = text.partition(begin)
        _, _, after = rest.partition(end + "\n")
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

"""Writing one benchmark's section into docs/benchmarks.md without touching the others.

Each benchmark owns the text between its markers `<!-- NAME:begin -->` and `<!-- NAME:end -->`;
a section that is not there yet is appended.
"""

from __future__ import annotations

import pathlib


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: str, name: str, section: str) -> None:
    """Replace (or append) the section `name`; `section` includes its own markers."""
    begin, end = markers(name)
    p = pathlib.Path(path)
    text = p.read_text() if p.exists() else "# Benchmarks\n"
    if begin in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    p.write_text(text)

"""Writing one benchmark's section without touching the others.

docs/benchmarks.md is the page of current figures. Each benchmark's full section lives in a file
of its own beside it, docs/benchmarks/NAME.md, and the page links every such file from its table
of sections. A script run with `--write docs/benchmarks.md` calls `write_section(page, NAME,
section)`, which

- replaces the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in the section file,
  or creates the file with the section alone: notes written around the markers stay;
- adds the section's row to the page's table (between `<!-- sections:begin -->` and
  `<!-- sections:end -->`) when the page has none yet, or updates it: the title (the first `## `
  heading of the file) and the script that wrote it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import platform as stdlib_platform
import re
import sys

TABLE = "sections"


def cpu_model() -> str:
    """The host's CPU as /proc/cpuinfo names it (a figure is only read beside the CPU it ran on)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return stdlib_platform.processor() or "unknown"


# What provides each module a benchmark script may need beyond the package's own dependencies.
INSTALL = {"matplotlib": "the `bench` extra: `make bench` installs it, or {python} -m pip install -e '.[bench]'"}


def require(script: str, modules: list[str]) -> None:
    """Exit (status 1) before any run when one of `modules` cannot be imported, saying how to
    install it: a benchmark that needs a module only for its last step (the plots) must not find
    out after its runs."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        how = "; ".join(
            f"{m}: " + INSTALL.get(m, "{python} -m pip install " + m).format(python=sys.executable) for m in missing
        )
        raise SystemExit(f"{script}: missing {', '.join(missing)} (needed before any run starts). Install: {how}")


TABLE_HEAD = "| section | written by |\n|---|---|\n"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def section_path(page: str | pathlib.Path, name: str) -> pathlib.Path:
    """Where the section `name` of `page` lives: docs/benchmarks.md -> docs/benchmarks/NAME.md."""
    page = pathlib.Path(page)
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
        raise ValueError(f"section name {name!r}: allowed are lowercase letters, digits, '-' and '_'")
    return page.parent / page.stem / f"{name}.md"


def replace_between(text: str, name: str, body: str) -> str:
    """`text` with the part from NAME's begin marker to its end marker replaced by `body` (which
    carries its own markers); `body` appended when the markers are not there."""
    begin, end = markers(name)
    if begin in text:
        return text[: text.index(begin)] + body + text[text.index(end) + len(end) :]
    return (text.rstrip() + "\n\n" if text.strip() else "") + body + "\n"


def write_section(page: str, name: str, section: str) -> None:
    """Replace (or create) the section `name`, which includes its own markers, and list it on `page`."""
    path = section_path(page, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = replace_between(path.read_text() if path.exists() else "", name, section)
    path.write_text(text)
    script = pathlib.Path(sys._getframe(1).f_code.co_filename).name  # the bench script calling us
    _list_on_page(pathlib.Path(page), name, _title(text, name), script)


def _title(text: str, name: str) -> str:
    return next((line[3:].strip() for line in text.splitlines() if line.startswith("## ")), name)


def _list_on_page(page: pathlib.Path, name: str, title: str, script: str) -> None:
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    begin, end = markers(TABLE)
    link = f"{page.stem}/{name}.md"
    row = f"| [{title}]({link}) | `bench/{script}` |"
    rows = []
    if begin in text:
        rows = [r for r in text[text.index(begin) + len(begin) : text.index(end)].splitlines() if r.startswith("| [")]
    found = [i for i, r in enumerate(rows) if f"]({link})" in r]
    if found:
        rows[found[0]] = row
    else:
        rows.append(row)
    table = begin + "\n" + TABLE_HEAD + "\n".join(rows) + "\n" + end
    page.write_text(replace_between(text, TABLE, table))

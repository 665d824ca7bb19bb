"""The project's docs stand on their own: nothing in the repository cites design notes kept
outside it, and every doc link inside docs/ and README.md resolves."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\b(DESIGN|STYLE)\.md\b")


def tracked_text_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    paths = [ROOT / line for line in out.splitlines()]
    return [p for p in paths if p.suffix in {".py", ".md", ".toml", ".yaml", ".yml", ".c", ".sh", ""} and p.is_file()]


def test_nothing_cites_notes_outside_the_repository():
    citing = [
        str(p.relative_to(ROOT))
        for p in tracked_text_files()
        if p.name != "test_docs.py" and OUTSIDE.search(p.read_text(errors="replace"))
    ]
    assert citing == []


def test_relative_doc_links_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []

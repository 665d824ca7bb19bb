"""bench/report.py and the benchmarks page it keeps: docs/benchmarks.md holds the current figures and
a table linking each benchmark's section, which lives in a file of its own under docs/benchmarks/."""

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402


def section(name: str, title: str, body: str) -> str:
    begin, end = report.markers(name)
    return f"{begin}\n## {title}\n\n{body}\n{end}"


def table_rows(page: str) -> list[str]:
    begin, end = report.markers(report.TABLE)
    return [r for r in page[page.index(begin) : page.index(end)].splitlines() if r.startswith("| [")]


def test_a_section_gets_its_own_file_and_one_row_on_the_page(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nintro\n\n<!-- sections:begin -->\n<!-- sections:end -->\n\n## Current figures\n")
    report.write_section(str(page), "alpha", section("alpha", "Alpha run", "| a | 1 |"))
    report.write_section(str(page), "beta", section("beta", "Beta run", "| b | 2 |"))
    assert (tmp_path / "benchmarks" / "alpha.md").read_text() == section("alpha", "Alpha run", "| a | 1 |") + "\n"
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n") and text.rstrip().endswith("## Current figures")
    assert table_rows(text) == [
        "| [Alpha run](benchmarks/alpha.md) | `bench/test_bench_report.py` |",
        "| [Beta run](benchmarks/beta.md) | `bench/test_bench_report.py` |",
    ]


def test_rewriting_keeps_the_notes_around_the_markers_and_the_row_order(tmp_path):
    page = tmp_path / "benchmarks.md"
    report.write_section(str(page), "alpha", section("alpha", "Alpha", "first"))
    report.write_section(str(page), "beta", section("beta", "Beta", "first"))
    path = tmp_path / "benchmarks" / "alpha.md"
    path.write_text("notes before\n\n" + path.read_text() + "\nWhat the run shows.\n")
    report.write_section(str(page), "alpha", section("alpha", "Alpha, renamed", "second"))
    text = path.read_text()
    assert text.startswith("notes before\n\n<!-- alpha:begin -->") and text.endswith("What the run shows.\n")
    assert "second" in text and "first" not in text and text.count("<!-- alpha:begin -->") == 1
    assert [re.sub(r" \|.*", "", r) for r in table_rows(page.read_text())] == [
        "| [Alpha, renamed](benchmarks/alpha.md)",
        "| [Beta](benchmarks/beta.md)",
    ]


def test_a_section_name_must_be_a_plain_file_name(tmp_path):
    with pytest.raises(ValueError, match="allowed are lowercase letters"):
        report.section_path(tmp_path / "benchmarks.md", "../escape")


def test_the_page_links_every_section_file_and_each_holds_its_markers():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    linked = [re.search(r"\]\(benchmarks/([^)]+)\.md\)", r).group(1) for r in table_rows(page)]
    assert len(linked) == len(set(linked)) >= 15
    for name in linked:
        begin, end = report.markers(name)
        text = (ROOT / "docs" / "benchmarks" / f"{name}.md").read_text()
        assert text.count(begin) == text.count(end) == 1, name
        assert begin not in page, f"{name}'s section is still on the page itself"
    with_markers = {p.stem for p in (ROOT / "docs" / "benchmarks").glob("*.md") if ":begin -->" in p.read_text()}
    assert with_markers == set(linked)
    for script in re.findall(r"`bench/([a-z_]+\.py)`", "\n".join(table_rows(page))):
        assert (ROOT / "bench" / script).is_file(), script


def test_require_names_what_is_missing_and_how_to_install_it_before_any_run():
    report.require("bench/x.py", ["json", "pathlib"])  # present: returns
    with pytest.raises(SystemExit) as exc:
        report.require("bench/x.py", ["json", "no_such_module_h7", "matplotlib_missing_probe"])
    message = str(exc.value)
    assert message.startswith("bench/x.py: missing no_such_module_h7, matplotlib_missing_probe")
    assert f"{sys.executable} -m pip install no_such_module_h7" in message


def test_require_points_matplotlib_at_the_bench_extra(monkeypatch):
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        SystemExit,
        match=r"matplotlib: the `bench` extra: `make bench` installs it, or .* -m pip install -e '\.\[bench\]'",
    ):
        report.require("bench/serving_suite.py", ["matplotlib"])

"""bench/results_md.py: one bench's section of RESULTS.md is replaced, every other byte is kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bench_modules import load_bench

ROOT = Path(__file__).resolve().parents[1]


rm = load_bench("results_md")
DOC = ("# Benchmark results\n\n## A (issue 1)\n\nalpha\n\n### A.1\n\nsub\n\n"
       "## B (issue 2)\n\nold b\n\n### B.1\n\nold b1\n\n### B.2\n\nb2\n\n## C\n\ngamma\n")


def test_write_section_replaces_only_its_section(tmp_path: Path) -> None:
    path = tmp_path / "R.md"
    path.write_text(DOC)
    rm.write_section("B (issue 2)", "new b\n", path)
    assert path.read_text() == DOC.replace("old b\n\n### B.1\n\nold b1\n\n### B.2\n\nb2\n\n", "new b\n\n")
    rm.write_section("## B (issue 2)", "new b", path)  # the heading may be given with its '## '
    once = path.read_text()
    assert once.count("## B (issue 2)") == 1 and "## A (issue 1)\n\nalpha\n\n### A.1\n\nsub\n\n" in once
    rm.write_section("D", "delta", path)  # missing: appended at the end
    assert path.read_text() == once + "\n## D\n\ndelta\n"
    # a heading that only starts like another one is a different section
    rm.write_section("A", "short", path)
    assert "## A (issue 1)\n\nalpha" in path.read_text() and path.read_text().endswith("## A\n\nshort\n")


def test_write_section_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "new.md"
    rm.write_section("X", "x", path)
    assert path.read_text() == "# Benchmark results\n\n## X\n\nx\n"


def test_write_subsection_keeps_siblings_and_refreshes_the_intro(tmp_path: Path) -> None:
    path = tmp_path / "R.md"
    path.write_text(DOC)
    rm.write_subsection("B (issue 2)", "B.1", "new b1", path, intro="Machine: new")
    assert path.read_text() == DOC.replace("old b\n\n### B.1\n\nold b1", "Machine: new\n\n### B.1\n\nnew b1")
    rm.write_subsection("B (issue 2)", "B.3", "b3", path)  # appended at the end of its section
    assert "### B.2\n\nb2\n\n### B.3\n\nb3\n\n## C\n\ngamma\n" in path.read_text()
    rm.write_subsection("E", "E.1", "e1", path, intro="hello")  # section created
    assert path.read_text().endswith("## C\n\ngamma\n\n## E\n\nhello\n\n### E.1\n\ne1\n")


def _sections(text: str) -> list[tuple[str, str]]:
    """``(heading, body stripped)`` of every level-2 section, in order."""
    out = []
    for h in [line for line in text.splitlines() if line.startswith("## ")]:
        start = text.index(h + "\n") + len(h) + 1
        nxt = text.find("\n## ", start)
        out.append((h, text[start: nxt + 1 if nxt >= 0 else len(text)].strip()))
    return out


def test_rewriting_every_section_of_the_real_file_with_its_own_text_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    shutil.copy(ROOT / "bench" / "RESULTS.md", path)
    text = path.read_text()
    sections = _sections(text)
    assert sections
    for h, body in sections:
        rm.write_section(h, body, path)
    once = path.read_text()
    # the same sections with the same text (only blank lines between sections may be normalised)
    assert _sections(once) == sections and once.split("\n## ")[0] == text.split("\n## ")[0]
    for h, body in sections:
        rm.write_section(h, body, path)
    assert path.read_text() == once


def test_rejects_a_heading_of_the_wrong_level(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="level-2"):
        rm.write_section("### X", "x", tmp_path / "R.md")
    with pytest.raises(ValueError, match="one non-empty line"):
        rm.write_section("a\nb", "x", tmp_path / "R.md")

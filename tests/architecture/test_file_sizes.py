"""No product file grows past :data:`MAX_LINES` lines (issue 18): a module that long does
several jobs and is split into single-purpose modules instead."""

from __future__ import annotations

from pathlib import Path

from tests.architecture.import_graph import SOURCES

MAX_LINES = 700


def product_files() -> list[Path]:
    """Every Python source file of the package: ``gradshard/``, ``passes/`` and ``kernels/``."""
    files: list[Path] = []
    for prefix, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).parts
            if prefix == "gradshard" and parts[0] in ("passes", "kernels"):
                continue  # installed copies of the top-level folders, counted there
            files.append(path)
    return files


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_product_file_is_longer_than_the_limit() -> None:
    root = SOURCES["gradshard"].parent
    long = sorted((line_count(p), str(p.relative_to(root))) for p in product_files() if line_count(p) > MAX_LINES)
    listing = "\n".join(f"  {path}: {n} lines" for n, path in reversed(long))
    assert not long, f"product files over {MAX_LINES} lines (split them into single-purpose modules):\n{listing}"


def test_the_check_sees_every_source_folder() -> None:
    """The walk covers all three folders and counts lines as an editor does."""
    files = product_files()
    root = SOURCES["gradshard"].parent
    tops = {p.relative_to(root).parts[0] for p in files}
    assert tops == {"gradshard", "passes", "kernels"}
    roll = root / "passes" / "roll_loops.py"
    assert roll in files and line_count(roll) == roll.read_text().count("\n")

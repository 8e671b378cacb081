"""Write one benchmark's section of ``RESULTS.md``, leaving every other section alone.

Where results go: in a source checkout, ``bench/RESULTS.md`` (and ``bench/out/`` for raw
JSON); from an installed gradshard (this folder is the package ``gradshard.bench``), the
current folder: ``./RESULTS.md`` and ``./out/``.

A section is a level-2 heading (``## Title``) and everything after it up to the next
level-2 heading (or the end of the file); subsections are level-3 headings (``### Sub``)
inside it. Every bench writes through these two functions::

    write_section("Adjoint sharding (issue 3)", body)                 # '## ...' optional
    write_subsection("SeCO / SpaCO (issue 4)", "Memory vs. length", body, intro="Machine: ...")
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CHECKOUT", "OUTPUT_DIR", "RESULTS", "write_section", "write_subsection"]

_HERE = Path(__file__).resolve().parent
#: The source checkout's root when these scripts run from one (``<root>/bench``), else None.
CHECKOUT: Path | None = (_HERE.parent if _HERE.name == "bench" and (_HERE.parent / "pyproject.toml").is_file()
                         and (_HERE.parent / "gradshard").is_dir() else None)
#: Folder for results: ``bench/`` in a checkout, the current folder for an installed package.
OUTPUT_DIR = _HERE if CHECKOUT is not None else Path.cwd()
RESULTS = OUTPUT_DIR / "RESULTS.md"
_EMPTY = "# Benchmark results\n"


def _heading(title: str, level: int) -> str:
    """``title`` as a heading line of ``level`` (a title that already is one is kept)."""
    marks = "#" * level + " "
    title = title.strip()
    if title.startswith("#"):
        if not title.startswith(marks) or title[level] != " ":
            raise ValueError(f"results_md: {title!r} is not a level-{level} heading ('{marks}Title' or 'Title')")
        title = title[len(marks):].strip()
    if not title or "\n" in title:
        raise ValueError(f"results_md: a heading must be one non-empty line, got {title!r}")
    return marks + title


def _span(text: str, heading: str, level: int, start: int = 0, end: int | None = None) -> tuple[int, int] | None:
    """``(start, end)`` of the block headed by the exact line ``heading`` in ``text[start:end]``:
    up to the next heading of ``level`` or higher (fewer '#'), or ``end``."""
    end = len(text) if end is None else end
    found = re.compile(rf"^{re.escape(heading)}[ \t]*$", re.M).search(text, start, end)
    if found is None:
        return None
    nxt = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, found.end(), end)
    return found.start(), (nxt.start() if nxt else end)


def _replace_or_append(text: str, heading: str, block: str, level: int, start: int = 0,
                       end: int | None = None) -> str:
    end = len(text) if end is None else end
    span = _span(text, heading, level, start, end)
    if span is not None:
        return text[: span[0]] + block + text[span[1]:]
    head = text[:end].rstrip("\n")
    return head + "\n\n" + block + text[end:].lstrip("\n")


def write_section(title: str, body: str, path: Path | str = RESULTS) -> None:
    """Replace the ``## title`` section of ``path`` by ``body`` (append it if missing).

    ``title`` may be given with or without its leading ``'## '``; ``body`` is the text under
    the heading (without the heading). Other sections are kept byte for byte; the file is
    created (with a ``# Benchmark results`` title) if it does not exist.
    """
    path = Path(path)
    heading = _heading(title, 2)
    old = path.read_text() if path.exists() else _EMPTY
    block = f"{heading}\n\n{body.strip()}\n\n"
    new = _replace_or_append(old, heading, block, 2)
    path.write_text(new.rstrip("\n") + "\n")


def write_subsection(title: str, subtitle: str, body: str, path: Path | str = RESULTS, *,
                     intro: str | None = None) -> None:
    """Replace the ``### subtitle`` subsection of the ``## title`` section (append it if missing).

    The section is created if missing. ``intro``, if given, replaces the section's text
    between its heading and its first subsection (e.g. a 'Machine: ...' line); other
    subsections and other sections are kept byte for byte.
    """
    path = Path(path)
    heading, sub = _heading(title, 2), _heading(subtitle, 3)
    text = path.read_text() if path.exists() else _EMPTY
    if _span(text, heading, 2) is None:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n"
    start, end = _span(text, heading, 2)  # type: ignore[misc]
    if intro is not None:
        first = re.compile(r"^### ", re.M).search(text, start + len(heading), end)
        cut = first.start() if first else end
        text = text[: start + len(heading)] + f"\n\n{intro.strip()}\n\n" + text[cut:]
        start, end = _span(text, heading, 2)  # type: ignore[misc]
    block = f"{sub}\n\n{body.strip()}\n\n"
    new = _replace_or_append(text, sub, block, 3, start, end)
    path.write_text(new.rstrip("\n") + "\n")

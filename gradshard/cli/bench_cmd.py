"""``gradshard bench``: list and run the benchmark scripts that ship as ``gradshard.bench``.

The scripts are the source checkout's ``bench/bench_NAME.py``, installed as the package
``gradshard.bench``; each runs in its own Python process. Where results go is decided by the
scripts' shared writer (``bench/results_md.py``): ``bench/RESULTS.md`` in a source checkout,
``./RESULTS.md`` (and ``./out/``) in the current folder for an installed gradshard.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gradshard.errors import GradshardError

__all__ = ["Benchmark", "bench_dir", "find_benchmarks", "results_path", "run_bench"]


@dataclass(frozen=True)
class Benchmark:
    """One ``bench_NAME.py`` script: its name, file, first docstring line, and what it needs."""

    name: str
    path: Path
    summary: str
    needs: str | None  # why it cannot run here (a source checkout only), or None


def bench_dir() -> Path:
    """The folder of the benchmark scripts: the installed ``gradshard.bench``, else the checkout's ``bench/``."""
    spec = importlib.util.find_spec("gradshard.bench")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    import gradshard

    checkout = Path(gradshard.__file__).resolve().parents[1] / "bench"
    if (checkout / "results_md.py").is_file():
        return checkout
    raise GradshardError(
        "no benchmark scripts: the package gradshard.bench is not installed and there is no source "
        f"checkout's bench/ beside {Path(gradshard.__file__).parent}; reinstall gradshard (pip install .)"
    )


def _test_suite_imports(tree: ast.Module) -> list[str]:
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    return sorted({m for m in names if m == "tests" or m.startswith("tests.")})


#: Scripts run as ``gradshard bench NAME`` that are not ``bench_NAME.py``: they draw what the benches
#: wrote (``plot``: ``bench_compose``'s rows), so they come after every bench, and ``all`` runs them last.
AFTER_BENCHES = {"plot": "plot_steps.py"}


def _benchmark(name: str, path: Path, has_tests: bool) -> Benchmark:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    summary = (ast.get_docstring(tree) or "").strip().splitlines()
    uses = _test_suite_imports(tree)
    needs = None
    if uses and not has_tests:
        needs = (f"imports {', '.join(uses)} from the test suite, which ships only in a source checkout: "
                 f"run `gradshard bench {name}` in a clone of the repository")
    return Benchmark(name, path, summary[0] if summary else "", needs)


def find_benchmarks(folder: Path | None = None) -> dict[str, Benchmark]:
    """Every ``bench_NAME.py`` in ``folder`` (default :func:`bench_dir`), by ``NAME``, then the
    scripts of :data:`AFTER_BENCHES` that are there."""
    folder = bench_dir() if folder is None else folder
    has_tests = (folder.parent / "tests").is_dir() and folder.name == "bench"
    found: dict[str, Benchmark] = {}
    for path in sorted(folder.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        found[name] = _benchmark(name, path, has_tests)
    for name, file in AFTER_BENCHES.items():
        if (folder / file).is_file():
            found[name] = _benchmark(name, folder / file, has_tests)
    return found


def results_path(folder: Path | None = None) -> Path:
    """Where the scripts write ``RESULTS.md`` when started from the current folder."""
    folder = bench_dir() if folder is None else folder
    spec = importlib.util.spec_from_file_location("_gradshard_bench_results_md", folder / "results_md.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.RESULTS)


def _list(benches: dict[str, Benchmark], console: Console, results: Path) -> int:
    t = Table(title="gradshard benchmarks")
    for c in ("name", "what it measures", "note"):
        t.add_column(c, overflow="fold")
    for b in benches.values():
        t.add_row(b.name, b.summary, "[yellow]needs a source checkout[/]" if b.needs else "")
    console.print(t)
    console.print(f"run one with `gradshard bench NAME [ARGS]` (e.g. `gradshard bench seco --quick`); "
                  f"`gradshard bench NAME --help` lists its options.\nscripts: {bench_dir()}\n"
                  f"results: {results}")
    return 0


def run_bench(args: argparse.Namespace, console: Console) -> int:
    """``gradshard bench list | all | NAME [ARGS...]``."""
    benches = find_benchmarks()
    results = results_path()
    if args.name == "list":
        return _list(benches, console, results)
    if args.name == "all":
        chosen = list(benches.values())
    else:
        name = args.name.removeprefix("bench_").removesuffix(".py")
        if name not in benches:
            raise GradshardError(f"no benchmark {args.name!r}; available: {', '.join(benches)} "
                                 "(`gradshard bench list` describes them)")
        chosen = [benches[name]]
        if chosen[0].needs:
            raise GradshardError(f"benchmark {name!r} {chosen[0].needs}")
    for bench in chosen:
        if bench.needs:
            console.print(f"[yellow]skipping {bench.name}[/]: {bench.needs}")
            continue
        console.rule(f"bench {bench.name}")
        console.print(f"[dim]{sys.executable} {bench.path} {' '.join(args.args)}; results: {results}[/]")
        rc = subprocess.call([sys.executable, str(bench.path), *args.args])
        if rc != 0:
            return rc
    return 0

"""Build gradshard's import graph from the source (every import counted).

Counted: ``import x`` / ``from x import y`` anywhere in a module (module level, inside
functions, under ``TYPE_CHECKING``), relative imports, module names handed to
``importlib.import_module`` / ``__import__`` as string constants or f-strings with a constant
prefix (the prefix's module is counted), and string constants that name a gradshard module
or ``module:function`` (tables that load code by name, such as capture's substitutions).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# The wheel installs the repository's top-level passes/ and kernels/ as gradshard.passes and
# gradshard.kernels (pyproject's package-dir); the graph uses the installed names.
SOURCES = {"gradshard": ROOT / "gradshard", "gradshard.passes": ROOT / "passes",
           "gradshard.kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for prefix, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if prefix == "gradshard" and parts and parts[0] in ("passes", "kernels"):
                continue
            out[name] = path
    return out


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module that ``name`` names (``a.b.c`` -> ``a.b`` if c is an attr)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


_NAMED = re.compile(r"^(gradshard(?:\.\w+)+)(?::\w+)?$")


def _imported_names(tree: ast.AST, module: str, is_pkg: bool) -> list[str]:
    names: list[str] = []
    pkg = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            names.append(root)
            names += [f"{root}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
                elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                    names.append(str(arg.values[0].value).rstrip("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _NAMED.match(node.value)
            if m:
                names.append(m.group(1))
    return names


def import_graph() -> nx.DiGraph:
    files = module_files()
    mods = set(files)
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for name in _imported_names(tree, mod, path.name == "__init__.py"):
            target = _resolve(name, mods)
            if target and target != mod and not mod.startswith(target + "."):
                g.add_edge(mod, target)
    return g


def room_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def room_graph(g: nx.DiGraph) -> nx.DiGraph:
    rg = nx.DiGraph()
    for a, b in g.edges:
        ra, rb = room_of(a), room_of(b)
        rg.add_node(ra), rg.add_node(rb)
        if ra != rb:
            rg.add_edge(ra, rb, via=rg.get_edge_data(ra, rb, {}).get("via", []) + [(a, b)])
    return rg

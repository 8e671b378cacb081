"""Resolve CLI targets to factories and parse ``key=value`` plan options.

A target names a *factory*: a function returning ``(model_or_fn, example_inputs)``. Three forms:

- ``NAME``: a factory that ships with gradshard (:data:`gradshard.examples.factories.FACTORIES`),
  e.g. ``ssm``, ``llama``; ``gradshard factories`` lists them;
- ``MODULE:FACTORY``: a function in an importable module, e.g.
  ``gradshard.examples.factories:ssm`` or ``mypackage.models:build``;
- ``FILE.py:FACTORY``: a function in a Python file, e.g. ``./my_model.py:build``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from gradshard.errors import GradshardError

__all__ = ["TARGET_HELP", "builtin_factories", "load_factory", "call_factory", "parse_options"]

TARGET_HELP = ("NAME (a factory shipped with gradshard, e.g. ssm; see `gradshard factories`), "
               "MODULE:FACTORY (e.g. gradshard.examples.factories:llama) or FILE.py:FACTORY, "
               "a function returning (model_or_fn, example_inputs)")


def builtin_factories() -> dict[str, Callable[..., Any]]:
    """The factories that ship with gradshard, by name."""
    from gradshard.examples.factories import FACTORIES

    return dict(FACTORIES)


def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``NAME``, ``MODULE:FACTORY`` or ``FILE.py:FACTORY`` to the factory function."""
    source, sep, name = spec.rpartition(":")
    if not sep:
        return _builtin(spec)
    if not source or not name:
        raise GradshardError(f"target {spec!r}: expected {TARGET_HELP}")
    if source.endswith(".py"):
        module, where = _module_from_file(source), source
    else:
        module, where = _module_from_name(source), f"module {source}"
    fn = getattr(module, name, None)
    if not callable(fn):
        available = [n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                     and v.__module__ == module.__name__]
        raise GradshardError(f"{where} has no factory {name!r}; functions defined there: "
                             f"{', '.join(available) or '(none)'}")
    return fn


def _builtin(name: str) -> Callable[..., Any]:
    factories = builtin_factories()
    if name in factories:
        return factories[name]
    hint = " (a file needs a factory: FILE.py:FACTORY)" if name.endswith(".py") else ""
    raise GradshardError(f"no built-in factory {name!r}{hint}; built-in factories: {', '.join(factories)}. "
                         f"A target is {TARGET_HELP}")


def _module_from_name(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name) and (len(name) == len(exc.name) or name[len(exc.name)] == "."):
            raise GradshardError(
                f"cannot import module {name!r} (no module {exc.name!r} on the Python path); "
                "for a file give its path ending in .py (FILE.py:FACTORY)"
            ) from exc
        raise


def _module_from_file(path_s: str) -> ModuleType:
    """Import a ``.py`` file as a module; a file inside a package can use package imports."""
    path = Path(path_s).resolve()
    if not path.is_file():
        raise GradshardError(f"no such file: {path_s} (resolved to {path})")
    top = path.parent
    while (top / "__init__.py").exists():  # the folder that holds the file's top-level package
        top = top.parent
    for p in dict.fromkeys((str(path.parent), str(top))):
        if p not in sys.path:
            sys.path.insert(0, p)
    mod_name = f"gs_factory_{path.stem}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    assert mod_spec and mod_spec.loader
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module  # as import does: dataclasses look their module up by name
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return sys.modules[mod_name]  # a module may replace itself there (the checkout's examples/ aliases)


def call_factory(fn: Callable[..., Any], **sizes: Any) -> tuple[Any, tuple[Any, ...]]:
    """Call a factory, passing only the size overrides (seq_len, batch) it accepts."""
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in sizes.items() if v is not None and (takes_kwargs or k in params)}
    out = fn(**kwargs)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple)):
        raise GradshardError(f"factory {fn.__name__} must return (model_or_fn, example_inputs_tuple)")
    return out


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["shard_size=128", "sampling=fixed"]`` -> ``{"shard_size": 128, "sampling": "fixed"}``."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, eq, raw = pair.partition("=")
        if not eq:
            raise GradshardError(f"option {pair!r} must be KEY=VALUE")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out

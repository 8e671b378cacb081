"""Load ``FILE.py:FACTORY`` targets and parse ``key=value`` plan options for the CLI."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from gradshard.errors import GradshardError

__all__ = ["load_factory", "call_factory", "parse_options", "repo_root"]


def repo_root() -> Path:
    """The source checkout holding ``gradshard/`` (and ``examples/``, ``bench/``)."""
    return Path(__file__).resolve().parents[2]


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``FILE.py:FACTORY`` and return the factory function."""
    path_s, sep, name = spec.rpartition(":")
    if not sep or not path_s.endswith(".py"):
        raise GradshardError(f"expected FILE.py:FACTORY, got {spec!r} (e.g. examples/factories.py:ssm_loop)")
    path = Path(path_s).resolve()
    if not path.exists():
        raise GradshardError(f"no such file: {path_s}")
    for p in (str(path.parent), str(repo_root())):
        if p not in sys.path:
            sys.path.insert(0, p)
    mod_spec = importlib.util.spec_from_file_location(f"gs_factory_{path.stem}", path)
    assert mod_spec and mod_spec.loader
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        available = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__]
        raise GradshardError(f"{path_s} has no factory {name!r}; functions there: {', '.join(available)}")
    return fn


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

"""gradshard: a compiler for the backward pass of long-context models.

>>> import gradshard as gs
>>> cm = gs.compile(model, plan="adjoint", shard_size=256)   # doctest: +SKIP
>>> cm(x).sum().backward()                                    # doctest: +SKIP
"""

from __future__ import annotations

from . import kernels, ops  # noqa: F401  (ops: the custom ops the kernels' front doors call)
from . import api as _api
from .api import CompiledModule, backend, plans
from .errors import CaptureError, GradshardError, UnsupportedGraphError
from .measure import measure  # after the submodule import: ``gs.measure`` is the function

__all__ = [
    "compile", "CompiledModule", "backend", "plans", "measure", "cost", "kernels",
    "GradshardError", "CaptureError", "UnsupportedGraphError",
]
__version__ = "0.1.0"


def compile(model_or_fn, plan: str = "none", **kwargs):  # noqa: A001 - the public name
    """Compile ``model_or_fn`` with ``plan``; ``plan="auto"`` lets the cost model choose.

    Every plan but ``"auto"``: :func:`gradshard.api.compile`. ``plan="auto"`` takes
    ``memory_budget`` (bytes or ``"8GB"``), optional ``device`` and ``allow_approximate``
    (:mod:`gradshard.autoplan`; it loads the cost model).
    """
    if plan == "auto":
        from .autoplan import compile_auto

        return compile_auto(model_or_fn, **kwargs)
    return _api.compile(model_or_fn, plan, **kwargs)


def __getattr__(name: str):
    # cost/distributed import heavier dependencies (sympy, torch.distributed); load them on
    # first use. ``gradshard.cost`` is a callable module, so ``import gradshard.cost`` is safe.
    if name == "cost":
        from .cost import cost

        globals()["cost"] = cost
        return cost
    if name == "distributed":
        import importlib

        return importlib.import_module("gradshard.distributed")
    raise AttributeError(f"module 'gradshard' has no attribute {name!r}")

"""gradshard: a compiler for the backward pass of long-context models.

>>> import gradshard as gs
>>> cm = gs.compile(model, plan="adjoint", shard_size=256)   # doctest: +SKIP
>>> cm(x).sum().backward()                                    # doctest: +SKIP
"""

from __future__ import annotations

from . import kernels
from .api import CompiledModule, backend, compile, plans
from .errors import CaptureError, GradshardError, UnsupportedGraphError

__all__ = [
    "compile", "CompiledModule", "backend", "plans", "measure", "cost", "kernels",
    "GradshardError", "CaptureError", "UnsupportedGraphError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # measure/cost/distributed import heavier dependencies; load them on first use.
    # Importing the submodule binds the *module* to this attribute; rebind the function.
    if name == "measure":
        from .measure import measure

        globals()["measure"] = measure
        return measure
    if name == "cost":
        from .cost import cost

        globals()["cost"] = cost
        return cost
    if name == "distributed":
        import importlib

        return importlib.import_module("gradshard.distributed")
    raise AttributeError(f"module 'gradshard' has no attribute {name!r}")

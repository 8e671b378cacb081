"""Plans: their options (frozen dataclasses) and their ordered pass pipelines.

Each plan names one explicit, ordered list of passes. Passes are referenced as
``"module:function"`` strings under ``gradshard.passes`` and imported when the plan is
used, so a plan's passes can live in their own small files. Every ordering constraint is
commented next to the list.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import GradshardError

__all__ = ["PlanSpec", "PLANS", "plans", "get_plan", "register_plan"]


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class NoneOptions:
    """``plan="none"``: plain autograd through the same pipeline."""


@dataclass(frozen=True)
class AdjointOptions:
    shard_size: int = 256


@dataclass(frozen=True)
class TruncatedAdjointOptions:
    window: int
    shard_size: int = 256


@dataclass(frozen=True)
class SecoOptions:
    chunk_size: int = 512


@dataclass(frozen=True)
class SpacoOptions:
    chunk_size: int = 512
    budget: int = 8
    sampling: str = "bernoulli"
    max_compensation: float | None = None
    generator: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class LaspOptions:
    group: Any = field(default=None, compare=False)
    chunk_size: int = 64
    reduce_grads: bool = True
    timeout_s: float | None = None  # per wait; None: GRADSHARD_COMM_TIMEOUT_S (default 60 s)


@dataclass(frozen=True)
class PartialUpdateOptions:
    num_slices: int = 4
    slice_index: int | None = None
    targets: tuple[str, ...] = ("mlp", "attention")

    def __post_init__(self) -> None:
        # targets="mlp" means ("mlp",), not the letters ('m', 'l', 'p')
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        elif isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class PlanSpec:
    """A plan: name, options class, ordered passes, and what its gradient is."""

    name: str
    options: type
    passes: tuple[str, ...]
    gradient: str
    doc: str
    needs_time_axis: bool = True

    def make_options(self, **kwargs: Any) -> Any:
        """Validate ``kwargs`` against the options dataclass with a helpful error."""
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            valid = ", ".join(fields) or "none"
            raise GradshardError(f"plan {self.name!r} has no option(s) {unknown}; its options are: {valid}")
        missing = [n for n, f in fields.items() if n not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise GradshardError(f"plan {self.name!r} requires option(s) {missing} (e.g. "
                                 f"gs.compile(model, plan={self.name!r}, {missing[0]}=...))")
        opts = self.options(**kwargs)
        _validate(self.name, opts)
        return opts

    def load_passes(self) -> list[Callable]:
        out = []
        # Lowering runs after every plan's own passes: it needs the final graph and region modules.
        for ref in (*self.passes, *_LOWER):
            mod, _, fn = ref.partition(":")
            try:
                out.append(getattr(importlib.import_module(f"gradshard.passes.{mod}"), fn))
            except (ImportError, AttributeError) as exc:
                raise GradshardError(f"plan {self.name!r}: pass {ref} is not available ({exc})") from exc
        return out


def _validate(name: str, opts: Any) -> None:
    """Check option values when ``gs.compile`` is called, not at the first call."""
    for f in ("shard_size", "chunk_size", "window", "budget", "num_slices"):
        v = getattr(opts, f, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise GradshardError(f"plan {name!r}: {f} must be a positive int, got {v!r}")
    if getattr(opts, "sampling", "bernoulli") not in ("bernoulli", "fixed"):
        raise GradshardError(f"plan {name!r}: sampling must be 'bernoulli' or 'fixed', got {opts.sampling!r}")
    cap = getattr(opts, "max_compensation", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise GradshardError(f"plan {name!r}: max_compensation must be a positive number or None, got {cap!r}")
    gen = getattr(opts, "generator", None)
    if gen is not None and not isinstance(gen, torch.Generator):
        raise GradshardError(f"plan {name!r}: generator must be a torch.Generator or None, got {type(gen).__name__}")
    index = getattr(opts, "slice_index", None)
    if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
        raise GradshardError(f"plan {name!r}: slice_index must be a non-negative int or None, got {index!r}")


# Detection runs first in every plan; it only needs the time-locality analysis, which
# `annotate_time_locality` computes once and caches in ctx.analyses["time"].
_DETECT = (
    "annotate_time:annotate_time_locality",
)

# Common tail of every pipeline (appended by PlanSpec.load_passes).
_LOWER = ("lower_kernels:lower_kernels",)

PLANS: dict[str, PlanSpec] = {}


def register_plan(spec: PlanSpec) -> PlanSpec:
    PLANS[spec.name] = spec
    return spec


register_plan(PlanSpec(
    name="none",
    options=NoneOptions,
    passes=(
        # Analysis only: plain autograd runs the captured graph unchanged; the findings
        # feed `cm.regions`, `gradshard show` and the cost model.
        *_DETECT,
        "detect_regions:detect_regions",
    ),
    gradient="exact (plain autograd)",
    doc="Plain autograd through the captured graph.",
    needs_time_axis=False,
))


def plans() -> list[str]:
    """Names of every registered plan."""
    _load_plugins()
    return sorted(PLANS)


def get_plan(name: str) -> PlanSpec:
    _load_plugins()
    if name not in PLANS:
        raise GradshardError(f"unknown plan {name!r}; available plans: {', '.join(sorted(PLANS))}")
    return PLANS[name]


_PLUGINS = ("plan_adjoint", "plan_chunked", "plan_lasp", "plan_partial")
_loaded = False


def _load_plugins() -> None:
    """Each plan family registers itself from ``gradshard.passes.plan_*`` (if present)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _PLUGINS:
        try:
            importlib.import_module(f"gradshard.passes.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"gradshard.passes.{mod}":
                raise

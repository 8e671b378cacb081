"""The plan registry: a plan is its frozen options dataclass plus one ordered pass list.

A plan family lives in one folder under ``gradshard/plans/`` holding its options, its
pipeline, the rewrite passes only it uses and the runtime modules those passes emit. It
registers itself by decorating its options class::

    @register_plan("seco", passes=SECO_PASSES, gradient="exact", doc="...")
    @dataclass(frozen=True)
    class SecoOptions:
        chunk_size: int = 512

Every pipeline gets :func:`~gradshard.passes.lower_kernels.lower_kernels` appended: lowering
needs the final graph and its region modules, so it runs last in every plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from gradshard.errors import GradshardError
from gradshard.passes.lower_kernels import lower_kernels
from gradshard.pipeline import GraphPass

__all__ = ["PlanSpec", "PLANS", "plans", "get_plan", "register_plan"]


@dataclass(frozen=True)
class PlanSpec:
    """A plan: name, options class, ordered passes, and what its gradient is."""

    name: str
    options: type
    passes: tuple[GraphPass, ...]
    gradient: str
    doc: str
    needs_time_axis: bool = True
    #: run by the compile driver before the passes, on every compile: the place for work that
    #: is not a graph rewrite (a plan's collective handshake); returns notes for ``explain()``
    prepare: Callable[[Any, Any], tuple[str, ...]] | None = None
    #: plans whose programs a specialiser re-serves at other lengths: a first call longer than
    #: twice this is compiled at this many steps first and served from there (``CompiledModule``)
    probe_length: int | None = None
    #: ``serve(compiled_module, args, kwargs) -> CompiledGraph | None``, registered on every
    #: module compiled with this plan (``CompiledModule.register_specializer``): serves a cache
    #: miss from a cached entry (e.g. at another length) or returns None to capture as usual
    serve: Callable[[Any, tuple, dict], Any] | None = None
    #: with a ``probe_length``: the last pass a probe compile runs (the plan's length-generic
    #: passes end there). The probe is then kept only for ``serve`` to plan the call's length
    #: from, not run; None: the probe is a full compile, cached like any other
    probe_until: str | None = None

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

    def pipeline(self) -> list[GraphPass]:
        """The passes to run, in order: the plan's own, then kernel lowering."""
        return [*self.passes, lower_kernels]


def _validate(name: str, opts: Any) -> None:
    """Check option values when ``gs.compile`` is called, not at the first call."""
    for f in ("shard_size", "chunk_size", "window", "budget", "num_slices"):
        v = getattr(opts, f, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise GradshardError(f"plan {name!r}: {f} must be a positive int, got {v!r}")
    for f in ("recompute_layer_inputs", "reuse_input_buffers"):
        v = getattr(opts, f, False)
        if not isinstance(v, bool):
            raise GradshardError(f"plan {name!r}: {f} must be True or False, got {v!r}")
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


PLANS: dict[str, PlanSpec] = {}


def register_plan(name: str, *, passes: Sequence[GraphPass], gradient: str, doc: str,
                  needs_time_axis: bool = True,
                  prepare: Callable[[Any, Any], tuple[str, ...]] | None = None,
                  probe_length: int | None = None,
                  serve: Callable[[Any, tuple, dict], Any] | None = None,
                  probe_until: str | None = None) -> Callable[[type], type]:
    """Class decorator: register the decorated frozen options dataclass as plan ``name``."""

    def deco(options: type) -> type:
        if not dataclasses.is_dataclass(options) or not options.__dataclass_params__.frozen:
            raise TypeError(f"plan {name!r}: options {options.__name__} must be a frozen dataclass")
        if name in PLANS:
            raise GradshardError(f"plan {name!r} is registered twice ({PLANS[name].options.__module__} "
                                 f"and {options.__module__})")
        if probe_until is not None and probe_until not in [p.name for p in passes]:
            raise GradshardError(f"plan {name!r}: probe_until={probe_until!r} names none of its passes")
        PLANS[name] = PlanSpec(name, options, tuple(passes), gradient, doc, needs_time_axis, prepare, probe_length,
                               serve, probe_until)
        return options

    return deco


def plans() -> list[str]:
    """Names of every registered plan."""
    return sorted(PLANS)


def get_plan(name: str) -> PlanSpec:
    if name not in PLANS:
        raise GradshardError(f"unknown plan {name!r}; available plans: {', '.join(sorted(PLANS))}")
    return PLANS[name]

"""``plan="auto"``: let the cost model choose the plan and its options under a memory budget.

::

    cm = gs.compile(model, plan="auto", memory_budget="8GB")   # bytes or a string
    cm(ids).sum().backward()                                   # chooses at the first call
    print(cm.explain())                                        # the candidates it priced

At the first call the cost model prices every candidate (:data:`CANDIDATES`: plain autograd,
``adjoint`` over shard sizes, ``seco`` over chunk sizes; with ``allow_approximate=True`` also
``truncated_adjoint`` and ``spaco``) at the call's batch and sequence length, and keeps the
one with the smallest predicted step time whose predicted peak fits the budget. A candidate
the compiler refuses for this model is listed with its reason. Time is a roofline estimate
on ``device`` (a profile name; default: the profile matching the CUDA device the inputs live
on, else ``h100`` for ranking only) and serves to rank candidates, not to predict seconds.
When nothing fits, the error gives the smallest predicted peak and, per plan, the longest
sequence that would fit. The choice is made once; later calls reuse it (the chosen plan's own
guards decide about capturing again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from gradshard.api import DEFAULT_CACHE_SIZE, CompiledGraph, CompiledModule
from gradshard.cost import cost, devices, format_bytes, parse_bytes
from gradshard.cost.inputs import find_input_axes
from gradshard.errors import GradshardError, first_line
from gradshard.plans import get_plan

__all__ = ["AutoCompiledModule", "Candidate", "Choice", "Pricing", "Priced", "CANDIDATES", "choose_plan",
           "price_candidates", "pick", "compile_auto"]


@dataclass(frozen=True)
class Candidate:
    """One (plan, options) pair to price; ``exact`` is whether its gradient is exact."""

    plan: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    exact: bool = True

    def label(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.plan}({opts})" if opts else self.plan


def _grid(seq_len: int) -> list[Candidate]:
    """The default candidates for a sequence of ``seq_len`` steps (sizes above T are dropped)."""
    sizes = sorted({s for s in (64, 256, 1024, 4096) if s < seq_len} or {max(1, seq_len)})
    out = [Candidate("none")]
    out += [Candidate("adjoint", {"shard_size": s}) for s in sizes]
    # at long T the kept layer inputs dominate the adjoint's memory: half of them, at the fastest shard size
    out.append(Candidate("adjoint", {"shard_size": sizes[-1], "recompute_layer_inputs": True}))
    out += [Candidate("seco", {"chunk_size": s}) for s in sizes]
    out += [Candidate("truncated_adjoint", {"window": s, "shard_size": s}, exact=False) for s in sizes]
    out += [Candidate("spaco", {"chunk_size": s, "budget": max(1, (seq_len // s) // 2)}, exact=False)
            for s in sizes if seq_len // s >= 2]
    return out


#: how the candidates are built from the sequence length (replace it to price other options)
CANDIDATES: Callable[[int], list[Candidate]] = _grid


@dataclass(frozen=True)
class Priced:
    """A candidate with its predicted peak and time (and cost report), or why it cannot run."""

    candidate: Candidate
    peak_bytes: float | None = None
    time_s: float | None = None
    report: Any = field(default=None, compare=False, repr=False)
    refused: str = ""

    def fits(self, budget: float) -> bool:
        return not self.refused and self.peak_bytes is not None and self.peak_bytes <= budget


@dataclass(frozen=True)
class Pricing:
    """Every candidate priced at one batch and sequence length (what :func:`pick` chooses from)."""

    seq_len: int
    batch: int
    device: str
    priced: tuple[Priced, ...]


@dataclass(frozen=True)
class Choice:
    """What :func:`pick` decided, and everything that was priced."""

    candidate: Candidate
    budget: float
    seq_len: int
    batch: int
    device: str
    priced: tuple[Priced, ...]

    def describe(self) -> str:
        lines = [f"plan='auto': chose {self.candidate.label()} for batch={self.batch}, T={self.seq_len} under "
                 f"{format_bytes(self.budget)} (time ranked by a roofline on {self.device}):"]
        for p in sorted(self.priced, key=lambda p: (bool(p.refused), p.time_s or 0.0)):
            mark = "->" if p.candidate == self.candidate else "  "
            if p.refused:
                lines.append(f"  {mark} {p.candidate.label():<44} refused: {p.refused}")
                continue
            fit = "fits" if p.fits(self.budget) else "over budget"
            lines.append(f"  {mark} {p.candidate.label():<44} peak {format_bytes(p.peak_bytes):>10}  "
                         f"time {p.time_s * 1e3:9.3f} ms  {fit}")
        return "\n".join(lines)


def _default_device(args: Sequence[Any]) -> str:
    for x in args:
        if isinstance(x, torch.Tensor) and x.is_cuda:
            name = torch.cuda.get_device_name(x.device).lower()
            for known in devices():
                if known in name.replace(" ", ""):
                    return known
    return "h100"


def price_candidates(target: nn.Module | Callable[..., Any], args: Sequence[Any], *, device: str | None = None,
                     allow_approximate: bool = False, candidates: Sequence[Candidate] | None = None,
                     time_axis: tuple[int, int] | None = None, frontend: str = "python",
                     progress: Callable[[str], None] | None = None) -> Pricing:
    """Predict each candidate's peak and step time for ``target(*args)`` with the cost model."""
    device = device or _default_device(args)
    say = progress or (lambda msg: None)
    axes = find_input_axes(target, tuple(args), time_axis=time_axis, frontend=frontend)
    pool = list(candidates) if candidates is not None else CANDIDATES(axes.seq_len)
    priced: list[Priced] = []
    for cand in pool:
        if not cand.exact and not allow_approximate:
            continue
        say(f"plan='auto': pricing {cand.label()}")
        try:
            # the steady step is what is compared (its peak and time); the first step's own probes
            # (a compile each) would price nothing the choice reads
            report = cost(target, cand.plan, example_inputs=tuple(args), device=device, time_axis=time_axis,
                          frontend=frontend, first_step=False, **cand.options)
        except GradshardError as exc:
            priced.append(Priced(cand, refused=first_line(exc)))
            continue
        vals = report.evaluate(axes.seq_len, axes.batch_size)
        priced.append(Priced(cand, float(vals["peak_bytes"]), float(vals["time_s"]), report))
    if not priced:
        raise GradshardError("plan='auto': no candidate to price: every candidate given has an approximate "
                             "gradient; pass allow_approximate=True to consider them")
    return Pricing(axes.seq_len, axes.batch_size, device, tuple(priced))


def pick(pricing: Pricing, memory_budget: float | str, *, allow_approximate: bool = False) -> Choice:
    """The fastest predicted candidate whose predicted peak fits ``memory_budget``."""
    budget = float(parse_bytes(memory_budget) if isinstance(memory_budget, str) else memory_budget)
    if not budget > 0:
        raise GradshardError(f"plan='auto': memory_budget must be positive, got {memory_budget!r}")
    priced, seq_len, batch = pricing.priced, pricing.seq_len, pricing.batch
    fitting = [p for p in priced if p.fits(budget)]
    if not fitting:
        ran = [p for p in priced if not p.refused]
        if not ran:
            raise GradshardError("plan='auto': the compiler refused every candidate for this model:\n" +
                                 "\n".join(f"  {p.candidate.label()}: {p.refused}" for p in priced))
        best = min(ran, key=lambda p: p.peak_bytes)
        longest = max(ran, key=lambda p: p.report.max_seq_len(budget, batch, quantity="peak_bytes"))
        fits_to = longest.report.max_seq_len(budget, batch, quantity="peak_bytes")
        raise GradshardError(
            f"plan='auto': no plan fits {format_bytes(budget)} at batch={batch}, T={seq_len}: the smallest "
            f"predicted peak is {format_bytes(best.peak_bytes)} ({best.candidate.label()}); under this budget "
            f"{longest.candidate.label()} fits up to T={fits_to:,}.\n"
            "  instead: raise memory_budget, shorten the sequence or the batch"
            + ("" if allow_approximate else ", or allow_approximate=True (truncated_adjoint, spaco)"))
    best = min(fitting, key=lambda p: (p.time_s, p.peak_bytes))
    return Choice(best.candidate, budget, seq_len, batch, pricing.device, priced)


def choose_plan(target: nn.Module | Callable[..., Any], args: Sequence[Any], *, memory_budget: float | str,
                allow_approximate: bool = False, **kwargs: Any) -> Choice:
    """Price the candidates for ``target(*args)`` and pick the fastest that fits the budget
    (:func:`price_candidates` then :func:`pick`; ``kwargs`` go to the former)."""
    if isinstance(memory_budget, str):
        parse_bytes(memory_budget)  # a malformed budget fails before anything is priced
    pricing = price_candidates(target, args, allow_approximate=allow_approximate, **kwargs)
    return pick(pricing, memory_budget, allow_approximate=allow_approximate)


class AutoCompiledModule(CompiledModule):
    """A compiled module whose plan the cost model chooses at the first call (see the module doc)."""

    def __init__(self, target: nn.Module | Callable[..., Any], *, memory_budget: float | str,
                 device: str | None = None, allow_approximate: bool = False,
                 candidates: Sequence[Candidate] | None = None, frontend: str = "python",
                 time_axis: tuple[int, int] | None = None, backend: str | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE, inductor: bool = False) -> None:
        super().__init__(target, "none", frontend=frontend, time_axis=time_axis, backend=backend,
                         cache_size=cache_size, inductor=inductor)
        if isinstance(memory_budget, str):
            parse_bytes(memory_budget)  # a malformed budget fails here, not at the first call
        if device is not None and device not in devices():
            raise GradshardError(f"plan='auto': unknown device {device!r}; known: {', '.join(devices())}")
        self.plan = "auto"
        self.memory_budget = memory_budget
        self.device = device
        self.allow_approximate = allow_approximate
        self.candidates = candidates
        self.choice: Choice | None = None

    def compile_at(self, args: tuple, kwargs: dict, **kw: Any) -> CompiledGraph:
        if self.choice is None:
            if kwargs:
                raise GradshardError("plan='auto' prices positional inputs only: call the model with "
                                     "positional tensors, or choose a plan yourself")
            self.choice = choose_plan(self.target, args, memory_budget=self.memory_budget, device=self.device,
                                      allow_approximate=self.allow_approximate, candidates=self.candidates,
                                      time_axis=self.time_axis, frontend=self.frontend)
            self.plan, self.options = self.choice.candidate.plan, dict(self.choice.candidate.options)
            get_plan(self.plan).make_options(**self.options)
        return super().compile_at(args, kwargs, **kw)

    def explain(self) -> str:
        text = super().explain()
        return text if self.choice is None else f"{self.choice.describe()}\n{text}"


def compile_auto(model_or_fn: nn.Module | Callable[..., Any], *, memory_budget: float | str | None = None,
                 **kwargs: Any) -> AutoCompiledModule:
    """``gs.compile(model, plan="auto", memory_budget=...)`` (see the module doc)."""
    if memory_budget is None:
        raise GradshardError("plan='auto' needs memory_budget= (bytes or a string such as '8GB'): the cost "
                             "model picks the fastest plan whose predicted peak fits it")
    unknown = sorted(set(kwargs) - {"device", "allow_approximate", "candidates", "frontend", "time_axis",
                                    "backend", "cache_size", "inductor"})
    if unknown:
        raise GradshardError(f"plan='auto' chooses the plan's options itself; it takes no {unknown} "
                             "(its own: memory_budget, device, allow_approximate, candidates)")
    return AutoCompiledModule(model_or_fn, memory_budget=memory_budget, **kwargs)

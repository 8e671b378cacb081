"""The first step: what a fresh compiled module's first call adds to a steady step.

The first call of ``gs.compile(model, plan)`` compiles before it steps: capture on fake
tensors, the plan's passes (time analysis, the chunk planner's dry run, the re-specialiser's
shape propagation, all on fake tensors; the adjoint self-check on *real* tensors), the cost
replays of the schedule (meta tensors: FLOPs, no bytes). ``gs.measure`` counts every real
storage dispatched on the device (a trace's fake tensors are no memory) and every FLOP, so
its first step is

    allocated(first) = allocated(steady) + compile_allocated
    flops(first)     = flops(steady)     + compile_flops
    peak(first)      = Max(compile_peak, compile_retained + peak(steady))

where ``compile_retained`` is what the compile leaves alive into the step (real tensors the
passes keep: self-check results, cached constants). The steady terms are the report's own; the
compile terms are fitted, like every other cost, to probes in ``B`` and ``T`` — each probe
measures its module's first step split at the end of the compile
(:class:`~gradshard.cost.probe.FirstStepSample`), and the probe decomposition above holds
exactly on every probe.

The compile changes form at a few lengths, so it is fitted piece by piece between them
(:func:`compile_regimes`): a plan with a ``probe_length`` compiles a call longer than twice
the probe at the probe and serves it re-specialised (its compile is then the probe's
compile plus the serving, linear in ``T``); SeCO/SpaCO's chunk planner dry-runs at most six
chunks (``PlanRule.compile_breaks``). Lengths no step probe covers are probed by compiling
alone (:func:`~gradshard.cost.probe.run_compile_probe`): four lengths per piece, three of
them at every probe batch, the fourth a check.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import sympy

from ..plans import get_plan
from .fit import LINEAR, T, Fit, _rel_errors, _solve_exact, _to_expr, fit_polynomial

__all__ = ["COMPILE_QUANTITIES", "compile_regimes", "compile_probe_points", "fit_compile", "first_step_expressions"]

#: Fitted per regime from the probes' :class:`~gradshard.cost.probe.FirstStepSample`.
COMPILE_QUANTITIES = ("compile_peak_bytes", "compile_retained_bytes", "compile_allocated_bytes", "compile_flops")
_FIELDS = {"compile_peak_bytes": "compile_peak_bytes", "compile_retained_bytes": "compile_retained_bytes",
           "compile_allocated_bytes": "compile_allocated_bytes", "compile_flops": "compile_flops"}
#: Lengths fitted per regime (the last one checks the fit).
_LENGTHS_PER_REGIME = 4

Regime = tuple[int, float]  # (lo, hi]: lengths lo < T <= hi


def compile_regimes(plan: str, options: Any, rule: Any) -> list[Regime]:
    """The length intervals ``(lo, hi]`` within which the compile keeps one form."""
    breaks = set(int(b) for b in rule.compile_breaks(options))
    probe = get_plan(plan).probe_length
    if probe is not None:
        breaks.add(2 * probe)  # CompiledModule._compile_probe: longer first calls compile at the probe
    edges = [0, *sorted(b for b in breaks if b > 0)]
    return [(lo, hi) for lo, hi in zip(edges, [*edges[1:], math.inf])]


def _in(regime: Regime, t: int) -> bool:
    return regime[0] < t <= regime[1]


def _lengths(regime: Regime, have: Sequence[int], granule: int) -> list[int]:
    """Up to four lengths in ``regime``: those already probed, then multiples of ``granule``
    (below the probed ones in the first regime, spread above its start in the others)."""
    lo, hi = regime
    out = sorted({t for t in have if _in(regime, t)})
    if len(out) >= _LENGTHS_PER_REGIME:
        return out
    g = max(1, granule)
    if lo == 0:
        start = min(out) if out else g * _LENGTHS_PER_REGIME
        cands = [t for t in range(start - g, 0, -g) if t > 1]
    else:
        first = (lo // g + 1) * g
        step = g * max(1, math.ceil(lo / (2 * g)))  # leverage for extrapolating far beyond lo
        cands = [first + i * step for i in range(2 * _LENGTHS_PER_REGIME)]
    for t in cands:
        if len(out) >= _LENGTHS_PER_REGIME:
            break
        if _in(regime, t) and t not in out:
            out.append(t)
    return sorted(out)


def compile_probe_points(regimes: Sequence[Regime], have: Sequence[tuple[int, int]], granule: int,
                         batches: Sequence[int]) -> list[tuple[int, int]]:
    """``(batch, seq_len)`` points to compile alone: each regime gets three lengths at every
    batch in ``batches`` and a fourth at the first batch, minus the points ``have`` already."""
    done = set(have)
    out: list[tuple[int, int]] = []
    for regime in regimes:
        lengths = _lengths(regime, [t for _, t in have], granule)
        for i, t in enumerate(lengths):
            for b in (batches if i < _LENGTHS_PER_REGIME - 1 else batches[:1]):
                if (b, t) not in done:
                    done.add((b, t))
                    out.append((b, t))
    return out


def fit_compile(regimes: Sequence[Regime], samples: Sequence[Any], compiles: Sequence[Any]
                ) -> tuple[dict[str, sympy.Expr], dict[str, Fit]]:
    """The compile quantities as ``Piecewise`` polynomials in ``B``/``T`` over ``regimes``,
    fitted to the step probes' first steps and the compile-only probes."""
    points = [(s.batch, s.seq_len, s.first_step) for s in [*samples, *compiles] if s.first_step is not None]
    exprs: dict[str, sympy.Expr] = {}
    fits: dict[str, Fit] = {}
    for q in COMPILE_QUANTITIES:
        pieces: list[tuple[sympy.Expr, Any]] = []
        exact, err = True, 0.0
        for regime in regimes:
            pts = [(b, t) for b, t, _ in points if _in(regime, t)]
            if not pts:
                continue
            fit = _fit_smooth(pts, [getattr(f, _FIELDS[q]) for b, t, f in points if _in(regime, t)])
            exact, err = exact and fit.exact, max(err, fit.max_rel_error)
            pieces.append((fit.expr, T <= regime[1] if math.isfinite(regime[1]) else True))
        if not pieces:
            continue
        pieces[-1] = (pieces[-1][0], True)
        expr = pieces[0][0] if len(pieces) == 1 else sympy.Piecewise(*pieces)
        exprs[q] = expr
        fits[q] = Fit(expr, exact, err, f"polynomial per regime ({len(pieces)} piece(s))")
    return exprs, fits


def _fit_smooth(points: Sequence[tuple[int, int]], values: Sequence[int]) -> Fit:
    """:func:`~gradshard.cost.fit.fit_polynomial` when it reproduces every probe; otherwise the
    least-squares fit linear in ``T``. The compile's work wobbles a little from length to length
    (a length that shares a factor with a model size re-specialises differently, so the adjoint
    self-check takes another path), and a ``T**2`` term fitted to that wobble extrapolates far
    worse than the wobble itself; a genuine ``T**2`` (a ``(T, T)`` mask traced at capture) is
    reproduced exactly."""
    fit = fit_polynomial(points, values)
    if fit.exact or "linear" in fit.method:
        return fit
    lin = _solve_exact(points, values, LINEAR)
    if lin is None:
        return fit
    return Fit(_to_expr(lin), False, max(_rel_errors(lin, points, values)), "polynomial (least squares, linear in T)")


def first_step_expressions(exprs: Mapping[str, sympy.Expr]) -> dict[str, sympy.Expr]:
    """``first_step_*`` from the steady costs and the compile (see the module doc)."""
    if not all(q in exprs for q in COMPILE_QUANTITIES):
        return {}
    return {
        "first_step_peak_bytes": sympy.Max(exprs["compile_peak_bytes"],
                                           exprs["compile_retained_bytes"] + exprs["peak_bytes"]),
        "first_step_allocated_bytes": exprs["allocated_bytes"] + exprs["compile_allocated_bytes"],
        "first_step_flops": exprs["flops"] + exprs["compile_flops"],
    }

"""Exact polynomial fits of probe results, and the peak as a ``Max`` of aligned timelines.

Every cost of one step is a polynomial in the batch ``B`` and the sequence length ``T`` of
degree at most 1 in ``B`` and 2 in ``T`` (``B·T²`` for materialised attention scores,
``T²`` for a causal mask, ``T`` for rotary tables, constants for gradients): the basis
:data:`BASIS`. Six probes on a ``{1, 2} x {t1, t2, t3}`` grid determine such a polynomial
exactly; further probes *check* it (:attr:`Fit.exact`).

The peak is a maximum over the step's timeline, not a polynomial: which op holds the peak
can change with ``T`` (the logits at short context, attention scores at long context). When
every probe runs the same op sequence (no Python loop whose trip count depends on ``T``),
the live bytes after each op are fitted position by position and the peak becomes
``Max(p_1, ..., p_k)`` over the positions that are the maximum somewhere
(:func:`fit_peak`); otherwise the peak values are fitted directly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np
import sympy

__all__ = ["B", "T", "BASIS", "Fit", "fit_polynomial", "fit_envelope", "fit_peak", "monomial_values"]

B = sympy.Symbol("B", positive=True, integer=True)
T = sympy.Symbol("T", positive=True, integer=True)
BASIS: tuple[sympy.Expr, ...] = (sympy.Integer(1), T, T**2, B, B * T, B * T**2)
_EXPONENTS = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))  # (B power, T power) of BASIS
LINEAR = (0, 1, 3, 4)  # the columns of BASIS without T**2
# A fit that is not exact keeps the linear basis when it is this close: extrapolating a T**2
# term fitted to noise is worse than a small error at the probes.
LINEAR_TOLERANCE = 0.02


@dataclass(frozen=True)
class Fit:
    """A fitted expression and how well it reproduces every probe.

    ``exact``: it reproduces every probe exactly (including the check probes that did not
    determine it); ``max_rel_error``: worst relative error over the probes; ``method``:
    ``"polynomial"``, ``"timeline-max"`` or ``"constant"``.
    """

    expr: sympy.Expr
    exact: bool
    max_rel_error: float
    method: str


def monomial_values(points: Sequence[tuple[int, int]]) -> np.ndarray:
    """The basis evaluated at ``(batch, seq_len)`` points: a ``len(points) x 6`` int matrix."""
    return np.array([[b**pb * t**pt for pb, pt in _EXPONENTS] for b, t in points], dtype=object)


def _solve_exact(points: Sequence[tuple[int, int]], values: Sequence[int],
                 columns: Sequence[int] | None = None) -> list[Fraction] | None:
    """Least squares over the rationals (exact): ``(A^T A) c = A^T y`` on the used columns."""
    a = sympy.Matrix(monomial_values(points).tolist())
    if columns is not None:
        a = a.copy()
        for c in range(len(BASIS)):
            if c not in columns:
                a[:, c] = sympy.zeros(a.rows, 1)
    y = sympy.Matrix([int(v) for v in values])
    cols = _independent_columns(a)
    sub = a[:, cols]
    try:
        coef = (sub.T * sub).LUsolve(sub.T * y)
    except (ValueError, ZeroDivisionError):
        return None
    out = [Fraction(0)] * len(BASIS)
    for c, v in zip(cols, coef):
        r = sympy.Rational(v)
        out[c] = Fraction(int(r.p), int(r.q))
    return out


def _independent_columns(a: sympy.Matrix) -> list[int]:
    """Basis columns the probe grid can tell apart (e.g. no ``B`` terms if every probe has B=1)."""
    _, pivots = a.rref()
    return [p for p in pivots if any(a[:, p])]


def _to_expr(coef: Sequence[Fraction]) -> sympy.Expr:
    return sympy.Add(*[sympy.Rational(c.numerator, c.denominator) * m for c, m in zip(coef, BASIS) if c])


def _evaluate(coef: Sequence[Fraction], b: int, t: int) -> Fraction:
    return sum((c * b**pb * t**pt for c, (pb, pt) in zip(coef, _EXPONENTS)), Fraction(0))


def _rel_errors(coef: Sequence[Fraction], points: Sequence[tuple[int, int]], values: Sequence[int]) -> list[float]:
    errs = []
    for (b, t), v in zip(points, values):
        pred = _evaluate(coef, b, t)
        errs.append(float(abs(pred - v)) / max(abs(v), 1))
    return errs


def fit_polynomial(points: Sequence[tuple[int, int]], values: Sequence[int]) -> Fit:
    """Fit ``values`` at ``(batch, seq_len)`` ``points`` with :data:`BASIS` (exact rationals)."""
    if len(set(values)) == 1:
        return Fit(sympy.Integer(int(values[0])), True, 0.0, "constant")
    coef = _solve_exact(points, values)
    if coef is None:
        raise ValueError(f"cannot fit a polynomial through {list(zip(points, values))}")
    errs = _rel_errors(coef, points, values)
    if max(errs) > 0:  # not a polynomial of the basis: prefer the linear basis if it is close
        lin = _solve_exact(points, values, LINEAR)
        lin_errs = _rel_errors(lin, points, values) if lin is not None else [math.inf]
        if max(lin_errs) <= max(LINEAR_TOLERANCE, max(errs)):
            return Fit(_to_expr(lin), False, max(lin_errs), "polynomial (least squares, linear in T)")
        return Fit(_to_expr(coef), False, max(errs), "polynomial (least squares)")
    return Fit(_to_expr(coef), True, 0.0, "polynomial")


def _fit_positions(points: Sequence[tuple[int, int]], live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fit every timeline position at once (float least squares, then exact rounding).

    ``live`` is ``probes x positions``. Returns ``(coefficients positions x 6 as Fractions
    in an object array, exact mask per position)``.
    """
    a = monomial_values(points).astype(float)
    cols = _independent_columns(sympy.Matrix(monomial_values(points).tolist()))
    sub = a[:, cols]
    sol, *_ = np.linalg.lstsq(sub, live.astype(float), rcond=None)  # len(cols) x positions
    coef = np.zeros((live.shape[1], len(BASIS)), dtype=object)
    coef[:] = Fraction(0)
    for row, c in enumerate(cols):
        coef[:, c] = [Fraction(x).limit_denominator(4096) for x in sol[row]]
    mono = monomial_values(points)  # probes x 6 (python ints)
    pred = np.array([[sum(coef[p, k] * mono[i, k] for k in range(len(BASIS))) for p in range(live.shape[1])]
                     for i in range(len(points))], dtype=object)
    exact = np.all(pred == live.astype(object), axis=0)
    return coef, exact


def _dominated(c: Sequence[Fraction], others: list[Sequence[Fraction]]) -> bool:
    """``c <= o`` for every B, T >= 1 when every coefficient of ``o - c`` is non-negative."""
    return any(all(oi >= ci for oi, ci in zip(o, c)) and tuple(o) != tuple(c) for o in others)


def fit_envelope(points: Sequence[tuple[int, int]], values: Sequence[int]) -> Fit:
    """A polynomial for the long sequences and a floor for the short ones: ``Max(p, floor)``.

    Chunked plans run the same machinery per chunk, but with only a few chunks a different
    op holds the peak (the first chunk's transients outweigh a short cache): the values are
    a maximum of two regimes. When no single polynomial reproduces every probe, the shortest
    probe lengths are dropped one at a time until a polynomial reproduces the rest exactly;
    the dropped probes become a floor fitted in ``B`` alone (least squares). Without such a
    split, the least-squares polynomial of :func:`fit_polynomial`.
    """
    full = fit_polynomial(points, values)
    if full.exact:
        return full
    ts = sorted({t for _, t in points})
    for k in range(1, len(ts) - 1):
        keep = [i for i, (_, t) in enumerate(points) if t >= ts[k]]
        drop = [i for i in range(len(points)) if i not in keep]
        batches = len({b for b, _ in points})  # probes at one batch fit in T alone
        if len({points[i][1] for i in keep}) < 2 or len({points[i][0] for i in keep}) < min(2, batches):
            break
        upper = fit_polynomial([points[i] for i in keep], [values[i] for i in keep])
        if not upper.exact:
            continue
        up = sympy.lambdify((B, T), upper.expr, modules="math")
        excess = [i for i in drop if values[i] > up(*points[i])]
        expr = upper.expr
        if excess:  # the short probes the long-sequence polynomial does not cover: a floor in B
            floor = fit_polynomial([(points[i][0], ts[0]) for i in excess], [values[i] for i in excess])
            expr = sympy.Max(upper.expr, floor.expr.subs(T, ts[0]))
        fn = sympy.lambdify((B, T), expr, modules=[{"Max": max}, "math"])
        errs = [abs(fn(b, t) - v) / max(v, 1) for (b, t), v in zip(points, values)]
        if max(errs) <= max(LINEAR_TOLERANCE, full.max_rel_error):
            return Fit(expr, max(errs) == 0, max(errs), f"envelope (polynomial for T >= {ts[k]}, floor below)")
    return full


def _fit_phase_peaks(points: Sequence[tuple[int, int]], peaks: Sequence[int],
                     phase_peaks: Sequence[Sequence[int]], why: str) -> Fit:
    """``Max`` of the forward peak and the backward peak, each fitted as a polynomial."""
    fits = [fit_envelope(points, list(col)) for col in zip(*phase_peaks)] if phase_peaks else []
    if not fits:
        fit = fit_envelope(points, peaks)
        return Fit(fit.expr, fit.exact, fit.max_rel_error, f"{fit.method}; {why}")
    exprs = list(dict.fromkeys(f.expr for f in fits))
    expr = exprs[0] if len(exprs) == 1 else sympy.Max(*exprs)
    fn = sympy.lambdify((B, T), expr, modules=[{"Max": max}, "math"])
    errs = [abs(fn(b, t) - v) / max(v, 1) for (b, t), v in zip(points, peaks)]
    exact = all(f.exact for f in fits) and max(errs) == 0
    return Fit(expr, exact, max(errs), f"max of phase peaks ({', '.join(f.method for f in fits)}); {why}")


def fit_peak(points: Sequence[tuple[int, int]], peaks: Sequence[int], ops: Sequence[Sequence[str]],
             live: Sequence[Sequence[int]], grid: Sequence[tuple[int, int]] = (),
             phase_peaks: Sequence[Sequence[int]] = ()) -> Fit:
    """The peak as ``Max`` of per-position polynomials when the timelines align (module doc).

    ``grid``: extra ``(batch, seq_len)`` points (e.g. long contexts) at which a candidate
    must be the maximum to be kept; candidates that are maximal at no probe and no grid point
    are dropped, and so are those dominated coefficient-wise by another. ``phase_peaks``:
    per probe, the peak of each phase (forward, backward), used when the timelines differ.
    """
    aligned = len({tuple(o) for o in ops}) == 1 and len({len(x) for x in live}) == 1 and live and len(live[0])
    if not aligned:
        return _fit_phase_peaks(points, peaks, phase_peaks, "timelines differ between probes")
    arr = np.array(live, dtype=np.int64)  # probes x positions
    # candidates: positions at a local maximum within 1/2 of the peak in some probe
    cand: set[int] = set()
    for row in arr:
        left = np.concatenate(([-1], row[:-1]))
        right = np.concatenate((row[1:], [-1]))
        local = np.nonzero((row >= left) & (row >= right) & (row * 2 >= row.max()))[0]
        cand.update(int(i) for i in local)
    idx = sorted(cand)
    coef, exact = _fit_positions(points, arr[:, idx])
    if not bool(np.all(exact)):
        return _fit_phase_peaks(points, peaks, phase_peaks, "a timeline position is not polynomial")
    polys = {tuple(coef[j]) for j in range(len(idx))}
    polys = [p for p in polys if not _dominated(p, [q for q in polys if q != p])]
    # keep the polynomials that are the maximum at some probe or grid point
    check = list(points) + list(grid) + [(b, t) for b, t in itertools.product((1, 8, 64), (2**k for k in range(4, 25, 2)))]
    keep: set[tuple] = set()
    for b, t in check:
        vals = [(_evaluate(p, b, t), p) for p in polys]
        best = max(v for v, _ in vals)
        keep.update(p for v, p in vals if v == best)
    chosen = sorted(keep, key=lambda p: tuple(float(x) for x in p))
    exprs = [_to_expr(p) for p in chosen]
    expr = exprs[0] if len(exprs) == 1 else sympy.Max(*exprs)
    errs = []
    for (b, t), v in zip(points, peaks):
        pred = max(_evaluate(p, b, t) for p in chosen)
        errs.append(float(abs(pred - v)) / max(v, 1))
    return Fit(expr, max(errs) == 0.0, max(errs), "timeline-max")

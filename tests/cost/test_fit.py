"""Exact polynomial fits, the timeline Max, and the envelope for regime changes."""

import sympy

from gradshard.cost.build import probe_points
from gradshard.cost.fit import B, T, fit_envelope, fit_peak, fit_polynomial

FIT, CHECK = probe_points(16)
POINTS = FIT + CHECK


def test_probe_grid():
    assert FIT == [(2, 16), (3, 16), (2, 32), (3, 32), (2, 48), (3, 48)]
    assert CHECK == [(2, 64), (4, 16)]
    fit, check = probe_points(8, chunked=True)
    assert sorted({t for _, t in fit}) == [32, 40, 48] and (2, 64) in check


def test_fit_polynomial_recovers_exact_rational_coefficients():
    truth = 7 * B * T**2 + sympy.Rational(5, 2) * B * T + 3 * T**2 + 11 * B + 1000
    vals = [int(truth.subs({B: b, T: t})) for b, t in POINTS]
    fit = fit_polynomial(POINTS, vals)
    assert fit.exact and fit.max_rel_error == 0
    assert sympy.simplify(fit.expr - truth) == 0


def test_fit_polynomial_reports_a_miss_and_prefers_linear_when_close():
    truth = 100 * B * T + 5000
    vals = [int(truth.subs({B: b, T: t})) for b, t in POINTS]
    vals[-2] += 300  # the long check probe is off by < 1%
    fit = fit_polynomial(POINTS, vals)
    assert not fit.exact and 0 < fit.max_rel_error < 0.02
    assert not fit.expr.has(T**2)  # no T^2 term fitted to noise


def test_constant():
    fit = fit_polynomial(POINTS, [42] * len(POINTS))
    assert fit.exact and fit.expr == 42


def _timeline(b, t):
    # forward builds B*T*100 bytes of activations, a fixed 50_000-byte buffer peaks at the start of
    # the backward, then attention scores of B*T*T*4 bytes peak later: the argmax changes with T.
    return [b * t * 100, b * t * 100 + 50_000, b * t * 50, b * t * t * 4 + b * t * 10, 0]


def test_fit_peak_max_of_aligned_timeline_positions():
    lives = [_timeline(b, t) for b, t in POINTS]
    ops = [("a", "b", "c", "d", "e")] * len(POINTS)
    fit = fit_peak(POINTS, [max(x) for x in lives], ops, lives)
    assert fit.exact and fit.method == "timeline-max"
    f = sympy.lambdify((B, T), fit.expr, modules=[{"Max": max}, "math"])
    for b, t in [(1, 8), (8, 100), (8, 4096), (64, 10**6)]:
        assert f(b, t) == max(_timeline(b, t))  # right in both regimes, far outside the probes


def test_fit_peak_with_differing_timelines_uses_phase_peaks():
    lives = [[b * t * 100] * (t // 16) for b, t in POINTS]  # op count depends on T (a loop)
    ops = [("x",) * len(x) for x in lives]
    phases = [(b * t * 100, b * t * 30 + 7) for b, t in POINTS]
    fit = fit_peak(POINTS, [max(p) for p in phases], ops, lives, phase_peaks=phases)
    assert fit.exact and "phase" in fit.method
    assert sympy.simplify(fit.expr.subs({B: 5, T: 1000}) - 500_000) == 0


def test_envelope_splits_a_short_sequence_regime():
    pts, _ = probe_points(8, chunked=True)
    pts = pts + [(2, 64), (4, 32)]
    vals = [max(2304 * b * t, 156_804 if (b, t) == (2, 32) else 0) for b, t in pts]
    fit = fit_envelope(pts, vals)
    assert fit.exact and "envelope" in fit.method
    f = sympy.lambdify((B, T), fit.expr, modules=[{"Max": max}, "math"])
    assert f(2, 1024) == 2304 * 2 * 1024 and f(2, 32) == 156_804

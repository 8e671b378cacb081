"""``gs.cost``: probe the compiled plan at a few small sizes and fit symbolic costs.

::

    report = gs.cost(model, plan="seco", example_inputs=(ids,), chunk_size=64, device="h100")
    report.evaluate(seq_len=1_000_000, batch=8)       # {'peak_bytes': ..., 'flops': ..., ...}
    report.max_seq_len(memory_bytes="80GB", batch=8)   # longest context that fits
    print(report.expressions["peak_bytes"])            # Max(1024*B*T + 156800, ...)

How (see :mod:`gradshard.cost.probe` and :mod:`gradshard.cost.fit`): the example inputs fix
the model and tell, through the time-locality analysis of their capture, which input
dimensions are the sequence and the batch. The plan is then compiled and run on fake
tensors at ``(batch, seq_len)`` in ``{2, 3} x {g, 2g, 3g}`` (``g``: a divisor of the example
length), plus two check points ``(2, 4g)`` and ``(4, g)`` that the fit must reproduce
exactly; plans that cut the sequence into chunks or shards of ``c`` probe ``{2c, 3c, 4c}``
and check ``6c``. Every cost is fitted with the polynomial basis
``{1, T, T², B, B·T, B·T²}``, the peak as a ``Max`` over the step's timeline; the plan's
rule (:mod:`gradshard.cost.rules`) adds what one process cannot observe (communication).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import sympy
import torch

from ..errors import GradshardError
from ..plans import get_plan
from .devices import get_device
from .facts import graph_facts
from .fit import LINEAR_TOLERANCE, B, T, Fit, fit_peak, fit_polynomial
from .probe import (CompileSample, ProbeSample, find_input_axes, older_objects_frozen, run_compile_probe,
                    run_probe)
from .first_step import compile_probe_points, compile_regimes, fit_compile, first_step_expressions
from .report import CostReport
from .rules import RuleContext, get_rule, optimizer_states

__all__ = ["cost", "probe_points", "default_granule"]


def default_granule(seq_len: int) -> int:
    """The probe step for an example of length ``seq_len``: its largest divisor in [4, 16], else itself."""
    for d in range(16, 3, -1):
        if seq_len % d == 0:
            return d
    return seq_len


def probe_points(granule: int, *, batched: bool = True, seq_lens: Sequence[int] | None = None,
                 chunked: bool = False) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(fit points, check points)`` as ``(batch, seq_len)`` pairs (see the module doc).

    ``chunked``: the plan cuts the sequence into pieces of ``granule`` (chunks, shards); its
    probes then start at two pieces (``2g, 3g, 4g``, check ``6g``), since a single piece
    runs none of the cross-piece machinery whose cost grows with ``T``.
    """
    mult = (4, 5, 6, 8) if chunked else (1, 2, 3, 4)
    ts = list(seq_lens) if seq_lens is not None else [m * granule for m in mult]
    if len(set(ts[:3])) < 3:
        raise ValueError(f"probe_seq_lens needs at least three distinct lengths, got {list(ts)}")
    # B = 1 is avoided: reshapes of broadcast tensors are views there but copies for B > 1,
    # so a B = 1 probe runs a different op sequence than every larger batch.
    batches = (2, 3) if batched else (1,)
    fit = [(b, t) for t in ts[:3] for b in batches]
    checks = [(batches[0], t) for t in ts[3:]]
    if batched:
        checks.append((4, ts[0]))
    return fit, checks


@older_objects_frozen()  # its probes each start with a full collection: scan only what they make
def cost(model_or_fn: Any, plan: str = "none", *, example_inputs: Sequence[Any], device: str | None = None,
         dtype: torch.dtype | None = None, optimizer: str | float = "adamw",
         loss_fn: Callable[[Any], torch.Tensor] | None = None, time_axis: tuple[int, int] | None = None,
         frontend: str = "python", probe_seq_lens: Sequence[int] | None = None, probe_mode: str = "auto",
         extra_rounds: int = 1, first_step: bool = True, progress: Callable[[str], None] | None = None,
         **options: Any) -> CostReport:
    """Symbolic costs of running ``model_or_fn`` under ``plan`` (see the module doc).

    ``example_inputs``: a tuple such that ``model_or_fn(*example_inputs)`` runs (a factory's
    second value). ``device``: a profile name (``"h100"``) for time estimates and the default
    memory budget. ``dtype``: price the model cast to this dtype (e.g. ``torch.bfloat16``).
    ``optimizer``: whose state to count (``"adamw"``: 2 per trainable parameter).
    ``loss_fn``: what the step backpropagates from the output (default
    :func:`~gradshard.cost.probe.default_loss`). ``probe_seq_lens``: override the probe
    lengths (three to fit, more to check). ``extra_rounds``: how many times to probe again
    at twice (then four times) the lengths when a fit misses a probe (at most 2).
    ``first_step``: also price the first step (the compile a fresh module's first call runs;
    :mod:`gradshard.cost.first_step`), probing the compile alone at a few more lengths where
    it changes form (False: steady-step costs only, fewer probes). Other keywords are the
    plan's options.
    """
    t_start = time.perf_counter()
    opts = get_plan(plan).make_options(**options)  # validates the options with a clear error
    rule = get_rule(plan)
    profile = get_device(device) if device is not None else None
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError("example_inputs must be a tuple of the model's arguments, e.g. (input_ids,)")
    example_inputs = tuple(example_inputs)
    say = progress or (lambda msg: None)
    axes = find_input_axes(model_or_fn, example_inputs, time_axis=time_axis, frontend=frontend)
    say(f"inputs: {axes.describe()}")
    plan_granule = rule.granularity(opts)
    granule = plan_granule if plan_granule > 1 else default_granule(axes.seq_len)
    batched = any(axes.batch)
    seq_lens = probe_seq_lens
    above = rule.probe_above(opts)
    if seq_lens is None and above >= (2 if plan_granule > 1 else 1) * granule:
        first = 2 * above // granule + 1  # above twice it: past the calls that end in the second window
        seq_lens = [m * granule for m in (first, first + 1, first + 2, first + 4)]
    fit_pts, check_pts = probe_points(granule, batched=batched, seq_lens=seq_lens, chunked=plan_granule > 1)
    samples: list[ProbeSample] = []

    def probe_all(points: Sequence[tuple[int, int]]) -> None:
        done = {(s.batch, s.seq_len) for s in samples}
        for b, t in points:
            if (b, t) in done:
                continue
            say(f"probe {plan} at batch={b}, seq_len={t}")
            ctx = (lambda t=t: rule.probe_context(opts, t)) if rule.probe_context is not None else None
            samples.append(run_probe(model_or_fn, example_inputs, plan=plan, options=dict(options), axes=axes,
                                     batch=b, seq_len=t, loss_fn=loss_fn, time_axis=time_axis, frontend=frontend,
                                     mode=probe_mode, dtype=dtype, context=ctx))

    probe_all(fit_pts + check_pts)
    exprs, fits = _fit_samples(samples, optimizer_states(optimizer))
    scaled = 1  # the lengths of the last round, as a multiple of the first
    for scale in (2, 4)[:max(0, extra_rounds)]:
        # A fit that misses a probe means the probes were still in the short-sequence regime
        # (few chunks): probe again at longer sequences and refit on everything.
        if all(f.exact for f in fits.values()) or probe_seq_lens is not None:
            break
        probe_all([(b, t * scale) for b, t in fit_pts] + [(b, t * scale) for b, t in check_pts if b == fit_pts[0][0]])
        exprs, fits = _fit_samples(samples, optimizer_states(optimizer))
        scaled = scale
    if batched:  # batch 1 at the last round's lengths: the regime the batched fit extrapolates from
        notes_b1 = _fit_batch_one(exprs, fits, samples, probe_all, [(b, t * scaled) for b, t in fit_pts],
                                  [(b, t * scaled) for b, t in check_pts], optimizer_states(optimizer),
                                  short=sorted({t for _, t in fit_pts + check_pts}) if scaled > 1 else [])
    compile_fits: dict[str, Fit] = {}
    compiles: list[CompileSample] = []
    if first_step:
        regimes = compile_regimes(plan, opts, rule)
        batches = sorted({b for b, _ in fit_pts})
        # the compile is fitted at the fit's batches: batch-1 probes (above) price the step only
        fitted = [s for s in samples if s.batch in batches]
        have = [(s.batch, s.seq_len) for s in fitted]
        for b, t in compile_probe_points(regimes, have, granule, batches):
            say(f"probe the compile of {plan} at batch={b}, seq_len={t}")
            ctx = (lambda t=t: rule.probe_context(opts, t)) if rule.probe_context is not None else None
            compiles.append(run_compile_probe(model_or_fn, example_inputs, plan=plan, options=dict(options),
                                              axes=axes, batch=b, seq_len=t, time_axis=time_axis, frontend=frontend,
                                              mode=probe_mode, dtype=dtype, context=ctx))
        compile_exprs, compile_fits = fit_compile(regimes, fitted, compiles)
        exprs.update(compile_exprs)
    notes = [f"probed {len(samples)} compiled steps on {samples[0].mode} tensors in "
             f"{time.perf_counter() - t_start:.1f} s at (batch, seq_len) = "
             + ", ".join(f"({s.batch}, {s.seq_len})" for s in samples)]
    if batched:
        notes += notes_b1
    if compiles:
        notes.append("probed the compile alone at (batch, seq_len) = "
                     + ", ".join(f"({c.batch}, {c.seq_len})" for c in compiles))
    symbols: dict[str, sympy.Symbol] = {"seq_len": T, "batch": B, **rule.symbols}
    if rule.per_rank_seq_len is not None:
        exprs = {k: sympy.expand(v.subs(T, rule.per_rank_seq_len)) if not v.has(sympy.Max)
                 else v.subs(T, rule.per_rank_seq_len) for k, v in exprs.items()}
        notes.append(f"per-rank costs: probed on one rank at seq_len = {rule.per_rank_seq_len}")
    exprs.setdefault("comm_bytes", sympy.Integer(0))
    if rule.adjust is not None:
        facts = graph_facts(model_or_fn, example_inputs, axes, rule.needs, time_axis=time_axis,
                            frontend=frontend, dtype=dtype, regions=samples[0].regions,
                            region_batch=samples[0].batch)
        exprs.update(rule.adjust(RuleContext(plan, opts, exprs, facts)))
        exprs["flops"] = exprs["flops_fwd"] + exprs["flops_bwd"]
        exprs["total_bytes"] = (exprs["param_bytes"] + exprs["optimizer_bytes"] + exprs["input_bytes"]
                                + exprs["peak_bytes"])
    if first_step:
        exprs.update(first_step_expressions(exprs))
    inexact = [q for q, f in fits.items() if not f.exact]
    if inexact:
        notes.append("not reproduced exactly on every probe (see .fits): " + ", ".join(inexact))
    report_dtype = str(dtype or _float_dtype(model_or_fn, example_inputs)).removeprefix("torch.")
    return CostReport(
        plan=plan, options={k: v for k, v in options.items()}, expressions=_ordered(exprs), symbols=symbols,
        defaults=rule.defaults(opts), example={"seq_len": axes.seq_len, "batch": axes.batch_size},
        method="probe", fits=fits, probes=tuple(samples), regions=samples[0].regions, device=profile,
        dtype=report_dtype, notes=tuple(notes), compile_fits=compile_fits,
    )


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _float_dtype(target: Any, inputs: tuple) -> torch.dtype:
    import torch.nn as nn
    import torch.utils._pytree as pytree

    for leaf in pytree.tree_leaves((target, inputs), is_leaf=lambda x: isinstance(x, nn.Module)):
        if isinstance(leaf, nn.Module):
            for p in leaf.parameters():
                if p.is_floating_point():
                    return p.dtype
        elif isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return torch.float32


def _fit_samples(samples: Sequence[ProbeSample], states_per_param: float) -> tuple[dict[str, sympy.Expr], dict[str, Fit]]:
    pts = [(s.batch, s.seq_len) for s in samples]
    values = [_sample_values(s) for s in samples]
    fits: dict[str, Fit] = {
        q: fit_peak(pts, [v[q] for v in values], [s.ops for s in samples], [s.live for s in samples],
                    phase_peaks=[s.phase_peaks for s in samples]) if q == "peak_bytes"
        else fit_polynomial(pts, [v[q] for v in values])
        for q in values[0]
    }
    state = {s.state_bytes for s in samples}
    trainable = {s.trainable_bytes for s in samples}
    if len(state) != 1 or len(trainable) != 1:
        raise GradshardError(f"the compiled step's parameters changed with the probe size ({sorted(state)}); "
                             "the cost model assumes a fixed model")
    exprs = {q: f.expr for q, f in fits.items()}
    exprs["param_bytes"] = sympy.Integer(state.pop())
    return _with_derived(exprs, states_per_param), fits


def _with_derived(e: dict[str, sympy.Expr], states_per_param: float) -> dict[str, sympy.Expr]:
    """The fitted quantities and ``param_bytes`` plus the costs derived from them."""
    exprs = dict(e)
    param_bytes = e["param_bytes"]
    # The optimizer updates what receives a gradient (partial_update: the trainable slices).
    exprs["optimizer_bytes"] = sympy.nsimplify(states_per_param) * e["grad_bytes"]
    exprs["hbm_bytes"] = 2 * e["allocated_bytes"] + 2 * param_bytes
    exprs["total_bytes"] = param_bytes + exprs["optimizer_bytes"] + e["input_bytes"] + e["peak_bytes"]
    exprs["flops"] = e["flops_fwd"] + e["flops_bwd"]
    return exprs


def _fit_batch_one(exprs: dict[str, sympy.Expr], fits: dict[str, Fit], samples: list[ProbeSample],
                   probe_all: Callable[[Sequence[tuple[int, int]]], None], fit_pts: Sequence[tuple[int, int]],
                   check_pts: Sequence[tuple[int, int]], states_per_param: float,
                   short: Sequence[int] = ()) -> list[str]:
    """Price batch 1 from batch-1 probes where the batched fit does not reproduce it.

    The fit probes batches 2 and 3 (:func:`probe_points`): at batch 1 a reshape of a
    broadcast tensor is a view, not a copy, so a batch-1 step can run another op sequence,
    and its peak is then not the batched polynomial at ``B = 1``. One batch-1 probe (the
    longest fit length of the batched fit's last round) checks it; when any quantity differs
    there, batch 1 is probed at those fit and check lengths and that quantity becomes
    ``Piecewise((batch-1 fit, B = 1 and T >= its shortest probe), (batched fit, True))``.
    ``short``: the batched fit's first-round lengths when it needed longer rounds; a quantity
    that changed is then probed at batch 1 there too, and a fit of those probes (exact, or
    within the linear tolerance and exact on its two longest) prices batch 1 from the shortest
    of them up to the longer batch-1 probes: there neither the batched fit nor the longer
    batch-1 fit extrapolated down holds on every model. Changes ``exprs`` and ``fits`` in place; returns
    the notes to report.
    """
    lengths = sorted({t for _, t in fit_pts})
    probe_all([(1, lengths[-1])])  # the longest: the regime the batched fit extrapolates from
    first = next(s for s in samples if s.batch == 1)
    if all(_value(exprs[q], 1, first.seq_len) == v for q, v in _sample_values(first).items()):
        return [f"batch 1 checked at seq_len = {first.seq_len}: the batched fit holds there"]
    checks = [t for b, t in check_pts if b == fit_pts[0][0]]
    probe_all([(1, t) for t in lengths + checks])
    ones = [s for s in samples if s.batch == 1]
    exprs1, fits1 = _fit_samples(ones, states_per_param)
    if not all(f.exact for f in fits1.values()):
        # still in the short-sequence regime at these lengths (a maximum of two forms whose
        # argmax moves): probe twice as long and fit every batch-1 probe (an envelope)
        probe_all([(1, 2 * t) for t in lengths + checks])
        ones = [s for s in samples if s.batch == 1]
        exprs1, fits1 = _fit_samples(ones, states_per_param)
    grid = sorted({s.seq_len for s in ones} | {2**k for k in range(10, 25, 2)})
    differ = [q for q in fits1 if q in exprs and any(_value(exprs[q], 1, t) != _value(exprs1[q], 1, t) for t in grid)]
    changed = [q for q in differ if _holds(q, exprs1, fits1, ones)]
    kept = [q for q in differ if q not in changed]
    # below the batch-1 probes the batch-1 fit would extrapolate a short-sequence floor: batch 1
    # is priced there by its own fit at the short lengths where that holds, else by the batched fit
    shortest = min(s.seq_len for s in ones)
    below = sorted(set(short))
    shorts_fit: dict[str, sympy.Expr] = {}
    if changed and len(below) >= 3 and below[0] < shortest:
        probe_all([(1, t) for t in below])
        shorts = [s for s in samples if s.batch == 1 and s.seq_len in below]
        exprs_s, fits_s = _fit_samples(shorts, states_per_param)
        shorts_fit = {q: exprs_s[q] for q in changed if q in fits_s and _holds(q, exprs_s, fits_s, shorts)}
        for q in shorts_fit:
            fits[f"{q} (batch 1, T < {shortest})"] = fits_s[q]
    for q in changed:
        pieces = [(exprs1[q], sympy.And(sympy.Eq(B, 1), T >= shortest))]
        if q in shorts_fit:
            pieces.append((shorts_fit[q], sympy.And(sympy.Eq(B, 1), T >= below[0])))
        exprs[q] = sympy.Piecewise(*pieces, (exprs[q], True))
        fits[f"{q} (batch 1)"] = fits1[q]
    exprs.update(_with_derived({q: exprs[q] for q in [*fits1, "param_bytes"] if q in exprs}, states_per_param))
    at = ", ".join(str(t) for t in sorted({s.seq_len for s in samples if s.batch == 1}))
    notes = []
    if changed:
        notes.append(f"batch 1 runs another op sequence than batches >= 2: {', '.join(changed)} priced from "
                     f"batch-1 probes at seq_len = {at}"
                     + (f" ({', '.join(shorts_fit)} from its own fit below {shortest})" if shorts_fit else ""))
    if kept:
        worst = max(abs(_value(exprs[q], 1, s.seq_len) - v) / max(v, 1)
                    for s in ones for q, v in _sample_values(s).items() if q in kept)
        notes.append(f"batch 1 differs from the batched fit in {', '.join(kept)} (up to {worst:.1%} at the batch-1 "
                     f"probes, seq_len = {at}) and is not a polynomial there: the batched fit is kept")
    return notes


def _holds(q: str, exprs: dict[str, sympy.Expr], fits: dict[str, Fit], ones: Sequence[ProbeSample]) -> bool:
    """A batch-1 fit of ``q`` to trust: exact, or within the linear tolerance and exact on its two
    longest probes (a fit that misses those would extrapolate worse than the batched one)."""
    longest = sorted(ones, key=lambda s: s.seq_len)[-2:]
    return fits[q].exact or (fits[q].max_rel_error <= LINEAR_TOLERANCE
                             and all(_value(exprs[q], 1, s.seq_len) == _sample_values(s)[q] for s in longest))


def _sample_values(s: ProbeSample) -> dict[str, int]:
    """The quantities :func:`_fit_samples` fits, as one probe measured them."""
    return {"activation_bytes": s.saved_bytes, "peak_bytes": s.peak_bytes, "grad_bytes": s.retained_bytes,
            "input_bytes": s.input_bytes, "flops_fwd": s.flops_fwd, "flops_bwd": s.flops_bwd,
            "allocated_bytes": s.allocated_bytes}


def _value(expr: sympy.Expr, batch: int, seq_len: int) -> int:
    return int(expr.subs({B: batch, T: seq_len}))


def _ordered(exprs: dict[str, sympy.Expr]) -> dict[str, sympy.Expr]:
    from .report import QUANTITIES

    return {q: exprs[q] for q in QUANTITIES if q in exprs} | {q: v for q, v in exprs.items() if q not in QUANTITIES}

"""``CostReport``: the symbolic costs of one plan, and the queries on them.

A report holds sympy expressions in the batch ``B``, the sequence length ``T`` and the
plan's extra symbols (e.g. the world size ``R`` of LASP):

==================  ==========================================================================
activation_bytes    bytes autograd saves for backward (distinct storages the step allocates);
                    checkpoints a plan keeps itself (SeCO's KV cache, adjoint state
                    checkpoints) live outside autograd: they count in peak_bytes only
peak_bytes          peak live bytes of the step above what was alive before it (as
                    ``gs.measure`` reports it): activations, gradients, transients
param_bytes         parameters and buffers of the compiled step (frozen slices included)
grad_bytes          gradients the step leaves behind (trainable parameters only)
optimizer_bytes     optimizer state for the trainable parameters (Adam: 2 per parameter)
input_bytes         the step's tensor inputs (token ids, labels)
total_bytes         device memory the step needs: params + optimizer + inputs + peak
flops_fwd/_bwd      FLOPs outside / inside the autograd engine (recomputation is backward)
flops               their sum
comm_bytes          bytes each rank sends per step (0 on one device)
hbm_bytes           estimated HBM traffic for the roofline: every allocated byte written and
                    read once, parameters read twice
allocated_bytes     bytes the steady step allocates, freed or not (``gs.measure``'s count)
compile_*           what a fresh module's first call runs before its step (capture, passes,
                    self-checks, schedule): its ``peak_bytes``, the bytes it leaves alive
                    into the step (``retained_bytes``), ``allocated_bytes`` and ``flops``
first_step_*        the first step of a fresh compiled module, compile included: ``peak_bytes``,
                    ``allocated_bytes`` and ``flops`` as ``gs.measure`` counts that call
                    (:mod:`gradshard.cost.first_step`). Fake tensors (capture, the planner's
                    dry runs) count as ``gs.measure`` counts them, as bytes on the device; the
                    allocator sees them as nothing
==================  ==========================================================================

``evaluate(seq_len=..., batch=...)`` gives numbers; ``max_seq_len(memory_bytes=...)`` the
longest context that fits; ``time_estimate`` a roofline *estimate* on a device profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import sympy

from .devices import DeviceProfile, RooflineEstimate, get_device, roofline_seconds
from .fit import Fit
from .units import format_bytes, format_flops

__all__ = ["CostReport", "QUANTITIES", "BYTE_QUANTITIES", "FIRST_STEP_QUANTITIES", "bisect_last"]


def bisect_last(holds: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi)`` with ``holds(n)``, given ``holds(lo)``, ``not holds(hi)``
    and ``holds`` monotone (true, then false)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo

#: What the first call adds is priced as the first step as a whole (see the module doc).
FIRST_STEP_QUANTITIES = ("compile_peak_bytes", "compile_retained_bytes", "compile_allocated_bytes", "compile_flops",
                         "first_step_peak_bytes", "first_step_allocated_bytes", "first_step_flops")
QUANTITIES = ("activation_bytes", "peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes",
              "total_bytes", "flops_fwd", "flops_bwd", "flops", "comm_bytes", "hbm_bytes", "allocated_bytes",
              *FIRST_STEP_QUANTITIES)
BYTE_QUANTITIES = tuple(q for q in QUANTITIES if q.endswith("_bytes"))


@dataclass(frozen=True)
class CostReport:
    """Symbolic costs of ``plan`` for one model (see the module doc for the quantities).

    ``symbols`` maps keyword names to sympy symbols (``seq_len -> T``, ``batch -> B``, and
    plan symbols such as ``world_size -> R``); ``defaults`` gives values for the plan
    symbols. ``fits`` says how each probed quantity was fitted and whether it reproduced
    every probe exactly; ``method`` is ``"probe"`` (fitted to fake-tensor runs of the
    compiled plan) or ``"rule"`` (derived from the rules of :mod:`gradshard.cost.rules`).
    """

    plan: str
    options: Mapping[str, Any]
    expressions: Mapping[str, sympy.Expr]
    symbols: Mapping[str, sympy.Symbol]
    defaults: Mapping[str, int]
    example: Mapping[str, int]
    method: str
    fits: Mapping[str, Fit] = field(default_factory=dict)
    probes: tuple[Any, ...] = ()
    regions: tuple[Any, ...] = ()
    device: DeviceProfile | None = None
    dtype: str = "float32"
    notes: tuple[str, ...] = ()
    #: how each ``compile_*`` quantity was fitted (per regime; see :mod:`gradshard.cost.first_step`)
    compile_fits: Mapping[str, Fit] = field(default_factory=dict)
    _fns: dict[str, Callable[..., float]] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ evaluation

    def _values(self, seq_len: int | None, batch: int | None, sizes: Mapping[str, int]) -> dict[sympy.Symbol, int]:
        unknown = sorted(set(sizes) - set(self.symbols))
        if unknown:
            raise TypeError(f"{self.plan!r} cost has no size(s) {unknown}; its sizes are: {sorted(self.symbols)}")
        vals = {**self.defaults, **{k: v for k, v in sizes.items()}}
        vals["seq_len"] = self.example["seq_len"] if seq_len is None else seq_len
        vals["batch"] = self.example["batch"] if batch is None else batch
        out = {}
        for name, sym in self.symbols.items():
            if name not in vals:
                raise TypeError(f"{self.plan!r} cost needs a value for {name!r} (e.g. evaluate({name}=8))")
            v = vals[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a non-negative number, got {v!r}")
            out[sym] = v
        return out

    def _fn(self, quantity: str) -> Callable[..., float]:
        fn = self._fns.get(quantity)
        if fn is None:
            syms = list(self.symbols.values())
            fn = sympy.lambdify(syms, self.expressions[quantity], modules=[{"Max": max, "Min": min}, "math", "sympy"])
            self._fns[quantity] = fn
        return fn

    def evaluate(self, seq_len: int | None = None, batch: int | None = None, **sizes: int) -> dict[str, float]:
        """Every quantity at ``seq_len`` and ``batch`` (defaults: the example's), as numbers.

        Byte counts and FLOPs are rounded to integers. With a device profile, the dict also
        holds ``time_s``, a roofline *estimate* (see :meth:`time_estimate`).
        """
        vals = self._values(seq_len, batch, sizes)
        order = list(self.symbols.values())
        args = [vals[s] for s in order]
        out: dict[str, float] = {}
        for q in self.expressions:
            v = self._fn(q)(*args)
            out[q] = int(round(v)) if math.isfinite(v) else v
        if self.device is not None:
            out["time_s"] = self._roofline(out, self.device).seconds
        return out

    def time_estimate(self, seq_len: int | None = None, batch: int | None = None, *,
                      device: DeviceProfile | str | None = None, link: str | None = None,
                      **sizes: int) -> RooflineEstimate:
        """Roofline *estimate* (a lower bound) of one step on ``device`` (default: the report's)."""
        dev = get_device(device) if device is not None else self.device
        if dev is None:
            raise ValueError("time_estimate needs a device: pass device='h100' (or build the report with one)")
        return self._roofline(self.evaluate(seq_len, batch, **sizes), dev, link)

    def first_step(self, seq_len: int | None = None, batch: int | None = None, **sizes: int) -> dict[str, dict[str, float]]:
        """The first step against a steady one at ``seq_len``/``batch``:
        ``{"peak_bytes": {"first": ..., "steady": ..., "added": ...}, "allocated_bytes": ..., "flops": ...}``.

        Raises ``KeyError`` for a report without first-step probes (built from rules)."""
        missing = [q for q in FIRST_STEP_QUANTITIES if q.startswith("first") and q not in self.expressions]
        if missing:
            raise KeyError(f"this {self.method!r} report has no first-step costs ({', '.join(missing)})")
        v = self.evaluate(seq_len, batch, **sizes)
        out = {}
        for q in ("peak_bytes", "allocated_bytes", "flops"):
            first, steady = v[f"first_step_{q}"], v[q]
            out[q] = {"first": first, "steady": steady, "added": first - steady}
        return out

    def _roofline(self, vals: Mapping[str, float], dev: DeviceProfile, link: str | None = None) -> RooflineEstimate:
        return roofline_seconds(dev, flops=vals["flops"], hbm_bytes=vals["hbm_bytes"],
                                comm_bytes=vals["comm_bytes"], dtype=self.dtype, link=link)

    def max_seq_len(self, memory_bytes: float | str | None = None, batch: int | None = None, *,
                    quantity: str = "total_bytes", multiple_of: int = 1, limit: int = 2**40,
                    **sizes: int) -> int:
        """The longest sequence whose ``quantity`` fits in ``memory_bytes`` (0 if none fits).

        ``memory_bytes`` defaults to the device's memory; strings like ``"80GB"`` are parsed.
        ``quantity="total_bytes"`` counts parameters, optimizer state and inputs too;
        ``"peak_bytes"`` only the step itself (what ``gs.measure`` reports). The answer is a
        multiple of ``multiple_of`` (e.g. a chunk size). Memory must not shrink as ``T``
        grows (it never does for the costs fitted here); the search is exact on integers.
        """
        from .units import parse_bytes

        if memory_bytes is None:
            if self.device is None:
                raise ValueError("max_seq_len needs memory_bytes=... (or a report built with device=...)")
            memory_bytes = self.device.memory_bytes
        budget = float(parse_bytes(memory_bytes) if isinstance(memory_bytes, str) else memory_bytes)
        if quantity not in self.expressions:
            raise KeyError(f"unknown quantity {quantity!r}; choose one of {list(self.expressions)}")
        step = max(1, int(multiple_of))

        def fits(t: int) -> bool:
            return self.evaluate(t, batch, **sizes)[quantity] <= budget

        if not fits(step):
            return 0
        lo, hi = 1, 2  # in units of `step`: fits(lo * step) holds
        while hi * step <= limit and fits(hi * step):
            lo, hi = hi, hi * 2
        if hi * step > limit:
            return lo * step if not fits(limit // step * step) else limit // step * step
        return bisect_last(lambda k: fits(k * step), lo, hi) * step

    # ------------------------------------------------------------------ display

    def formula(self, quantity: str) -> str:
        """``quantity`` as a printable formula, e.g. ``'256*B*T + 72256'``."""
        return sympy.sstr(sympy.expand(self.expressions[quantity]) if not self.expressions[quantity].has(sympy.Max)
                          else self.expressions[quantity])

    def describe(self, seq_len: int | None = None, batch: int | None = None, **sizes: int) -> str:
        """A human summary: the formulas, and their values at ``seq_len``/``batch``."""
        vals = self.evaluate(seq_len, batch, **sizes)
        where = ", ".join(f"{k}={v}" for k, v in {"seq_len": seq_len or self.example["seq_len"],
                                                   "batch": batch or self.example["batch"], **sizes}.items())
        sym = ", ".join(f"{s}={n}" for n, s in self.symbols.items())
        lines = [f"cost of plan {self.plan!r} {dict(self.options) or ''} ({self.method}; symbols {sym})"]
        for q, expr in self.expressions.items():
            v = vals[q]
            shown = format_flops(v) if q.endswith("flops") or q.startswith("flops") else format_bytes(v)
            fit = self.fits.get(q) or self.compile_fits.get(q)
            tag = "" if fit is None else (" [exact on all probes]" if fit.exact else
                                          f" [fit error {fit.max_rel_error:.2%}]")
            lines.append(f"  {q:17s} = {self.formula(q)}{tag}")
            lines.append(f"  {'':17s}   = {shown} at {where}")
        if self.device is not None:
            est = self._roofline(vals, self.device)
            lines.append(f"  time ~ {est.seconds:.3g} s on {self.device.name} ({est.label}; {est.bound}-bound)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def to_dict(self, seq_len: int | None = None, batch: int | None = None, **sizes: int) -> dict[str, Any]:
        """JSON-friendly: plan, options, formulas and values at the given sizes."""
        return {
            "plan": self.plan, "options": {k: repr(v) for k, v in self.options.items()}, "method": self.method,
            "symbols": {k: str(v) for k, v in self.symbols.items()},
            "formulas": {q: self.formula(q) for q in self.expressions},
            "values": self.evaluate(seq_len, batch, **sizes),
            "exact": {q: f.exact for q, f in self.fits.items()}, "notes": list(self.notes),
        }

    def short_name(self) -> str:
        """``'seco(chunk_size=64)'``-style label for tables and plots."""
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items() if k not in ("group", "generator"))
        return f"{self.plan}({opts})" if opts else self.plan


"""Check the cost model against measurement: ``gs.cost`` predictions vs. ``gs.measure`` runs.

For one model factory and one plan, :func:`validate_plan` builds the report once (probes at
small sizes), then compiles and *runs* the plan for real at each sequence length and
compares the predicted peak memory and FLOPs with what :func:`gradshard.measure.measure`
reports for the same step (:func:`~gradshard.cost.probe.make_step`). The test suite and
``bench/bench_cost_validation.py`` use it; :func:`bisect_max_seq_len` is the ground truth
that ``CostReport.max_seq_len`` is checked against.

:data:`VALIDATION_CASES` holds, per plan, the options and lengths the sweep uses: small
chunks and shards so that every length spans several of them (chunked plans are fitted for
``T >= 4`` chunks), and lengths that are not probe lengths where possible.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from gradshard.errors import GradshardError, summary
from gradshard.cost.build import cost
from gradshard.cost.probe import collector_held, make_step, older_objects_frozen
from gradshard.cost.report import CostReport, bisect_last
from gradshard.passes.respecialize_memo import fresh_memo

__all__ = ["ValidationRow", "FirstStepRow", "ValidationCase", "VALIDATION_CASES", "validate_plan", "measure_step",
           "measure_first_and_steady",
           "bisect_max_seq_len", "plan_applies"]

Factory = Callable[..., tuple[Any, tuple[Any, ...]]]


@dataclass(frozen=True)
class ValidationCase:
    """Options and sequence lengths one plan is validated with."""

    options: Mapping[str, Any]
    seq_lens: tuple[int, ...]
    note: str = ""


#: Plans that compile a long first call at their probe length (67) are also validated at 200
#: steps, where the first call is served from the probe (the first step's last regime).
VALIDATION_CASES: dict[str, ValidationCase] = {
    "none": ValidationCase({}, (24, 40, 80, 128)),
    "seco": ValidationCase({"chunk_size": 8}, (40, 56, 80, 128, 200)),
    "spaco": ValidationCase({"chunk_size": 8, "budget": 2}, (40, 56, 80, 128, 200),
                            "peak: every chunk kept (the worst case); FLOPs: budget/k of the all-chunk backward"),
    "partial_update": ValidationCase({"num_slices": 4, "slice_index": 1}, (24, 40, 80, 128)),
    "adjoint": ValidationCase({"shard_size": 8}, (40, 56, 80, 128, 200)),
    "truncated_adjoint": ValidationCase({"window": 8, "shard_size": 8}, (40, 56, 80, 128, 200)),
}


@dataclass(frozen=True)
class ValidationRow:
    """One (example, plan, seq_len): predicted vs. measured peak bytes and FLOPs (steady step),
    and the same for the first step when the report prices it."""

    example: str
    plan: str
    seq_len: int
    batch: int
    predicted_peak: int
    measured_peak: int
    predicted_flops: int
    measured_flops: int
    probed: bool  # this (batch, seq_len) was one of the report's probes
    first: FirstStepRow | None = None  # the first step of a fresh compiled module

    @property
    def peak_error(self) -> float:
        return abs(self.predicted_peak - self.measured_peak) / max(self.measured_peak, 1)

    @property
    def flops_error(self) -> float:
        return abs(self.predicted_flops - self.measured_flops) / max(self.measured_flops, 1)


@dataclass(frozen=True)
class FirstStepRow:
    """The first step (compile included) at one length: predicted vs. ``gs.measure``'s count."""

    predicted_peak: int
    measured_peak: int
    predicted_allocated: int
    measured_allocated: int
    predicted_flops: int
    measured_flops: int

    @staticmethod
    def _err(p: int, m: int) -> float:
        return abs(p - m) / max(abs(m), 1)

    @property
    def peak_error(self) -> float:
        return self._err(self.predicted_peak, self.measured_peak)

    @property
    def allocated_error(self) -> float:
        return self._err(self.predicted_allocated, self.measured_allocated)

    @property
    def flops_error(self) -> float:
        return self._err(self.predicted_flops, self.measured_flops)


def _step_context(plan: str, options: Mapping[str, Any], seq_len: int) -> Any:
    if plan == "spaco":
        from gradshard.plans.chunked.runtime import force_selection

        return force_selection(range(-(-seq_len // int(options["chunk_size"]))))
    return contextlib.nullcontext()


def measure_step(factory: Factory, plan: str, options: Mapping[str, Any], seq_len: int, batch: int,
                 device: str | torch.device | None = None) -> Any:
    """Compile ``plan`` for the factory's model at ``(batch, seq_len)`` and measure one real step."""
    from gradshard.api import compile as gs_compile
    from gradshard.measure import measure

    target, inputs = factory(seq_len=seq_len, batch=batch)
    if device is not None:
        target, inputs = _to_device((target, inputs), device)
    cm = gs_compile(target, plan, **options)
    cm(*inputs)  # capture + compile, outside the measured step
    for p in cm.parameters():
        p.grad = None
    with _step_context(plan, options, seq_len):
        return measure(make_step(cm), *inputs, repeat=0)  # the instrumented step only


@fresh_memo()  # a fresh process's first step, as the cost model prices it
def measure_first_and_steady(factory: Factory, plan: str, options: Mapping[str, Any], seq_len: int, batch: int,
                             device: str | torch.device | None = None) -> tuple[Any, Any]:
    """``gs.measure`` of a fresh compiled module's first step (its compile included; the garbage
    collector held off, :func:`~gradshard.cost.probe.collector_held`), then of a steady step of
    the same module (gradients cleared in between)."""
    from gradshard.api import compile as gs_compile
    from gradshard.measure import measure

    target, inputs = factory(seq_len=seq_len, batch=batch)
    if device is not None:
        target, inputs = _to_device((target, inputs), device)
    cm = gs_compile(target, plan, **options)
    with _step_context(plan, options, seq_len), collector_held():  # as the cost model prices it
        first = measure(make_step(cm), *inputs, repeat=0)
    for p in cm.parameters():
        p.grad = None
    with _step_context(plan, options, seq_len):
        steady = measure(make_step(cm), *inputs, repeat=0)
    return first, steady


def _to_device(tree: Any, device: str | torch.device) -> Any:
    import torch.nn as nn
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, (torch.Tensor, nn.Module)) else x, tree,
                           is_leaf=lambda x: isinstance(x, nn.Module))


def plan_applies(factory: Factory, plan: str, options: Mapping[str, Any], seq_len: int = 32) -> str | None:
    """``None`` if ``plan`` compiles for the factory's model, else the reason it does not."""
    from gradshard.api import compile as gs_compile

    target, inputs = factory(seq_len=seq_len)
    try:
        gs_compile(target, plan, **options)(*inputs)
    except GradshardError as exc:
        return summary(exc)
    return None


@older_objects_frozen()  # many measured steps, each after a full collection
def validate_plan(name: str, factory: Factory, plan: str, options: Mapping[str, Any] | None = None,
                  seq_lens: Sequence[int] | None = None, batch: int = 2, report: CostReport | None = None,
                  device: str | torch.device | None = None) -> tuple[CostReport, list[ValidationRow], float]:
    """Build the report (unless given) and compare it with measured steps at ``seq_lens``.

    ``device``: where the measured steps run (``"cuda"``: peaks from the CUDA allocator); the
    report is built from fake-tensor probes and does not depend on it.

    Returns ``(report, rows, seconds spent building the report)``.
    """
    case = VALIDATION_CASES.get(plan, ValidationCase({}, (24, 40, 80, 128)))
    options = dict(case.options if options is None else options)
    seq_lens = tuple(case.seq_lens if seq_lens is None else seq_lens)
    t0 = time.perf_counter()
    if report is None:
        target, inputs = factory(seq_len=32)
        report = cost(target, plan, example_inputs=inputs, **options)
    build_s = time.perf_counter() - t0
    probed = {(s.batch, s.seq_len) for s in report.probes}
    priced_first = "first_step_allocated_bytes" in report.expressions
    rows = []
    for t in seq_lens:
        if priced_first:
            m1, m = measure_first_and_steady(factory, plan, options, t, batch, device=device)
        else:
            m1, m = None, measure_step(factory, plan, options, t, batch, device=device)
        v = report.evaluate(seq_len=t, batch=batch)
        flops = v["flops"]
        if plan == "spaco":  # measured with every chunk kept: compare with the all-chunk backward
            k = -(-t // int(options["chunk_size"]))
            q = min(1.0, int(options["budget"]) / k)
            flops = v["flops_fwd"] + round(v["flops_bwd"] / q)
        first = None
        if m1 is not None:
            first = FirstStepRow(v["first_step_peak_bytes"], m1.peak_bytes, v["first_step_allocated_bytes"],
                                 m1.allocated_bytes, int(flops + v["compile_flops"]), m1.flops)
        rows.append(ValidationRow(name, plan, t, batch, v["peak_bytes"], m.peak_bytes, int(flops), m.flops,
                                  (batch, t) in probed, first))
    return report, rows, build_s


@older_objects_frozen()  # many measured steps, each after a full collection
def bisect_max_seq_len(factory: Factory, plan: str, options: Mapping[str, Any], budget: int, *, batch: int,
                       lo: int, hi: int, multiple_of: int = 1) -> int:
    """The longest ``T`` (a multiple of ``multiple_of``, in ``[lo, hi]``) whose *measured* step
    peak fits in ``budget`` bytes, by bisection over real runs (peak assumed non-decreasing)."""
    step = max(1, multiple_of)

    def fits(t: int) -> bool:
        return measure_step(factory, plan, options, t, batch).peak_bytes <= budget

    a, b = lo // step, hi // step
    if not fits(a * step):
        return 0
    if fits(b * step):
        return b * step
    return bisect_last(lambda k: fits(k * step), a, b) * step

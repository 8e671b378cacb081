"""gradshard's cost model: symbolic memory, FLOPs and communication of any plan, before running it.

::

    import gradshard as gs
    from gradshard.cost import compare_plans, cost_table

    report = gs.cost(model, plan="seco", example_inputs=(ids,), chunk_size=512, device="h100")
    report.evaluate(seq_len=1_000_000, batch=8)        # dict of numbers
    report.max_seq_len(memory_bytes="80GB", batch=8)    # the longest context that fits
    report.expressions["peak_bytes"]                    # a sympy expression in B and T
    report.time_estimate(seq_len=65536, batch=8)        # roofline estimate on the device

    rows = compare_plans(model, ["none", ("seco", {"chunk_size": 512})], example_inputs=(ids,),
                         seq_lens=[1000, 64000, 1000000], device="h100")

How the numbers are made: :mod:`gradshard.cost.build` (probe the compiled plan on fake
tensors, fit exact polynomials), :mod:`gradshard.cost.rules` (per-plan rules),
:mod:`gradshard.cost.devices` (profiles and the roofline), :mod:`gradshard.cost.units`
(``"64k"``, ``"80GB"``). The CLI (``gradshard cost``/``whatif``) is a thin layer over
:func:`compare_plans`, :func:`cost_table`, :func:`max_seq_len_table` and
:func:`plot_memory_vs_seq_len` (see :mod:`gradshard.cost.compare` for the commands).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .build import cost
from .compare import CostTable, PlanRequest, compare_plans, cost_reports, cost_table, max_seq_len_table, parse_plans
from .devices import DEVICES, DeviceProfile, RooflineEstimate, devices, get_device, register_device, roofline_seconds
from .plot import plot_memory_vs_seq_len
from .probe import default_loss, make_step
from .report import FIRST_STEP_QUANTITIES, QUANTITIES, CostReport
from .rules import RULES, PlanRule, get_rule, register_rule
from .units import format_bytes, format_count, format_flops, parse_bytes, parse_count, parse_counts

__all__ = [
    "cost", "CostReport", "QUANTITIES", "FIRST_STEP_QUANTITIES", "compare_plans", "cost_reports", "cost_table", "max_seq_len_table",
    "CostTable", "PlanRequest", "parse_plans", "plot_memory_vs_seq_len", "DeviceProfile", "DEVICES", "devices",
    "get_device", "register_device", "roofline_seconds", "RooflineEstimate", "PlanRule", "RULES", "get_rule",
    "register_rule", "parse_count", "parse_counts", "parse_bytes", "format_bytes", "format_count",
    "format_flops", "default_loss", "make_step",
]


class _CallableModule(types.ModuleType):
    """``gradshard.cost`` is both this package and ``gs.cost(...)``.

    Importing the subpackage binds ``gradshard.cost`` to the module object, shadowing the
    lazily exported function of the same name; making the module callable keeps
    ``gs.cost(model, ...)`` working however the package was first imported.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> CostReport:
        return cost(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

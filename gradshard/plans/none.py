"""``plan="none"``: plain autograd through the same pipeline (analysis only)."""

from __future__ import annotations

from dataclasses import dataclass

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.detect_regions import detect_regions
from gradshard.plans.registry import register_plan

PASSES = (
    # Analysis only: plain autograd runs the captured graph unchanged; the findings feed
    # `cm.regions`, `gradshard show` and the cost model. Detection reads the time analysis.
    annotate_time_locality,
    detect_regions,
)


@register_plan("none", passes=PASSES, gradient="exact (plain autograd)",
               doc="Plain autograd through the captured graph.", needs_time_axis=False)
@dataclass(frozen=True)
class NoneOptions:
    """No options."""

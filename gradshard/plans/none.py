"""``plan="none"``: plain autograd through the same pipeline (analysis only)."""

from __future__ import annotations

from dataclasses import dataclass

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.detect_regions import detect_regions
from gradshard.passes.simplify_masks import simplify_attention_masks
from gradshard.plans.registry import register_plan

PASSES = (
    # First, before the analysis reads any mask: a traced causal (T, T) mask that eager
    # would not build (transformers skips it when it can see there is no padding) is folded
    # back into `is_causal`, so plain autograd costs what eager costs.
    simplify_attention_masks,
    # Analysis only: plain autograd runs the captured graph otherwise unchanged; the findings
    # feed `cm.regions`, `gradshard show` and the cost model. Detection reads the time analysis.
    annotate_time_locality,
    detect_regions,
)


@register_plan("none", passes=PASSES, gradient="exact (plain autograd)",
               doc="Plain autograd through the captured graph.", needs_time_axis=False)
@dataclass(frozen=True)
class NoneOptions:
    """No options."""

"""``plan="none"``: plain autograd through the same pipeline (analysis only).

A first call longer than twice :data:`~gradshard.plans.length_generic.PROBE_LENGTH` is
compiled at the probe length and served at its own by re-specialisation, as the chunked plans
are (:mod:`gradshard.plans.length_generic`): capture costs the same at every ``T``. Not for a
model written as a per-step Python loop: plain autograd runs the loop as captured, unrolled,
and an unrolled graph is not length-generic, so that model is captured at each length.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.detect_regions import detect_regions
from gradshard.passes.simplify_masks import simplify_attention_masks
from gradshard.plans.length_generic import PROBE_LENGTH, record_length_generic, serve_new_length
from gradshard.plans.registry import register_plan

PASSES = (
    # First, before the analysis reads any mask: a traced causal (T, T) mask that eager
    # would not build (transformers skips it when it can see there is no padding) is folded
    # back into `is_causal`, so plain autograd costs what eager costs.
    simplify_attention_masks,
    # Analysis: the findings feed `cm.regions`, `gradshard show` and the cost model.
    annotate_time_locality,
    # Everything above is length-generic: kept so another length is served without a capture.
    # Plain autograd runs loops as captured (unrolled): a graph with an unrolled loop is not
    # kept, so such a model is captured at each length (the chunked plans roll loops first).
    record_length_generic,
    # Detection reads the time analysis; it is per length (analysis only).
    detect_regions,
)


@register_plan("none", passes=PASSES, gradient="exact (plain autograd)",
               doc="Plain autograd through the captured graph.", needs_time_axis=False,
               probe_length=PROBE_LENGTH, serve=serve_new_length, probe_until=record_length_generic.name)
@dataclass(frozen=True)
class NoneOptions:
    """No options."""

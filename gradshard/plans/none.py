"""``plan="none"``: plain autograd through the same pipeline (analysis only).

A first call longer than twice :data:`~gradshard.plans.length_generic.PROBE_LENGTH` is
compiled at the probe length and served at its own by re-specialisation, as the chunked plans
are (:mod:`gradshard.plans.length_generic`): capture costs the same at every ``T``. A model
written as a per-step Python loop is the exception: plain autograd runs the loop as captured,
unrolled, and a graph unrolled ``T`` times costs time and Python heap that grow with ``T`` to
capture (HF Mamba's slow path: 80 s and 8 GB at T=1024) while giving back nothing eager
autograd does not. So at any length but the one captured, such a model runs *eagerly*: the
module itself, under plain autograd, which is what this plan computes
(:func:`serve_or_run_eagerly`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.detect_regions import detect_regions
from gradshard.passes.simplify_masks import simplify_attention_masks
from gradshard.plans.length_generic import (PROBE_LENGTH, UNROLLED_KEY, UnrolledLoop, entries_at_new_length,
                                            record_length_generic, serve_new_length)
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
    # kept, and such a model runs eagerly at other lengths (the chunked plans roll loops first).
    record_length_generic,
    # Detection reads the time analysis; it is per length (analysis only).
    detect_regions,
)


def serve_or_run_eagerly(cm: Any, args: tuple, kwargs: dict) -> Optional[Any]:
    """Specialiser: a new length served from the kept graph (:func:`serve_new_length`); for a
    model whose graph holds an unrolled loop, an entry that runs the module eagerly at the new
    length (``extras["run_eagerly"]``: ``CompiledModule.forward`` calls the module itself).

    Eager is this plan at any length: the same module under the same autograd, its buffers
    updated once by the module itself, its modes and parameters read live."""
    served = serve_new_length(cm, args, kwargs)
    if served is not None:
        return served
    for entry, unrolled, (T_new, _) in entries_at_new_length(cm, args, kwargs, UNROLLED_KEY, UnrolledLoop):
        reason = (f"running the module eagerly at T={T_new} (plain autograd, what this plan computes): its "
                  f"graph holds {unrolled.loops} per-step Python loop(s), unrolled {unrolled.seq_len} times at "
                  f"T={unrolled.seq_len}; capturing at T={T_new} would unroll {T_new} steps, at a cost in time "
                  "and host memory that grows with T. The graph below is the one captured at "
                  f"T={unrolled.seq_len}.")
        return dataclasses.replace(entry, extras={"run_eagerly": reason, "seq_len": T_new})
    return None


@register_plan("none", passes=PASSES, gradient="exact (plain autograd)",
               doc="Plain autograd through the captured graph.", needs_time_axis=False,
               probe_length=PROBE_LENGTH, serve=serve_or_run_eagerly, probe_until=record_length_generic.name)
@dataclass(frozen=True)
class NoneOptions:
    """No options."""

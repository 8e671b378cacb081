"""plan="partial_update": partial parameter updates (Filippova et al., 2025).

Selected projections are split into one trainable slice (slice ``slice_index``, default
``rank mod num_slices``) and frozen slices; the forward is unchanged, the backward forms
input gradients through every slice and the weight gradient of the trainable slice only.
Pair it with :class:`gradshard.distributed.diloco.PartialDiLoCo` for the outer loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.detect_regions import detect_regions
from gradshard.passes.simplify_masks import simplify_attention_masks
from gradshard.plans.length_generic import PROBE_LENGTH, record_length_generic, serve_new_length
from gradshard.plans.partial_update.detect import detect_sliceable_linears
from gradshard.plans.partial_update.rewrite import rewrite_partial_update
from gradshard.plans.registry import register_plan

PASSES = (
    # As in plan none: a traced causal (T, T) mask eager would not build becomes is_causal.
    simplify_attention_masks,
    # Analysis for cm.regions / explain (non-strict: a model without a time axis is fine).
    annotate_time_locality,
    # As in plan none: the graph is kept from here (unless it holds an unrolled loop), so another
    # length is served without a capture; the slicing below is per length.
    record_length_generic,
    detect_regions,
    # Must see the captured aten.linear / aten.addmm nodes (and the view/split ops after
    # them, which reveal fused projections), so it runs before the rewrite replaces them.
    detect_sliceable_linears,
    # Consumes the partial_slice regions found just above.
    rewrite_partial_update,
)


@register_plan(
    "partial_update", passes=PASSES, gradient="exact on the trainable slice, none elsewhere",
    doc="Train one slice of each MLP / attention input projection per rank (partial updates); "
        "fused qkv / gate_up projections are sliced per block, biases are trained whole.",
    needs_time_axis=False, probe_length=PROBE_LENGTH, serve=serve_new_length,
    probe_until=record_length_generic.name)
@dataclass(frozen=True)
class PartialUpdateOptions:
    num_slices: int = 4
    slice_index: int | None = None
    targets: tuple[str, ...] = ("mlp", "attention")

    def __post_init__(self) -> None:
        # targets="mlp" means ("mlp",), not the letters ('m', 'l', 'p')
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        elif isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))

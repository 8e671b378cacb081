"""plan="partial_update": partial parameter updates (Filippova et al., 2025).

Selected projections are split into one trainable slice (slice ``slice_index``, default
``rank mod num_slices``) and frozen slices; the forward is unchanged, the backward forms
input gradients through every slice and the weight gradient of the trainable slice only.
Pair it with :class:`gradshard.distributed.diloco.PartialDiLoCo` for the outer loop.
"""

from __future__ import annotations

from gradshard.plans import PartialUpdateOptions, PlanSpec, register_plan

register_plan(PlanSpec(
    name="partial_update",
    options=PartialUpdateOptions,
    passes=(
        # Analysis for cm.regions / explain (non-strict: a model without a time axis is fine).
        "annotate_time:annotate_time_locality",
        "detect_regions:detect_regions",
        # Must see the captured aten.linear / aten.addmm nodes (and the view/split ops after
        # them, which reveal fused projections), so it runs before the rewrite replaces them.
        "detect_partial:detect_sliceable_linears",
        # Consumes the partial_slice regions found just above.
        "rewrite_partial:rewrite_partial_update",
    ),
    gradient="exact on the trainable slice, none elsewhere",
    doc="Train one slice of each MLP / attention input projection per rank (partial updates); "
        "fused qkv / gate_up projections are sliced per block, biases are trained whole.",
    needs_time_axis=False,
))

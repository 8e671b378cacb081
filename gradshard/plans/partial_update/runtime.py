"""Partial parameter updates: weights split into one trainable slice and frozen slices.

A targeted ``nn.Linear`` with weight ``W`` of shape ``(out, in)`` is split along one
dimension into ``N`` contiguous slices ``W_0 .. W_{N-1}``; slice ``k`` (the rank's slice,
by default ``rank mod N``) is an ``nn.Parameter``, the others are buffers::

    before:  y = x @ W.T + b                         W: (out, in), one Parameter
    after:   dim=0 (output split, MLP up/gate, q/k/v by head groups)
               y = cat_n(x @ W_n.T + b_n)            W_n: (out_n, in)
             dim=1 (input split, MLP down)
               y = sum_n(x[..., in_n] @ W_n.T) + b   W_n: (out, in_n)

A *fused* projection (``qkv``, ``gate_up``) is split inside each block: the split dim is
cut into contiguous runs and slice ``k`` owns one run per block (``SliceLayout.owners``);
each trainable run is its own Parameter. A weight stored ``(in, out)`` (GPT-2's
``Conv1D``) is sliced along the matching stored dim (``SlicedLinear(transposed=True)``).
The bias is split with the weight (``dim=0``, the standalone :func:`slice_linears` API) or
trained whole (``dim=1``; and every layer of the compiled plan, which keeps the user's own
bias Parameter and passes it in from the graph).

The forward value is the same as ``F.linear(x, W, b)``. The backward propagates the input
gradient through *every* slice but forms the weight gradient of the trainable slice only,
with split matmuls, so the skipped weight-gradient FLOPs (``2 * m * (out*in - |W_k|)``
for ``m`` tokens) are really skipped (paper, Appendix C.1). Frozen slices carry no
gradient and, not being parameters, get no optimizer state.

Slice metadata follows docs/DESIGN.md: :func:`parameter_slices` returns
``{slice_name: (original_name, (dim, start, stop))}``; :func:`full_parameters` and
:func:`load_full_parameters` convert between the sliced module and full weights under
the original names (checkpoints, export, the DiLoCo outer loop).

The code is split by job: :mod:`.layout` (slice layouts), :mod:`.linear` (the split-matmul
autograd function), :mod:`.sliced` (:class:`SlicedLinear`, :func:`slice_linears`) and
:mod:`.views` (whole-model views: slice metadata, full parameters, state dicts). This module
is their public face.
"""

from __future__ import annotations

from gradshard.plans.partial_update.layout import (
    PartialUpdateError,
    SliceLayout,
    attention_layouts,
    default_slice_index,
    even_bounds,
    layout_from_owners,
    mlp_in_layout,
    mlp_out_layout,
)
from gradshard.plans.partial_update.linear import partial_linear
from gradshard.plans.partial_update.sliced import SlicedLinear, slice_linears
from gradshard.plans.partial_update.views import (
    full_parameters,
    load_full_parameters,
    materialized_state_dict,
    parameter_slices,
    predicted_backward_flops_saved,
)

__all__ = [
    "PartialUpdateError",
    "SliceLayout",
    "layout_from_owners",
    "even_bounds",
    "mlp_in_layout",
    "mlp_out_layout",
    "attention_layouts",
    "default_slice_index",
    "partial_linear",
    "SlicedLinear",
    "slice_linears",
    "parameter_slices",
    "full_parameters",
    "load_full_parameters",
    "materialized_state_dict",
    "predicted_backward_flops_saved",
]

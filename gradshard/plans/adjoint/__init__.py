"""Register ``plan="adjoint"`` and ``plan="truncated_adjoint"`` (adjoint sharding, Xu et al.).

Both plans share one pipeline; the options decide the backward (exact adjoint, or the
windowed adjoint with ``window``). This folder holds the plan's own passes (``rewrite``,
``region``, ``remat``, ``tail``) and the runtime modules they emit (``runtime``, ``local``,
``generic``, ``scan``, ``truncated``, ``respecialize``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.check_mutations import refuse_unordered_mutations
from gradshard.passes.canonicalize_recurrence import canonicalize_recurrences
from gradshard.passes.detect_regions import detect_regions
from gradshard.passes.recurrence_delta import rewrite_delta_rule_blocks
from gradshard.passes.recurrence_mlstm import rewrite_chunkwise_mlstm
from gradshard.passes.recurrence_driven import roll_driven_loops
from gradshard.passes.roll_loops import roll_loops
from gradshard.passes.simplify_masks import simplify_attention_masks
from gradshard.passes.trim_padding import drop_right_padding
from gradshard.plans.adjoint.rewrite import rewrite_adjoint
from gradshard.plans.registry import register_plan

PASSES = (
    # 0. before any analysis: attention layers of a hybrid keep plain autograd, so a traced
    #    (T, T) mask that eager would not build is folded back into is_causal first.
    simplify_attention_masks,
    # Before the time analysis: the blocked gated delta rule (time split over blocks, a solve
    # along the steps of a block) becomes one dense scan along time, which the analysis follows.
    rewrite_delta_rule_blocks,
    # Before the time analysis too: xLSTM's chunkwise mLSTM (a loop over blocks with one stabiliser
    # per block, outputs from a masked intra-block product) becomes its step recurrence, a loop
    # carrying (C, n, m) that the loop rolling below handles (proven on the region first).
    rewrite_chunkwise_mlstm,
    # Before anything cuts the graph along its data flow, after the block rewrites (xLSTM's and
    #    the delta rule's loops write their per-block pieces in place; those rewrites consume them):
    #    an in-place write that a later reader sees only through the mutation is refused here.
    refuse_unordered_mutations,
    # 1. time axis and per-node reach: everything below reads ctx.analyses["time"].
    annotate_time_locality,
    # 1b. a loop carrying linear states beside a driver (a running maximum: RWKV, mLSTM)
    #     becomes a driver loop and one scan of the states; needs the time analysis (finds the
    #     loops), before roll_loops (which rolls one carried state and would refuse it).
    roll_driven_loops,
    # 2. roll unrolled per-timestep loops into one scan each; must precede detection (the
    #    detectors see scans, not T copies of a step) and recomputes the time analysis.
    roll_loops,
    # 3. rewrite vectorised scans (log-space cumsum, associative_scan trees, cumsum) as one
    #    scan-op node each and recompute the time analysis; after rolling (loops become scan
    #    ops too), before detection (which then sees one node per recurrence).
    canonicalize_recurrences,
    # 3b. a block-form scan's right padding cut back by a slice through pointwise ops (Mamba-2's
    #     skip connection) reads the unpadded values; after canonicalization, which emits such
    #     pads around the scans it rewrites, before detection and the tails (a pad stops them).
    drop_right_padding,
    # 4. report regions (recurrences, and anything else that reads far along time); pure.
    detect_regions,
    # 5. cut each recurrence's producers/scan/readout into one AdjointRegion module; needs
    #    the regions of step 4 (it replaces them with the per-layer regions it installs).
    rewrite_adjoint,
)

#: A long first call is compiled at this many steps and served by re-specialising the program
#: (:mod:`gradshard.plans.adjoint.generic`): capture and the passes cost the same at any T, and a
#: per-step Python loop unrolls this many steps, not T. A prime: a length equal to a model size
#: (64 channels) makes the re-specialiser refuse, since it cannot tell the two integers apart.
PROBE_LENGTH = 67


@register_plan(
    "adjoint", passes=PASSES, gradient="exact", probe_length=PROBE_LENGTH,
    doc="Adjoint sharding: per layer, store the layer input and state checkpoints; the backward "
        "runs the adjoint reverse scan and independent VJP shards over time.")
@dataclass(frozen=True)
class AdjointOptions:
    shard_size: int = 256
    #: every other layer's input recomputed from the layer before (its forward rerun per backward
    #: window), not kept: about half the layer inputs' memory for one more forward per layer pair
    recompute_layer_inputs: bool = False
    #: the segment after the last region (norm, head, loss) writes its input's gradient over that
    #: input's rows as its backward shards finish with them; False keeps the input, which a
    #: second backward through one forward (``retain_graph=True``) needs
    reuse_input_buffers: bool = True
    #: a region whose state is an outer product read by a contraction (Mamba-2's SSD, linear
    #: attention) runs each shard as chunked linear attention, never forming per-step states
    #: (:mod:`gradshard.plans.adjoint.chunked`); False: per-step scans and the adjoint scan
    chunked: bool = True


@register_plan(
    "truncated_adjoint", passes=PASSES, probe_length=PROBE_LENGTH,
    gradient="exact for window >= T; windowed (each loss term reaches the last `window` transitions) otherwise",
    doc="Truncated adjoint sharding: like adjoint, with the adjoint state truncated to `window` "
        "steps (computed blockwise in O(T)).")
@dataclass(frozen=True)
class TruncatedAdjointOptions:
    window: int
    shard_size: int = 256
    recompute_layer_inputs: bool = False  # as for plan="adjoint"
    reuse_input_buffers: bool = True  # as for plan="adjoint"
    #: as for plan="adjoint", on calls with ``window >= T`` (the exact adjoint); shorter windows
    #: truncate the per-step adjoint state, so those calls run the per-step form
    chunked: bool = True

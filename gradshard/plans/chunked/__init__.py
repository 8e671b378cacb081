"""Chunk-wise optimisation plans: ``seco`` (exact) and ``spaco`` (sparse, unbiased by default).

Li et al., "Training Long-Context LLMs Efficiently via Chunk-wise Optimization"; semantics
in docs/DESIGN.md (``seco``, ``spaco``). Both plans share one pipeline; the plan name selects
whether the backward visits every chunk or a sampled subset (see
:mod:`gradshard.plans.chunked.runtime`). A first call longer than twice ``PROBE_LENGTH`` is
compiled at the probe and served by re-specialising the length-generic graph
(:mod:`gradshard.plans.length_generic`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.check_mutations import refuse_unordered_mutations
from gradshard.passes.canonicalize_recurrence import canonicalize_recurrences
from gradshard.passes.detect_regions import detect_regions
from gradshard.passes.recurrence_delta import rewrite_delta_rule_blocks
from gradshard.passes.recurrence_mlstm import rewrite_chunkwise_mlstm
from gradshard.passes.roll_loops import roll_loops_carrying
from gradshard.passes.simplify_masks import simplify_attention_masks
from gradshard.plans.chunked.plan import plan_chunk_program
from gradshard.plans.length_generic import PROBE_LENGTH, record_length_generic, serve_new_length
from gradshard.plans.chunked.rewrite import rewrite_chunked
from gradshard.plans.registry import register_plan

PASSES = (
    # Before any analysis: a traced mask with always-true terms, or a causal mask written
    # out, would otherwise be hoisted as a (T, T) tensor by the planner.
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
    # The time analysis comes next: everything after reads ctx.analyses["time"].
    annotate_time_locality,
    # Per-timestep Python loops become one linear_scan each, or, without a linear update, one
    # carried loop (both run chunk by chunk with their carried values); needs the time analysis
    # and recomputes it, so detection below sees the scans.
    roll_loops_carrying,
    # Vectorised scans the chunk rules cannot carry themselves (associative_scan trees) become
    # one scan op each; after rolling, before detection; recomputes the time analysis.
    canonicalize_recurrences,
    # Everything above is length-generic, everything below plans for this length: keep the
    # graph here (with the time analysis' facts) so another length is served from it without
    # a new capture (serve_new_length). After rolling (a rolled loop serves any length).
    record_length_generic,
    # Detectors (attention among them) need the time analysis (causality, score matrices);
    # their attention regions name the KV cache points the planner keeps.
    detect_regions,
    # The planner needs the regions (KV sources) and the time analysis; it only analyses.
    plan_chunk_program,
    # The rewrite needs the chunk program; it must be last (it replaces the whole body).
    rewrite_chunked,
)


@register_plan(
    "seco", passes=PASSES, gradient="exact", probe_length=PROBE_LENGTH, serve=serve_new_length,
    probe_until=record_length_generic.name,
    doc="Sequential chunk-wise optimisation: forward chunk by chunk keeping the KV cache and scan "
        "states, backward one recomputed chunk at a time in reverse order.")
@dataclass(frozen=True)
class SecoOptions:
    chunk_size: int = 512


@register_plan(
    "spaco", passes=PASSES, probe_length=PROBE_LENGTH, serve=serve_new_length,
    probe_until=record_length_generic.name,
    gradient="unbiased estimate (sampling='bernoulli', no cap); biased with 'fixed' or max_compensation",
    doc="Sparse chunk-wise optimisation: like seco, but the backward runs only a sampled subset of "
        "chunks (budget t of k) with compensation factors.")
@dataclass(frozen=True)
class SpacoOptions:
    chunk_size: int = 512
    budget: int = 8
    sampling: str = "bernoulli"
    max_compensation: float | None = None
    generator: Any = field(default=None, compare=False)

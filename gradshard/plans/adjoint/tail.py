"""Find the time-local segments around the recurrences that the adjoint plans recompute in shards.

After ``rewrite_adjoint`` a model's recurrences keep only their layer inputs and state
checkpoints; what follows the last recurrence (final norm, LM head, ...) and what sits between
two recurrences outside their producers and readouts (an MLP block between SSM layers) would
run under plain autograd, which keeps every intermediate its backward reads. When such a
segment is pointwise in time, the plan runs it as a
:class:`~gradshard.plans.adjoint.local.LocalSegment` that keeps only the segment's inputs
and recomputes it shard by shard in the backward.

:func:`find_local_tails` picks the tail from the time analysis of the graph *before* the
regions are installed:

1. candidates: ``call_function`` nodes outside the regions, carry one time dim,
   read position ``t`` only (own reach ``[0, 0]``, or a split beside time) or a causal
   window of at most ``time_local.MAX_HALO`` positions before it (``conv1d``, and the slice cutting
   its output back to full length), read at least one time-carrying value, and are neither
   random, in place, nor position-sensitive (``cat``/``slice``/``index``/...). Shards are
   positions, not absolute steps: a value whose position 0 holds step 1 (next-token targets,
   ``pad`` + ``slice``) is cut like any other once it exists at full length. A segment with a
   window (its halo: the longest sum of windows along a path) runs each shard on its inputs
   from ``halo`` steps earlier and keeps only the shard's own outputs;
2. convexity: each connected piece must not leave and re-enter itself (a piece runs as one
   call); the nodes past such an exit form a piece of their own;
3. boundary: outputs and time-carrying inputs must have exactly one full-length time dim, or
   an output is a reduction over time of a candidate (a loss: ``sum``, ``mean``,
   ``cross_entropy``; :mod:`gradshard.plans.adjoint.reductions`), read outside only;
4. peeling: a node whose inputs all lie outside is moved out while that does not raise the
   bytes the segment must keep (so ``y + out`` stays outside when ``y`` is kept anyway);
5. recomputed inputs: in a piece worth running as a segment, an input a cheap chain computes
   from the piece's other inputs is copied into it (:mod:`gradshard.plans.adjoint.tail_remat`);
6. benefit: a connected piece is kept only if plain autograd would save more bytes for it
   (replayed on meta tensors with saved-tensor hooks) than the segment keeps.

Bytes kept for free: graph inputs, parameters and constants, and values the caller says are
kept anyway (the time-carrying inputs a region saves, the anchors its input remats read).
Which nodes can run on a window of time: :mod:`gradshard.plans.adjoint.time_local`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from gradshard.plans.adjoint.tail_remat import rematerialize_segment_inputs
from gradshard.plans.adjoint.time_local import (boundary, full_time_dim, halo_in_time, is_free, kept_bytes,
                                                 path_halo, reduces_over_time, timed, value_of)

__all__ = ["TailPlan", "find_local_tails", "autograd_saved_bytes"]


@dataclass
class TailPlan:
    """One time-local segment to run as a ``LocalSegment``."""

    nodes: list[fx.Node]  # graph order
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    input_time_dims: tuple[Optional[int], ...]
    output_time_dims: tuple[Optional[int], ...]  # None: a reduction over time (summed over shards)
    autograd_saved: int  # bytes plain autograd keeps for these nodes (not counting free values)
    kept: int  # bytes the segment keeps (its non-free inputs)
    halo: int = 0  # steps before a shard its outputs read (a causal conv's window - 1)

def _convex(order: list[fx.Node], cand: set[fx.Node]) -> set[fx.Node]:
    """Drop candidates reachable from a candidate through a non-candidate (single topological sweep)."""
    keep: set[fx.Node] = set()
    tainted: set[fx.Node] = set()
    for n in order:
        ins = n.all_input_nodes
        if n in cand:
            if any(a in tainted for a in ins):
                tainted.add(n)
            else:
                keep.add(n)
        elif any(a in keep or a in tainted for a in ins):
            tainted.add(n)
    return keep

def _components(nodes: set[fx.Node]) -> list[set[fx.Node]]:
    left = set(nodes)
    comps = []
    while left:
        stack = [left.pop()]
        comp: set[fx.Node] = set()
        while stack:
            n = stack.pop()
            comp.add(n)
            for m in [*n.all_input_nodes, *n.users]:
                if m in left:
                    left.discard(m)
                    stack.append(m)
        comps.append(comp)
    return comps


def _meta_like(v: torch.Tensor, grad: bool = True) -> torch.Tensor:
    t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    return t.requires_grad_(grad) if t.is_floating_point() else t


def _replay_saved(nodes: list[fx.Node]) -> Optional[tuple[dict[int, int], dict[int, fx.Node]]]:
    """Replay ``nodes`` (graph order) on meta tensors under saved-tensor hooks.

    Returns the saved storages (key -> bytes) and the node owning each storage the replay
    created or received (key -> node); ``None`` if an op has no meta kernel.
    """
    env: dict[fx.Node, Any] = {}
    owner: dict[int, fx.Node] = {}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        keep.append(t)
        seen.setdefault(st._cdata, st.nbytes())
        return t

    def own(n: fx.Node, v: Any) -> None:
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                owner.setdefault(t.untyped_storage()._cdata, n)

    def arg(a: fx.Node) -> Any:
        if a not in env:
            v = value_of(a)
            # a graph input keeps its own flag (a loss's class weights are a buffer: no gradient;
            # a parameter traced on fake values is tagged by capture)
            grad = a.op != "placeholder" or v is None or v.requires_grad or bool(a.meta.get("gs_requires_grad"))
            env[a] = _meta_like(v, grad) if v is not None else a.meta.get("val")
            own(a, env[a])
        return env[a]

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            for n in nodes:
                args = fx.node.map_arg(n.args, arg)
                kwargs = fx.node.map_arg(n.kwargs, arg)
                env[n] = n.target(*args, **kwargs)
                own(n, env[n])
    except Exception:  # an op without a meta kernel: unknown
        return None
    return seen, owner


def autograd_saved_bytes(nodes: list[fx.Node], free: set[fx.Node]) -> int:
    """Bytes plain autograd saves for ``nodes`` (graph order), replayed on meta tensors.

    Saved views count once per storage; storages of free values count nothing; an op
    without a meta kernel makes the answer 0 (unknown: nothing is gained by recomputing).
    """
    return _saved_bytes(_replay_saved(nodes), free)


def _saved_bytes(got: Optional[tuple[dict[int, int], dict[int, fx.Node]]], free: set[fx.Node]) -> int:
    """:func:`autograd_saved_bytes` from a replay's result."""
    if got is None:
        return 0
    seen, owner = got
    return sum(b for k, b in seen.items() if not (k in owner and is_free(owner[k], free)))


def _saves_only(n: fx.Node, allowed: set[fx.Node], free: set[fx.Node]) -> bool:
    """Whether autograd, for ``n`` alone, saves nothing but free values and values in ``allowed``."""
    got = _replay_saved([n])
    if got is None:
        return False
    seen, owner = got
    for k, b in seen.items():
        who = owner.get(k)
        if b and (who is None or not (is_free(who, free) or who in allowed)):
            return False
    return True


def _read_only_past(keep: set[fx.Node], rest: set[fx.Node], comp: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``keep`` that go with ``rest``, the piece past a convexity exit: a chain
    fed from outside ``comp`` and read only by ``rest`` (a loss's shifted, reshaped targets)."""
    past: set[fx.Node] = set()
    changed = True
    while changed:  # read only by rest, or by nodes read only by rest
        changed = False
        for n in keep - past:
            if n.users and all(u in rest or u in past for u in n.users):
                past.add(n)
                changed = True
    changed = True
    while changed:  # and fed by nothing in comp that stays
        changed = False
        for n in list(past):
            if any(a in comp and a not in past for a in n.all_input_nodes):
                past.discard(n)
                changed = True
    return past


def _convex_pieces(order: list[fx.Node], cand: set[fx.Node], tl: Any, facts: dict) -> list[set[fx.Node]]:
    """Candidates split into connected pieces, each convex (no path leaves a piece and comes back:
    a piece runs as one call) and with full-length single time dims at its boundary. The nodes of a
    piece past such an exit start a piece of their own; nodes at a bad boundary are dropped."""
    pieces: list[set[fx.Node]] = []
    pending = [set(cand)]
    while pending:
        for comp in _components(pending.pop()):
            keep = _convex(order, comp)
            if keep != comp:
                keep -= _read_only_past(keep, comp - keep, comp)
                pending += [keep, comp - keep]
                continue
            inputs, outputs = boundary(comp)
            bad = {n for n in outputs if full_time_dim(tl, facts, n) is None and not reduces_over_time(tl, facts, n)}
            for x in inputs:
                if timed(tl, x) and full_time_dim(tl, facts, x) is None:
                    bad |= {u for u in x.users if u in comp}
            if bad:
                pending.append(comp - bad)
            else:
                pieces.append(comp)
    return pieces


def _acyclic_once_collapsed(order: list[fx.Node], regions: list[set[fx.Node]],
                            pieces: list[set[fx.Node]]) -> list[set[fx.Node]]:
    """Drop pieces until collapsing every region and piece into one call leaves the graph acyclic.

    A piece may be convex in the original graph and still close a cycle through a region, whose
    call makes every output depend on every input (``x_b`` computed by the piece, ``e_a`` read by
    it, the region mapping ``x_a -> e_a`` and ``x_b -> e_b`` separately)."""
    import networkx as nx

    pieces = list(pieces)
    while True:
        group: dict[fx.Node, tuple[str, int]] = {}
        for i, r in enumerate(regions):
            group.update({n: ("region", i) for n in r})
        for i, p in enumerate(pieces):
            group.update({n: ("piece", i) for n in p})
        dag = nx.DiGraph()
        for n in order:
            dag.add_node(group.get(n, n))
            for a in n.all_input_nodes:
                if group.get(a, a) != group.get(n, n):
                    dag.add_edge(group.get(a, a), group.get(n, n))
        try:
            cycle = nx.find_cycle(dag)
        except nx.NetworkXNoCycle:
            return pieces
        on_cycle = [v for edge in cycle for v in edge[:2] if isinstance(v, tuple) and v[0] == "piece"]
        if not on_cycle:
            raise RuntimeError("internal: the recurrence regions form a cycle once collapsed")
        del pieces[max(i for _, i in on_cycle)]


def find_local_tails(gm: fx.GraphModule, tl: Any, facts: dict, regions: list[set[fx.Node]],
                     free: set[fx.Node], exported: Iterable[fx.Node] = ()) -> list[TailPlan]:
    """The time-local segments worth recomputing in shards (see module doc): after the last
    recurrence, and between recurrences (an MLP block between two SSM layers).

    ``regions`` (the node sets the region calls replace) never join a segment; ``exported``
    (values a region call will read: the anchors its input remats start from) are outputs of
    the segment computing them.
    """
    order = list(gm.graph.nodes)
    barred = set().union(*regions)
    exported = set(exported)
    cand = {n for n in order if n not in barred and halo_in_time(tl, facts, n) is not None}
    # a reduction over time ends a segment: no candidate may read its (whole-sequence) value
    cand |= {n for n in order if n not in barred and reduces_over_time(tl, facts, n)
             and not any(u in cand for u in n.users)}
    pieces = _convex_pieces(order, cand, tl, facts)
    # peeling removes only source nodes of a piece: what is left stays convex
    pieces = [q for p in pieces for q in _components(_peel(p, free, tl, facts)) if q]
    pieces = _acyclic_once_collapsed(order, regions, pieces)
    pieces = [_with_inputs_recomputed(gm, tl, facts, p, free, barred) for p in pieces]
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    plans = []
    for comp in pieces:
        nodes = sorted(comp, key=pos.get)
        halo = path_halo(nodes, tl, facts)
        if halo:  # a shard's window starts before the shard: a reduction would count those steps twice
            comp -= {n for n in comp if reduces_over_time(tl, facts, n)}
            nodes = sorted(comp, key=pos.get)
        replay = _replay_saved(nodes)
        if replay is None:  # e.g. a weighted, smoothed cross-entropy has no meta kernel:
            comp -= {n for n in comp if reduces_over_time(tl, facts, n)}  # keep the rest
            nodes = sorted(comp, key=pos.get)
            replay = _replay_saved(nodes)
        inputs, outputs = boundary(comp)
        outputs += [n for n in comp & exported if n not in outputs]
        inputs.sort(key=pos.get)
        outputs.sort(key=pos.get)
        saved = _saved_bytes(replay, free)
        kept = kept_bytes(inputs, free)
        if saved <= kept:
            continue
        plans.append(TailPlan(nodes, inputs, outputs,
                              tuple(full_time_dim(tl, facts, x) if timed(tl, x) else None for x in inputs),
                              tuple(full_time_dim(tl, facts, y) for y in outputs), saved, kept, halo))
    return plans


def _with_inputs_recomputed(gm: fx.GraphModule, tl: Any, facts: dict, piece: set[fx.Node],
                            free: set[fx.Node], barred: set[fx.Node]) -> set[fx.Node]:
    """``piece``, and copies of cheap chains computing its inputs when the piece is worth running
    as a segment (:mod:`gradshard.plans.adjoint.tail_remat`); a piece that is not stays as it is,
    so no copy runs under plain autograd."""
    nodes = sorted(piece, key={n: i for i, n in enumerate(gm.graph.nodes)}.get)
    if _saved_bytes(_replay_saved(nodes), free) <= kept_bytes(boundary(piece)[0], free):
        return piece
    return rematerialize_segment_inputs(gm, tl, facts, piece, free, barred)


def _peel(cand: set[fx.Node], free: set[fx.Node], tl: Any, facts: dict) -> set[fx.Node]:
    """Move out nodes whose inputs all lie outside while the bytes kept do not grow.

    A node moved out runs under autograd again: it may leave only if its backward saves
    nothing but free values and values the segment keeps anyway (``y + out``, ``0.1 * x``),
    and, as the segment's input then, it has a time dim a shard can cut (not ``(B*T,)`` targets).
    """
    cand = set(cand)
    changed = True
    while changed:
        changed = False
        cost = kept_bytes(boundary(cand)[0], free)
        for n in sorted(cand, key=lambda m: m.name):
            if any(a in cand for a in n.all_input_nodes) or timed(tl, n) and full_time_dim(tl, facts, n) is None:
                continue
            rest = cand - {n}
            rest_inputs = boundary(rest)[0]
            if kept_bytes(rest_inputs, free) <= cost and _saves_only(n, set(rest_inputs), free):
                cand = rest
                changed = True
                break
    return cand

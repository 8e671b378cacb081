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
   window of at most :data:`MAX_HALO` positions before it (``conv1d``, and the slice cutting
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
5. benefit: a connected piece is kept only if plain autograd would save more bytes for it
   (replayed on meta tensors with saved-tensor hooks) than the segment keeps.

Bytes kept for free: graph inputs, parameters and constants, and values the caller says are
kept anyway (the time-carrying inputs a region saves).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from gradshard.analysis.node_costs import tensor_bytes

from gradshard.plans.adjoint.reductions import time_reduction

aten = torch.ops.aten

__all__ = ["TailPlan", "find_local_tails", "pointwise_in_time", "autograd_saved_bytes"]

# ops that move, select or join along an axis: their value at step t may depend on positions
_POSITIONAL = {
    "cat", "stack", "slice", "narrow", "select", "index", "index_select", "gather", "scatter", "scatter_add",
    "constant_pad_nd", "pad", "reflection_pad1d", "replication_pad1d", "roll", "flip", "split", "split_with_sizes",
    "unbind", "chunk", "tensor_split", "arange", "as_strided", "take_along_dim", "diagonal", "tril", "triu",
    "cumsum", "cumprod", "linear_scan",
}


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


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _op_name(n: fx.Node) -> str:
    t = n.target
    packet = getattr(t, "_overloadpacket", None)
    return getattr(packet, "__name__", getattr(t, "__name__", str(t))).rstrip("_")


def _time_dim_fact(tl: Any, facts: dict, n: fx.Node) -> Optional[tuple[int, Any]]:
    """The node's one time dim and its size fact; ``None`` if it has none or several.

    Whatever step its position 0 holds (``origin``): a shard cuts positions."""
    info = tl.info.get(n.name)
    if info is None or len(info.time_dims) != 1:
        return None
    d = info.time_dims[0]
    f = facts.get(n.name, ())
    return (d, f[d]) if d < len(f) and f[d] is not None else None


def full_time_dim(tl: Any, facts: dict, n: fx.Node) -> Optional[int]:
    """The node's time dim if it has exactly one, of full length (``shift 0``); else ``None``."""
    got = _time_dim_fact(tl, facts, n)
    return got[0] if got is not None and got[1].kind == "shift" and got[1].value == 0 else None


def _timed(tl: Any, n: fx.Node) -> bool:
    info = tl.info.get(n.name)
    return info is not None and bool(info.time_dims)


def pointwise_in_time(tl: Any, n: fx.Node) -> bool:
    """Whether ``n`` computes position ``t`` of its time-carrying output from position ``t`` of
    its inputs only (whatever steps those positions hold: ``logits[t]`` beside ``labels[t + 1]``)."""
    if n.op != "call_function" or _val(n) is None:
        return False
    info = tl.info.get(n.name)
    if info is None or len(info.time_dims) != 1:
        return False
    if info.local is None or not info.local.is_pointwise:
        return False
    if n.target is operator.getitem or not isinstance(n.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in n.target.tags or n.target._schema.is_mutable:
        return False
    if _op_name(n) in _POSITIONAL:
        return False
    # a time-carrying value built from no time-carrying input (positions, constants) is not
    return any(_timed(tl, a) for a in n.all_input_nodes)


#: a segment recomputes at most this many steps before each shard (a causal conv's kernel - 1)
MAX_HALO = 64


def _trims_time(tl: Any, facts: dict, n: fx.Node) -> bool:
    """Whether ``n`` is ``x[..., :T]`` along time: the full-length prefix of a longer value
    (a causal conv's output, padded on both sides, cut back to its input's length)."""
    if n.target is not aten.slice.Tensor or not isinstance(n.args[0], fx.Node) or _val(n.args[0]) is None:
        return False
    x = n.args[0]
    args = list(n.args) + [None] * (5 - len(n.args))
    dim, start, step = args[1] or 0, args[2], args[4] if args[4] is not None else 1
    src, out = _time_dim_fact(tl, facts, x), _time_dim_fact(tl, facts, n)
    if src is None or out is None or step != 1 or start not in (None, 0):
        return False
    return (dim % _val(x).dim() == src[0] == out[0] and out[1].kind == "shift" and out[1].value == 0
            and tl.info[x.name].origin == tl.info[n.name].origin)


_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


def _splits_beside_time(tl: Any, n: fx.Node) -> bool:
    """Whether ``n`` splits a value along a dim other than its time dim (``in_proj`` output
    into gate, conv input and time step), or takes one piece of such a split."""
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        return _splits_beside_time(tl, n.args[0]) and _val(n) is not None
    if n.target not in _SPLITS or not isinstance(n.args[0], fx.Node) or _val(n.args[0]) is None:
        return False
    info, src = tl.info.get(n.name), tl.info.get(n.args[0].name)
    if info is None or src is None or len(src.time_dims) != 1 or info.time_dims != src.time_dims:
        return False
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    return dim % _val(n.args[0]).dim() != src.time_dims[0]


def halo_in_time(tl: Any, facts: dict, n: fx.Node) -> Optional[int]:
    """How many steps before position ``t`` the node reads to compute position ``t`` (0:
    pointwise, or a split beside time; ``k``: a causal window such as ``conv1d`` with ``k``
    left padding, or 0 for the trim of its output back to full length); ``None`` if it cannot
    run on a window of the sequence."""
    if pointwise_in_time(tl, n) or _splits_beside_time(tl, n):
        return 0
    if n.op != "call_function" or _val(n) is None or not isinstance(n.target, torch._ops.OpOverload):
        return None
    if not any(_timed(tl, a) for a in n.all_input_nodes):
        return None
    if _trims_time(tl, facts, n):
        return 0
    info = tl.info.get(n.name)
    if info is None or len(info.time_dims) != 1 or info.local is None or _op_name(n) in _POSITIONAL:
        return None
    if torch.Tag.nondeterministic_seeded in n.target.tags or n.target._schema.is_mutable:
        return None
    lo, hi = info.local.lo, info.local.hi
    if hi > 0 or not -MAX_HALO <= lo <= 0 or lo != int(lo):
        return None
    return int(-lo)


def _halo(nodes: list[fx.Node], tl: Any, facts: dict) -> int:
    """The steps before a shard that ``nodes`` (graph order) read: the largest sum of node halos
    along a path."""
    need: dict[fx.Node, int] = {}
    for n in nodes:
        own = halo_in_time(tl, facts, n) or 0
        need[n] = own + max((need[a] for a in n.all_input_nodes if a in need), default=0)
    return max(need.values(), default=0)


def _whole_time_dim(tl: Any, facts: dict, n: fx.Node) -> Optional[int]:
    """The node's time dim if it holds every step: full length, or merged with batch
    (``(B, T, V) -> (B*T, V)``: a sum over that dim adds the same rows in another order)."""
    got = _time_dim_fact(tl, facts, n)
    if got is None or not (got[1].kind == "scale" or got[1].kind == "shift" and got[1].value == 0):
        return None
    return got[0]


def reduces_over_time(tl: Any, facts: dict, n: fx.Node) -> bool:
    """Whether ``n`` reduces a time-carrying value holding every step over time (a rule in
    :data:`~gradshard.plans.adjoint.reductions.REDUCTIONS`) and every other time-carrying input
    it reads (a loss's targets) holds every step too (full length, or merged with batch)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node) or _timed(tl, n):
        return False
    if not time_reduction(n, _whole_time_dim(tl, facts, n.args[0])):
        return False
    return all(_whole_time_dim(tl, facts, a) is not None for a in n.all_input_nodes if _timed(tl, a))


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


def _boundary(nodes: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    order = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in nodes:
                order.setdefault(a, None)
    outputs = [n for n in nodes if any(u not in nodes for u in n.users)]
    return list(order), outputs


def _kept_bytes(inputs: Iterable[fx.Node], free: set[fx.Node]) -> int:
    return sum(tensor_bytes(_val(x)) for x in inputs if not _is_free(x, free))


def _is_free(x: fx.Node, free: set[fx.Node]) -> bool:
    return x.op in ("placeholder", "get_attr") or x in free


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
            v = _val(a)
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
    return sum(b for k, b in seen.items() if not (k in owner and _is_free(owner[k], free)))


def _saves_only(n: fx.Node, allowed: set[fx.Node], free: set[fx.Node]) -> bool:
    """Whether autograd, for ``n`` alone, saves nothing but free values and values in ``allowed``."""
    got = _replay_saved([n])
    if got is None:
        return False
    seen, owner = got
    for k, b in seen.items():
        who = owner.get(k)
        if b and (who is None or not (_is_free(who, free) or who in allowed)):
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
            inputs, outputs = _boundary(comp)
            bad = {n for n in outputs if full_time_dim(tl, facts, n) is None and not reduces_over_time(tl, facts, n)}
            for x in inputs:
                if _timed(tl, x) and full_time_dim(tl, facts, x) is None:
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
                     free: set[fx.Node], excluded: Iterable[fx.Node] = ()) -> list[TailPlan]:
    """The time-local segments worth recomputing in shards (see module doc): after the last
    recurrence, and between recurrences (an MLP block between two SSM layers).

    ``regions`` (the node sets the region calls replace) and ``excluded`` (e.g. nodes an input
    remat recomputes) never join a segment.
    """
    order = list(gm.graph.nodes)
    barred = set().union(*regions, excluded)
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
        halo = _halo(nodes, tl, facts)
        if halo:  # a shard's window starts before the shard: a reduction would count those steps twice
            comp -= {n for n in comp if reduces_over_time(tl, facts, n)}
            nodes = sorted(comp, key=pos.get)
        replay = _replay_saved(nodes)
        if replay is None:  # e.g. a weighted, smoothed cross-entropy has no meta kernel:
            comp -= {n for n in comp if reduces_over_time(tl, facts, n)}  # keep the rest
            nodes = sorted(comp, key=pos.get)
            replay = _replay_saved(nodes)
        inputs, outputs = _boundary(comp)
        inputs.sort(key=pos.get)
        outputs.sort(key=pos.get)
        saved = _saved_bytes(replay, free)
        kept = _kept_bytes(inputs, free)
        if saved <= kept:
            continue
        plans.append(TailPlan(nodes, inputs, outputs,
                              tuple(full_time_dim(tl, facts, x) if _timed(tl, x) else None for x in inputs),
                              tuple(full_time_dim(tl, facts, y) for y in outputs), saved, kept, halo))
    return plans


def _with_inputs_recomputed(gm: fx.GraphModule, tl: Any, facts: dict, piece: set[fx.Node],
                            free: set[fx.Node], barred: set[fx.Node]) -> set[fx.Node]:
    """``piece``, and copies of cheap chains computing its inputs when the piece is worth running
    as a segment (:mod:`gradshard.plans.adjoint.tail_remat`); a piece that is not stays as it is,
    so no copy runs under plain autograd."""
    from gradshard.plans.adjoint.tail_remat import rematerialize_segment_inputs

    nodes = sorted(piece, key={n: i for i, n in enumerate(gm.graph.nodes)}.get)
    if _saved_bytes(_replay_saved(nodes), free) <= _kept_bytes(_boundary(piece)[0], free):
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
        cost = _kept_bytes(_boundary(cand)[0], free)
        for n in sorted(cand, key=lambda m: m.name):
            if any(a in cand for a in n.all_input_nodes) or _timed(tl, n) and full_time_dim(tl, facts, n) is None:
                continue
            rest = cand - {n}
            rest_inputs = _boundary(rest)[0]
            if _kept_bytes(rest_inputs, free) <= cost and _saves_only(n, set(rest_inputs), free):
                cand = rest
                changed = True
                break
    return cand

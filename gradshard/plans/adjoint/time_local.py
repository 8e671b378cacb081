"""Which nodes of a captured graph can run on a window of time, and node-set helpers.

The adjoint plans cut time-local work (segments after and between recurrences, region inputs
recomputed per shard) into shards of positions. A node qualifies when position ``t`` of its
output reads positions ``t - halo .. t`` of its time-carrying inputs (:func:`halo_in_time`:
0 for pointwise ops and splits beside time, ``k`` for a causal ``conv1d`` padded by ``k``).
Shards are positions, not absolute steps: a value whose position 0 holds step 1 (next-token
targets) is cut like any other once it exists at full length.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from gradshard.analysis.node_costs import tensor_bytes

from gradshard.plans.adjoint.reductions import time_reduction

aten = torch.ops.aten

__all__ = ["MAX_HALO", "boundary", "full_time_dim", "halo_in_time", "is_free", "kept_bytes", "op_name",
           "path_halo", "pointwise_in_time", "reduces_over_time", "timed", "value_of", "whole_time_dim"]

# ops that move, select or join along an axis: their value at step t may depend on positions
POSITIONAL = {
    "cat", "stack", "slice", "narrow", "select", "index", "index_select", "gather", "scatter", "scatter_add",
    "constant_pad_nd", "pad", "reflection_pad1d", "replication_pad1d", "roll", "flip", "split", "split_with_sizes",
    "unbind", "chunk", "tensor_split", "arange", "as_strided", "take_along_dim", "diagonal", "tril", "triu",
    "cumsum", "cumprod", "linear_scan",
}


def value_of(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def op_name(n: fx.Node) -> str:
    t = n.target
    packet = getattr(t, "_overloadpacket", None)
    return getattr(packet, "__name__", getattr(t, "__name__", str(t))).rstrip("_")


def time_dim_fact(tl: Any, facts: dict, n: fx.Node) -> Optional[tuple[int, Any]]:
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
    got = time_dim_fact(tl, facts, n)
    return got[0] if got is not None and got[1].kind == "shift" and got[1].value == 0 else None


def timed(tl: Any, n: fx.Node) -> bool:
    info = tl.info.get(n.name)
    return info is not None and bool(info.time_dims)


def pointwise_in_time(tl: Any, n: fx.Node) -> bool:
    """Whether ``n`` computes position ``t`` of its time-carrying output from position ``t`` of
    its inputs only (whatever steps those positions hold: ``logits[t]`` beside ``labels[t + 1]``)."""
    if n.op != "call_function" or value_of(n) is None:
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
    if op_name(n) in POSITIONAL:
        return False
    # a time-carrying value built from no time-carrying input (positions, constants) is not
    return any(timed(tl, a) for a in n.all_input_nodes)


#: a segment recomputes at most this many steps before each shard (a causal conv's kernel - 1)
MAX_HALO = 64


def trims_time(tl: Any, facts: dict, n: fx.Node) -> bool:
    """Whether ``n`` is ``x[..., :T]`` along time: the full-length prefix of a longer value
    (a causal conv's output, padded on both sides, cut back to its input's length)."""
    if n.target is not aten.slice.Tensor or not isinstance(n.args[0], fx.Node) or value_of(n.args[0]) is None:
        return False
    x = n.args[0]
    args = list(n.args) + [None] * (5 - len(n.args))
    dim, start, step = args[1] or 0, args[2], args[4] if args[4] is not None else 1
    src, out = time_dim_fact(tl, facts, x), time_dim_fact(tl, facts, n)
    if src is None or out is None or step != 1 or start not in (None, 0):
        return False
    return (dim % value_of(x).dim() == src[0] == out[0] and out[1].kind == "shift" and out[1].value == 0
            and tl.info[x.name].origin == tl.info[n.name].origin)


_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


def splits_beside_time(tl: Any, n: fx.Node) -> bool:
    """Whether ``n`` splits a value along a dim other than its time dim (``in_proj`` output
    into gate, conv input and time step), or takes one piece of such a split."""
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        return splits_beside_time(tl, n.args[0]) and value_of(n) is not None
    if n.target not in _SPLITS or not isinstance(n.args[0], fx.Node) or value_of(n.args[0]) is None:
        return False
    info, src = tl.info.get(n.name), tl.info.get(n.args[0].name)
    if info is None or src is None or len(src.time_dims) != 1 or info.time_dims != src.time_dims:
        return False
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    return dim % value_of(n.args[0]).dim() != src.time_dims[0]


def halo_in_time(tl: Any, facts: dict, n: fx.Node) -> Optional[int]:
    """How many steps before position ``t`` the node reads to compute position ``t`` (0:
    pointwise, or a split beside time; ``k``: a causal window such as ``conv1d`` with ``k``
    left padding, or 0 for the trim of its output back to full length); ``None`` if it cannot
    run on a window of the sequence."""
    if pointwise_in_time(tl, n) or splits_beside_time(tl, n):
        return 0
    if n.op != "call_function" or value_of(n) is None or not isinstance(n.target, torch._ops.OpOverload):
        return None
    if not any(timed(tl, a) for a in n.all_input_nodes):
        return None
    if trims_time(tl, facts, n):
        return 0
    info = tl.info.get(n.name)
    if info is None or len(info.time_dims) != 1 or info.local is None or op_name(n) in POSITIONAL:
        return None
    if torch.Tag.nondeterministic_seeded in n.target.tags or n.target._schema.is_mutable:
        return None
    lo, hi = info.local.lo, info.local.hi
    if hi > 0 or not -MAX_HALO <= lo <= 0 or lo != int(lo):
        return None
    got = time_dim_fact(tl, facts, n)
    if got is None or got[1].kind != "shift":  # a strided window (T/2 positions) is no window of positions
        return None
    return int(-lo)


def path_halo(nodes: list[fx.Node], tl: Any, facts: dict) -> int:
    """The steps before a shard that ``nodes`` (graph order) read: the largest sum of node halos
    along a path."""
    need: dict[fx.Node, int] = {}
    for n in nodes:
        own = halo_in_time(tl, facts, n) or 0
        need[n] = own + max((need[a] for a in n.all_input_nodes if a in need), default=0)
    return max(need.values(), default=0)


def whole_time_dim(tl: Any, facts: dict, n: fx.Node) -> Optional[int]:
    """The node's time dim if it holds every step: full length, or merged with batch
    (``(B, T, V) -> (B*T, V)``: a sum over that dim adds the same rows in another order)."""
    got = time_dim_fact(tl, facts, n)
    if got is None or not (got[1].kind == "scale" or got[1].kind == "shift" and got[1].value == 0):
        return None
    return got[0]


def reduces_over_time(tl: Any, facts: dict, n: fx.Node) -> bool:
    """Whether ``n`` reduces a time-carrying value holding every step over time (a rule in
    :data:`~gradshard.plans.adjoint.reductions.REDUCTIONS`) and every other time-carrying input
    it reads (a loss's targets) holds every step too (full length, or merged with batch)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node) or timed(tl, n):
        return False
    if not time_reduction(n, whole_time_dim(tl, facts, n.args[0])):
        return False
    return all(whole_time_dim(tl, facts, a) is not None for a in n.all_input_nodes if timed(tl, a))


def boundary(nodes: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """``(inputs, outputs)`` of a node set: values it reads from outside (first-read order),
    and its nodes read outside."""
    order = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in nodes:
                order.setdefault(a, None)
    outputs = [n for n in nodes if any(u not in nodes for u in n.users)]
    return list(order), outputs


def kept_bytes(inputs: Iterable[fx.Node], free: set[fx.Node]) -> int:
    """Bytes of ``inputs`` a segment keeps itself (the free ones are kept by someone else)."""
    return sum(tensor_bytes(value_of(x)) for x in inputs if not is_free(x, free))


def is_free(x: fx.Node, free: set[fx.Node]) -> bool:
    """Whether ``x`` is kept anyway: a graph input, parameter, constant, or in ``free``."""
    return x.op in ("placeholder", "get_attr") or x in free

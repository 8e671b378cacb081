"""Chunk rules of a carried loop (a per-step loop with any state update, see
:mod:`gradshard.ops.carried_loop`): the generic carried-state rule.

``run_carried_loop`` is a scan whose carry is the whole packed row of carried values: chunk
``j`` starts from row ``lo - 1`` (a cache point; kept one step per chunk) and runs the
captured step over its own steps; with grad, the recomputed chunk's gradient reaches that
row, and through the cache the chunk before it. ``run_carried_readout`` reads the rows one
step behind its own window (the values carried *into* each step), and the loop's initial
values at step 0. Exact for any update: the loop runs the captured step itself.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from gradshard.errors import node_error
from gradshard.ops.carried_loop import CarriedLoop, run_carried_loop, run_carried_readout
from gradshard.plans.chunked.frames import Demand, DimMap, TDim
from gradshard.plans.chunked.rules import CHUNK_RULES, BuildCtx, NodeRule, _INSTEAD, _norm, meta_shape

__all__: list[str] = []


def _sequence_maps(node: fx.Node, bc: BuildCtx, loop: CarriedLoop, first: int) -> tuple[list[Any], int]:
    """Slot maps of the sequences (from arg ``first``), inits and invariants; the loop length."""
    seqs, inits, invariants = loop.split(node.args[first:])
    maps: list[Any] = []
    lengths = set()
    for a, d in zip(seqs, loop.seq_dims):
        fr = bc.frame(a)
        shp = meta_shape(a)
        if len(fr) != 1 or fr[0].dim != _norm(d, len(shp)) or not fr[0].pure(shp[fr[0].dim]):
            raise node_error(node, f"the loop reads `{a.name}` one step at a time along a dim that is not a "
                             "time axis gradshard can cut into chunks (time merged with another dim, or two "
                             "time axes)", _INSTEAD)
        lengths.add(fr[0].length)
        maps.append((DimMap("same", 0),))
    for a in [*inits, *invariants]:
        if isinstance(a, fx.Node) and bc.frame(a):
            raise node_error(node, f"`{a.name}`, an initial value or loop invariant of the loop, runs along time",
                             _INSTEAD)
        if isinstance(a, fx.Node):
            maps.append(None)
    if len(lengths) != 1:
        raise node_error(node, "the loop's inputs run along time axes of different lengths", _INSTEAD)
    return maps, lengths.pop()


def _whole(node: fx.Node, demand: Demand, ev: Any) -> tuple[int, int] | None:
    """The window to compute instead of ``demand`` (None: ``demand`` itself): from
    ``min(lo, chunk start)`` to the chunk's end, so that the windows the chunk's consumers ask
    for (shifted by token shifts, one step behind for a readout) share one computation."""
    (lo, hi), = demand
    (c_lo, c_hi), = ev.program.chunk_demand(node.name, ev.index)
    want = (min(lo, c_lo), c_hi)
    return want if hi <= c_hi and (lo, hi) != want else None


def _loop_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    (lo, hi), = demand
    whole = _whole(node, demand, ev)
    if whole is not None:  # (a window starting before the chunk is served from the cache)
        return ev.value(node, (whole,)).narrow(0, lo - whole[0], hi - lo)
    loop: CarriedLoop = vals[0]
    seqs, inits, invariants = loop.split(vals[1:])
    carried_in = ev.value(node, ((lo - 1, lo),))[0] if lo > 0 else None
    return loop.scan(seqs, inits, invariants, carried_in)


def _loop_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``run_carried_loop``: the rows of carried values, time at dim 0, carried across chunks."""
    loop = getattr(node.graph.owning_module, node.args[0].target)
    maps, length = _sequence_maps(node, bc, loop, 1)
    rule = NodeRule((TDim(0, length),), (None, *maps), _loop_run, kind="scan")
    rule.note = f"carried loop ({len(loop.states)} value(s) carried across chunks, run step by step)"
    return rule


def _readout_run(node: fx.Node, vals: list, demand: Demand, arg_demands: list, ev: Any) -> Any:
    (lo, hi), = demand
    loop: CarriedLoop = vals[0]
    rows = vals[1]
    seqs, inits, invariants = loop.split(vals[2:])
    first = lo == 0  # step 0 reads the initial values; the rows window is (0, hi), else (lo - 1, hi)
    carried = rows.narrow(0, 0, max(hi - lo - int(first), 0))
    return loop.outputs(carried, seqs, inits, invariants, first=first)


def _readout_rule(node: fx.Node, bc: BuildCtx) -> NodeRule:
    """``run_carried_readout``: per step; reads the rows one step behind its window."""
    loop = getattr(node.graph.owning_module, node.args[0].target)
    rows = node.args[1]
    fr = bc.frame(rows)
    if len(fr) != 1 or fr[0].dim != 0:
        raise node_error(node, "the rows of a carried loop have no time axis gradshard can follow", _INSTEAD)
    maps, length = _sequence_maps(node, bc, loop, 2)
    row_map = (DimMap("extend", 0, 1, 0, fr[0].length),)
    vals = node.meta.get("val") or ()
    elems = tuple((TDim(_norm(d, v.dim()), length),) for d, v in zip(loop.out_dims, vals))
    rule = NodeRule(elems[0] if elems else (), (None, row_map, *maps), _readout_run,
                    note="carried loop readout (per step, from the values carried into the step)")
    rule.elem_frames = elems
    return rule


CHUNK_RULES[run_carried_loop] = _loop_rule
CHUNK_RULES[run_carried_readout] = _readout_rule

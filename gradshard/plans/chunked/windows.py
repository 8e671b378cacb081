"""The window a node is computed on in one chunk: the hull of every window asked of it.

Consumers ask one node for different windows of a chunk: a causal convolution reads its input
``K - 1`` steps before the residual add beside it does, so a layer's input is asked for
``[s - 3, e)`` and ``[s, e)``, and every layer below it for those windows shifted once more.
Memoised per window, each distinct window computed the node -- and everything it reads --
again, and the memo's eviction (a value is dropped once its consumers ran) made the repeats
multiply: on transformers' Mamba-2 (4 layers, width-4 convolutions) the first layer's
projections ran 130 times per chunk.

:func:`chunk_windows` takes the chunk's demands from its roots (time outputs, the arguments of
reductions, cache points) through the slot maps, and what rules read themselves
(``NodeRule.reads``), in reverse graph order; the hull of the windows asked of a node is its window. :class:`~gradshard.plans.chunked.evaluate.ChunkEvaluator`
computes a node on its window once and serves every smaller window as a narrow of it (values
at a step do not depend on the window they are computed in: the premise of every chunk rule).
A cache point's own window starts at the chunk (earlier steps come from the cache). Only nodes
with one time dim that is time alone take part: a window of a merged ``(B*T)`` dim is not one
slice of the whole; and a window stops at the chunk's end.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from gradshard.plans.chunked.frames import SKIP, Win

__all__ = ["chunk_windows", "narrow_window"]


def _time_dims(program: Any, name: str) -> Optional[tuple[int, ...]]:
    """Per tensor of the node's value (one, or each element of a tuple), the dim that is time
    alone, or None when the node's value is not sliceable along time that way."""
    rule = program.rules.get(name)
    node = program.nodes.get(name)
    if rule is None or node is None or len(rule.frame) != 1:
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        t = rule.frame[0]
        return (t.dim,) if t.pure(val.shape[t.dim]) else None
    elems = getattr(rule, "elem_frames", None)
    if not isinstance(val, (tuple, list)) or not elems or len(elems) != len(val):
        return None
    dims = []
    for v, fr in zip(val, elems):
        if not isinstance(v, torch.Tensor) or len(fr) != 1 or not fr[0].pure(v.shape[fr[0].dim]):
            return None
        dims.append(fr[0].dim)
    return tuple(dims)


def chunk_windows(program: Any, j: int) -> dict[str, Win]:
    """Node name -> the window chunk ``j`` computes it on (see module doc); nodes that are not
    sliceable along one time dim, or that no root reaches through slot maps, are left out."""
    start, end = program.bounds[j]
    if j == program.num_chunks - 1:
        end = sys.maxsize
    wins: dict[str, Win] = {}
    apart: dict[str, set[Win]] = {}  # nodes computed per window asked (ExtraReads.hull False)

    def ask(name: str, win: Win) -> None:
        # steps past the chunk are not merged in: asked of a node that reads attention or a
        # scan they are an error the evaluator reports where they are asked, with the asker
        win = (win[0], min(win[1], end))
        if win[1] <= win[0] or _time_dims(program, name) is None:
            return
        reads = program.rules[name].reads
        if reads is not None and not reads.hull:
            apart.setdefault(name, set()).add(win)
            return
        old = wins.get(name)
        wins[name] = win if old is None else (min(old[0], win[0]), max(old[1], win[1]))

    for o in program.outputs:
        if o.kind == "time":
            ask(o.name, program.chunk_demand(o.name, j)[0])
            continue
        for a in program.slots.get(o.name, ()):
            if program.rules[a.name].frame:
                ask(a.name, program.chunk_demand(a.name, j)[0])
    for name in program.cache_points:
        ask(name, program.cache_window(name, j))
    for node in reversed(program.gm.graph.nodes):
        if node.name in apart:  # only what it reads itself, per window (its slots are skipped)
            cached = node.name in program.cache_points  # its steps before the chunk: from the cache
            for lo, hi in sorted(apart[node.name]):
                if cached and hi <= start:
                    continue
                for name, w in program.rules[node.name].reads.windows((max(lo, start) if cached else lo, hi), start):
                    ask(name, w)
            continue
        win = wins.get(node.name)
        if win is None or node.op in ("placeholder", "get_attr") or node.name in program.hoisted:
            continue
        if node.name in program.cache_points and win[0] < start:
            win = (min(start, win[1]), win[1])  # the steps before the chunk are read from the cache
            if win[1] <= win[0]:
                del wins[node.name]
                continue
            wins[node.name] = win
        for arg, smap in program.inputs_of.get(node.name, ()):
            if smap is not SKIP and smap is not None and len(smap) == 1:
                ask(arg.name, smap[0].apply((win,)))
        reads = program.rules[node.name].reads
        for name, w in reads.windows(win, start) if reads is not None else ():
            ask(name, w)
    return wins


def narrow_window(program: Any, name: str, value: Any, whole: Win, want: Win) -> Any:
    """``value`` (the node on ``whole``) cut to ``want``, a window inside it."""
    dims = _time_dims(program, name)
    lo, n = want[0] - whole[0], want[1] - want[0]
    if isinstance(value, torch.Tensor):
        return value.narrow(dims[0], lo, n)
    return type(value)([v.narrow(d, lo, n) for v, d in zip(value, dims)])  # tuple, list, return_types

"""A last loop step cut short: the template step with the ops only the next step would read.

In ``for t: out[t] = f(state, x_t); state = g(state, x_t)`` (RWKV's WKV: the output reads the
state carried *into* the step) nothing reads the last step's update, so the captured graph
drops it: the last step is the template step minus its update. :func:`align_last_step` proves
that (the last step's ops are, in order, a subsequence of the template's, with the same
arguments) and :func:`complete_last_step` puts the missing ops back as dead copies, so every
step runs the same ops and the rolled loop runs the template at every step.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.loop_steps import _step_signature

aten = torch.ops.aten

__all__ = ["align_last_step", "complete_last_step"]


def _relabel(entry: Any, mapping: dict[int, int]) -> Any:
    """``entry`` with its references to this step (``("L", k)``) renumbered by ``mapping``."""
    if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "L" and isinstance(entry[1], int):
        return ("L", mapping.get(entry[1], -1))
    if isinstance(entry, tuple):
        return tuple(_relabel(e, mapping) for e in entry)
    if isinstance(entry, list):
        return [_relabel(e, mapping) for e in entry]
    if isinstance(entry, dict):
        return {k: _relabel(v, mapping) for k, v in entry.items()}
    return entry


def _earlier_refs(entry: Any) -> bool:
    """Does ``entry`` read a step before the previous one (``("X", d)``)?"""
    if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "X":
        return True
    if isinstance(entry, (tuple, list)):
        return any(_earlier_refs(e) for e in entry)
    if isinstance(entry, dict):
        return any(_earlier_refs(v) for v in entry.values())
    return False


def align_last_step(chain: LoopChain) -> Optional[list[Optional[fx.Node]]]:
    """The last step's nodes at their template positions (``None`` where dropped), when the
    last step is shorter than the template and its ops are an ordered subsequence of it."""
    T = len(chain.steps)
    if T < 3 or len(chain.steps[-1]) >= len(chain.steps[1]):
        return None
    ref = _step_signature(chain, 1)
    last = _step_signature(chain, T - 1)
    mapping: dict[int, int] = {}
    i = 0
    for k, entry in enumerate(last):
        want = _relabel(entry, mapping)
        while i < len(ref) and ref[i] != want:
            i += 1
        if i == len(ref):
            return None
        mapping[k] = i
        i += 1
    aligned: list[Optional[fx.Node]] = [None] * len(ref)
    for k, i in mapping.items():
        aligned[i] = chain.steps[-1][k]
    if any(n is None and _earlier_refs(ref[i]) for i, n in enumerate(aligned)):
        return None
    return aligned


def complete_last_step(gm: fx.GraphModule, chain: LoopChain, aligned: list[Optional[fx.Node]]) -> int:
    """Insert the dropped ops of the last step (dead copies of the template's) after it, in
    place on ``gm`` and ``chain``; return how many were inserted."""
    T = len(chain.steps)
    template, prev, before = chain.steps[1], chain.steps[0], chain.steps[T - 2]
    local = {n: i for i, n in enumerate(template)}
    at_end = {n: i - len(prev) for i, n in enumerate(prev)}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = max(chain.steps[-1], key=order.__getitem__)
    filled = list(aligned)

    def arg(a: fx.Node) -> fx.Node:
        if a in local:
            return filled[local[a]]
        if a in at_end:  # the previous step, counted from its end
            return before[len(before) + at_end[a]]
        return a

    added = 0
    for i, node in enumerate(template):
        if filled[i] is not None:
            continue
        with gm.graph.inserting_after(anchor):
            if node in chain.sources and node.target is aten.select.int:
                new = gm.graph.call_function(aten.select.int, (node.args[0], node.args[1], T - 1))
            elif node in chain.sources and node.target is operator.getitem:
                new = gm.graph.call_function(operator.getitem, (node.args[0], T - 1))
            else:
                new = gm.graph.node_copy(node, arg)
        new.meta = dict(node.meta)
        filled[i] = anchor = new
        chain.step_of[new] = T - 1
        if node in chain.sources:
            chain.sources[new] = chain.sources[node]
        added += 1
    chain.steps[-1] = [n for n in filled if n is not None]
    return added

"""Finding unrolled loops: group the per-step copies of a captured Python loop into chains.

A loop ``for t in range(T)`` over a time-carrying tensor is captured as ``T`` copies of the
step body; each copy starts at a read of one step (``select(x, t_dim, i)`` or an ``unbind``
item). :func:`find_loops` puts every node in the step it belongs to, groups connected
steps into one :class:`LoopChain` per loop, and keeps only chains that carry a value from
step to step. Where a step ends is ambiguous for ops that read only the previous step's
values (``dA * h`` evaluated before ``x[:, t]`` is read); each chain comes with a second cut
(``alternative``) for ``roll_loops`` to try. Whether the steps really are copies is checked
later (:mod:`gradshard.passes.loop_steps`).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten

__all__ = ["LoopChain", "find_loops"]


@dataclass
class LoopChain:
    """One unrolled loop: its steps (node lists in graph order) and its outside uses."""

    steps: list[list[fx.Node]]
    step_of: dict[fx.Node, int]
    sources: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)  # select node -> (seq, dim)
    #: The same nodes cut into steps the other way (see :func:`_assign_precomputations`), or None.
    alternative: Optional["LoopChain"] = None


def _loop_select(node: fx.Node, tl: Any) -> Optional[tuple[fx.Node, int, int]]:
    """``(sequence, time dim, step)`` if ``node`` reads one step of a time-carrying tensor."""
    if node.op != "call_function":
        return None
    if node.target is aten.select.int:
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.name not in tl.info:
            return None
        td = tl.time_dim(src)
        shp = src.meta.get("val").shape if isinstance(src.meta.get("val"), torch.Tensor) else None
        if td is None or shp is None:
            return None
        d = node.args[1] % len(shp)
        if d != td:
            return None
        i = int(node.args[2])
        return src, d, i if i >= 0 else i + int(shp[d])
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.unbind.int:
        ub = node.args[0]
        src = ub.args[0]
        td = tl.time_dim(src) if isinstance(src, fx.Node) and src.name in tl.info else None
        shp = src.meta.get("val").shape
        d = (ub.args[1] if len(ub.args) > 1 else 0) % len(shp)
        if td is None or d != td:
            return None
        return src, d, int(node.args[1])
    return None


def _assign_state_ops_to_their_step(gm: fx.GraphModule, step_of: dict[fx.Node, int],
                                    sources: dict[fx.Node, tuple[fx.Node, int]]) -> None:
    """Move ops on the previous state into the step that uses them (in place on ``step_of``).

    A first guess puts every node in the latest step it reads from, so ``dA * h`` in
    ``h = dA * h + B * x[:, t]`` -- evaluated before ``x[:, t]`` is read -- lands in step
    ``t-1``. A node whose users all sit in the next step (so nothing outside the body reads it)
    moves there. Whatever this decides is still checked by the step isomorphism test, so a
    wrong guess is an error, never a wrong scan.
    """
    for node in reversed(gm.graph.nodes):
        s = step_of.get(node)
        if s is None or node in sources or not node.users:
            continue
        if all(step_of.get(u) == s + 1 for u in node.users):
            step_of[node] = s + 1


def _assign_precomputations(gm: fx.GraphModule, natural: dict[fx.Node, int],
                            sources: dict[fx.Node, tuple[fx.Node, int]]) -> dict[fx.Node, int]:
    """The other cut: move into step ``s + 1`` only the ops of step ``s`` that precompute step
    ``s + 1`` from values carried anyway.

    :func:`_assign_state_ops_to_their_step` moves every op whose users all sit in the next
    step, so a state update read only by the next step (RWKV's ``num``, ``den`` and running max,
    computed from ``k[:, t]`` after the step's output) moves with it, and the next step then
    reads this step's inputs. Here an op moves only when each value of its own step it reads
    is used beyond that step anyway (``max_state + time_decay``, evaluated in the next
    iteration from the carried max, moves; the update that reads ``k[:, t]`` stays). Candidates
    cascade within one step only (users first); moves that break the rule are undone until
    none does. Still checked by the step comparison.
    """
    cand: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        s = natural.get(node)
        if s is None or node in sources or not node.users:
            continue
        if all(natural.get(u) == s + 1 or (natural.get(u) == s and u in cand) for u in node.users):
            cand.add(node)

    def invalid(p: fx.Node) -> bool:
        s = natural[p]
        if any(natural.get(u) == s and u not in cand for u in p.users):
            return True  # a user stays behind in step s
        return any(natural.get(a) == s and a not in cand and all(natural.get(u) == s for u in a.users)
                   for a in p.all_input_nodes)  # it would carry a value of step s no one else carries

    work = list(cand)
    while work:
        p = work.pop()
        if p not in cand or not invalid(p):
            continue
        cand.discard(p)
        work.extend(a for a in p.all_input_nodes if a in cand)
        work.extend(u for u in p.users if u in cand)
    step_of = dict(natural)
    for p in cand:
        step_of[p] = natural[p] + 1
    return step_of


def _absorb_initial_state_ops(steps: list[list[fx.Node]], step_of: dict[fx.Node, int], tl: Any) -> None:
    """Pull ops on the initial state into step 0 while step 0 is shorter than step 1.

    In ``h = dA * h + B * x[:, t]`` the first ``dA * h0`` reads no step of the sequence, so it
    is outside the body; it belongs to step 0 when only step 0 uses it. Walks back from step
    0's inputs (nodes without a time dim that step 0 alone uses); ``steps[0]`` keeps graph order.
    """
    first, want = steps[0], len(steps[1])
    changed = True
    while changed and len(first) < want:
        changed = False
        for node in [a for n in first for a in n.all_input_nodes]:
            info = tl.info.get(node.name)
            if (node.op != "call_function" or node in step_of or info is None or info.time_dims
                    or any(step_of.get(u) != 0 for u in node.users) or len(first) >= want):
                continue
            step_of[node] = 0
            first.append(node)
            changed = True
    order = {n: i for i, n in enumerate(first[0].graph.nodes)} if first else {}
    first.sort(key=order.__getitem__)


def find_loops(gm: fx.GraphModule, tl: Any) -> list[LoopChain]:
    """Group the unrolled-loop nodes of ``gm`` into chains (one per loop), steps in order."""
    step_of: dict[fx.Node, int] = {}
    sources: dict[fx.Node, tuple[fx.Node, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        sel = _loop_select(node, tl)
        if sel is not None:
            step_of[node] = sel[2]
            sources[node] = (sel[0], sel[1])
            continue
        if node.target is aten.unbind.int:
            continue
        info = tl.info.get(node.name)
        if info is None or info.time_dims:
            continue
        ins = [step_of[a] for a in node.all_input_nodes if a in step_of]
        if ins:
            step_of[node] = max(ins)
    other = _assign_precomputations(gm, step_of, sources)
    _assign_state_ops_to_their_step(gm, step_of, sources)
    # connected components of body nodes (edges between body nodes)
    parent: dict[fx.Node, fx.Node] = {n: n for n in step_of}

    def find(x: fx.Node) -> fx.Node:
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in step_of:
        for a in n.all_input_nodes:
            if a in step_of:
                ra, rb = find(a), find(n)
                if ra is not rb:
                    parent[ra] = rb
    comps: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n in step_of:
            comps[find(n)].append(n)
    chains = []
    for nodes in comps.values():
        chain = _chain_of(nodes, step_of, sources, tl)
        if chain is None:
            continue
        alt = _chain_of(nodes, dict(other), sources, tl)
        if alt is not None and alt.steps != chain.steps:
            chain.alternative = alt
        chains.append(chain)
    return chains


def _chain_of(nodes: list[fx.Node], step_of: dict[fx.Node, int], sources: dict[fx.Node, tuple[fx.Node, int]],
              tl: Any) -> Optional[LoopChain]:
    """The chain of one component under the step assignment ``step_of`` (None: not a loop)."""
    n_steps = max(step_of[n] for n in nodes) + 1
    if n_steps < 2:
        return None
    steps: list[list[fx.Node]] = [[] for _ in range(n_steps)]
    for n in nodes:
        steps[step_of[n]].append(n)
    if any(not s for s in steps):
        return None
    _absorb_initial_state_ops(steps, step_of, tl)
    # a chain carries a value from step to step; plain per-step maps are not loops over a state
    carried = any(step_of.get(a) == step_of[n] - 1 for n in steps[1] for a in n.all_input_nodes)
    if not carried:
        return None
    return LoopChain(steps, {n: t for t, ns in enumerate(steps) for n in ns}, {n: sources[n] for n in nodes if n in sources})

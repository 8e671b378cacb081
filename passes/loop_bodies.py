"""Extracting the bodies of an unrolled loop: the carried state, the outside uses, the step bodies.

From a checked :class:`~gradshard.passes.loop_chains.LoopChain`, :func:`analyse_state` finds
the one carried state (previous, new and initial value) and the per-step readout;
:func:`find_outside_uses` lists where the loop's values leave it (stacked per step, or taken
after the last step); :func:`extract_bodies` builds the two :class:`RolledBody` graphs that
run vectorised over time: the *producers* ``(x_t..., invariants) -> (a_t, u_t, readout
inputs)`` in the scan's layout, and the *readout* ``(h_t, readout inputs, invariants) ->
y_t...``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.ir import graph_module
from gradshard.errors import node_error
from gradshard.ops.rolled_body import RolledBody
from gradshard.pipeline import ancestors

from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.loop_steps import NONLINEAR_HINT, UNROLLABLE_HINT, Update, analyse_update, check_isomorphic
from gradshard.passes.recurrence_graph import fake_run

aten = torch.ops.aten

__all__ = ["LoopState", "LoopUses", "LoopBodies", "analyse_state", "find_outside_uses", "extract_bodies", "body_graph"]


@dataclass
class LoopState:
    """The carried state of one loop, read off its template step (step 1)."""

    template: list[fx.Node]  # step 1's nodes, in graph order
    h_prev: fx.Node  # the previous state, as step 1 reads it (a node of step 0)
    h_new: fx.Node  # the new state (a node of the template)
    h_init: fx.Node  # the initial state, outside the loop
    update: Update  # h_new = A * h_prev + U (or A @ h_prev + U)
    dep: set[fx.Node]  # h_prev and the template nodes that depend on it
    readout: list[fx.Node]  # template nodes reading the state off the update path


@dataclass
class LoopUses:
    """Where the loop's values leave it, by local index in a step (counted from its end)."""

    stack_outs: dict[int, list[tuple[fx.Node, int, str]]]  # -> (stack/cat consumer, dim, "stack"|"cat")
    final_uses: dict[int, list[fx.Node]]  # -> users of the last step's value
    consumers: list[fx.Node]  # every consumer outside the loop


@dataclass
class LoopBodies:
    """The two vectorised bodies of one loop and how their outputs map to the loop's uses."""

    seqs: list[tuple[fx.Node, int]]  # (sequence, time dim) read per step: the producers' inputs
    invariants: list[fx.Node]  # values from outside the loop the producers read
    producers: RolledBody
    n_prod_out: int  # a_t, u_t, then one per readout input
    readout_invariants: list[fx.Node]  # values from outside the loop the readout reads
    readout: Optional[RolledBody]  # None when every output is the stacked state itself
    readout_nodes: list[fx.Node]
    out_locals: list[int]  # local indices of the values used outside the loop
    outputs: list[tuple[int, fx.Node, int]]  # (local idx, source node, stack dim >= 0), one per use
    body_outputs: list[tuple[int, fx.Node, int]]  # the outputs the readout body computes


_LIKE = {aten.zeros_like.default: aten.new_zeros.default, aten.ones_like.default: aten.new_ones.default,
         aten.empty_like.default: aten.new_empty.default}


def _rebuild_initial_state(gm: fx.GraphModule, chain: LoopChain, prefix: list[fx.Node], h_init: fx.Node) -> fx.Node:
    """``zeros_like(x[:, 0])`` built in step 0 -> ``new_zeros(x, shape)`` outside the loop."""
    if h_init not in prefix:
        return h_init
    if h_init.target not in _LIKE and h_init.target not in (aten.new_zeros.default, aten.new_ones.default,
                                                             aten.new_empty.default):
        raise node_error(h_init, "the loop's initial state is computed from the first step's inputs",
                         "start from an explicit initial state (zeros, or a parameter) so every step is the same")
    src = h_init.args[0]
    while isinstance(src, fx.Node) and src in chain.step_of:
        if src in chain.sources:
            src = chain.sources[src][0]
            break
        src = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else None
    if not isinstance(src, fx.Node):
        raise node_error(h_init, "cannot rebuild the loop's initial state outside the loop", "use h = zeros(...)")
    shape = list(h_init.meta["val"].shape)
    target = _LIKE.get(h_init.target, h_init.target)
    # keep the factory's dtype (``zeros_like(x[:, 0], dtype=torch.float32)``)
    kwargs = {k: v for k, v in h_init.kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
    kwargs.setdefault("dtype", h_init.meta["val"].dtype)
    with gm.graph.inserting_after(src):
        new = gm.graph.call_function(target, (src, shape), kwargs)
        new.meta["val"] = fake_run(target, (src, shape), kwargs)
        new.meta["stack_trace"] = h_init.meta.get("stack_trace")
    return new


def body_graph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[Any],
               extra: Optional[list] = None) -> fx.GraphModule:
    """A graph of ``nodes`` with ``inputs`` as placeholders returning ``outputs``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        ph = g.placeholder(f"in{i}_{n.name}")
        ph.meta = dict(n.meta)
        env[n] = ph
    for n in nodes:
        if n in env:
            continue
        new = g.node_copy(n, lambda a: env[a])
        env[n] = new
    outs = []
    for o in outputs:
        outs.append(env[o] if isinstance(o, fx.Node) else o)
    for fn in extra or []:
        outs = fn(g, outs)
    g.output(tuple(outs))
    return graph_module(torch.nn.Module(), g, "LoopBody")


_RUNNING_MAX = (aten.maximum.default, aten.max.other, aten.fmax.default)


_CASTS = (aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default, aten.to.dtype_layout)


def _under_casts(node: fx.Node) -> fx.Node:
    """The value ``node`` casts or copies (``m_new.to(float32)`` -> ``m_new``)."""
    while node.target in _CASTS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _refuse_several_carried(chain: LoopChain) -> None:
    """Refuse, before the step comparison, a loop that carries several values from step to step
    (read between steps 1 and 2 where there are three, so step 0's set-up cannot blur the count);
    a running maximum among them is named: a max-stabilised recurrence (a log-sum-exp
    normaliser kept as (scaled state, running max)) is not recognised as the linear one it
    stabilises."""
    first = 1 if len(chain.steps) >= 3 else 0
    cur = chain.steps[first + 1]
    carried = list(dict.fromkeys(a for n in cur for a in n.all_input_nodes if chain.step_of.get(a) == first))
    if first:  # a per-step input read one step early (``x[:, t]`` kept for step t+1) is no state
        on_state: set[fx.Node] = set()
        for n in chain.steps[first]:
            if any(chain.step_of.get(a) == first - 1 or a in on_state for a in n.all_input_nodes):
                on_state.add(n)
        carried = [a for a in carried if a in on_state]
    if len(carried) <= 1:
        return
    names = ", ".join(f"`{c.name}`" for c in carried)
    running_max = next((m for m in map(_under_casts, carried) if m.target in _RUNNING_MAX), None)
    if running_max is not None:
        raise node_error(running_max, f"the loop carries {len(carried)} values from step to step ({names}), one of "
                         "them a running maximum: a max-stabilised (log-sum-exp) recurrence, which gradshard does "
                         "not yet recognise as the linear recurrence it stabilises; the adjoint plans roll loops "
                         "that carry one linear state", UNROLLABLE_HINT)
    raise node_error(carried[0], f"the loop carries {len(carried)} values from step to step ({names}); the adjoint "
                     "plans roll loops that carry one linear state", UNROLLABLE_HINT)


def analyse_state(gm: fx.GraphModule, chain: LoopChain) -> LoopState:
    """Check the steps, find the one carried state and the per-step readout (see the module doc).

    Rebuilds an initial state built inside step 0 (``zeros_like(x[:, 0])``) outside the loop.
    """
    _refuse_several_carried(chain)
    _, init, prefix = check_isomorphic(chain)
    template = chain.steps[1]
    prev = chain.steps[0]
    carried = sorted({prev.index(a) - len(prev) for n in template for a in n.all_input_nodes if chain.step_of.get(a) == 0})
    if len(carried) != 1:
        raise node_error(template[0], f"the loop carries {len(carried)} values from step to step; the adjoint "
                         "plans roll loops that carry one linear state", NONLINEAR_HINT)
    k = carried[0]
    h_prev_t = prev[k]
    h_new_t = template[k]
    h_init = init[k]
    if prefix:
        h_init = _rebuild_initial_state(gm, chain, prefix, h_init)
    upd = analyse_update(template, h_prev_t, h_new_t)
    dep = {h_prev_t}
    for n in template:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    readout = [n for n in template if n in dep and n not in upd.path]
    for n in readout:
        bad = [a for a in n.all_input_nodes if a in dep and a is not h_new_t and a not in readout]
        if bad:
            raise node_error(n, "the loop's per-step output reads the previous state (h_{t-1}) or the update's "
                             "intermediate values; gradshard needs outputs that read the new state h_t",
                             "compute the outputs from the updated state, or " + UNROLLABLE_HINT)
    return LoopState(template, h_prev_t, h_new_t, h_init, upd, dep, readout)


def find_outside_uses(chain: LoopChain, template: list[fx.Node]) -> LoopUses:
    """Where the loop's values are used outside it (``template``: the step-1 nodes); anything but
    a per-step stack or a use of the last step is an error naming the user."""
    T = len(chain.steps)
    stack_outs: dict[int, list[tuple[fx.Node, int, str]]] = defaultdict(list)  # local idx -> (consumer, dim, mode)
    final_uses: dict[int, list[fx.Node]] = defaultdict(list)
    all_body = set(chain.step_of)
    consumers: list[fx.Node] = []
    stack_ok: dict[fx.Node, bool] = {}
    pos_end = {n: i - len(nodes) for nodes in chain.steps for i, n in enumerate(nodes)}
    for t, nodes in enumerate(chain.steps):
        for j0, n in enumerate(nodes):
            j = j0 - len(nodes)  # counted from the end: step 0 may start with extra nodes
            for user in n.users:
                if user in all_body:
                    continue
                if j < -len(template):
                    raise node_error(user, "a value built while setting up the loop's first step is used outside "
                                     "the loop", "build it outside the loop")
                if user.target in (aten.stack.default, aten.cat.default):
                    if user not in stack_ok:  # checked once per stack: linear in T
                        pieces = user.args[0]
                        stack_ok[user] = len(pieces) == T and all(
                            isinstance(p, fx.Node) and chain.step_of.get(p) == s and pos_end.get(p) == j
                            for s, p in enumerate(pieces))
                        if stack_ok[user]:
                            dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
                            stack_outs[j].append((user, dim, "stack" if user.target is aten.stack.default else "cat"))
                            consumers.append(user)
                    if stack_ok[user]:
                        continue
                if t == T - 1:
                    if user not in final_uses[j]:
                        final_uses[j].append(user)
                        consumers.append(user)
                    continue
                raise node_error(user, f"a value of step {t} of an unrolled loop is used outside the loop; "
                                 "gradshard rolls loops whose outputs are stacked per step or taken after the last step",
                                 "collect per-step outputs in a list and torch.stack them, or " + UNROLLABLE_HINT)
    if not consumers:
        raise node_error(template[0], "the unrolled loop has no output", "return or stack the loop's outputs")
    return LoopUses(stack_outs, final_uses, consumers)


def extract_bodies(chain: LoopChain, state: LoopState, uses: LoopUses, index: int) -> LoopBodies:
    """The producer and readout bodies of loop ``index`` (see the module doc)."""
    template, h_prev_t, h_new_t = state.template, state.h_prev, state.h_new
    upd, dep, readout = state.update, state.dep, state.readout
    stack_outs, final_uses = uses.stack_outs, uses.final_uses
    members = set(template)
    # ---- producer body: state-independent values the update and the readout need
    sel_nodes = [n for n in template if n in chain.sources]
    seqs: list[tuple[fx.Node, int]] = []
    for n in sel_nodes:
        key = chain.sources[n]
        if key not in seqs:
            seqs.append(key)
    sel_of_seq = {chain.sources[n]: n for n in sel_nodes}
    invariants: list[fx.Node] = []
    for n in template:
        if n in chain.sources:
            continue  # a step read: becomes a placeholder of the body
        for a in n.all_input_nodes:
            if a not in members and chain.step_of.get(a) is None and a not in invariants and a is not h_prev_t:
                invariants.append(a)
    readout_inputs: list[fx.Node] = []  # non-state template values the readout reads
    for n in readout:
        for a in n.all_input_nodes:
            if a in members and a not in dep and a not in readout_inputs:
                readout_inputs.append(a)
    readout_invariants = [a for n in readout for a in n.all_input_nodes if a not in members and a is not h_prev_t]
    readout_invariants = list(dict.fromkeys(readout_invariants))
    u_val = upd.U.meta["val"]
    h_val = h_new_t.meta["val"]
    prod_targets = [x for x in (upd.A, upd.U) if isinstance(x, fx.Node)] + readout_inputs
    needed = ancestors(prod_targets, members.__contains__)
    prod_nodes = [n for n in template if n in needed]
    prod_inputs = [sel_of_seq[s] for s in seqs] + invariants
    A_node = upd.A

    def shape_fix(g: fx.Graph, outs: list) -> list:
        """Make ``A`` a tensor of U's rank and ``U`` h-shaped (the scan's layout)."""
        A, U = outs[0], outs[1]
        nd = h_val.dim()
        if not isinstance(U, fx.Node):
            raise node_error(h_new_t, "the additive term of the state update is not a tensor", NONLINEAR_HINT)
        if tuple(u_val.shape) != tuple(h_val.shape):
            U = g.call_function(aten.expand.default, (U, list(h_val.shape)))
        if upd.kind == "diagonal":
            if A is None:
                A = g.call_function(aten.new_ones.default, (U, [1] * nd))
            elif not isinstance(A, fx.Node):
                A = g.call_function(aten.new_full.default, (U, [1] * nd, float(A)))
            want = nd
        else:
            if upd.transpose_A:
                A = g.call_function(aten.transpose.int, (A, -1, -2))
            if upd.vector_state:
                U = g.call_function(aten.unsqueeze.default, (U, -1))
            want = nd + (1 if upd.vector_state else 0)
        if isinstance(A_node, fx.Node):
            shape_a = list(A_node.meta["val"].shape)
            if upd.transpose_A:
                shape_a[-1], shape_a[-2] = shape_a[-2], shape_a[-1]
            if len(shape_a) < want:
                A = g.call_function(aten.reshape.default, (A, [1] * (want - len(shape_a)) + shape_a))
            elif len(shape_a) > want:
                raise node_error(A_node, "the transition broadcasts the state to a larger shape", NONLINEAR_HINT)
        return [A, U, *outs[2:]]

    prod_gm = body_graph(prod_nodes, prod_inputs, [A_node, upd.U, *readout_inputs], extra=[shape_fix])
    in_dims = [d for _, d in seqs] + [None] * len(invariants)
    n_prod_out = 2 + len(readout_inputs)
    prod_mod = RolledBody(prod_gm, in_dims, [1] * n_prod_out, f"loop {index}: per-step a_t, u_t and readout inputs")
    # ---- readout body: (h_t, readout inputs, invariants) -> per-step outputs
    out_locals = sorted(set(stack_outs) | set(final_uses))
    for j in out_locals:
        node = template[j]
        if node not in readout and node is not h_new_t:
            raise node_error(node, "a state-independent value computed inside the loop is used outside it",
                             "compute it outside the loop")
    ro_outputs: list[tuple[int, fx.Node, int]] = []  # (local idx, template node, out dim)
    for j in out_locals:
        node = template[j]
        for _, dim, mode in stack_outs.get(j, []):
            src = node
            od = dim
            if mode == "cat":
                if node.target is not aten.unsqueeze.default:
                    raise node_error(node, "per-step outputs concatenated along time must be unsqueezed steps",
                                     "use torch.stack(ys, dim)")
                src = node.args[0]
            ro_outputs.append((j, src, od))
        if j in final_uses and node is not h_new_t:
            ro_outputs.append((j, node, 0))
    # normalise negative stack dims to the stacked rank
    norm_outputs = []
    for j, src, od in ro_outputs:
        rank = src.meta["val"].dim() + 1
        norm_outputs.append((j, src, od % rank))
    # a stacked state (``hs.append(h)``) is the scan's output itself: no readout body for it, so
    # the analyses see the scan's dims (state dims, time) on it and a readout after the loop
    # (``einsum(c, stack(hs))``) joins the recurrence region like an in-loop readout does
    body_outputs = [(j, src, od) for j, src, od in norm_outputs if src is not h_new_t]
    ro_nodes = [n for n in template if n in readout]
    ro_mod: Optional[RolledBody] = None
    if body_outputs:
        ro_in = [h_new_t] + readout_inputs + readout_invariants
        ro_gm = body_graph(ro_nodes, ro_in, [src for _, src, _ in body_outputs])
        ro_mod = RolledBody(ro_gm, [1] + [1] * len(readout_inputs) + [None] * len(readout_invariants),
                            [od for _, _, od in body_outputs], f"loop {index}: per-step readout")
    return LoopBodies(seqs, invariants, prod_mod, n_prod_out, readout_invariants, ro_mod, ro_nodes, out_locals,
                      norm_outputs, body_outputs)

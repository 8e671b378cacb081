"""Emitting a driven loop (:mod:`.loop_driven`): a driver loop, one packed scan, a readout.

For RWKV's WKV (driver: the running max ``m``; linear states ``num`` and ``den``, which the
output reads as carried into the step)::

    before:  select(k,1,0) -> maximum -> exp -> mul -> add ... (T copies) ... stack([y_0, ...], 1)
    after:   rows   = run_carried_loop(loop0_driver, k, m0, w)          # m after every step, (T, B*C)
             m_new  = reshape(rows, [-1, B, C]);  m_prev = cat([m0[None], m_new[:-1]])
             a, u   = run_rolled_body(loop0_states, k, v, m_prev, m_new, w)   # per step, vmap
                      # a_t = [e1_t, e1_t], u_t = [e2_t v_t, e2_t]: (B, T, 2C), num and den side by side
             s      = linear_scan(pad(a, 1 before, 1), pad(u, 1 before, 0), [num0, den0])
                      # s_t = (num, den) carried into step t
             y      = run_rolled_body(loop0_readout, s, k, v, m_prev, u_bonus)

One scan holds every linear state (flattened side by side, per batch row where they share
their first dim), so a readout that combines them (``num / den``) reads one state sequence,
as the adjoint plans' regions need. The bodies are copies of the template step's nodes, so
every per-step value is computed by the model's own operations; the scan runs the proven
``h_t = a_t h_{t-1} + u_t`` in the promoted dtype of ``a``, ``u`` and ``h0`` (a state the step
rounds to a narrower dtype is rounded once, when the readout reads it), and nothing holds the
sequence length.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from gradshard.ir import graph_module
from gradshard.errors import node_error
from gradshard.fake import fake_run
from gradshard.ops.carried_loop import CarriedLoop, run_carried_loop
from gradshard.ops.rolled_body import RolledBody, run_rolled_body
from gradshard.pipeline import ancestors

from gradshard.passes.loop_bodies import body_graph
from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.loop_driven import DrivenLoop, LinearState
from gradshard.passes.loop_emit import erase_steps
from gradshard.passes.loop_generic import _rebuild_inits

aten = torch.ops.aten

__all__ = ["emit_driven_loop"]

_INTERNAL = "report this: the loop split into drivers and linear states reads a value it was not given"


class _Emitter:
    """Inserts nodes at the graph's insertion point, with their value and stack trace."""

    def __init__(self, gm: fx.GraphModule, trace: Optional[str]) -> None:
        self.gm, self.graph, self.trace = gm, gm.graph, trace

    def op(self, target: Any, *args: Any) -> fx.Node:
        n = self.graph.call_function(target, args)
        n.meta["val"] = fake_run(target, args)
        if self.trace:
            n.meta["stack_trace"] = self.trace
        return n

    def cast(self, x: fx.Node, like: fx.Node) -> fx.Node:
        dtype = like.meta["val"].dtype
        return x if x.meta["val"].dtype == dtype else self.op(aten.to.dtype, x, dtype)

    def body(self, name: str, body: fx.GraphModule, inputs: list[fx.Node], in_dims: list[Optional[int]],
             out_dims: list[int], description: str) -> list[fx.Node]:
        """``run_rolled_body`` of ``body`` with time at ``out_dims`` of its outputs. The body stacks
        its outputs along dim 0 and views move time where it goes: ``vmap`` cannot put an output
        that no step input reaches (a per-step constant) at a dim other than 0."""
        module = RolledBody(body, in_dims, [0] * len(out_dims), description)
        self.gm.add_submodule(name, module)
        attr = self.graph.get_attr(name)
        call = self.graph.call_function(run_rolled_body, (attr, *inputs))
        call.meta["val"] = fake_run(lambda *a: module(*a), tuple(inputs))
        if self.trace:
            call.meta["stack_trace"] = self.trace
        outs = []
        for i, od in enumerate(out_dims):
            g = self.graph.call_function(operator.getitem, (call, i))
            g.meta["val"] = call.meta["val"][i]
            outs.append(g if od == 0 else self.op(aten.movedim.int, g, 0, od))
        return outs


@dataclass(frozen=True)
class _Pack:
    """The linear states packed side by side into one scanned state: per step ``(B, N)`` when
    every state starts with the same batch size ``B`` (else ``(N,)``), state ``i`` at
    ``[offsets[i], offsets[i] + sizes[i])`` of the last dim, flattened."""

    batch: Optional[int]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def of(states: tuple[LinearState, ...]) -> "_Pack":
        shapes = [list(s.core.meta["val"].shape) for s in states]
        batch = shapes[0][0] if all(sh[0] == shapes[0][0] for sh in shapes) else None
        sizes = tuple(math.prod(sh[1:] if batch is not None else sh) for sh in shapes)
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        return _Pack(batch, offsets, sizes)

    def flat(self) -> list[int]:
        return [self.batch, -1] if self.batch is not None else [-1]


def _cut_body(loop: DrivenLoop, roots: list[Any], fed: dict[fx.Node, tuple[fx.Node, int]],
              packed: Optional[tuple[fx.Node, int, dict[fx.Node, int]]] = None,
              extra: Optional[Callable] = None) -> tuple[fx.GraphModule, list[fx.Node], list[Optional[int]]]:
    """The template nodes ``roots`` need as one per-step body: ``(body graph, graph inputs, vmap
    in_dims)``. ``fed``: template (or step-0) node -> (sequence in the graph, its time dim);
    ``packed``: the packed scan, its time dim and the nodes it holds (node -> state number),
    unpacked inside the body; everything else the roots read is computed from these."""
    plan = loop.plan
    members = set(plan.template)
    unpacked = packed[2] if packed is not None else {}
    given = set(fed) | set(unpacked)
    nodes = ancestors(roots, within=lambda n: n in members and n not in given)
    invariants = set(plan.invariants)
    need_fed: list[fx.Node] = []
    need_inv: list[fx.Node] = []
    need_packed: list[fx.Node] = []

    def need(a: fx.Node, user: fx.Node) -> None:
        for pool, found in ((unpacked, need_packed), (fed, need_fed), (invariants, need_inv)):
            if a in pool:
                if a not in found:
                    found.append(a)
                return
        if a not in nodes:
            raise node_error(user, f"internal: a rolled body reads `{a.name}`", _INTERNAL)

    for n in nodes:
        for a in n.all_input_nodes:
            need(a, n)
    for r in roots:
        if isinstance(r, fx.Node) and r not in nodes:
            need(r, r)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph_inputs: list[fx.Node] = []
    in_dims: list[Optional[int]] = []
    if need_packed:
        ph = g.placeholder("packed_states")
        graph_inputs.append(packed[0])
        in_dims.append(packed[1])
        pack = _Pack.of(loop.states)
        for n in need_packed:
            k = unpacked[n]
            piece = g.call_function(aten.slice.Tensor, (ph, -1, pack.offsets[k], pack.offsets[k] + pack.sizes[k]))
            shaped = g.call_function(aten.reshape.default, (piece, list(n.meta["val"].shape)))
            env[n] = g.call_function(aten.to.dtype, (shaped, n.meta["val"].dtype))
    for i, n in enumerate([*need_fed, *need_inv]):
        ph = g.placeholder(f"in{i}_{n.name}")
        ph.meta = dict(n.meta)
        env[n] = ph
    graph_inputs += [fed[n][0] for n in need_fed] + need_inv
    in_dims += [fed[n][1] for n in need_fed] + [None] * len(need_inv)
    for n in plan.template:
        if n in nodes:
            env[n] = g.node_copy(n, env.__getitem__)
    outs = [env[r] if isinstance(r, fx.Node) else r for r in roots]
    g.output(tuple(extra(g, outs) if extra else outs))
    return graph_module(torch.nn.Module(), g, "LoopBody"), graph_inputs, in_dims


def _scan_layout(states: tuple[LinearState, ...], pack: _Pack) -> Callable:
    """Body outputs ``(A_0, U_0, A_1, U_1, ...)`` -> the packed ``(a_t, u_t)`` (the scan's layout)."""

    def fix(g: fx.Graph, outs: list) -> list:
        a_parts, u_parts = [], []
        for k, state in enumerate(states):
            A, U = outs[2 * k], outs[2 * k + 1]
            shape = list(state.core.meta["val"].shape)
            if list(state.U.meta["val"].shape) != shape:
                U = g.call_function(aten.expand.default, (U, shape))
            if state.negate_u:
                U = g.call_function(aten.neg.default, (U,))
            if A is None:
                A = g.call_function(aten.new_ones.default, (U, shape))
            elif not isinstance(A, fx.Node):
                A = g.call_function(aten.new_full.default, (U, shape, float(A)))
            else:
                A = g.call_function(aten.expand.default, (A, shape))
            a_parts.append(g.call_function(aten.reshape.default, (A, pack.flat())))
            u_parts.append(g.call_function(aten.reshape.default, (U, pack.flat())))
        return [g.call_function(aten.cat.default, (a_parts, -1)), g.call_function(aten.cat.default, (u_parts, -1))]

    return fix


def _emit_drivers(em: _Emitter, chain: LoopChain, loop: DrivenLoop, inits: list[fx.Node], index: int,
                  fed: dict[fx.Node, tuple[fx.Node, int]]) -> None:
    """The driver loop and its per-step values (after and before each step, time at dim 0)."""
    plan = loop.plan
    members = set(plan.template)
    roots = [plan.h_new[d] for d in loop.drivers]
    needed = ancestors(roots, members.__contains__)
    update_nodes = [n for n in plan.template if n in needed]
    # only the inputs the drivers read (others would leave the scan's region for the driver
    # loop); at least one sequence, which gives the loop its length
    sels = [n for n in plan.sel_nodes if n in needed] or plan.sel_nodes[:1]
    invariants = [x for x in plan.invariants if any(x in n.all_input_nodes for n in update_nodes)]
    body_in = [*sels, *(plan.h_prev[d] for d in loop.drivers), *invariants]
    update = body_graph(update_nodes, body_in, roots)
    readout = body_graph([], body_in, [])
    specs = [plan.specs[d] for d in loop.drivers]
    seq_dims = [chain.sources[n][1] for n in sels]
    driver = CarriedLoop(update, readout, seq_dims, specs, len(invariants), (),
                         f"loop {index}: the driver(s) of {len(loop.states)} linear state(s)")
    name = f"loop{index}_driver"
    em.gm.add_submodule(name, driver)
    args = (*[chain.sources[n][0] for n in sels], *(inits[d] for d in loop.drivers), *invariants)
    rows = em.graph.call_function(run_carried_loop, (em.graph.get_attr(name), *args))
    rows.meta["val"] = fake_run(lambda *a: run_carried_loop(driver, *a), args)
    rows.meta["stack_trace"] = em.trace
    rows.meta["gs_rolled_loop"] = {"steps": len(chain.steps), "form": "carried"}
    at = 0
    for d, spec in zip(loop.drivers, specs):
        piece = em.op(aten.slice.Tensor, rows, 1, at, at + spec.numel)
        at += spec.numel
        new = em.cast(em.op(aten.reshape.default, piece, [-1, *spec.shape]), plan.h_new[d])
        first = em.op(aten.unsqueeze.default, em.cast(inits[d], plan.h_new[d]), 0)
        if list(first.meta["val"].shape[1:]) != list(spec.shape):
            first = em.op(aten.expand.default, first, [1, *spec.shape])
        prev = em.op(aten.cat.default, [first, em.op(aten.slice.Tensor, new, 0, 0, -1)], 0)
        fed[plan.h_new[d]] = (new, 0)
        fed[plan.h_prev[d]] = (prev, 0)


def _emit_scan(em: _Emitter, loop: DrivenLoop, pack: _Pack, inits: list[fx.Node], index: int,
               fed: dict[fx.Node, tuple[fx.Node, int]], steps: int) -> fx.Node:
    """The linear states' producers and their one packed scan (time at dim 1)."""
    roots = [x for s in loop.states for x in (s.A, s.U)]
    body, inputs, in_dims = _cut_body(loop, roots, fed, extra=_scan_layout(loop.states, pack))
    a, u = em.body(f"loop{index}_states", body, inputs, in_dims, [1, 1] if pack.batch is not None else [0, 0],
                   f"loop {index}: a_t, u_t of {len(loop.states)} linear state(s), packed")
    parts = []
    for s in loop.states:
        shape = list(s.core.meta["val"].shape)
        h0 = inits[s.index]
        if list(h0.meta["val"].shape) != shape:
            h0 = em.op(aten.expand.default, h0, shape)
        parts.append(em.op(aten.reshape.default, h0, pack.flat()))
    h0 = em.op(aten.cat.default, parts, -1)
    if pack.batch is None:  # one scan row: (1, T, N)
        a, u, h0 = em.op(aten.unsqueeze.default, a, 0), em.op(aten.unsqueeze.default, u, 0), em.op(
            aten.unsqueeze.default, h0, 0)
    if loop.shifted:  # the scan of the values carried into each step: h0 first, then h_0 .. h_{T-2}
        pads = [0, 0] * (a.meta["val"].dim() - 2) + [1, -1]
        a = em.op(aten.constant_pad_nd.default, a, pads, 1.0)
        u = em.op(aten.constant_pad_nd.default, u, pads, 0.0)
    scan = em.op(torch.ops.gradshard.linear_scan.default, a, u, h0, False, None)
    scan.meta["gs_rolled_loop"] = {"steps": steps, "form": "diagonal"}
    return scan if pack.batch is not None else em.op(aten.squeeze.dim, scan, 0)


def emit_driven_loop(gm: fx.GraphModule, chain: LoopChain, loop: DrivenLoop, index: int,
                     order: dict[fx.Node, int]) -> tuple[str, list[fx.Node]]:
    """Replace loop ``index`` of ``gm`` by its driver loop, scans and readout, in place; return a
    note and the values that replace the loop's stacked outputs (in ``plan.stack_users`` order).

    ``order``: position of every node in the graph before the loop was touched."""
    plan = loop.plan
    graph = gm.graph
    first = min(plan.uses.consumers, key=lambda c: order[c])
    em = _Emitter(gm, plan.h_new[loop.states[0].index].meta.get("stack_trace"))
    fed: dict[fx.Node, tuple[fx.Node, int]] = {n: chain.sources[n] for n in plan.sel_nodes}
    pack = _Pack.of(loop.states)
    with graph.inserting_before(first):
        inits = _rebuild_inits(gm, chain, plan)
        if loop.drivers:
            _emit_drivers(em, chain, loop, inits, index, fed)
        scan = _emit_scan(em, loop, pack, inits, index, fed, len(chain.steps))
        held = {(s.h_prev if loop.shifted else s.core): k for k, s in enumerate(loop.states)}
        roots = loop.readout_roots
        body, inputs, in_dims = _cut_body(loop, roots, fed, packed=(scan, 1 if pack.batch is not None else 0, held))
        outs = em.body(f"loop{index}_readout", body, inputs, in_dims, [od for _, _, od in plan.outputs],
                       f"loop {index}: per-step readout")
    for value, consumer in zip(outs, plan.stack_users):
        want, got = consumer.meta.get("val"), value.meta["val"]
        if isinstance(want, torch.Tensor) and (want.shape != got.shape or want.dtype != got.dtype):
            raise node_error(consumer, f"internal: the rolled readout gives {tuple(got.shape)} {got.dtype} where the "
                             f"loop stacked {tuple(want.shape)} {want.dtype}", _INTERNAL)
        consumer.replace_all_uses_with(value)
        graph.erase_node(consumer)
    erase_steps(graph, chain, order)
    for n in reversed(inits):
        if not n.users and n.op == "call_function":
            graph.erase_node(n)
    kinds = ", ".join(f"`{plan.h_new[s.index].name}`" for s in loop.states)
    kinds += " (the scan holds them as carried into each step)" if loop.shifted else ""
    drivers = ", ".join(f"`{plan.h_new[d].name}`" for d in loop.drivers) or "none"
    return (f"split loop {index} ({len(chain.steps)} steps): driver(s) {drivers} run as loop{index}_driver; "
            f"linear state(s) {kinds} packed into one scan {scan.name}"), outs

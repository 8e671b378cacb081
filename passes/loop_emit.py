"""Emitting a rolled loop: the vectorised bodies and one scan replace the unrolled steps.

Inserts ``run_rolled_body(producers, ...) -> (a_seq, u_seq, readout inputs)``, one
``linear_scan`` / ``dense_linear_scan`` over them, and ``run_rolled_body(readout, h_seq,
...)``; points every stack of per-step outputs (and every use of the last step) at them; then
erases the unrolled steps.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.ops.rolled_body import run_rolled_body

from gradshard.passes.loop_bodies import LoopBodies, LoopState, LoopUses
from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.recurrence_graph import fake_run

aten = torch.ops.aten

__all__ = ["emit_rolled_loop", "erase_steps"]


def emit_rolled_loop(gm: fx.GraphModule, chain: LoopChain, state: LoopState, uses: LoopUses, bodies: LoopBodies,
                     index: int, order: dict[fx.Node, int]) -> str:
    """Replace loop ``index`` of ``gm`` by its bodies and one scan, in place; return a note.

    ``order``: position of every node in the graph before the loop was touched.
    """
    first_consumer = min(uses.consumers, key=lambda c: order[c])
    outs, h_seq, scan = _emit_scan(gm, chain, state, bodies, index, first_consumer)
    _rewire_consumers(gm.graph, chain, state, uses, bodies, outs, h_seq, first_consumer)
    erase_steps(gm.graph, chain, order)
    prefix = f"loop{index}"
    tail = f" -> {prefix}_readout" if bodies.readout is not None else ""
    folded = " (the stacked states are the scan's output)" if len(bodies.body_outputs) < len(bodies.outputs) else ""
    return (f"rolled loop {index}: {len(chain.steps)} steps of a {state.update.kind} recurrence "
            f"({len(state.template)} nodes per step) into {prefix}_producers -> {scan.name}{tail}{folded}")


def _emit_scan(gm: fx.GraphModule, chain: LoopChain, state: LoopState, bodies: LoopBodies, index: int,
               first_consumer: fx.Node) -> tuple[list[fx.Node], fx.Node, fx.Node]:
    """Insert the bodies and the scan before ``first_consumer``: ``(one output per use, h_seq, scan)``."""
    graph = gm.graph
    h_new_t, h_init, upd = state.h_new, state.h_init, state.update
    h_val = h_new_t.meta["val"]
    seqs, invariants, n_prod_out = bodies.seqs, bodies.invariants, bodies.n_prod_out
    prod_mod, ro_mod, ro_nodes = bodies.producers, bodies.readout, bodies.readout_nodes
    readout_invariants, body_outputs, norm_outputs = bodies.readout_invariants, bodies.body_outputs, bodies.outputs
    prefix = f"loop{index}"
    gm.add_submodule(f"{prefix}_producers", prod_mod)
    if ro_mod is not None:
        gm.add_submodule(f"{prefix}_readout", ro_mod)
    trace = h_new_t.meta.get("stack_trace")
    with graph.inserting_before(first_consumer):
        p_attr = graph.get_attr(f"{prefix}_producers")
        p_args = (p_attr, *[s for s, _ in seqs], *invariants)
        p_node = graph.call_function(run_rolled_body, p_args)
        p_node.meta["val"] = fake_run(lambda *a: prod_mod(*a), p_args[1:])
        p_node.meta["stack_trace"] = trace
        getters = []
        for i in range(n_prod_out):
            gi = graph.call_function(operator.getitem, (p_node, i))
            gi.meta["val"] = p_node.meta["val"][i]
            getters.append(gi)
        a_seq, u_seq, r_seqs = getters[0], getters[1], getters[2:]
        h0 = h_init
        if tuple(h_init.meta["val"].shape) != tuple(h_val.shape):
            h0 = graph.call_function(aten.expand.default, (h_init, list(h_val.shape)))
            h0.meta["val"] = fake_run(aten.expand.default, (h_init, list(h_val.shape)))
        if upd.kind == "diagonal":
            scan = graph.call_function(torch.ops.gradshard.linear_scan.default, (a_seq, u_seq, h0, False, None))
        else:
            if upd.vector_state:
                h0 = graph.call_function(aten.unsqueeze.default, (h0, -1))
                h0.meta["val"] = fake_run(aten.unsqueeze.default, (h0.args[0], -1))
            scan = graph.call_function(torch.ops.gradshard.dense_linear_scan.default, (a_seq, u_seq, h0))
        scan.meta["val"] = fake_run(scan.target, scan.args)
        scan.meta["stack_trace"] = trace
        scan.meta["gs_rolled_loop"] = {"steps": len(chain.steps), "form": upd.kind}
        h_seq = scan
        if upd.kind == "dense" and upd.vector_state:
            h_seq = graph.call_function(aten.squeeze.dim, (scan, -1))
            h_seq.meta["val"] = fake_run(aten.squeeze.dim, (scan, -1))
        body_outs: list[fx.Node] = []
        if ro_mod is not None:
            r_attr = graph.get_attr(f"{prefix}_readout")
            r_args = (r_attr, h_seq, *r_seqs, *readout_invariants)
            r_node = graph.call_function(run_rolled_body, r_args)
            r_node.meta["val"] = fake_run(lambda *a: ro_mod(*a), r_args[1:])
            r_node.meta["stack_trace"] = next((n.meta.get("stack_trace") for n in ro_nodes if n.meta.get("stack_trace")),
                                              trace)
            for i in range(len(body_outputs)):
                gi = graph.call_function(operator.getitem, (r_node, i))
                gi.meta["val"] = r_node.meta["val"][i]
                body_outs.append(gi)
        outs = []  # one per entry of norm_outputs
        next_body = iter(body_outs)
        for _, src, od in norm_outputs:
            if src is not h_new_t:
                outs.append(next(next_body))
            elif od == 1:  # the scan's layout: time at dim 1
                outs.append(h_seq)
            else:
                moved = graph.call_function(aten.movedim.int, (h_seq, 1, od))
                moved.meta["val"] = fake_run(aten.movedim.int, (h_seq, 1, od))
                moved.meta["stack_trace"] = trace
                outs.append(moved)
    return outs, h_seq, scan


def _rewire_consumers(graph: fx.Graph, chain: LoopChain, state: LoopState, uses: LoopUses, bodies: LoopBodies,
                      outs: list[fx.Node], h_seq: fx.Node, first_consumer: fx.Node) -> None:
    """Point every stack of per-step outputs, and every use of the last step, at the rolled values."""
    template, h_new_t = state.template, state.h_new
    stack_outs, final_uses = uses.stack_outs, uses.final_uses
    pos = 0
    for j in bodies.out_locals:
        for consumer, dim, mode in stack_outs.get(j, []):
            consumer.replace_all_uses_with(outs[pos])
            graph.erase_node(consumer)
            pos += 1
        if j in final_uses:
            node_last = chain.steps[-1][j]
            seq, dim = (h_seq, 1) if template[j] is h_new_t else (outs[pos], 0)
            with graph.inserting_before(first_consumer):
                last = graph.call_function(aten.select.int, (seq, dim, -1))
                last.meta["val"] = fake_run(aten.select.int, (seq, dim, -1))
            for user in list(final_uses[j]):
                user.replace_input_with(node_last, last)
            if template[j] is not h_new_t:
                pos += 1


def erase_steps(graph: fx.Graph, chain: LoopChain, order: dict[fx.Node, int]) -> None:
    """Erase the unrolled steps (users first) and the ``unbind`` nodes left without users."""
    for n in sorted(chain.step_of, key=lambda x: -order[x]):
        if n.users:
            raise node_error(n, "internal: an unrolled loop node is still used after rolling", "report this")
        graph.erase_node(n)
    # drop unbind nodes left without users
    for n in list(graph.nodes):
        if n.target is aten.unbind.int and not n.users:
            graph.erase_node(n)

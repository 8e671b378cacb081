"""Rolling a loop with any state update into a carried loop (the chunked plans' fallback).

A loop whose update is not linear in its state (``h = tanh(W h + x_t)``) or that carries
several values (``(num, den, running max)``) has no scan, but its steps still repeat the same
ops. :func:`plan_carried_loop` proves what the rolled loop needs (isomorphic steps, carried
values of one shape and dtype at every step, inputs read one step at a time, outputs
stacked per step) without touching the graph;
:func:`emit_carried_loop` replaces the unrolled steps by ``run_carried_loop`` (the carried
values after every step) and ``run_carried_readout`` (the per-step outputs), see
:mod:`gradshard.ops.carried_loop`::

    before:  select(x,1,0) -> ... -> h_1 -> ... (T copies) ... stack([y_0, ..., y_{T-1}], 1)
    after:   loop0_rows = run_carried_loop(loop0_carried, x, h0, W)       # (T, N)
             (ys,) = run_carried_readout(loop0_carried, loop0_rows, x, h0, W)

The chunked plans run it chunk by chunk: exact for any update (the loop is the captured step
itself); the adjoint plans need the scan and refuse such a loop.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.fake import fake_run
from gradshard.ops.carried_loop import CarriedLoop, StateSpec, run_carried_loop, run_carried_readout
from gradshard.pipeline import ancestors

from gradshard.passes.loop_bodies import LoopUses, body_graph, find_outside_uses
from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.loop_emit import erase_steps
from gradshard.passes.loop_steps import UNROLLABLE_HINT, check_isomorphic

aten = torch.ops.aten

__all__ = ["CarriedPlan", "plan_carried_loop", "emit_carried_loop"]

_LIKE = {aten.zeros_like.default: aten.new_zeros.default, aten.ones_like.default: aten.new_ones.default,
         aten.empty_like.default: aten.new_empty.default, aten.full_like.default: aten.new_full.default}
_NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}
_FACTORY_KWARGS = ("dtype", "layout", "device", "pin_memory")
_INIT_HINT = "start the loop from explicit initial values (zeros, a constant, or a parameter) built outside it"


@dataclass
class CarriedPlan:
    """What :func:`emit_carried_loop` needs, proven by :func:`plan_carried_loop`."""

    template: list[fx.Node]
    h_prev: list[fx.Node]  # the carried values as step 1 reads them (nodes of step 0)
    h_new: list[fx.Node]  # the carried values step 1 computes
    inits: list[fx.Node]  # the values step 0 reads in their place (outside, or built in step 0)
    prefix: list[fx.Node]  # step 0's leading nodes that only build initial values
    sel_nodes: list[fx.Node]  # template reads of one step: one body input each
    invariants: list[fx.Node]
    specs: list[StateSpec]
    uses: LoopUses
    outputs: list[tuple[int, fx.Node, int]]  # (local idx, body output node, time dim in the output)
    stack_users: list[fx.Node]  # per output: the stack/cat it replaces


def _step_index(node: fx.Node) -> int:
    return int(node.args[2] if node.target is aten.select.int else node.args[1])


def _check_initial(chain: LoopChain, prefix: list[fx.Node], inits: list[fx.Node]) -> None:
    """Initial values built in step 0 may read a step's input only for its shape
    (``zeros_like(x[:, 0])``): they are rebuilt outside the loop from the sequence."""
    inside = set(prefix)
    seen: set[fx.Node] = set()
    stack = [n for n in inits if n in inside]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in chain.sources:
            raise node_error(n, "the loop's initial values are computed from the first step's inputs", _INIT_HINT)
        if n.target in _LIKE or n.target in _NEW:
            continue  # reads only the shape, dtype and device of its input
        stack.extend(a for a in n.all_input_nodes if a in inside)


def plan_carried_loop(chain: LoopChain) -> CarriedPlan:
    """Prove ``chain`` (isomorphic steps, last step complete) rolls into a carried loop whose
    outputs are stacked per step (a chunked plan keeps no single step of it)."""
    _, init, prefix = check_isomorphic(chain, precheck=False)
    template, prev = chain.steps[1], chain.steps[0]
    T = len(chain.steps)
    at_end = {n: i - len(prev) for i, n in enumerate(prev)}
    for n in template:
        for a in n.all_input_nodes:
            s = chain.step_of.get(a)
            if s is not None and s not in (0, 1):
                raise node_error(n, "a step of the loop reads a step before the previous one", UNROLLABLE_HINT)
    carried = sorted({at_end[a] for n in template for a in n.all_input_nodes if chain.step_of.get(a) == 0})
    if not carried:
        raise node_error(template[0], "the loop carries no value from step to step", UNROLLABLE_HINT)
    missing = [k for k in carried if k not in init]
    if missing:
        raise node_error(prev[missing[0]], "the first step reads no initial value in place of this carried value",
                         _INIT_HINT)
    h_prev = [prev[k] for k in carried]
    h_new = [template[k] for k in carried]
    inits = [init[k] for k in carried]
    _check_initial(chain, prefix, inits)
    specs = []
    for k, h in zip(carried, h_new):
        val = h.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            raise node_error(h, "a value the loop carries is not a floating-point tensor", UNROLLABLE_HINT)
        for t in range(T):
            other = chain.steps[t][len(chain.steps[t]) + k].meta.get("val")
            if not isinstance(other, torch.Tensor) or other.shape != val.shape or other.dtype != val.dtype:
                raise node_error(chain.steps[t][len(chain.steps[t]) + k], f"the loop's carried value changes shape "
                                 f"or dtype at step {t}", UNROLLABLE_HINT)
        specs.append(StateSpec(tuple(int(s) for s in val.shape), val.dtype))
    sel_nodes = [n for n in template if n in chain.sources]
    for n in sel_nodes:
        seq, d = chain.sources[n]
        if _step_index(n) != 1 or int(seq.meta["val"].shape[d]) != T:
            raise node_error(n, f"the loop does not read its input `{seq.name}` one step at a time from the first "
                             "step to the last", UNROLLABLE_HINT)
    members = set(template)
    invariants: list[fx.Node] = []
    for n in template:
        if n in chain.sources:
            continue
        for a in n.all_input_nodes:
            if a not in members and chain.step_of.get(a) is None and a not in invariants:
                invariants.append(a)
    uses = find_outside_uses(chain, template)
    for j in uses.final_uses:
        last = chain.steps[-1][len(chain.steps[-1]) + j]
        raise node_error(last, "the loop's value after its last step is used outside the loop (returned, or read "
                         "after it); a chunked plan runs the loop chunk by chunk inside its region, and no single "
                         "step of it leaves the region",
                         "return the per-step values (torch.stack) and pick the last step outside the compiled "
                         "module, or " + UNROLLABLE_HINT)
    outputs, stack_users = [], []
    for j in sorted(uses.stack_outs):
        node = template[j]
        for consumer, dim, mode in uses.stack_outs.get(j, []):
            src = node
            if mode == "cat":
                if node.target is not aten.unsqueeze.default:
                    raise node_error(node, "per-step outputs concatenated along time must be unsqueezed steps",
                                     "use torch.stack(ys, dim)")
                src = node.args[0]
            outputs.append((j, src, dim % (src.meta["val"].dim() + 1)))
            stack_users.append(consumer)
    return CarriedPlan(template, h_prev, h_new, inits, prefix, sel_nodes, invariants, specs, uses, outputs,
                       stack_users)


def _rebuild_inits(gm: fx.GraphModule, chain: LoopChain, plan: CarriedPlan) -> list[fx.Node]:
    """Initial values built in step 0 (``zeros_like(x[:, 0]) - 1e38``), rebuilt outside the loop
    (``new_zeros(x, shape)``); inserted at the graph's current insertion point."""
    inside = set(plan.prefix)
    env: dict[fx.Node, fx.Node] = {}

    def sequence_of(src: fx.Node) -> fx.Node:
        while src in chain.step_of and src not in chain.sources:
            src = src.args[0]
        return chain.sources[src][0] if src in chain.sources else src

    def build(n: fx.Node) -> fx.Node:
        if n not in inside:
            return n
        if n in env:
            return env[n]
        if n.target in _LIKE or n.target in _NEW:
            target = _LIKE.get(n.target, n.target)
            extra = tuple(n.args[1:]) if n.target in (aten.full_like.default,) else tuple(n.args[2:])
            args = (sequence_of(n.args[0]), list(n.meta["val"].shape), *extra)
            kwargs = {k: v for k, v in n.kwargs.items() if k in _FACTORY_KWARGS}
            kwargs.setdefault("dtype", n.meta["val"].dtype)
            new = gm.graph.call_function(target, args, kwargs)
            new.meta["val"] = fake_run(target, args, kwargs)
        else:
            new = gm.graph.node_copy(n, build)
            new.meta["val"] = n.meta.get("val")
        new.meta["stack_trace"] = n.meta.get("stack_trace")
        env[n] = new
        return new

    return [build(n) for n in plan.inits]


def emit_carried_loop(gm: fx.GraphModule, chain: LoopChain, plan: CarriedPlan, index: int,
                      order: dict[fx.Node, int]) -> str:
    """Replace loop ``index`` of ``gm`` by a carried loop, in place; return a note.

    ``order``: position of every node in the graph before the loop was touched."""
    graph = gm.graph
    members = set(plan.template)
    update_nodes = [n for n in plan.template if n in ancestors(plan.h_new, members.__contains__)]
    out_srcs = [src for _, src, _ in plan.outputs]
    readout_nodes = [n for n in plan.template if n in ancestors(out_srcs, members.__contains__)]
    body_in = [*plan.sel_nodes, *plan.h_prev, *plan.invariants]
    update = body_graph(update_nodes, body_in, plan.h_new)
    readout = body_graph(readout_nodes, body_in, out_srcs)
    seq_dims = [chain.sources[n][1] for n in plan.sel_nodes]
    loop = CarriedLoop(update, readout, seq_dims, plan.specs, len(plan.invariants), [od for _, _, od in plan.outputs],
                       f"loop {index}: {len(plan.h_new)} carried value(s), {len(chain.steps)} steps when captured")
    name = f"loop{index}_carried"
    gm.add_submodule(name, loop)
    first = min(plan.uses.consumers, key=lambda c: order[c])
    trace = plan.h_new[0].meta.get("stack_trace")
    with graph.inserting_before(first):
        inits = _rebuild_inits(gm, chain, plan)
        attr = graph.get_attr(name)
        args = (*[chain.sources[n][0] for n in plan.sel_nodes], *inits, *plan.invariants)
        rows = graph.call_function(run_carried_loop, (attr, *args))
        rows.meta["val"] = fake_run(lambda *a: run_carried_loop(loop, *a), args)
        rows.meta["stack_trace"] = trace
        rows.meta["gs_rolled_loop"] = {"steps": len(chain.steps), "form": "carried"}
        outs = graph.call_function(run_carried_readout, (attr, rows, *args))
        outs.meta["val"] = fake_run(lambda *a: run_carried_readout(loop, *a), (rows, *args))
        outs.meta["stack_trace"] = next((n.meta.get("stack_trace") for n in readout_nodes if n.meta.get("stack_trace")),
                                        trace)
        values = []
        for i in range(len(plan.outputs)):
            item = graph.call_function(operator.getitem, (outs, i))
            item.meta["val"] = outs.meta["val"][i]
            values.append(item)
    for value, consumer in zip(values, plan.stack_users):
        consumer.replace_all_uses_with(value)
        graph.erase_node(consumer)
    erase_steps(graph, chain, order)
    names = ", ".join(f"`{h.name}`" for h in plan.h_new)
    return (f"rolled loop {index}: {len(chain.steps)} steps carrying {len(plan.h_new)} value(s) ({names}) into "
            f"{name} (run step by step; a chunked plan carries its values across chunks)")

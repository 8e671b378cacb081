"""rewrite_chunked: replace the model body by one region module that runs it chunk by chunk.

Before (captured)::

    embedding -> ... -> scaled_dot_product_attention -> ... -> linear (logits)
              -> reshape -> cross_entropy_loss -> mul(loss, 0.5) -> output

After::

    seco_0 = call_module[seco_0](*params, *buffers, *inputs)   # ChunkedRegion
    cross_entropy_loss = getitem(seco_0, 0)                    # split into per-chunk sums
    mul = mul(cross_entropy_loss, 0.5)                         # stays outside: plain autograd
    output(mul)

The region returns the graph outputs that run along time (concatenated over chunks) and
the whole-sequence reductions; parameters stay graph inputs, so gradients reach them.
Requires ``ctx.analyses["chunks"]`` from :func:`~gradshard.plans.chunked.plan.plan_chunk_program`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from gradshard.ir import graph_module
from gradshard.plans.chunked.plan import hoisted_subgraph, outer_nodes
from gradshard.pipeline import PassContext, PassResult, graph_pass
from gradshard.plans.chunked.runtime import ChunkedRegion

__all__ = ["rewrite_chunked"]


@graph_pass
def rewrite_chunked(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Install the chunked region module (SeCO/SpaCO) in place of the model body."""
    program = ctx.analyses["chunks"]
    name = f"{ctx.plan}_0"
    region = ChunkedRegion(program, ctx.plan, ctx.options, name)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        new = graph.placeholder(ph.name, type_expr=ph.type)
        new.meta = dict(ph.meta)
        env[ph.name] = new
    root: dict[str, Any] = {name: region}
    for node in hoisted_subgraph(program):  # masks and positions: once, for the whole sequence
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
        if node.op == "get_attr":
            root[node.target] = getattr(gm, node.target)
    call = graph.call_module(name, tuple(env[p] for p in program.flat_names))
    call.meta["gs_region"] = name
    for i, o in enumerate(program.outputs):
        item = graph.call_function(operator.getitem, (call, i))
        item.meta = dict(program.nodes[o.name].meta)
        env[o.name] = item
    for node in outer_nodes(program):
        if node.name in env:
            continue
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
        if node.op == "get_attr":
            root[node.target] = getattr(gm, node.target)
    out = next(iter(gm.graph.find_nodes(op="output")))
    graph.output(fx.node.map_arg(out.args[0], lambda a: env[a.name]), type_expr=out.type)
    new_gm = graph_module(root, graph, type(gm).__name__)
    notes = (f"{name}: {program.num_chunks} chunk(s) of {program.chunk_size} steps, "
             f"{len(program.cache_points)} cache point(s), {len(program.outputs)} region output(s)",)
    return PassResult(new_gm, changed=True, notes=notes)

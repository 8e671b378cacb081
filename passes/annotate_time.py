"""annotate_time_locality: compute the time-locality analysis once and cache it."""

from __future__ import annotations

import torch.fx as fx

from gradshard.errors import first_line
from gradshard.analysis.locality import NoTimeAxisError, analyze_time_locality
from gradshard.pipeline import PassContext, PassResult, graph_pass


@graph_pass
def annotate_time_locality(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Infer the time axis and every node's time reach (analysis; the graph is unchanged).

    Stores the :class:`~gradshard.analysis.locality.TimeLocality` in
    ``ctx.analyses["time"]``. A plan that needs a time axis fails here with the reason;
    ``plan="none"`` records a note instead.
    """
    try:
        tl = analyze_time_locality(gm, time_axis=ctx.time_axis, example_inputs=ctx.example_inputs)
    except NoTimeAxisError as exc:
        if ctx.strict:
            raise
        ctx.analyses["time"] = None
        return PassResult(gm, notes=(f"no time axis: {first_line(exc)}",))
    ctx.analyses["time"] = tl
    index = {n.name: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    ctx.input_time_dims = {index[n]: d for n, d in tl.time_inputs.items() if n in index}
    names = {n.name: n.meta.get("gs_input_name", n.name) for n in gm.graph.find_nodes(op="placeholder")}
    axis = ", ".join(f"{names.get(n, n)}[dim {d}]" for n, d in tl.time_inputs.items())
    return PassResult(gm, notes=(f"time axis: {axis} (T={tl.seq_len})",
                                 *(f"evidence: {e}" for es in tl.evidence.values() for e in es)))

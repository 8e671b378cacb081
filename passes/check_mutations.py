"""refuse_unordered_mutations: refuse a graph whose in-place writes its data flow does not show.

The capture keeps in-place ops; replayed in order they compute the model's function. The
chunked and adjoint plans cut the graph along its data flow and evaluate the pieces per chunk
or shard, in another order: a reader of a tensor written in place through a view (``x[..., :d]
= y`` on an intermediate, not rewritten by the capture's canonical forms) would read it before
the write. Such a graph is refused naming the write, never run with stale values.
"""

from __future__ import annotations

import torch.fx as fx

from gradshard.capture.mutations import unordered_mutations
from gradshard.errors import node_error
from gradshard.ir import source_of
from gradshard.pipeline import PassContext, PassResult, graph_pass

__all__ = ["refuse_unordered_mutations"]


@graph_pass
def refuse_unordered_mutations(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Refuse (naming the op and its source line) an in-place write into an intermediate tensor
    that a later node reads through the tensor itself or an earlier view of it."""
    found = unordered_mutations(gm)
    if found:
        write, reader = found[0]
        where = source_of(reader)
        raise node_error(
            write,
            f"writes in place into a tensor that a later op reads (`{reader.name}`"
            f"{f' at {where}' if where else ''}) through the tensor itself or a view taken before "
            f"the write; plan={ctx.plan!r} evaluates the graph in pieces (chunks or shards) along "
            "its data flow, which does not show that read's dependence on the write",
            "build the tensor out of place (`torch.cat`, `torch.where`, `tensor.index_put` "
            "without the trailing underscore), or use plan='none'")
    return PassResult(gm, notes=("no in-place writes outside the data flow",))

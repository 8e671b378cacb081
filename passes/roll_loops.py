"""roll_loops: roll unrolled per-timestep loops back into one scan per loop.

A Python loop ``for t in range(T): h = a[:, t] * h + u[:, t]; ys.append(c[:, t] @ h)``
is captured unrolled: ``T`` isomorphic copies of the step body, chained through ``h``, and a
``stack`` of the per-step outputs. This pass finds each chain, checks the copies are
isomorphic, extracts the body of one step as a small fx graph of
``(x_t..., h_{t-1}, invariants) -> (h_t, y_t...)``, proves the state update is linear in
the state, and rewrites the graph::

    before:  select(a,1,0) -> mul(., h0) -> add(., select(u,1,0)) -> h_1 -> einsum -> y_0 ...
             ... (T copies) ... stack([y_0, ..., y_{T-1}], 1)
    after:   run_rolled_body(producers, a, u, c)         -> (a_seq, u_seq, r_seq)   (vmap over t)
             linear_scan(a_seq, u_seq, h0)             -> h_seq                   (one scan)
             run_rolled_body(readout, h_seq, r_seq)    -> y_seq                   (vmap over t)

A stacked state itself (``hs.append(h)``, readout after the loop) is ``h_seq`` (moved to the
stack dim), with no readout body: the scan's dims reach the readout after the loop.

The linear forms accepted for the state update (``A``, ``U`` not depending on ``h``):
``A * h + U`` (either operand order, ``A`` a tensor or a number), ``addcmul(U, A, h)``,
``h + U`` (``A = 1``), ``A @ h + U`` / ``matmul``/``bmm``/matmul-shaped ``einsum`` (dense).
Anything else that feeds the next state (``tanh(W h + x)``) is an error naming the node,
with plain autograd (``none``) and checkpointing suggested: this pass runs in the chunked
plans' pipelines too, so they cannot take such a loop either. One carried state per loop; the first step must
be isomorphic to the others (its previous state is the loop's initial state).

The rolled bodies hold no sequence length: the rolled program runs at any length. The pass
is linear in the number of graph nodes (T=1000 loops roll in well under a second).

The pass is split by job: :mod:`.loop_chains` finds the loops, :mod:`.loop_steps` checks the
steps are isomorphic and the update linear, :mod:`.loop_bodies` extracts the state, the
outside uses and the vectorised bodies, :mod:`.loop_emit` writes the scan into the graph.
"""

from __future__ import annotations

import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.pipeline import PassContext, PassResult, graph_pass

from gradshard.passes.loop_bodies import analyse_state, extract_bodies, find_outside_uses
from gradshard.passes.loop_chains import LoopChain, find_loops
from gradshard.passes.loop_emit import emit_rolled_loop

__all__ = ["roll_loops", "find_loops", "LoopChain"]


def _roll_one(gm: fx.GraphModule, chain: LoopChain, index: int) -> str:
    """Roll one loop of ``gm`` in place; return the note for the pass record."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    state = analyse_state(gm, chain)
    uses = find_outside_uses(chain, state)
    bodies = extract_bodies(chain, state, uses, index)
    return emit_rolled_loop(gm, chain, state, uses, bodies, index, order)


@graph_pass
def roll_loops(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Roll unrolled per-timestep loops into one vectorised scan each (see module doc).

    Needs ``ctx.analyses["time"]``; recomputes it on the rolled graph. Rewrites ``gm`` in place.
    """
    tl = ctx.analyses.get("time")
    if tl is None:
        return PassResult(gm, notes=("no time axis: nothing to roll",))
    chains = find_loops(gm, tl)
    if not chains:
        return PassResult(gm, notes=("no unrolled loops",))
    # Rolled in place: copying and recompiling a graph of T unrolled steps costs more than the
    # rolling itself, and the pass manager already recorded the code before this pass.
    new = gm
    new.graph.owning_module = new  # a shared graph may name another module its owner
    notes = []
    for i, chain in enumerate(chains):
        notes.append(_roll_one(new, chain, i))
    new.graph.lint()
    ctx.invalidate("time")
    ctx.analyses["time"] = analyze_time_locality(new, time_axis=ctx.time_axis)
    return PassResult(new, changed=True, notes=tuple(notes))

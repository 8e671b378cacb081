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
One carried state per loop; the first step must be isomorphic to the others (its previous
state is the loop's initial state); a last step cut short by dead code (an update nothing
reads after the loop) is completed first (:mod:`.loop_tail`).

Anything else that feeds the next state (``tanh(W h + x)``), or several carried values
(RWKV's ``(num, den, running max)``), has no scan. :func:`roll_loops` (the adjoint plans)
refuses it naming the node; where the steps do repeat, the advice names the chunked plans,
which take it: :func:`roll_loops_carrying` (their pass) rolls such a loop into a *carried
loop* instead (:mod:`.loop_generic`, run step by step, exact for any update).

The rolled bodies hold no sequence length: the rolled program runs at any length. The pass
is linear in the number of graph nodes (T=1000 loops roll in well under a second).

The pass is split by job: :mod:`.loop_chains` finds the loops, :mod:`.loop_steps` checks the
steps are isomorphic and the update linear, :mod:`.loop_bodies` extracts the state, the
outside uses and the vectorised bodies, :mod:`.loop_emit` writes the scan into the graph.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.errors import UnsupportedGraphError
from gradshard.pipeline import PassContext, PassResult, graph_pass

from gradshard.passes.loop_bodies import analyse_state, extract_bodies, find_outside_uses
from gradshard.passes.loop_chains import LoopChain, find_loops
from gradshard.passes.loop_emit import emit_rolled_loop
from gradshard.passes.loop_generic import emit_carried_loop, plan_carried_loop
from gradshard.passes.loop_steps import CARRY_HINT, UNROLLABLE_HINT, check_isomorphic
from gradshard.passes.loop_tail import align_last_step, complete_last_step

__all__ = ["roll_loops", "roll_loops_carrying", "find_loops", "LoopChain"]


def pick_repeating_cut(chain: LoopChain) -> tuple[LoopChain, Optional[list], bool]:
    """The first cut of the loop into steps (``find_loops`` offers two) whose steps repeat the
    same ops, a last step cut short allowed: ``(chain, aligned last step or None, found)``."""
    for cut in (chain, chain.alternative):
        if cut is None:
            continue
        aligned = align_last_step(cut)
        try:
            check_isomorphic(cut, precheck=False, last_aligned=aligned is not None)
        except UnsupportedGraphError:
            continue
        return cut, aligned, True
    return chain, None, False


def _advise_chunked(exc: UnsupportedGraphError) -> UnsupportedGraphError:
    """``exc`` with its advice naming the chunked plans (the loop rolls as a carried loop)."""
    text = str(exc)
    return type(exc)(text.replace(UNROLLABLE_HINT, CARRY_HINT)) if UNROLLABLE_HINT in text else exc


def _roll_one(gm: fx.GraphModule, chain: LoopChain, index: int, carry: bool) -> str:
    """Roll one loop of ``gm`` in place; return the note for the pass record.

    ``carry``: a loop without a linear update becomes a carried loop (else: an error)."""
    chain, aligned, repeats = pick_repeating_cut(chain)
    tail = ""
    if aligned is not None:
        added = complete_last_step(gm, chain, aligned)
        tail = f"; its last step was completed with {added} op(s) nothing read (the update after the last output)"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    try:
        state = analyse_state(gm, chain)
        uses = find_outside_uses(chain, state.template)
        bodies = extract_bodies(chain, state, uses, index)
    except UnsupportedGraphError as exc:
        if not repeats:
            raise
        try:
            plan = plan_carried_loop(chain)
        except UnsupportedGraphError as why:  # no plan rolls it: say why in this plan's terms
            raise (why if carry else exc) from None
        if not carry:
            raise _advise_chunked(exc) from None
        return emit_carried_loop(gm, chain, plan, index, order) + tail
    return emit_rolled_loop(gm, chain, state, uses, bodies, index, order) + tail


def _roll_all(gm: fx.GraphModule, ctx: PassContext, carry: bool) -> PassResult:
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
        notes.append(_roll_one(new, chain, i, carry))
    new.graph.lint()
    ctx.invalidate("time")
    ctx.analyses["time"] = analyze_time_locality(new, time_axis=ctx.time_axis)
    return PassResult(new, changed=True, notes=tuple(notes))


@graph_pass
def roll_loops(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Roll unrolled per-timestep loops into one vectorised scan each (see module doc); a loop
    without a linear update is an error naming the node.

    Needs ``ctx.analyses["time"]``; recomputes it on the rolled graph. Rewrites ``gm`` in place.
    """
    return _roll_all(gm, ctx, carry=False)


@graph_pass
def roll_loops_carrying(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """:func:`roll_loops`, with a loop whose steps repeat but whose update is not linear in one
    state rolled into a carried loop (run step by step; the chunked plans' pass)."""
    return _roll_all(gm, ctx, carry=True)

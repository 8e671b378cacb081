"""roll_driven_loops: a loop carrying linear states beside a driver becomes a driver loop and scans.

Max-stabilised recurrences (RWKV's WKV, xLSTM's mLSTM step) carry a running maximum next to
their states, and ``roll_loops`` rolls loops that carry one linear state. This pass runs before
it (in the adjoint plans) and rolls such a loop exactly, keeping the stabilisation:
:mod:`.loop_driven` proves which carried values are linear states (``cast(A h_{t-1} + U)`` with
``A``, ``U`` reading no linear state) and which are drivers (read no linear state), and
:mod:`.loop_driven_emit` writes the driver loop (``run_carried_loop``, step by step, any
update), one ``linear_scan`` of the linear states (packed side by side) and one per-step
readout in its place. The adjoint plans then shard the scan like any other. A loop of any other form is left as it is
(``roll_loops`` rolls it or refuses it naming the node).
"""

from __future__ import annotations

import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.errors import node_error
from gradshard.pipeline import PassContext, PassResult, graph_pass

from gradshard.passes.loop_chains import LoopChain, find_loops
from gradshard.passes.loop_driven import Refusal, analyse_driven_loop
from gradshard.passes.loop_driven_emit import emit_driven_loop
from gradshard.passes.loop_driven_proof import check_rolled_loop, snapshot_loop
from gradshard.passes.loop_steps import CARRY_HINT
from gradshard.passes.loop_tail import complete_last_step
from gradshard.passes.roll_loops import pick_repeating_cut

__all__ = ["roll_driven_loops"]


def _carries_several(chain: LoopChain) -> bool:
    """Whether step 1 reads more than one value of step 0 (a cheap filter before any rewrite)."""
    return len({a for n in chain.steps[1] for a in n.all_input_nodes if chain.step_of.get(a) == 0}) > 1


def _repeating_cut(gm: fx.GraphModule, chain: LoopChain) -> tuple[LoopChain | None, int]:
    """The cut of ``chain`` into steps that repeat the same ops (its last step completed in
    place when it was cut short), and how many ops the completion added; None if neither does."""
    cut, aligned, found = pick_repeating_cut(chain)
    if not found:
        return None, 0
    return cut, complete_last_step(gm, cut, aligned) if aligned is not None else 0


@graph_pass
def roll_driven_loops(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Roll each loop that carries linear states beside a driver (a running maximum) into a
    driver loop, one scan of the states and a readout (see module doc); other loops stay.

    Needs ``ctx.analyses["time"]``; recomputes it when it rolls a loop. Rewrites ``gm`` in place."""
    tl = ctx.analyses.get("time")
    if tl is None:
        return PassResult(gm, notes=("no time axis: nothing to roll",))
    chains = [c for c in find_loops(gm, tl) if len(c.steps) >= 3]
    if not chains:
        return PassResult(gm, notes=("no unrolled loops",))
    gm.graph.owning_module = gm  # rolled in place, like roll_loops (a shared graph may name another owner)
    notes: list[str] = []
    changed = False
    for i, chain in enumerate(chains):
        if not any(_carries_several(c) for c in (chain, chain.alternative) if c is not None):
            continue
        cut, added = _repeating_cut(gm, chain)
        changed |= added > 0
        loop = analyse_driven_loop(cut) if cut is not None else None
        if isinstance(loop, Refusal):  # roll_loops would refuse it too, knowing less about why
            raise node_error(loop.node, loop.why, CARRY_HINT)
        if loop is None:
            continue
        snapshot = snapshot_loop(gm, cut, loop.plan)
        order = {n: j for j, n in enumerate(gm.graph.nodes)}
        note, outs = emit_driven_loop(gm, cut, loop, i, order)
        notes.append(f"{note}; {check_rolled_loop(snapshot, gm, outs)}")
        changed = True
    if not changed:
        return PassResult(gm, notes=("no loop carries linear states beside a driver",))
    gm.graph.lint()
    ctx.invalidate("time")
    ctx.analyses["time"] = analyze_time_locality(gm, time_axis=ctx.time_axis)
    return PassResult(gm, changed=True, notes=tuple(notes) or ("completed cut-short last steps only",))

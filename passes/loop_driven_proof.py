"""A numeric check of a driven-loop rewrite: the rolled loop computes what the unrolled one did.

The split of :mod:`.loop_driven` is proven on the graph's structure; this check guards the
emission. Before the loop is rewritten, :func:`snapshot_loop` copies the unrolled loop (its
steps and the stacks of its outputs) into a standalone graph of the loop's inputs; after it,
:func:`check_rolled_loop` runs that copy and the rolled replacement on the same random
inputs at the captured length and compares every output, within a tolerance set by the
least precise dtype the loop computes in. A mismatch is an internal error naming the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.pipeline import ancestors

from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.loop_generic import CarriedPlan
from gradshard.passes.region_proof import region_subgraph

__all__ = ["LoopSnapshot", "snapshot_loop", "check_rolled_loop"]

#: Relative tolerance by the least precise floating dtype the loop computes in.
_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
_LOW_TOL = 5e-2


@dataclass(frozen=True)
class LoopSnapshot:
    """The unrolled loop as a callable of its inputs, returning its stacked outputs in order."""

    run: fx.GraphModule
    inputs: tuple[fx.Node, ...]
    tolerance: float
    where: fx.Node  # named by a failed check (the first stack of outputs)


def _outside_inputs(gm: fx.GraphModule, members: set[fx.Node]) -> list[fx.Node]:
    found: dict[fx.Node, None] = {}
    for n in gm.graph.nodes:
        if n in members:
            for a in n.all_input_nodes:
                if a not in members and a.op != "get_attr":
                    found.setdefault(a)
    return list(found)


def snapshot_loop(gm: fx.GraphModule, chain: LoopChain, plan: CarriedPlan) -> LoopSnapshot:
    """Copy the unrolled loop of ``chain`` (before it is rewritten)."""
    members = set(chain.step_of) | set(plan.stack_users)
    members |= {a for n in members for a in n.all_input_nodes if a.op == "get_attr"}
    inputs = _outside_inputs(gm, members)
    dtypes = [v.dtype for n in members for v in [n.meta.get("val")]
              if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    least = max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float64)
    tol = _TOL.get(least, _LOW_TOL) if torch.finfo(least).eps <= torch.finfo(torch.float32).eps else _LOW_TOL
    return LoopSnapshot(region_subgraph(gm, inputs, members, list(plan.stack_users), widen=False), tuple(inputs), tol,
                        plan.stack_users[0])


def _random_like(val: Any, gen: torch.Generator) -> Optional[torch.Tensor]:
    if not isinstance(val, torch.Tensor):
        return None
    if val.dtype.is_floating_point:
        return (0.5 * torch.randn(tuple(val.shape), generator=gen, dtype=torch.float64)).to(val.dtype)
    return torch.zeros(tuple(val.shape), dtype=val.dtype)


def check_rolled_loop(snapshot: LoopSnapshot, gm: fx.GraphModule, outs: list[fx.Node]) -> str:
    """Compare the rolled loop (``outs``: its outputs in ``gm``, in the snapshot's order) with the
    snapshot on random inputs; returns a note, raises naming the loop on a mismatch."""
    given = set(snapshot.inputs)
    nodes = ancestors(outs, within=lambda n: n not in given)
    stray = [n for n in nodes if n.op == "placeholder"]
    if stray:
        raise node_error(stray[0], "internal: the rolled loop reads a graph input the loop did not read",
                         "report this; use plan='seco' for this model meanwhile")
    rolled = region_subgraph(gm, list(snapshot.inputs), nodes | given, outs, widen=False)
    gen = torch.Generator().manual_seed(0)
    args = [_random_like(x.meta.get("val"), gen) for x in snapshot.inputs]
    if any(a is None for a in args):
        return "numeric check skipped: a loop input is not a tensor"
    with torch.no_grad():
        want = snapshot.run(*args)
        got = rolled(*args)
    worst = 0.0
    for w, g in zip(want, got):
        w64, g64 = w.to(torch.float64), g.to(torch.float64)
        if not bool(torch.isfinite(w64).all()):
            return "numeric check skipped: the loop is not finite on random inputs"
        scale = float(w64.abs().max()) if w64.numel() else 0.0
        err = float((g64 - w64).abs().max()) / max(scale, 1e-300) if w64.numel() else 0.0
        worst = max(worst, err)
    if not worst <= snapshot.tolerance:
        raise node_error(snapshot.where, f"internal check failed: the loop rolled into a driver loop and scans "
                         f"differs from the unrolled loop on random inputs (relative error {worst:.3g} > "
                         f"{snapshot.tolerance:g})", "report this; use plan='seco' for this model meanwhile")
    return f"checked against the unrolled loop on random inputs (relative error {worst:.2g})"

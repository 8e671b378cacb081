"""A region input's gradient written into the gradient its output received (no second buffer).

In a residual stack of regions (``x_{l+1} = x_l + f_l(x_l)``, the add taken into region ``l``),
the backward of region ``l`` receives ``dL/dx_{l+1}`` and returns ``dL/dx_l``: two buffers of
the residual stream's size, alive together for the whole of the region's backward. Shards run
right to left and shard ``[s, e)`` reads rows ``[s, e)`` of the output gradient in its readout
VJP and never again, so once its producers' VJP is done those rows may hold the input's
gradient instead: one buffer serves both.

That is sound only when nothing else holds the output gradient. :func:`assign_gradient_donors`
proves it on the rewritten graph (the output's one user is another region, whose backward
hands over a buffer of its own); :class:`DonatedGrad` does the row bookkeeping in the backward.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor

__all__ = ["DonatedGrad", "assign_gradient_donors"]


class DonatedGrad:
    """Input gradient rows written over the donated output gradient ``buf`` shard by shard.

    Per shard, after its VJP, :meth:`close` overwrites rows ``[s, e)`` with the window gradient's
    (zero where none), adds the rows after the shard (a right halo: shards already closed) and
    keeps the rows before it (a left halo: rows the earlier shards still read as output
    gradient) pending until those rows are closed.
    """

    def __init__(self, buf: Tensor, time_dim: int) -> None:
        self.buf = buf
        self.dim = time_dim
        self.pending: list[tuple[int, Tensor]] = []

    def close(self, s: int, e: int, g: Optional[Tensor], ws: int, we: int) -> None:
        """Shard ``[s, e)`` is done; ``g``: its input gradient on the window ``[ws, we)`` (or None)."""
        d, buf = self.dim, self.buf
        rows = buf.narrow(d, s, e - s)
        if g is None:
            rows.zero_()
        else:
            rows.copy_(g.narrow(d, s - ws, e - s))
            if we > e:
                buf.narrow(d, e, we - e).add_(g.narrow(d, e - ws, we - e))
            if ws < s:  # a copy: the rows are few, and nothing may alias the buffer's
                self.pending.append((ws, g.narrow(d, 0, s - ws).clone()))
        self._flush(s)

    def _flush(self, closed_from: int) -> None:
        """Add the pending rows at or after ``closed_from`` (every row there is closed)."""
        d, keep = self.dim, []
        for a, g in self.pending:
            b = a + int(g.shape[d])
            if a >= closed_from:
                self.buf.narrow(d, a, b - a).add_(g)
            elif b > closed_from:
                self.buf.narrow(d, closed_from, b - closed_from).add_(g.narrow(d, closed_from - a, b - closed_from))
                keep.append((a, g.narrow(d, 0, closed_from - a)))
            else:
                keep.append((a, g))
        self.pending = keep

    def result(self) -> Tensor:
        if self.pending:
            raise RuntimeError("internal: donated gradient rows left pending after the first shard")
        return self.buf


def donatable(dy: Optional[Tensor], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """``dy`` can take the input gradient's rows: same shape, dtype and device, dense and not a view,
    and the backward does not build a graph (``create_graph=True`` may keep ``dy``)."""
    return (dy is not None and not torch.is_grad_enabled() and tuple(dy.shape) == tuple(shape)
            and dy.dtype == dtype and dy.device == device and dy._base is None and dy.is_contiguous())


def _input_grads(mod: torch.nn.Module) -> Optional[list[str]]:
    """Per call argument of region module ``mod``, what its backward returns for that argument's
    gradient: ``"fresh"`` (a time-carrying input: a full-length buffer it alone holds),
    ``"none"`` (an extra input: read without grad) or ``"other"``."""
    from gradshard.plans.adjoint.local import LocalSegment
    from gradshard.plans.adjoint.runtime import AdjointRegion

    if isinstance(mod, AdjointRegion):
        return ["fresh" if d is not None else "other" for d in mod.io.input_time_dims] + ["none"] * mod.n_extra
    if isinstance(mod, LocalSegment):
        return ["fresh" if d is not None else "other" for d in mod.input_time_dims]
    return None


def _one_fresh_gradient(g: fx.Node, calls: dict[fx.Node, torch.nn.Module]) -> Optional[fx.Node]:
    """The one region call that returns a gradient for ``g``, when that gradient is a buffer of its
    own and every other reader of ``g`` is a region call that returns none for it."""
    giving: list[tuple[fx.Node, str]] = []
    for user in g.users:
        kinds = _input_grads(calls[user]) if user in calls else None
        if kinds is None:
            return None
        giving += [(user, kinds[p]) for p, a in enumerate(user.args) if a is g and kinds[p] != "none"]
    return giving[0][0] if len(giving) == 1 and giving[0][1] == "fresh" else None


def assign_gradient_donors(gm: fx.GraphModule) -> list[str]:
    """Set ``donors`` (input index -> output index) on each ``AdjointRegion`` of ``gm`` whose output
    gradient it may write its input's gradient into; returns a note per donation.

    An output qualifies when one call of another region module takes it as a time-carrying input
    (that backward returns a full-length buffer it alone holds: a fresh one, or its own donated
    one), every other reader is a region that reads it without grad (a chained region's extra
    input), and an input of the same shape, dtype and time dim needs a gradient. Must run on the
    final graph: a later consumer of the output would break the proof.
    """
    from gradshard.plans.adjoint.runtime import AdjointRegion

    calls = {n: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    notes: list[str] = []
    for call, mod in calls.items():
        if not isinstance(mod, AdjointRegion):
            continue
        mod.donors = {}
        n_base = len(call.args) - mod.n_extra
        for g in call.users:
            if g.op != "call_function" or g.target is not operator.getitem:
                continue
            j = g.args[1]
            user = _one_fresh_gradient(g, calls) if j < len(mod.io.output_time_dims) else None
            if user is None:
                continue
            out_val, td = g.meta.get("val"), mod.io.output_time_dims[j]
            for i, x in enumerate(call.args[:n_base]):
                x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
                if (i in mod.donors or mod.io.input_time_dims[i] != td or not isinstance(x_val, Tensor)
                        or not isinstance(out_val, Tensor) or x_val.shape != out_val.shape
                        or x_val.dtype != out_val.dtype):
                    continue
                mod.donors[i] = j
                notes.append(f"{mod.region_name}: the gradient of input `{x.name}` is written into the gradient "
                             f"of output {j} (its gradient comes from `{user.target}` alone): one residual-stream buffer, not two")
                break
    return notes

"""A region input's gradient written into the gradient its output received (no second buffer).

In a residual stack of regions (``x_{l+1} = x_l + f_l(x_l)``, the add taken into region ``l``),
the backward of region ``l`` receives ``dL/dx_{l+1}`` and returns ``dL/dx_l``: two buffers of
the residual stream's size, alive together for the whole of the region's backward. Shards run
right to left and shard ``[s, e)`` reads rows ``[s, e)`` of the output gradient in its readout
VJP and never again, so once its producers' VJP is done those rows may hold the input's
gradient instead: one buffer serves both.

That is sound only when nothing else holds the output gradient:
:func:`gradshard.plans.adjoint.links.assign_gradient_donors` proves it on the rewritten graph
(the output's gradient comes from one other region, whose backward hands over a buffer of its
own); :class:`DonatedGrad` does the row bookkeeping in the backward (this module is the
runtime's, and imports nothing of it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["DonatedGrad", "donatable"]


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

"""``gradshard::adjoint_shard``: the gradients of one time shard of a diagonal recurrence.

See :mod:`gradshard.kernels.adjoint` for the math. The op is a building block of the
backward pass (not differentiable itself) and only runs inside region modules, so the graphs
the analyses read never hold it: it has no time or dims rule.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from gradshard.kernels.adjoint import run_adjoint_shard, shard_dtypes
from gradshard.ops.linear_scan import Shape, linear_scan_flops

__all__ = ["ADJOINT_SHARD", "adjoint_shard_flops"]

ADJOINT_SHARD = "gradshard::adjoint_shard"


@torch.library.custom_op(ADJOINT_SHARD, mutates_args=())
def _adjoint_shard_op(
    a: Tensor, u: Tensor, g: Tensor, h0: Optional[Tensor], lam_carry: Optional[Tensor], backend: Optional[str]
) -> tuple[Tensor, Tensor, Tensor]:
    """Dispatcher-level op; see the module docstring."""
    return run_adjoint_shard(a, u, g, h0, lam_carry, backend)


@_adjoint_shard_op.register_fake
def _adjoint_shard_fake(a, u, g, h0, lam_carry, backend):
    da_t, du_t, dh_t = shard_dtypes(a, u, g, h0)
    return a.new_empty(a.shape, dtype=da_t), u.new_empty(u.shape, dtype=du_t), u.new_empty(
        (u.shape[0], *u.shape[2:]), dtype=dh_t
    )


# --------------------------------------------------------------------------- FLOPs (FlopCounterMode)

def adjoint_shard_flops(u_shape: Shape) -> int:
    """One shard's gradients: the forward scan recomputing ``h`` and the reverse scan of ``lam``."""
    return 2 * linear_scan_flops(u_shape)


def _adjoint_shard_formula(a: Shape, u: Shape, g: Shape, h0: Optional[Shape] = None,
                           lam_carry: Optional[Shape] = None, backend: Optional[str] = None, *,
                           out_shape: Any = None, **_: Any) -> int:
    return adjoint_shard_flops(u)


register_flop_formula(torch.ops.gradshard.adjoint_shard)(_adjoint_shard_formula)

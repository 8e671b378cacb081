"""Rolled loop bodies: a per-timestep fx graph applied to every step at once with ``vmap``.

``roll_loops`` replaces an unrolled per-timestep loop by (1) one :class:`RolledBody` that
computes the state-independent per-step values (``a_t``, ``u_t``, readout inputs) for all
steps, (2) one scan node, and (3) one :class:`RolledBody` for the readout. Bodies hold no
sequence length, so the rolled program runs at any length. In the graph they appear as
``run_rolled_body(get_attr(body), *inputs)`` (a plain call_function node whose time
behaviour is registered with the dims/locality analyses by :mod:`gradshard.passes.recurrence_ops`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

__all__ = ["RolledBody", "run_rolled_body"]


class RolledBody(nn.Module):
    """``vmap(body, in_dims, out_dims)`` over the time axis.

    ``in_dims[i]``: the time dim of input i (``None``: the same for every step);
    ``out_dims[j]``: where output j's time dim goes.
    """

    def __init__(self, body: fx.GraphModule, in_dims: Sequence[Optional[int]], out_dims: Sequence[int],
                 description: str = "") -> None:
        super().__init__()
        self.body = body
        self.in_dims = tuple(in_dims)
        self.out_dims = tuple(out_dims)
        self.description = description

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        if all(d is None for d in self.in_dims):
            raise RuntimeError("RolledBody: no input carries the time axis")
        outs = torch.func.vmap(self._call, in_dims=self.in_dims, out_dims=self.out_dims)(*args)
        return tuple(outs)

    def _call(self, *args: Any) -> tuple[torch.Tensor, ...]:
        out = self.body(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def extra_repr(self) -> str:
        return f"in_dims={self.in_dims}, out_dims={self.out_dims}" + (f", {self.description}" if self.description else "")


def run_rolled_body(body: RolledBody, *args: Any) -> tuple[torch.Tensor, ...]:
    """Graph-level entry point for a rolled body (see the module doc)."""
    return body(*args)

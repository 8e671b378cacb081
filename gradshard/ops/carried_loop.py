"""Carried loops: a per-step Python loop with any state update, run step by step.

``roll_loops`` rolls a loop whose update is linear in its state into a scan. A loop whose
update is not (``h = tanh(W h + x_t)``), or that carries several values (RWKV's WKV keeps
``(num, den, running max)``, xLSTM's mLSTM ``(C, n, m)``), becomes, in the chunked plans, a
:class:`CarriedLoop` with two graph nodes::

    S = run_carried_loop(loop, *seqs, *inits, *invariants)      # (T, N): the carried values
                                                              # after every step, packed
    y = run_carried_readout(loop, S, *seqs, *inits, *invariants)  # the per-step outputs

``S`` packs the carried values of one step into one row (flattened, cast to one float dtype
that holds every one of them exactly), so a chunked plan keeps it as one cache point: chunk
``j`` starts from row ``lo - 1`` of the previous chunk. The readout recomputes every step's
outputs from the values carried *into* the step (row ``t - 1``; the loop's own initial values
at step 0) and that step's inputs, vectorised over the steps with ``vmap``. Both bodies are
the captured step itself (fx graphs of the template step), so the loop computes exactly what
eager computes, in the same dtypes. The bodies hold no sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from gradshard.analysis import locality
from gradshard.analysis.dims import DimsContext, NodeDims, register_dim_rule

__all__ = ["StateSpec", "CarriedLoop", "run_carried_loop", "run_carried_readout"]


@dataclass(frozen=True)
class StateSpec:
    """One carried value: its per-step shape and dtype (after every step)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class CarriedLoop(nn.Module):
    """The step of a loop: ``update(x_t..., h_{t-1}..., inv...) -> h_t...`` and
    ``readout(x_t..., h_{t-1}..., inv...) -> y_t...``.

    ``seq_dims[i]``: the time dim of sequence input i (it reads ``seq.select(dim, t)``);
    ``states``: the carried values; ``out_dims[j]``: where output j's time dim goes.
    """

    def __init__(self, update: fx.GraphModule, readout: fx.GraphModule, seq_dims: Sequence[int],
                 states: Sequence[StateSpec], n_invariants: int, out_dims: Sequence[int],
                 description: str = "") -> None:
        super().__init__()
        self.update = update
        self.readout = readout
        self.seq_dims = tuple(seq_dims)
        self.states = tuple(states)
        self.n_invariants = n_invariants
        self.out_dims = tuple(out_dims)
        self.description = description
        dtype = self.states[0].dtype
        for spec in self.states[1:]:
            dtype = torch.promote_types(dtype, spec.dtype)
        self.pack_dtype = dtype  # holds every carried value exactly (floating dtypes only)

    # ---------------------------------------------------------------- argument layout

    def split(self, args: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """``(*seqs, *inits, *invariants)`` -> the three lists."""
        n, k = len(self.seq_dims), len(self.states)
        if len(args) != n + k + self.n_invariants:
            raise ValueError(f"carried loop: {len(args)} inputs, expected {n} sequence(s), {k} initial value(s) "
                             f"and {self.n_invariants} invariant(s)")
        return list(args[:n]), list(args[n:n + k]), list(args[n + k:])

    # ---------------------------------------------------------------- packing

    def pack(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """One step's carried values -> one row ``(N,)`` (batched under vmap)."""
        return torch.cat([v.reshape(-1).to(self.pack_dtype) for v in values])

    def unpack(self, row: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`pack` on one row (each value in its own dtype and shape)."""
        out, at = [], 0
        for spec in self.states:
            out.append(row[at:at + spec.numel].reshape(spec.shape).to(spec.dtype))
            at += spec.numel
        return out

    # ---------------------------------------------------------------- running

    def scan(self, seqs: Sequence[torch.Tensor], inits: Sequence[torch.Tensor], invariants: Sequence[Any],
             carried_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the update over the steps of ``seqs``; rows of the values after each step.

        ``carried_in``: the packed row carried into the first step (``None``: ``inits``)."""
        h = list(inits) if carried_in is None else self.unpack(carried_in)
        length = seqs[0].shape[self.seq_dims[0]]
        rows = []
        for t in range(length):
            xs = [s.select(d, t) for s, d in zip(seqs, self.seq_dims)]
            out = self.update(*xs, *h, *invariants)
            h = list(out) if isinstance(out, (tuple, list)) else [out]
            rows.append(self.pack(h))
        if not rows:
            spec_n = sum(s.numel for s in self.states)
            return seqs[0].new_empty((0, spec_n), dtype=self.pack_dtype)
        return torch.stack(rows, 0)

    def outputs(self, carried: torch.Tensor, seqs: Sequence[torch.Tensor], inits: Sequence[torch.Tensor],
                invariants: Sequence[Any], first: bool) -> tuple[torch.Tensor, ...]:
        """Per-step outputs over the steps of ``seqs``: ``carried`` holds the packed values
        carried into each step, except the first one when ``first`` (that step reads ``inits``)."""
        parts: list[list[torch.Tensor]] = [[] for _ in self.out_dims]
        rest = [s.narrow(d, 1, s.shape[d] - 1) for s, d in zip(seqs, self.seq_dims)] if first else list(seqs)
        if first:
            xs = [s.select(d, 0) for s, d in zip(seqs, self.seq_dims)]
            for j, (o, od) in enumerate(zip(self._readout(*xs, *inits, *invariants), self.out_dims)):
                parts[j].append(o.unsqueeze(od))
        if carried.shape[0] > 0:
            fn = torch.func.vmap(self._readout_packed, in_dims=(0, *self.seq_dims, *([None] * len(invariants))),
                                 out_dims=self.out_dims)
            for j, o in enumerate(fn(carried, *rest, *invariants)):
                parts[j].append(o)
        return tuple(p[0] if len(p) == 1 else torch.cat(p, od) for p, od in zip(parts, self.out_dims))

    def _readout(self, *args: Any) -> tuple[torch.Tensor, ...]:
        out = self.readout(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _readout_packed(self, row: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        n = len(self.seq_dims)
        return self._readout(*args[:n], *self.unpack(row), *args[n:])

    def forward(self, *args: Any) -> torch.Tensor:
        seqs, inits, invariants = self.split(args)
        return self.scan(seqs, inits, invariants)

    def extra_repr(self) -> str:
        return (f"seq_dims={self.seq_dims}, states={[tuple(s.shape) for s in self.states]}, "
                f"out_dims={self.out_dims}" + (f", {self.description}" if self.description else ""))


def run_carried_loop(loop: CarriedLoop, *args: Any) -> torch.Tensor:
    """Graph-level entry point: the packed carried values after every step, ``(T, N)``."""
    seqs, inits, invariants = loop.split(args)
    return loop.scan(seqs, inits, invariants)


def run_carried_readout(loop: CarriedLoop, carried: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    """Graph-level entry point: the per-step outputs, from the rows of :func:`run_carried_loop`."""
    seqs, inits, invariants = loop.split(args)
    return loop.outputs(carried.narrow(0, 0, max(carried.shape[0] - 1, 0)), seqs, inits, invariants, first=True)


# --------------------------------------------------------------------------- analysis rules


def _module(node: fx.Node) -> Optional[CarriedLoop]:
    attr = node.args[0]
    owner = node.graph.owning_module
    if not isinstance(attr, fx.Node) or owner is None:
        return None
    mod = owner.get_submodule(attr.target)
    return mod if isinstance(mod, CarriedLoop) else None


def _time_labels(node: fx.Node, ctx: DimsContext, loop: CarriedLoop, first: int) -> set[int]:
    """Unify the time dims of the sequence inputs (args from ``first`` on); return them."""
    labels: set[int] = set()
    for arg, d in zip(node.args[first:], loop.seq_dims):
        dims = ctx.dims(arg) if isinstance(arg, fx.Node) else ()
        if d < len(dims):
            labels |= set(dims[d])
    ctx.union(labels)
    return labels


@register_dim_rule(run_carried_loop)
def _loop_dims_rule(node: fx.Node, ctx: DimsContext) -> NodeDims:
    """``(T, N)``: time (the sequences' time dims) and a fresh packed dim."""
    val = node.meta["val"]
    dims = list(ctx.fresh_dims(val.shape))
    loop = _module(node)
    labels = _time_labels(node, ctx, loop, 1) if loop is not None else set()
    if labels:
        dims[0] = frozenset(labels)
    return NodeDims(tuple(dims))


@register_dim_rule(run_carried_readout)
def _readout_dims_rule(node: fx.Node, ctx: DimsContext) -> tuple[NodeDims | None, ...]:
    """Outputs: time at ``out_dims[j]`` (the time dim of the sequences and of the loop rows)."""
    vals = node.meta.get("val") or ()
    loop = _module(node)
    labels: set[int] = set()
    if loop is not None:
        labels = _time_labels(node, ctx, loop, 2)
        rows = ctx.dims(node.args[1]) if isinstance(node.args[1], fx.Node) else ()
        if rows:
            labels |= set(rows[0])
            ctx.union(labels)
    outs: list[NodeDims | None] = []
    for j, v in enumerate(vals):
        if not isinstance(v, torch.Tensor):
            outs.append(None)
            continue
        dims = list(ctx.fresh_dims(v.shape))
        od = loop.out_dims[j] if loop is not None else None
        if od is not None and od < len(dims) and labels:
            dims[od] = frozenset(labels)
        outs.append(NodeDims(tuple(dims)))
    return tuple(outs)


# each row reads every earlier step (through the carried values); time at dim 0 of the rows
locality.register_time_op(run_carried_loop, time_dim=0, reach=locality.ALL_PAST)

"""Layouts of an adjoint region's tensors and the producer graph's per-shard trim.

A region's scan reads ``a``, ``u`` in the *canonical* layout ``(batch, time, *state)``
(:func:`canon`); the producer and readout graphs use the captured layout (time at
``ScanSpec.time_dim``, ``a`` right-aligned to ``u``). :func:`shard_producers` trims a window's
producer outputs to its shard inside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.fx as fx
from torch import Tensor

from gradshard.ir import graph_module
from gradshard.pipeline import copy_graph

__all__ = ["ScanSpec", "RegionIO", "canon", "uncanon", "state_canon", "state_uncanon", "narrow", "trim",
           "step_major", "shard_producers"]


@dataclass(frozen=True)
class ScanSpec:
    """Where the recurrence sits in the producer outputs and its layout.

    Producer outputs are ``(a, u, h0, r_0, ..., r_m)``; ``a``/``h0`` may be ``None``.
    ``u`` has rank ``rank`` with time at ``time_dim``; ``a`` is right-aligned to ``u``.
    """

    kind: str  # "diagonal" | "dense"
    has_a: bool
    has_h0: bool
    time_dim: int
    rank: int


@dataclass(frozen=True)
class RegionIO:
    """Time layout of a region's inputs, producer outputs and outputs (``None``: no time)."""

    input_time_dims: tuple[Optional[int], ...]
    producer_time_dims: tuple[Optional[int], ...]
    output_time_dims: tuple[Optional[int], ...]  # readout outputs
    final_state: bool  # an extra last output: h at the last step
    halo: tuple[int, int]  # steps recomputed before / after each shard
    captured_len: int
    #: per producer output: ``(outer, inner)`` where its time dim merges ``(outer, T, inner)``
    #: (rows ``B*T*H`` of a per-head norm) and a halo must be trimmed from it; else None
    producer_merged: tuple[Optional[tuple[int, int]], ...] = ()



def canon(x: Optional[Tensor], td: int, rank: int) -> Optional[Tensor]:
    """To ``(batch, time, *state)``: right-align to ``rank`` dims, move time to dim 1."""
    if x is None:
        return None
    if x.dim() < rank:
        x = x.reshape((1,) * (rank - x.dim()) + tuple(x.shape))
    if rank == 1:
        return x.unsqueeze(0)
    return x.movedim(td, 1) if td != 1 else x


def uncanon(x: Tensor, td: int, rank: int, shape: Optional[Sequence[int]] = None) -> Tensor:
    """Inverse of :func:`canon` (``shape``: the original shape, for right-aligned inputs)."""
    if rank == 1:
        x = x.squeeze(0)
    elif td != 1:
        x = x.movedim(1, td)
    if shape is not None and tuple(x.shape) != tuple(shape):
        x = x.reshape(shape)
    return x


def state_canon(h: Optional[Tensor], rank: int) -> Optional[Tensor]:
    """A state ``(*state)`` in the layout of canonical ``h`` minus time."""
    if h is None:
        return None
    return h.unsqueeze(0) if rank == 1 else h


def state_uncanon(h: Tensor, rank: int) -> Tensor:
    return h.squeeze(0) if rank == 1 else h


def narrow(x: Tensor, dim: Optional[int], start: int, length: int) -> Tensor:
    return x if dim is None else x.narrow(dim, start, length)


def trim(x: Tensor, dim: Optional[int], merged: Optional[tuple[int, int]], start: int, length: int) -> Tensor:
    """Steps ``[start, start + length)`` of ``x`` along ``dim``, which holds ``(outer, T, inner)``
    merged when ``merged = (outer, inner)``."""
    if dim is None or merged is None:
        return narrow(x, dim, start, length)
    outer, inner = merged
    return x.unflatten(dim, (outer, -1, inner)).narrow(dim + 1, start, length).flatten(dim, dim + 2)


def step_major(x: Tensor, td: int) -> Tensor:
    """``x`` dense in step order (each step's slice one contiguous block), as the scan reads it; a
    broadcast (a stride-0 dim: a decay shared over time) stays a view, never materialised."""
    steps = x.movedim(td, 1) if x.dim() >= 2 and td != 1 else x
    if 0 in x.stride() or steps.is_contiguous():
        return x
    return steps.contiguous().movedim(1, td) if steps is not x else x.contiguous()


def shard_producers(gm: fx.GraphModule, io: RegionIO, scan: ScanSpec, start: int, length: int) -> fx.GraphModule:
    """``gm`` (the producers on a window) with its outputs trimmed to the window's steps ``[start,
    start + length)`` and the scan's operands ``a``, ``u`` laid out dense in step order, inside the
    graph. Compiled, the backward then pads the trimmed outputs' gradients inside its own kernels
    (a state-sized output such as an outer product ``x B^T`` gets no gradient buffer at the window's
    length, zero-filled and copied into, per shard), and the scan's step-ordered gradient of ``u``
    is not copied into another layout (Inductor keeps an output's eager strides: Mamba-2's ``u``
    comes out heads-major).
    """
    graph = copy_graph(gm)
    out = next(n for n in graph.nodes if n.op == "output")
    single = not isinstance(out.args[0], (tuple, list))
    vals = [out.args[0]] if single else list(out.args[0])
    merged = io.producer_merged or (None,) * len(io.producer_time_dims)
    with graph.inserting_before(out):
        for i, (v, d, m) in enumerate(zip(vals, io.producer_time_dims, merged)):
            if not isinstance(v, fx.Node) or d is None:
                continue
            v = graph.call_function(trim, (v, d, m, start, length))
            if i == 1 or (i == 0 and scan.has_a and d == scan.time_dim):  # u; a with u's rank
                v = graph.call_function(step_major, (v, scan.time_dim))
            vals[i] = v
    out.args = (vals[0] if single else tuple(vals),)
    return graph_module(gm, graph, type(gm).__name__)

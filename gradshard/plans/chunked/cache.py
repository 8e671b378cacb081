"""Checkpoints kept across chunks: KV caches, scan carries, convolution tails.

A *cache point* is a node whose values for earlier chunks later chunks read: the keys and
values of an attention layer (after RoPE, before any GQA repeat), the output of a scan
(its last step is the next chunk's carry), the input of a causal convolution (its last
``K - 1`` steps). The forward writes each chunk's values; the backward of chunk ``j``
reads the values of chunks ``< j`` as *leaves* that require grad, and the gradient that
reaches a leaf is added to the cotangent of the chunk that produced it (``seed``), which
that chunk's backward injects when its turn comes (chunks run in reverse order).

Two layouts (chosen by the dry run from how far back the model reads):

- ``retention=None`` (all of the past, attention): one buffer of the full length, written
  in place; a chunk's leaf is a view of the prefix ``[0, s)``, no copy.
- ``retention=r`` (a bounded window): per chunk only its last ``r`` steps are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CacheSpec", "CacheStore"]


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@dataclass(frozen=True)
class CacheSpec:
    """One cache point: node, its time dim and length, and how many past steps are read."""

    name: str
    dim: int
    length: int
    retention: int | None = None  # None: all of the past
    reason: str = ""


class CacheStore:
    """Values of every cache point over the chunks of one forward/backward."""

    def __init__(self, specs: dict[str, CacheSpec], bounds: list[tuple[int, int]]) -> None:
        self.specs = specs
        self.bounds = bounds
        self.buffers: dict[str, torch.Tensor] = {}
        self.pieces: dict[str, dict[int, tuple[int, torch.Tensor]]] = {n: {} for n in specs}
        self.grads: dict[str, Any] = {}
        self.leaves: dict[str, Any] = {}
        self.grad_mode = False
        self.current = 0

    # ---------------------------------------------------------------- forward

    def write(self, name: str, j: int, lo: int, value: torch.Tensor) -> None:
        """Store chunk ``j``'s values of ``name`` (steps ``[lo, lo + width)``)."""
        spec = self.specs[name]
        width = value.shape[spec.dim]
        if spec.retention is None:
            buf = self.buffers.get(name)
            if buf is None:
                shape = list(value.shape)
                shape[spec.dim] = spec.length
                buf = self.buffers[name] = value.new_empty(shape)
            buf.narrow(spec.dim, lo, width).copy_(value)
            return
        keep = min(width, spec.retention)
        piece = value.narrow(spec.dim, width - keep, keep)
        # a view of a larger tensor (the chunk's window of the node) would keep all of it alive
        owns = piece.untyped_storage().nbytes() <= piece.numel() * piece.element_size()
        self.pieces[name][j] = (lo + width - keep, piece if owns else piece.clone())

    def nbytes(self) -> int:
        total = sum(b.numel() * b.element_size() for b in self.buffers.values())
        for ps in self.pieces.values():
            total += sum(t.numel() * t.element_size() for _, t in ps.values())
        return total

    # ---------------------------------------------------------------- reading

    def read(self, name: str, lo: int, hi: int, start: int) -> torch.Tensor:
        """Values of steps ``[lo, hi)`` (all before the current chunk's ``start``)."""
        spec = self.specs[name]
        if spec.retention is None:
            buf = self.buffers[name]
            if not (self.grad_mode and _differentiable(buf)):  # integer caches (positions) take no gradient
                return buf.narrow(spec.dim, lo, hi - lo)
            leaf = self.leaves.get(name)
            if leaf is None:
                leaf = self.leaves[name] = buf.narrow(spec.dim, 0, start).detach().requires_grad_()
            if lo == 0 and hi == start:
                return leaf  # not a view: its gradient needs no zero-padded copy
            return leaf.narrow(spec.dim, lo, hi - lo)
        parts = []
        covered = hi
        for j in sorted(self.pieces[name], reverse=True):
            p_lo, piece = self.pieces[name][j]
            p_hi = p_lo + piece.shape[spec.dim]
            if p_lo >= hi or p_hi <= lo:
                continue
            if self.grad_mode and _differentiable(piece):
                key = (name, j)
                leaf = self.leaves.get(key)
                if leaf is None:
                    leaf = self.leaves[key] = piece.detach().requires_grad_()
                piece = leaf
            a, b = max(lo, p_lo), min(hi, p_hi)
            parts.append(piece.narrow(spec.dim, a - p_lo, b - a))
            covered = min(covered, a)
        if covered > lo:
            raise RuntimeError(f"gradshard internal: cache point {name} was asked for steps [{lo}, {hi}) "
                               f"but keeps only {spec.retention} steps per chunk")
        parts.reverse()
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)

    # ---------------------------------------------------------------- backward

    def begin_backward(self) -> None:
        self.grad_mode = True
        self.grads = {n: ({} if s.retention is not None else None) for n, s in self.specs.items()}

    def begin_chunk(self, j: int) -> None:
        self.current = j
        self.leaves = {}

    def leaf_list(self) -> list[tuple[Any, torch.Tensor]]:
        return list(self.leaves.items())

    def accumulate(self, key: Any, grad: torch.Tensor | None) -> None:
        """Add the gradient that reached a leaf to the cotangent of the chunk(s) it came from."""
        if grad is None:
            return
        if isinstance(key, tuple):
            name, j = key
            acc = self.grads[name]
            acc[j] = grad if j not in acc else acc[j] + grad
            return
        spec = self.specs[key]
        g = self.grads.get(key)
        if g is None:
            shape = list(self.buffers[key].shape)
            g = self.grads[key] = grad.new_zeros(shape)
        g.narrow(spec.dim, 0, grad.shape[spec.dim]).add_(grad)

    def seed(self, name: str, j: int) -> tuple[int, torch.Tensor] | None:
        """``(first step, cotangent)`` accumulated on chunk ``j``'s values of ``name`` (None: none)."""
        spec = self.specs[name]
        lo, hi = self.bounds[j]
        hi = min(hi, spec.length)
        if spec.retention is None:
            g = self.grads.get(name)
            if g is None or hi <= lo:
                return None
            return lo, g.narrow(spec.dim, lo, hi - lo)
        acc = self.grads[name]
        if j not in acc:
            return None
        p_lo, _ = self.pieces[name][j]
        return p_lo, acc[j]

    def drop_chunk(self, j: int) -> None:
        """Chunk ``j`` is done: later chunks were processed before it, free its pieces."""
        for name, spec in self.specs.items():
            if spec.retention is not None:
                self.pieces[name].pop(j, None)
                self.grads[name].pop(j, None)

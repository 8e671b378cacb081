"""Time frames and windows: the vocabulary of chunked execution.

A *frame* says which output dims of a node run along time. Each such dim is a
:class:`TDim`: its index, the length of the time axis in window coordinates, and
``inner``, the product of the dims flattened *inside* it (a ``(B, T, V) -> (B*T, V)``
reshape gives ``TDim(0, T, inner=1)`` with ``outer = B``; a pure time dim has
``outer = inner = 1``). Score matrices have two time dims (query, key). ``tail``
counts positions appended after the steps that are no step (attention sinks: a
learned logit concatenated to each row's keys); every window keeps them.

A *window* ``(lo, hi)`` selects steps ``lo <= t < hi`` of a time dim; a *demand* gives
one window per time dim of a frame. A :class:`DimMap` derives an input's window from
the output's demand:

=========  =====================================  =============================
kind       input window                           used by
=========  =====================================  =============================
same       the output window                      pointwise ops, views, matmuls
prefix     ``(0, hi)`` of the query window        attention keys (causal)
shift      ``(lo + offset, hi + offset)``         slices and pads along time
extend     ``(lo - left, hi + right)``            convolutions along time
=========  =====================================  =============================

shift/extend windows are clipped to ``[0, length)`` of the input.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TDim", "Frame", "Win", "Demand", "DimMap", "clip", "is_empty", "SKIP"]

Win = tuple[int, int]
Demand = tuple[Win, ...]


@dataclass(frozen=True)
class TDim:
    """One time-carrying output dim: ``size = outer * length * inner``."""

    dim: int
    length: int
    inner: int = 1
    tail: int = 0  # positions after the steps, in every window (module doc)

    def size(self, full_size: int, width: int) -> int:
        """Size of this dim when the window has ``width`` steps (``full_size`` at full length)."""
        return (full_size - self.tail) // self.length * width + self.tail

    def pure(self, full_size: int) -> bool:
        """Is the dim time alone (not merged with other dims, nothing appended)?"""
        return full_size == self.length and self.inner == 1 and not self.tail


Frame = tuple[TDim, ...]


def clip(lo: int, hi: int, length: int) -> Win:
    """``[lo, hi)`` clipped to ``[0, length)`` (an empty window keeps ``lo <= hi``)."""
    a = min(max(lo, 0), length)
    b = min(max(hi, 0), length)
    return (a, max(a, b))


def is_empty(demand: Demand) -> bool:
    return any(hi <= lo for lo, hi in demand)


@dataclass(frozen=True)
class DimMap:
    """How one time dim of an input gets its window from the output demand (module doc)."""

    kind: str  # "same" | "prefix" | "shift" | "extend"
    k: int  # index of the output time dim it follows
    offset: int = 0  # shift: input index = output index + offset; extend: steps to the left
    right: int = 0  # extend: steps to the right
    length: int = 0  # the input's time length (clipping)

    def apply(self, demand: Demand) -> Win:
        lo, hi = demand[self.k]
        if self.kind == "same":
            return (lo, hi)
        if self.kind == "prefix":
            return (0, hi)
        if self.kind == "shift":
            return clip(lo + self.offset, hi + self.offset, self.length)
        if self.kind == "extend":
            return clip(lo - self.offset, hi + self.right, self.length)
        raise ValueError(f"unknown DimMap kind {self.kind!r}")


class _Skip:
    """Slot marker: the argument is not evaluated (the rule fetches what it needs itself)."""

    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()

"""Partial-update slice layouts: how one weight is cut into slices and which slice trains.

:class:`SliceLayout` describes the split of one weight ``(out, in)`` along one dim into
contiguous runs and the runs' owning slices (several runs per slice for a fused ``qkv`` /
``gate_up`` projection); the helpers build the layouts of MLP and attention projections
(:func:`mlp_in_layout`, :func:`mlp_out_layout`, :func:`attention_layouts`) and pick this
rank's slice (:func:`default_slice_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gradshard.errors import GradshardError

__all__ = [
    "PartialUpdateError",
    "SliceLayout",
    "layout_from_owners",
    "even_bounds",
    "mlp_in_layout",
    "mlp_out_layout",
    "attention_layouts",
    "default_slice_index",
]


class PartialUpdateError(GradshardError, ValueError):
    """A partial-update layout or module conversion is invalid."""


@dataclass(frozen=True)
class SliceLayout:
    """How one weight ``(out, in)`` is split: along ``dim`` at ``bounds``; slice ``index`` trains.

    ``dim`` is 0 (rows = output features) or 1 (columns = input features); ``bounds`` are
    ``R + 1`` increasing integers from 0 to the size of ``dim`` cutting it into ``R``
    contiguous *runs*, run ``n`` covering ``[bounds[n], bounds[n + 1])``. ``owners[n]`` is
    the slice that run ``n`` belongs to; empty ``owners`` (the common case) means run ``n``
    is slice ``n``. A slice made of several runs is how a *fused* projection is split: the
    rows of a fused ``qkv`` weight that slice ``k`` owns are one run inside each of the
    q, k and v blocks::

        qkv rows:  [ q: h0 h1 | h2 h3 ][ k: h0 | h1 ][ v: h0 | h1 ]
        owners:       0         1         0    1        0    1       (2 slices)

    Slice ``index`` trains: its runs become parameters, every other run a frozen buffer.
    """

    dim: int
    bounds: tuple[int, ...]
    index: int
    owners: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dim not in (0, 1):
            raise PartialUpdateError(f"SliceLayout.dim must be 0 (output) or 1 (input), got {self.dim}")
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(lo >= hi for lo, hi in zip(b, b[1:])):
            raise PartialUpdateError(
                f"SliceLayout.bounds must start at 0 and strictly increase (no empty slice), got {b}"
            )
        if self.owners:
            o = self.owners
            if len(o) != len(b) - 1:
                raise PartialUpdateError(
                    f"SliceLayout.owners has {len(o)} entries for {len(b) - 1} runs; give one per run"
                )
            if min(o) < 0 or set(o) != set(range(max(o) + 1)):
                raise PartialUpdateError(
                    f"SliceLayout.owners must name every slice 0..N-1 at least once, got {o}"
                )
        if not 0 <= self.index < self.num_slices:
            raise PartialUpdateError(
                f"SliceLayout.index={self.index} is out of range for {self.num_slices} slices"
            )

    @property
    def num_runs(self) -> int:
        """Contiguous runs along ``dim`` (one per weight piece)."""
        return len(self.bounds) - 1

    @property
    def num_slices(self) -> int:
        return max(self.owners) + 1 if self.owners else self.num_runs

    @property
    def size(self) -> int:
        """Length of the split dimension."""
        return self.bounds[-1]

    def owner(self, run: int) -> int:
        """The slice that run ``run`` belongs to."""
        return self.owners[run] if self.owners else run

    def span(self, n: int) -> tuple[int, int]:
        """``(start, stop)`` of run ``n`` along ``dim``."""
        return self.bounds[n], self.bounds[n + 1]

    @property
    def trainable_runs(self) -> tuple[int, ...]:
        return tuple(n for n in range(self.num_runs) if self.owner(n) == self.index)

    @property
    def trainable_spans(self) -> tuple[tuple[int, int], ...]:
        return tuple(self.span(n) for n in self.trainable_runs)

    @property
    def trainable_size(self) -> int:
        """Entries of ``dim`` that train (the sum of the trainable runs' lengths)."""
        return sum(hi - lo for lo, hi in self.trainable_spans)

    @property
    def trainable_span(self) -> tuple[int, int]:
        """The trainable run, for a layout whose trainable slice is one run."""
        spans = self.trainable_spans
        if len(spans) != 1:
            raise PartialUpdateError(
                f"slice {self.index} is {len(spans)} runs {spans}; use trainable_spans"
            )
        return spans[0]

    def with_index(self, index: int) -> "SliceLayout":
        return SliceLayout(self.dim, self.bounds, index, self.owners)


def layout_from_owners(dim: int, owner: Sequence[int], index: int) -> SliceLayout:
    """The layout giving entry ``i`` of ``dim`` to slice ``owner[i]`` (runs of equal owners).

    Returns the plain form (``owners=()``) when the runs are the slices in order, so a
    projection that is not fused gets exactly the layout of :func:`mlp_in_layout` /
    :func:`attention_layouts`.
    """
    owner = [int(o) for o in owner]
    if not owner:
        raise PartialUpdateError("layout_from_owners: no entries")
    bounds, owners = [0], [owner[0]]
    for i in range(1, len(owner)):
        if owner[i] != owner[i - 1]:
            bounds.append(i)
            owners.append(owner[i])
    bounds.append(len(owner))
    plain = owners == list(range(len(owners)))
    return SliceLayout(dim, tuple(bounds), index, () if plain else tuple(owners))


def even_bounds(size: int, num_slices: int, unit: int = 1) -> tuple[int, ...]:
    """Boundaries splitting ``size`` into ``num_slices`` contiguous runs of whole ``unit``s.

    The ``size // unit`` units are spread as evenly as possible; the first slices get one
    extra unit when they do not divide evenly. ``even_bounds(10, 3) == (0, 4, 7, 10)``.
    """
    if num_slices < 1:
        raise PartialUpdateError(f"num_slices must be >= 1, got {num_slices}")
    if unit < 1 or size % unit:
        raise PartialUpdateError(f"size {size} is not a whole number of units of {unit}")
    units = size // unit
    if units < num_slices:
        raise PartialUpdateError(
            f"cannot split {units} unit(s) of {unit} into {num_slices} non-empty slices; "
            f"use num_slices <= {units}"
        )
    q, r = divmod(units, num_slices)
    bounds, pos = [0], 0
    for n in range(num_slices):
        pos += (q + (1 if n < r else 0)) * unit
        bounds.append(pos)
    return tuple(bounds)


def mlp_in_layout(hidden: int, num_slices: int, index: int) -> SliceLayout:
    """Layout of an MLP up/gate projection ``(hidden, d)``: split the output (hidden) dim."""
    return SliceLayout(0, even_bounds(hidden, num_slices), index)


def mlp_out_layout(hidden: int, num_slices: int, index: int) -> SliceLayout:
    """Layout of an MLP down projection ``(d, hidden)``: split the input (hidden) dim.

    Uses the same boundaries as :func:`mlp_in_layout`, so slice ``k`` of up, gate and down
    together form one independent sub-MLP.
    """
    return SliceLayout(1, even_bounds(hidden, num_slices), index)


def attention_layouts(
    num_heads: int, num_kv_heads: int, head_dim: int, num_slices: int, index: int
) -> tuple[SliceLayout, SliceLayout]:
    """``(q_layout, kv_layout)`` splitting attention input projections by head groups.

    The ``num_kv_heads`` key/value heads are split evenly into ``num_slices`` groups; a
    slice of ``q`` holds exactly the query heads that attend with its k/v heads
    (``num_heads / num_kv_heads`` per kv head, GQA), so q, k and v are split consistently.
    Boundaries are multiples of ``head_dim`` (q: of ``head_dim * num_heads/num_kv_heads``).
    Plain multi-head attention is ``num_kv_heads == num_heads``.
    """
    if num_heads % num_kv_heads:
        raise PartialUpdateError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if num_kv_heads < num_slices:
        raise PartialUpdateError(
            f"cannot split {num_kv_heads} key/value head(s) into {num_slices} head groups "
            f"consistently with the query heads; use num_slices <= {num_kv_heads}, or "
            f"targets=('mlp',) to leave attention unsliced"
        )
    group = num_heads // num_kv_heads
    kv = even_bounds(num_kv_heads, num_slices)
    q_layout = SliceLayout(0, tuple(b * group * head_dim for b in kv), index)
    kv_layout = SliceLayout(0, tuple(b * head_dim for b in kv), index)
    return q_layout, kv_layout


def default_slice_index(num_slices: int, group: object | None = None) -> int:
    """``rank mod num_slices`` for ``group`` (a ProcessGroup) or the default world; 0 if none."""
    if group is not None:
        return group.rank() % num_slices  # type: ignore[attr-defined]
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() % num_slices
    return 0


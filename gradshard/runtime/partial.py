"""Partial parameter updates: weights split into one trainable slice and frozen slices.

A targeted ``nn.Linear`` with weight ``W`` of shape ``(out, in)`` is split along one
dimension into ``N`` contiguous slices ``W_0 .. W_{N-1}``; slice ``k`` (the rank's slice,
by default ``rank mod N``) is an ``nn.Parameter``, the others are buffers::

    before:  y = x @ W.T + b                         W: (out, in), one Parameter
    after:   dim=0 (output split, MLP up/gate, q/k/v by head groups)
               y = cat_n(x @ W_n.T + b_n)            W_n: (out_n, in)
             dim=1 (input split, MLP down)
               y = sum_n(x[..., in_n] @ W_n.T) + b   W_n: (out, in_n)

A *fused* projection (``qkv``, ``gate_up``) is split inside each block: the split dim is
cut into contiguous runs and slice ``k`` owns one run per block (``SliceLayout.owners``);
each trainable run is its own Parameter. A weight stored ``(in, out)`` (GPT-2's
``Conv1D``) is sliced along the matching stored dim (``SlicedLinear(transposed=True)``).
The bias is split with the weight (``dim=0``, the standalone :func:`slice_linears` API) or
trained whole (``dim=1``; and every layer of the compiled plan, which keeps the user's own
bias Parameter and passes it in from the graph).

The forward value is the same as ``F.linear(x, W, b)``. The backward propagates the input
gradient through *every* slice but forms the weight gradient of the trainable slice only,
with split matmuls, so the skipped weight-gradient FLOPs (``2 * m * (out*in - |W_k|)``
for ``m`` tokens) are really skipped (paper, Appendix C.1). Frozen slices carry no
gradient and, not being parameters, get no optimizer state.

Slice metadata follows DESIGN.md: :func:`parameter_slices` returns
``{slice_name: (original_name, (dim, start, stop))}``; :func:`full_parameters` and
:func:`load_full_parameters` convert between the sliced module and full weights under
the original names (checkpoints, export, the DiLoCo outer loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..errors import GradshardError

Tensor = torch.Tensor

__all__ = [
    "PartialUpdateError",
    "SliceLayout",
    "layout_from_owners",
    "even_bounds",
    "mlp_in_layout",
    "mlp_out_layout",
    "attention_layouts",
    "default_slice_index",
    "partial_linear",
    "SlicedLinear",
    "slice_linears",
    "parameter_slices",
    "full_parameters",
    "load_full_parameters",
    "materialized_state_dict",
    "predicted_backward_flops_saved",
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


# --------------------------------------------------------------------------- autograd


class _PartialLinearFn(torch.autograd.Function):
    """Split-matmul linear; weight gradients for the runs of ``layout.index`` only (see module doc).

    ``bias_mode``: ``"none"``; ``"split"`` (dim 0: one bias piece per run after the
    weights); ``"whole"`` (one full bias after the weights, any dim).
    """

    @staticmethod
    def forward(ctx, x: Tensor, layout: SliceLayout, bias_mode: str, *tensors: Tensor) -> Tensor:
        r = layout.num_runs
        weights, rest = tensors[:r], tensors[r:]
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if layout.dim == 0:
            parts = []
            for i, w in enumerate(weights):
                lo, hi = layout.span(i)
                b = rest[i] if bias_mode == "split" else rest[0][lo:hi] if bias_mode == "whole" else None
                parts.append(torch.mm(x2, w.t()) if b is None else torch.addmm(b, x2, w.t()))
            y = torch.cat(parts, dim=1)
        else:
            y = None
            for i, w in enumerate(weights):
                lo, hi = layout.span(i)
                xs = x2[:, lo:hi]
                if y is None:
                    y = torch.mm(xs, w.t()) if bias_mode == "none" else torch.addmm(rest[0], xs, w.t())
                else:  # out= (not addmm_): in place, and visible to FlopCounterMode
                    torch.addmm(y, xs, w.t(), out=y)
        ctx.layout, ctx.bias_mode, ctx.x_shape = layout, bias_mode, x.shape
        ctx.save_for_backward(x2, *weights)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor):
        layout: SliceLayout = ctx.layout
        x2, *weights = ctx.saved_tensors
        r = layout.num_runs
        trained = layout.trainable_runs
        gy2 = gy.reshape(-1, gy.shape[-1])
        need = ctx.needs_input_grad
        gx = None
        gws: list[Tensor | None] = [None] * r
        if layout.dim == 0:
            if need[0]:
                for i, w in enumerate(weights):
                    lo, hi = layout.span(i)
                    if gx is None:
                        gx = torch.mm(gy2[:, lo:hi], w)
                    else:
                        torch.addmm(gx, gy2[:, lo:hi], w, out=gx)
            for i in trained:
                if need[3 + i]:
                    lo, hi = layout.span(i)
                    gws[i] = torch.mm(gy2[:, lo:hi].t(), x2)
        else:
            if need[0]:
                gx = torch.cat([torch.mm(gy2, w) for w in weights], dim=1)
            for i in trained:
                if need[3 + i]:
                    lo, hi = layout.span(i)
                    gws[i] = torch.mm(gy2.t(), x2[:, lo:hi])
        gbias: list[Tensor | None] = []
        if ctx.bias_mode == "split":
            gbias = [None] * r
            for i in trained:
                if need[3 + r + i]:
                    lo, hi = layout.span(i)
                    gbias[i] = gy2[:, lo:hi].sum(0)
        elif ctx.bias_mode == "whole":
            gbias = [gy2.sum(0) if need[3 + r] else None]
        if gx is not None:
            gx = gx.reshape(ctx.x_shape)
        return (gx, None, None, *gws, *gbias)


def partial_linear(
    x: Tensor,
    weights: Sequence[Tensor],
    layout: SliceLayout,
    bias: Tensor | Sequence[Tensor] | None = None,
) -> Tensor:
    """``F.linear(x, W, b)`` with ``W`` given as its runs; weight grad for slice ``layout.index`` only.

    ``weights`` are the ``R`` runs of ``W`` in order along ``layout.dim`` (shape ``(out_n,
    in)`` or ``(out, in_n)``). ``bias``: None; the full bias as one tensor (trained whole:
    its gradient is the full bias gradient); or, for ``dim=0``, a sequence of ``R`` bias
    pieces split like the weight. Only the trainable runs (and their bias pieces) may
    require grad: a frozen run that requires grad would silently get no gradient, so it
    is an error.
    """
    r = layout.num_runs
    if len(weights) != r:
        raise PartialUpdateError(f"partial_linear: got {len(weights)} weight slices, layout has {r}")
    for i, w in enumerate(weights):
        lo, hi = layout.span(i)
        other = w.shape[1 - layout.dim] if w.dim() == 2 else None
        if w.dim() != 2 or w.shape[layout.dim] != hi - lo or other != weights[0].shape[1 - layout.dim]:
            raise PartialUpdateError(
                f"partial_linear: weight slice {i} has shape {tuple(w.shape)}, expected size "
                f"{hi - lo} along dim {layout.dim} and matching other dims"
            )
        if layout.owner(i) != layout.index and w.requires_grad:
            raise PartialUpdateError(
                f"partial_linear: frozen weight slice {i} requires grad but would receive none; "
                f"detach it or make slice {layout.owner(i)} the trainable one (layout.index)"
            )
    in_features = layout.size if layout.dim == 1 else weights[0].shape[1]
    out_features = weights[0].shape[0] if layout.dim == 1 else layout.size
    if x.shape[-1] != in_features:
        raise PartialUpdateError(
            f"partial_linear: input has {x.shape[-1]} features, the weight expects {in_features}"
        )
    biases: tuple[Tensor, ...] = ()
    mode = "none"
    if isinstance(bias, torch.Tensor):
        if tuple(bias.shape) != (out_features,):
            raise PartialUpdateError(
                f"partial_linear: the bias has shape {tuple(bias.shape)}, expected ({out_features},)"
            )
        biases, mode = (bias,), "whole"
    elif bias is not None:
        if layout.dim != 0 or len(bias) != r:
            raise PartialUpdateError(
                "partial_linear: a split bias needs an output-split (dim=0) layout and one bias "
                "piece per weight slice; pass the full bias as one tensor to train it whole"
            )
        biases, mode = tuple(bias), "split"
        for i, b in enumerate(biases):
            if layout.owner(i) != layout.index and b.requires_grad:
                raise PartialUpdateError(
                    f"partial_linear: frozen bias slice {i} requires grad but would receive none"
                )
    return _PartialLinearFn.apply(x, layout, mode, *weights, *biases)


# --------------------------------------------------------------------------- modules


class SlicedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is split by ``layout``: one trainable slice, frozen rest.

    Attributes: the trainable runs are Parameters (``weight_slice`` when slice
    ``layout.index`` is one run, else ``weight_slice_{n}`` per run ``n``), every other run
    ``n`` is a buffer ``frozen_weight_{n}``. The bias is either *split* like the weight
    (``dim=0`` only: ``bias_slice``/``bias_slice_{n}`` + ``frozen_bias_{n}``) or trained
    *whole*: an ordinary ``bias`` Parameter (like norms and embeddings in the paper,
    trained on every rank). ``dim=1`` always trains the bias whole; ``dim=0`` does when
    ``whole_bias=True``. ``weight_name``/``bias_name`` are the original qualified names
    of the full tensors (reported by :func:`parameter_slices`).

    ``transposed=True`` takes a weight stored ``(in, out)`` (GPT-2's ``Conv1D``, used as
    ``addmm(b, x, W)``): ``layout`` still speaks of the linear map (dim 0 = outputs), the
    pieces are cut from the stored tensor along the matching dim and keep its layout, so
    a piece's gradient lines up with ``W.grad.narrow(...)``.

    ``share_storage=True`` makes every weight piece a *view* of ``weight`` instead of a
    copy: no extra memory, and the original full tensor always holds the current values
    (optimizer steps on the trainable slice write through); a whole bias that is an
    ``nn.Parameter`` is then the user's Parameter itself, not a copy. Moving the layer or
    the original to another device breaks the sharing: place the model first, then slice.
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        layout: SliceLayout,
        *,
        weight_name: str = "weight",
        bias_name: str = "bias",
        share_storage: bool = False,
        transposed: bool = False,
        whole_bias: bool = False,
    ) -> None:
        super().__init__()
        self.layout, self.transposed = layout, transposed
        self.storage_dim = 1 - layout.dim if transposed else layout.dim
        if weight.dim() != 2 or weight.shape[self.storage_dim] != layout.size:
            raise PartialUpdateError(
                f"SlicedLinear({weight_name}): weight shape {tuple(weight.shape)} does not have "
                f"size {layout.size} along dim {self.storage_dim}"
            )
        out_f, in_f = (weight.shape[1], weight.shape[0]) if transposed else tuple(weight.shape)
        self.in_features, self.out_features = in_f, out_f
        self.weight_name, self.bias_name = weight_name, bias_name
        trained = layout.trainable_runs
        self._weight_names = [
            ("weight_slice" if len(trained) == 1 else f"weight_slice_{n}") if n in trained else f"frozen_weight_{n}"
            for n in range(layout.num_runs)
        ]
        w = weight.detach()
        for n, name in enumerate(self._weight_names):
            lo, hi = layout.span(n)
            piece = w.narrow(self.storage_dim, lo, hi - lo)
            piece = piece if share_storage else piece.clone()
            if n in trained:
                setattr(self, name, nn.Parameter(piece, requires_grad=weight.requires_grad))
            else:
                self.register_buffer(name, piece)
        self.has_bias = bias is not None
        self.bias_mode = "none" if bias is None else "whole" if (layout.dim == 1 or whole_bias) else "split"
        self.bias: nn.Parameter | None = None
        self._bias_names: list[str] = []
        if bias is not None and tuple(bias.shape) != (out_f,):
            raise PartialUpdateError(
                f"SlicedLinear({bias_name}): bias shape {tuple(bias.shape)}, expected ({out_f},)"
            )
        if self.bias_mode == "whole":
            if share_storage and isinstance(bias, nn.Parameter):
                self.bias = bias  # the user's own Parameter: its gradient lands where they look
            else:
                b = bias.detach()
                self.bias = nn.Parameter(b if share_storage else b.clone(), requires_grad=bias.requires_grad)
        elif self.bias_mode == "split":
            b = bias.detach()
            self._bias_names = [n.replace("weight", "bias") for n in self._weight_names]
            for n, name in enumerate(self._bias_names):
                lo, hi = layout.span(n)
                piece = b[lo:hi] if share_storage else b[lo:hi].clone()
                if n in trained:
                    setattr(self, name, nn.Parameter(piece, requires_grad=bias.requires_grad))
                else:
                    self.register_buffer(name, piece)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, layout: SliceLayout, *, name: str = "", share_storage: bool = False
    ) -> "SlicedLinear":
        """Slice an existing ``nn.Linear`` (``name``: its qualified name in the model)."""
        prefix = f"{name}." if name else ""
        return cls(
            linear.weight,
            linear.bias,
            layout,
            weight_name=f"{prefix}weight",
            bias_name=f"{prefix}bias",
            share_storage=share_storage,
        )

    def weight_pieces(self) -> tuple[Tensor, ...]:
        """The ``R`` weight runs in order, in the stored layout (trainable ones are Parameters)."""
        return tuple(getattr(self, name) for name in self._weight_names)

    def bias_pieces(self) -> Tensor | tuple[Tensor, ...] | None:
        """None, the whole bias (a tensor), or the split bias runs (a tuple)."""
        if self.bias_mode == "none":
            return None
        if self.bias_mode == "whole":
            return self.bias
        return tuple(getattr(self, name) for name in self._bias_names)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, W, b)``. ``bias`` overrides a whole bias (the compiled plan passes
        the user's bias as read by the graph)."""
        pieces = self.weight_pieces()
        if self.transposed:
            pieces = tuple(p.t() for p in pieces)
        if bias is not None and self.bias_mode != "whole":
            raise PartialUpdateError(
                f"SlicedLinear({self.weight_name}): a bias argument needs a layer whose bias is trained whole"
            )
        return partial_linear(x, pieces, self.layout, bias if bias is not None else self.bias_pieces())

    @torch.no_grad()
    def full_weight(self) -> Tensor:
        """The full weight in its stored layout (a new tensor)."""
        return torch.cat([p.detach() for p in self.weight_pieces()], dim=self.storage_dim)

    @torch.no_grad()
    def full_bias(self) -> Tensor | None:
        b = self.bias_pieces()
        if b is None:
            return None
        if isinstance(b, torch.Tensor):
            return b.detach().clone()
        return torch.cat([p.detach() for p in b])

    @torch.no_grad()
    def load_full(self, weight: Tensor | None = None, bias: Tensor | None = None) -> None:
        """Copy a full weight (stored layout) and/or bias into the pieces, in place."""
        if weight is not None:
            shape = (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)
            if tuple(weight.shape) != shape:
                raise PartialUpdateError(
                    f"{self.weight_name}: full weight has shape {tuple(weight.shape)}, expected {shape}"
                )
            for n, piece in enumerate(self.weight_pieces()):
                lo, hi = self.layout.span(n)
                piece.copy_(weight.narrow(self.storage_dim, lo, hi - lo))
        if bias is not None:
            pieces = self.bias_pieces()
            if pieces is None:
                raise PartialUpdateError(f"{self.bias_name}: this layer has no bias")
            if tuple(bias.shape) != (self.out_features,):
                raise PartialUpdateError(
                    f"{self.bias_name}: full bias has shape {tuple(bias.shape)}, expected "
                    f"{(self.out_features,)}"
                )
            if isinstance(pieces, torch.Tensor):
                pieces.copy_(bias)
            else:
                for n, piece in enumerate(pieces):
                    lo, hi = self.layout.span(n)
                    piece.copy_(bias[lo:hi])

    def frozen_buffer_names(self) -> list[str]:
        """Names (relative to this layer) of the frozen-slice buffers."""
        trained = set(self.layout.trainable_runs)
        names = [n for i, n in enumerate(self._weight_names) if i not in trained]
        names += [n for i, n in enumerate(self._bias_names) if i not in trained]
        return names

    def slices(self, prefix: str = "") -> dict[str, tuple[str, tuple[int, int, int]]]:
        """``{slice_name: (original_name, (dim, start, stop))}`` for this layer's trainable pieces.

        ``dim`` is the dim of the stored tensor. A bias trained whole is an ordinary
        parameter and is not listed here.
        """
        out: dict[str, tuple[str, tuple[int, int, int]]] = {}
        for n in self.layout.trainable_runs:
            lo, hi = self.layout.span(n)
            out[f"{prefix}{self._weight_names[n]}"] = (self.weight_name, (self.storage_dim, lo, hi))
        if self.bias_mode == "split":
            for n in self.layout.trainable_runs:
                lo, hi = self.layout.span(n)
                out[f"{prefix}{self._bias_names[n]}"] = (self.bias_name, (0, lo, hi))
        return out

    def extra_repr(self) -> str:
        spans = ", ".join(f"{lo}:{hi}" for lo, hi in self.layout.trainable_spans)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dim={self.layout.dim}, slices={self.layout.num_slices}, trainable=[{spans}], "
            f"bias={self.bias_mode}" + (", transposed" if self.transposed else "")
        )


def slice_linears(model: nn.Module, layouts: Mapping[str, SliceLayout]) -> nn.Module:
    """Replace each named ``nn.Linear`` of ``model`` by a :class:`SlicedLinear`, in place.

    ``layouts`` maps qualified module names to their layout (see :func:`mlp_in_layout`,
    :func:`mlp_out_layout`, :func:`attention_layouts`). Returns ``model``. Parameters of
    the replaced layers are dropped from ``model.parameters()``: build the optimizer after
    slicing.
    """
    modules = dict(model.named_modules())
    for name, layout in layouts.items():
        mod = modules.get(name)
        if not isinstance(mod, nn.Linear):
            kind = "missing" if mod is None else type(mod).__name__
            raise PartialUpdateError(
                f"slice_linears: `{name}` is {kind}, not an nn.Linear; only nn.Linear layers "
                f"can be sliced (pass the qualified name of one, e.g. 'layers.0.mlp.up')"
            )
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, attr, SlicedLinear.from_linear(mod, layout, name=name))
    return model


# --------------------------------------------------------------------------- whole-model views


def _sliced_layers(module: nn.Module) -> dict[str, SlicedLinear]:
    return {n: m for n, m in module.named_modules() if isinstance(m, SlicedLinear)}


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def _original_entries(module: nn.Module) -> list[tuple[str, SlicedLinear | None, str]]:
    """``(original_name, layer or None, what)`` for every full parameter, in module order.

    ``what`` is ``"weight"``/``"bias"`` for tensors of a :class:`SlicedLinear`, else the
    parameter's own name in ``module``.
    """
    layers = _sliced_layers(module)
    owner: dict[str, SlicedLinear] = {}
    for name, layer in layers.items():
        for p, _ in layer.named_parameters(recurse=False):
            owner[_prefix(name) + p] = layer
    entries: list[tuple[str, SlicedLinear | None, str]] = []
    seen: set[int] = set()
    for name, _ in module.named_parameters():
        layer = owner.get(name)
        if layer is None:
            entries.append((name, None, name))
        elif id(layer) not in seen:
            seen.add(id(layer))
            entries.append((layer.weight_name, layer, "weight"))
            if layer.has_bias:
                entries.append((layer.bias_name, layer, "bias"))
    # A layer whose slices are all frozen (requires_grad False still lists them) is covered
    # above; a layer with no parameters at all cannot exist (weight_slice is a Parameter).
    return entries


def parameter_slices(module: nn.Module) -> dict[str, tuple[str, tuple[int, int, int]]]:
    """``{slice_name: (original_name, (dim, start, stop))}`` for every trainable slice in ``module``."""
    out: dict[str, tuple[str, tuple[int, int, int]]] = {}
    for name, layer in _sliced_layers(module).items():
        out.update(layer.slices(_prefix(name)))
    return out


@torch.no_grad()
def full_parameters(module: nn.Module, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Full parameter values under their original names (sliced weights reassembled).

    Tensors that are not split (ordinary parameters, the unsplit bias of an input-split
    layer) are returned as the live ``Parameter`` objects, so ``requires_grad`` tells
    whether they are trained; split weights and biases as new tensors (no grad).
    ``names`` restricts the result (default: all, in module order). Do not modify the
    returned tensors; write with :func:`load_full_parameters`.
    """
    want = None if names is None else set(names)
    params = dict(module.named_parameters())
    out: dict[str, Tensor] = {}
    for orig, layer, what in _original_entries(module):
        if want is not None and orig not in want:
            continue
        if layer is None:
            out[orig] = params[what]
        elif what == "weight":
            out[orig] = layer.full_weight()
        elif layer.bias_mode == "whole":
            out[orig] = layer.bias  # not split: the live parameter, trained on every rank
        else:
            out[orig] = layer.full_bias()
    if want is not None and want - set(out):
        raise PartialUpdateError(
            f"full_parameters: unknown parameter name(s) {sorted(want - set(out))}"
        )
    return out


@torch.no_grad()
def load_full_parameters(module: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Copy full values (original names, as from :func:`full_parameters`) into ``module``, in place."""
    entries = {orig: (layer, what) for orig, layer, what in _original_entries(module)}
    own = dict(module.named_parameters())
    for name, value in params.items():
        if name not in entries:
            raise PartialUpdateError(
                f"load_full_parameters: `{name}` is not a (full) parameter of the module; "
                f"known names are those of full_parameters(module)"
            )
        layer, what = entries[name]
        if layer is not None:
            layer.load_full(**{what: value})
            continue
        if own[what].shape != value.shape:
            raise PartialUpdateError(
                f"load_full_parameters: `{name}` has shape {tuple(own[what].shape)}, "
                f"got {tuple(value.shape)}"
            )
        own[what].copy_(value)


def materialized_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` of the *unsliced* model: slices folded back into full weights.

    Every sliced layer's entries (trainable slices, frozen-slice buffers) are replaced by
    its full ``weight``/``bias`` under the original names, so the result loads into the
    original model with ``load_state_dict`` when slicing kept the original names.
    """
    layers = _sliced_layers(module)
    prefixes = tuple(_prefix(n) for n in layers)
    full = full_parameters(module)
    out: dict[str, Tensor] = {}
    for name, value in module.state_dict(keep_vars=False).items():
        if any(name.startswith(p) and "." not in name[len(p):] for p in prefixes):
            continue  # a slice or frozen buffer of a SlicedLinear: replaced by the full tensor
        out[name] = value
    for name, value in full.items():
        out[name] = value.detach()
    return out


def predicted_backward_flops_saved(module: nn.Module, tokens: int) -> int:
    """Weight-gradient FLOPs the sliced layers of ``module`` skip for ``tokens`` input rows.

    Each :class:`SlicedLinear` skips ``2 * tokens * (out*in - |W_k|)`` (one GEMM per frozen
    slice's weight gradient); bias reductions are not counted (nor by FlopCounterMode).
    """
    saved = 0
    for layer in _sliced_layers(module).values():
        full = layer.out_features * layer.in_features
        other = layer.in_features if layer.layout.dim == 0 else layer.out_features
        trained = layer.layout.trainable_size * other
        saved += 2 * tokens * (full - trained)
    return saved

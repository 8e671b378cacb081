"""Partial parameter updates: weights split into one trainable slice and frozen slices.

A targeted ``nn.Linear`` with weight ``W`` of shape ``(out, in)`` is split along one
dimension into ``N`` contiguous slices ``W_0 .. W_{N-1}``; slice ``k`` (the rank's slice,
by default ``rank mod N``) is an ``nn.Parameter``, the others are buffers::

    before:  y = x @ W.T + b                         W: (out, in), one Parameter
    after:   dim=0 (output split, MLP up/gate, q/k/v by head groups)
               y = cat_n(x @ W_n.T + b_n)            W_n: (out_n, in)
             dim=1 (input split, MLP down)
               y = sum_n(x[..., in_n] @ W_n.T) + b   W_n: (out, in_n)

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
    ``N + 1`` increasing integers from 0 to the size of ``dim``; slice ``n`` covers
    ``[bounds[n], bounds[n + 1])``.
    """

    dim: int
    bounds: tuple[int, ...]
    index: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1):
            raise PartialUpdateError(f"SliceLayout.dim must be 0 (output) or 1 (input), got {self.dim}")
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(lo >= hi for lo, hi in zip(b, b[1:])):
            raise PartialUpdateError(
                f"SliceLayout.bounds must start at 0 and strictly increase (no empty slice), got {b}"
            )
        if not 0 <= self.index < len(b) - 1:
            raise PartialUpdateError(
                f"SliceLayout.index={self.index} is out of range for {len(b) - 1} slices"
            )

    @property
    def num_slices(self) -> int:
        return len(self.bounds) - 1

    @property
    def size(self) -> int:
        """Length of the split dimension."""
        return self.bounds[-1]

    def span(self, n: int) -> tuple[int, int]:
        """``(start, stop)`` of slice ``n`` along ``dim``."""
        return self.bounds[n], self.bounds[n + 1]

    @property
    def trainable_span(self) -> tuple[int, int]:
        return self.span(self.index)

    def with_index(self, index: int) -> "SliceLayout":
        return SliceLayout(self.dim, self.bounds, index)


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
    """Split-matmul linear; weight gradient for ``layout.index`` only (see module doc)."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: SliceLayout, has_bias: bool, *tensors: Tensor) -> Tensor:
        n = layout.num_slices
        weights, rest = tensors[:n], tensors[n:]
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if layout.dim == 0:
            biases = rest if has_bias else (None,) * n
            parts = [
                torch.mm(x2, w.t()) if b is None else torch.addmm(b, x2, w.t())
                for w, b in zip(weights, biases)
            ]
            y = torch.cat(parts, dim=1)
        else:
            y = None
            for i, w in enumerate(weights):
                lo, hi = layout.span(i)
                xs = x2[:, lo:hi]
                if y is None:
                    y = torch.mm(xs, w.t()) if not has_bias else torch.addmm(rest[0], xs, w.t())
                else:  # out= (not addmm_): in place, and visible to FlopCounterMode
                    torch.addmm(y, xs, w.t(), out=y)
        ctx.layout, ctx.has_bias, ctx.x_shape = layout, has_bias, x.shape
        ctx.save_for_backward(x2, *weights)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor):
        layout: SliceLayout = ctx.layout
        x2, *weights = ctx.saved_tensors
        n, k = layout.num_slices, layout.index
        gy2 = gy.reshape(-1, gy.shape[-1])
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[3 + k]
        gx = gw = None
        gbias: list[Tensor | None] = []
        if layout.dim == 0:
            if need_x:
                for i, w in enumerate(weights):
                    lo, hi = layout.span(i)
                    if gx is None:
                        gx = torch.mm(gy2[:, lo:hi], w)
                    else:
                        torch.addmm(gx, gy2[:, lo:hi], w, out=gx)
            lo, hi = layout.trainable_span
            if need_w:
                gw = torch.mm(gy2[:, lo:hi].t(), x2)
            if ctx.has_bias:
                gbias = [None] * n
                if ctx.needs_input_grad[3 + n + k]:
                    gbias[k] = gy2[:, lo:hi].sum(0)
        else:
            if need_x:
                gx = torch.cat([torch.mm(gy2, w) for w in weights], dim=1)
            lo, hi = layout.trainable_span
            if need_w:
                gw = torch.mm(gy2.t(), x2[:, lo:hi])
            if ctx.has_bias:
                gbias = [gy2.sum(0) if ctx.needs_input_grad[3 + n] else None]
        gws = [None] * n
        gws[k] = gw
        if gx is not None:
            gx = gx.reshape(ctx.x_shape)
        return (gx, None, None, *gws, *gbias)


def partial_linear(
    x: Tensor,
    weights: Sequence[Tensor],
    layout: SliceLayout,
    bias: Tensor | Sequence[Tensor] | None = None,
) -> Tensor:
    """``F.linear(x, W, b)`` with ``W`` given as its slices; weight grad for ``layout.index`` only.

    ``weights`` are the ``N`` slices of ``W`` in order along ``layout.dim``. ``bias``: for
    ``dim=0`` a sequence of ``N`` bias slices (or None); for ``dim=1`` the full bias (or
    None). Only the trainable slice (and its bias part; for ``dim=1`` the whole bias) may
    require grad: a frozen slice that requires grad would silently get no gradient, so it
    is an error.
    """
    n = layout.num_slices
    if len(weights) != n:
        raise PartialUpdateError(f"partial_linear: got {len(weights)} weight slices, layout has {n}")
    for i, w in enumerate(weights):
        lo, hi = layout.span(i)
        other = w.shape[1 - layout.dim]
        if w.dim() != 2 or w.shape[layout.dim] != hi - lo or other != weights[0].shape[1 - layout.dim]:
            raise PartialUpdateError(
                f"partial_linear: weight slice {i} has shape {tuple(w.shape)}, expected size "
                f"{hi - lo} along dim {layout.dim} and matching other dims"
            )
        if i != layout.index and w.requires_grad:
            raise PartialUpdateError(
                f"partial_linear: frozen weight slice {i} requires grad but would receive none; "
                f"detach it or make slice {i} the trainable one (layout.index)"
            )
    in_features = layout.size if layout.dim == 1 else weights[0].shape[1]
    if x.shape[-1] != in_features:
        raise PartialUpdateError(
            f"partial_linear: input has {x.shape[-1]} features, the weight expects {in_features}"
        )
    biases: tuple[Tensor, ...] = ()
    if bias is not None:
        if layout.dim == 0:
            if isinstance(bias, torch.Tensor) or len(bias) != n:
                raise PartialUpdateError(
                    "partial_linear: an output-split (dim=0) layout needs one bias slice per weight slice"
                )
            biases = tuple(bias)
            for i, b in enumerate(biases):
                if i != layout.index and b.requires_grad:
                    raise PartialUpdateError(
                        f"partial_linear: frozen bias slice {i} requires grad but would receive none"
                    )
        else:
            if not isinstance(bias, torch.Tensor):
                raise PartialUpdateError(
                    "partial_linear: an input-split (dim=1) layout takes the full bias tensor"
                )
            biases = (bias,)
    return _PartialLinearFn.apply(x, layout, bias is not None, *weights, *biases)


# --------------------------------------------------------------------------- modules


class SlicedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is split by ``layout``: one trainable slice, frozen rest.

    Attributes: ``weight_slice`` (Parameter, slice ``layout.index``), buffers
    ``frozen_weight_{n}`` for every other slice ``n``; for ``dim=0`` the bias is split the
    same way (``bias_slice`` + ``frozen_bias_{n}``); for ``dim=1`` the bias is not split
    and stays an ordinary trainable ``bias`` Parameter (like norms and embeddings in the
    paper, it is trained on every rank). ``weight_name``/``bias_name`` are the original
    qualified names of the full tensors (reported by :func:`parameter_slices`).

    ``share_storage=True`` makes every slice a *view* of ``weight``/``bias`` instead of a
    copy: no extra memory, and the original full tensors always hold the current values
    (optimizer steps on the trainable slice write through). Moving the layer or the
    original to another device breaks the sharing: place the model first, then slice.
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
    ) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.shape[layout.dim] != layout.size:
            raise PartialUpdateError(
                f"SlicedLinear({weight_name}): weight shape {tuple(weight.shape)} does not have "
                f"size {layout.size} along dim {layout.dim}"
            )
        self.layout = layout
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight_name, self.bias_name = weight_name, bias_name
        w = weight.detach()
        k = layout.index
        for n in range(layout.num_slices):
            lo, hi = layout.span(n)
            piece = w.narrow(layout.dim, lo, hi - lo)
            piece = piece if share_storage else piece.clone()
            if n == k:
                self.weight_slice = nn.Parameter(piece, requires_grad=weight.requires_grad)
            else:
                self.register_buffer(f"frozen_weight_{n}", piece)
        self.has_bias = bias is not None
        self.bias: nn.Parameter | None = None
        if bias is not None:
            b = bias.detach()
            if layout.dim == 0:
                for n in range(layout.num_slices):
                    lo, hi = layout.span(n)
                    piece = b[lo:hi] if share_storage else b[lo:hi].clone()
                    if n == k:
                        self.bias_slice = nn.Parameter(piece, requires_grad=bias.requires_grad)
                    else:
                        self.register_buffer(f"frozen_bias_{n}", piece)
            else:
                self.bias = nn.Parameter(b if share_storage else b.clone(), requires_grad=bias.requires_grad)

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
        """The ``N`` weight slices in order (the trainable one is the Parameter)."""
        k = self.layout.index
        return tuple(
            self.weight_slice if n == k else getattr(self, f"frozen_weight_{n}")
            for n in range(self.layout.num_slices)
        )

    def bias_pieces(self) -> Tensor | tuple[Tensor, ...] | None:
        if not self.has_bias:
            return None
        if self.layout.dim == 1:
            return self.bias
        k = self.layout.index
        return tuple(
            self.bias_slice if n == k else getattr(self, f"frozen_bias_{n}")
            for n in range(self.layout.num_slices)
        )

    def forward(self, x: Tensor) -> Tensor:
        return partial_linear(x, self.weight_pieces(), self.layout, self.bias_pieces())

    @torch.no_grad()
    def full_weight(self) -> Tensor:
        """The full ``(out, in)`` weight (a new tensor)."""
        return torch.cat([p.detach() for p in self.weight_pieces()], dim=self.layout.dim)

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
        """Copy a full weight and/or bias into the slices, in place."""
        if weight is not None:
            if tuple(weight.shape) != (self.out_features, self.in_features):
                raise PartialUpdateError(
                    f"{self.weight_name}: full weight has shape {tuple(weight.shape)}, expected "
                    f"{(self.out_features, self.in_features)}"
                )
            for n, piece in enumerate(self.weight_pieces()):
                lo, hi = self.layout.span(n)
                piece.copy_(weight.narrow(self.layout.dim, lo, hi - lo))
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
        k = self.layout.index
        names = [f"frozen_weight_{n}" for n in range(self.layout.num_slices) if n != k]
        if self.has_bias and self.layout.dim == 0:
            names += [f"frozen_bias_{n}" for n in range(self.layout.num_slices) if n != k]
        return names

    def slices(self, prefix: str = "") -> dict[str, tuple[str, tuple[int, int, int]]]:
        """``{slice_name: (original_name, (dim, start, stop))}`` for this layer's trainable slices."""
        lo, hi = self.layout.trainable_span
        out = {f"{prefix}weight_slice": (self.weight_name, (self.layout.dim, lo, hi))}
        if self.has_bias and self.layout.dim == 0:
            out[f"{prefix}bias_slice"] = (self.bias_name, (0, lo, hi))
        return out

    def extra_repr(self) -> str:
        lo, hi = self.layout.trainable_span
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dim={self.layout.dim}, slices={self.layout.num_slices}, trainable=[{lo}:{hi}], "
            f"bias={self.has_bias}"
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
        elif layer.layout.dim == 1:
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
        lo, hi = layer.layout.trainable_span
        full = layer.out_features * layer.in_features
        trained = (hi - lo) * (layer.in_features if layer.layout.dim == 0 else layer.out_features)
        saved += 2 * tokens * (full - trained)
    return saved

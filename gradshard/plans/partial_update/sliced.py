"""``SlicedLinear``: an ``nn.Linear`` stored as one trainable slice and frozen slices.

The trainable runs of the weight (and of a split bias) are Parameters, the others buffers;
the forward is :func:`~gradshard.plans.partial_update.linear.partial_linear`.
:func:`slice_linears` swaps named ``nn.Linear`` layers of a model for sliced ones in place.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from gradshard.plans.partial_update.layout import PartialUpdateError, SliceLayout
from gradshard.plans.partial_update.linear import partial_linear

Tensor = torch.Tensor

__all__ = ["SlicedLinear", "slice_linears"]


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

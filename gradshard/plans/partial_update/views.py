"""Whole-model views of a sliced model: slice metadata, full parameters, state dicts.

Every view speaks the original parameter names: :func:`parameter_slices` maps each
trainable slice to ``(original_name, (dim, start, stop))`` (docs/DESIGN.md),
:func:`full_parameters` / :func:`load_full_parameters` read and write the full tensors
(sliced weights reassembled), :func:`materialized_state_dict` is the unsliced model's state
dict. :class:`FullEntry` with :func:`read_full` / :func:`write_full` is the one
implementation of reading and writing full values, shared with the compiled plan's view
(``cm.full_parameters()`` in :mod:`gradshard.plans.partial_update.rewrite`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from gradshard.plans.partial_update.layout import PartialUpdateError
from gradshard.plans.partial_update.sliced import SlicedLinear

Tensor = torch.Tensor

__all__ = [
    "FullEntry",
    "read_full",
    "write_full",
    "parameter_slices",
    "full_parameters",
    "load_full_parameters",
    "materialized_state_dict",
    "predicted_backward_flops_saved",
]


@dataclass(frozen=True)
class FullEntry:
    """One full parameter under its original ``name``: the ``"weight"`` or ``"bias"``
    (``what``) of a sliced ``layer``, or, when ``layer`` is None, the live ``param``."""

    name: str
    layer: SlicedLinear | None = None
    what: str = ""
    param: Tensor | None = None


@torch.no_grad()
def read_full(entries: Sequence[FullEntry], names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Full values of ``entries`` (restricted to ``names``), in entry order.

    Tensors that are not split (ordinary parameters, a bias trained whole) are the live
    ``Parameter`` objects, so ``requires_grad`` tells whether they are trained; split
    weights and biases are new tensors (no grad).
    """
    want = None if names is None else set(names)
    out: dict[str, Tensor] = {}
    for e in entries:
        if want is not None and e.name not in want:
            continue
        if e.layer is None:
            out[e.name] = e.param
        elif e.what == "weight":
            out[e.name] = e.layer.full_weight()
        elif e.layer.bias_mode == "whole":
            out[e.name] = e.layer.bias  # not split: the live parameter, trained on every rank
        else:
            out[e.name] = e.layer.full_bias()
    if want is not None and want - set(out):
        raise PartialUpdateError(
            f"full_parameters: unknown parameter name(s) {sorted(want - set(out))}; the known "
            f"names are the original (unsliced) parameter names"
        )
    return out


@torch.no_grad()
def write_full(entries: Sequence[FullEntry], params: Mapping[str, Tensor]) -> None:
    """Copy full values (original names) into the slices and parameters of ``entries``, in place.

    Every value must have its parameter's full shape: a value that would broadcast (a
    scalar, a slice) is an error, never a silent fill.
    """
    by_name = {e.name: e for e in entries}
    for name, value in params.items():
        e = by_name.get(name)
        if e is None:
            raise PartialUpdateError(
                f"load_full_parameters: `{name}` is not a (full) parameter of the module; "
                f"known names are those of full_parameters()"
            )
        if e.layer is not None:
            e.layer.load_full(**{e.what: value})
            continue
        if e.param.shape != value.shape:
            raise PartialUpdateError(
                f"load_full_parameters: `{name}` has shape {tuple(e.param.shape)}, "
                f"got {tuple(value.shape)}; pass the full tensor (no broadcasting)"
            )
        e.param.copy_(value)


def _sliced_layers(module: nn.Module) -> dict[str, SlicedLinear]:
    return {n: m for n, m in module.named_modules() if isinstance(m, SlicedLinear)}


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def _original_entries(module: nn.Module) -> list[FullEntry]:
    """A :class:`FullEntry` for every full parameter of ``module``, in module order: the
    ``weight``/``bias`` of each :class:`SlicedLinear`, every other parameter as itself."""
    layers = _sliced_layers(module)
    owner: dict[str, SlicedLinear] = {}
    for name, layer in layers.items():
        for p, _ in layer.named_parameters(recurse=False):
            owner[_prefix(name) + p] = layer
    entries: list[FullEntry] = []
    seen: set[int] = set()
    for name, param in module.named_parameters():
        layer = owner.get(name)
        if layer is None:
            entries.append(FullEntry(name, param=param))
        elif id(layer) not in seen:
            seen.add(id(layer))
            entries.append(FullEntry(layer.weight_name, layer, "weight"))
            if layer.has_bias:
                entries.append(FullEntry(layer.bias_name, layer, "bias"))
    # A layer whose slices are all frozen (requires_grad False still lists them) is covered
    # above; a layer with no parameters at all cannot exist (weight_slice is a Parameter).
    return entries


def parameter_slices(module: nn.Module) -> dict[str, tuple[str, tuple[int, int, int]]]:
    """``{slice_name: (original_name, (dim, start, stop))}`` for every trainable slice in ``module``."""
    out: dict[str, tuple[str, tuple[int, int, int]]] = {}
    for name, layer in _sliced_layers(module).items():
        out.update(layer.slices(_prefix(name)))
    return out


def full_parameters(module: nn.Module, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Full parameter values under their original names (sliced weights reassembled).

    Tensors that are not split (ordinary parameters, the unsplit bias of an input-split
    layer) are returned as the live ``Parameter`` objects, so ``requires_grad`` tells
    whether they are trained; split weights and biases as new tensors (no grad).
    ``names`` restricts the result (default: all, in module order). Do not modify the
    returned tensors; write with :func:`load_full_parameters`.
    """
    return read_full(_original_entries(module), names)


def load_full_parameters(module: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Copy full values (original names, as from :func:`full_parameters`) into ``module``, in place."""
    write_full(_original_entries(module), params)


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

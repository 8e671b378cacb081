"""The example inputs of a cost query: their time and batch axes, resized and fake copies.

- :func:`find_input_axes`: which dimension of every tensor input is the sequence and which
  the batch, from the time-locality analysis of a capture at the example sizes;
- :func:`resize_inputs`: the inputs at another ``(batch, seq_len)``, entries repeated
  cyclically (token ids and labels stay valid);
- :func:`fake_clone`: a copy of the model and inputs on fake tensors (shapes without data)
  made through meta tensors, so no parameter is copied whatever the model size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..capture import capture
from ..errors import GradshardError, first_line

__all__ = ["InputAxes", "CostProbeError", "find_input_axes", "resize_inputs", "fake_clone", "real_clone",
           "tensor_leaves"]


class CostProbeError(GradshardError):
    """A cost probe could not run the compiled step at a probe size."""


@dataclass(frozen=True)
class InputAxes:
    """Time and batch dimensions of every tensor leaf of the example inputs (pytree order)."""

    time: tuple[tuple[int, ...], ...]
    batch: tuple[tuple[int, ...], ...]
    seq_len: int
    batch_size: int

    def describe(self) -> str:
        parts = []
        for i, (t, b) in enumerate(zip(self.time, self.batch)):
            if t or b:
                parts.append(f"input{i}: time dims {list(t)}, batch dims {list(b)}")
        return "; ".join(parts) or "no input has a time axis"


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a pytree, in order."""
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def find_input_axes(target: Any, example_inputs: Sequence[Any], *, time_axis: tuple[int, int] | None = None,
                    frontend: str = "python") -> InputAxes:
    """Capture at the example sizes and read each input's time and batch dims off the graph.

    The time class is the one the time-locality analysis infers (``time_axis`` overrides
    it); the batch class is the class of dim 0 of the first input carrying time, when dim 0
    is not itself time.
    """
    from ..analysis.dims import analyze_dims
    from ..analysis.locality import NoTimeAxisError, infer_time_class

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ftarget, finputs = fake_clone((target, tuple(example_inputs)), mode)
    try:
        cap = capture(ftarget, tuple(finputs), {}, frontend=frontend)
    except Exception as exc:
        raise CostProbeError(f"gs.cost could not capture the model at the example sizes: {exc}") from exc
    dims = analyze_dims(cap.gm)
    try:
        cls, _ = infer_time_class(cap.gm, dims, time_axis)
    except NoTimeAxisError as exc:
        raise CostProbeError(
            "gs.cost needs the sequence axis: " + first_line(exc) +
            "\n  instead: pass time_axis=(input_index, dim) to gs.cost") from exc
    phs = [p for p in cap.gm.graph.find_nodes(op="placeholder")][cap.num_state:]
    time = [dims.axes_in_class(p, cls) for p in phs]
    # Batch-first convention: when dim 0 of an input lands in the time class together with
    # other dims (an op the dims analysis cannot see through merged the batch and time
    # classes), dim 0 is the batch and the others are time.
    merged = [0 in t and len(t) > 1 for t in time]
    time = [tuple(d for d in t if d != 0) if m else t for t, m in zip(time, merged)]
    batch_cls = None
    for p, t in zip(phs, time):
        shape = tuple(p.meta["val"].shape)
        if t and len(shape) >= 2 and 0 not in t:
            batch_cls = dims.canon(dims.input_labels[p.name][0])
            break
    batch = [dims.axes_in_class(p, batch_cls) if batch_cls is not None and not any(merged) else ()
             for p in phs]
    batch = [(0,) if m else tuple(d for d in b if d not in t) for b, t, m in zip(batch, time, merged)]
    # Inputs the analysis could not connect to the time axis (the dims of position ids or
    # labels do not always meet the token ids' in one op) but shaped exactly like the first
    # time-carrying input (ids, position ids, labels: all (B, T)) share its axes.
    first = next((i for i, t in enumerate(time) if t), None)
    if first is not None:
        ref_shape = tuple(phs[first].meta["val"].shape)
        for i, p in enumerate(phs):
            if not time[i] and not batch[i] and tuple(p.meta["val"].shape) == ref_shape:
                time[i], batch[i] = time[first], batch[first]
    seq_len = next((int(p.meta["val"].shape[t[0]]) for p, t in zip(phs, time) if t), 0)
    if not seq_len:
        raise CostProbeError("no example input carries the time axis the analysis found; pass "
                             "time_axis=(input_index, dim) to gs.cost")
    bsz = next((int(p.meta["val"].shape[b[0]]) for p, b in zip(phs, batch) if b), 1)
    # the graph's tensor inputs are the example's tensor leaves in pytree order
    return InputAxes(tuple(time), tuple(batch), seq_len, bsz)


def resize_inputs(example_inputs: Sequence[Any], axes: InputAxes, batch: int, seq_len: int) -> tuple[Any, ...]:
    """The example inputs with every time dim of size ``seq_len`` and batch dim of size ``batch``.

    Entries are repeated cyclically (``x[..., arange(n) % size, ...]``), so integer inputs
    keep values the model accepts (token ids, labels).
    """
    leaves, spec = pytree.tree_flatten(tuple(example_inputs))
    out, k = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            x = leaf
            for dims, n in ((axes.time[k], seq_len), (axes.batch[k], batch)):
                for d in dims:
                    idx = torch.arange(n, device=x.device) % x.shape[d]
                    x = x.index_select(d, idx)
            out.append(x)
            k += 1
        else:
            out.append(leaf)
    return tuple(pytree.tree_unflatten(out, spec))


# --------------------------------------------------------------------------- fake copies


def fake_clone(tree: Any, mode: FakeTensorMode, originals: dict[int, torch.Tensor] | None = None,
               dtype: torch.dtype | None = None) -> Any:
    """A copy of ``tree`` (modules and tensors) whose parameters, buffers and tensors are fake.

    Modules are deep-copied with their state replaced by meta tensors first (nothing real is
    copied, so this is cheap for any model size), then every state tensor becomes a fake
    tensor on the original device; shared (tied) tensors stay shared. ``originals``, when
    given, receives ``id(fake) -> original tensor`` for every fake made. ``dtype`` casts
    floating-point state and inputs (a what-if: "this model in bfloat16").
    """

    def cast(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    originals = {} if originals is None else originals
    modules = [m for m in pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nn.Module))
               if isinstance(m, nn.Module)]
    memo: dict[int, Any] = {}
    source: dict[int, torch.Tensor] = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) in memo:
                continue
            meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=cast(t), device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
            source[id(memo[id(t)])] = t
    fakes: dict[int, torch.Tensor] = {}

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            real = source.get(id(t))
            device = real.device if real is not None else torch.device("cpu")
            f = mode.fake_tensor_converter.from_meta_and_device(mode, t, device)
            if t.requires_grad:
                f.requires_grad_(True)
            fakes[id(t)] = f
            if real is not None:
                originals[id(f)] = real
        return fakes[id(t)]

    def convert(x: Any) -> Any:
        if isinstance(x, nn.Module):
            m = copy.deepcopy(x, memo)
            for sub in m.modules():
                for k, p in list(sub._parameters.items()):
                    if p is not None:
                        sub._parameters[k] = to_fake(p)
                for k, b in list(sub._buffers.items()):
                    if b is not None:
                        sub._buffers[k] = to_fake(b)
            return m
        if isinstance(x, torch.Tensor):
            f = mode.from_tensor(x if cast(x) == x.dtype else x.to(cast(x)))
            originals[id(f)] = x
            return f
        return x

    return pytree.tree_map(convert, tree, is_leaf=lambda x: isinstance(x, nn.Module))


def real_clone(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """A deep copy of the modules in ``tree`` (ties kept), cast to ``dtype`` if given."""
    memo: dict[int, Any] = {}

    def convert(x: Any) -> Any:
        if isinstance(x, nn.Module):
            m = copy.deepcopy(x, memo)
            return m.to(dtype) if dtype is not None else m
        if isinstance(x, torch.Tensor) and dtype is not None and x.is_floating_point():
            return x.to(dtype)
        return x

    return pytree.tree_map(convert, tree, is_leaf=lambda x: isinstance(x, nn.Module))



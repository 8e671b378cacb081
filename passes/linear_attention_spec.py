"""How a detected linear-attention region maps onto ``lasp_attention``'s canonical arguments.

``lasp_attention`` (and the lightning kernel) take ``q, k: (B, H, T, dk)``, ``v: (B, H, T, dv)``
and a decay that is ``None``, ``(H,)`` per head or ``(B, H, T)`` per step. Models hold these
in their own layouts: ``(B, T, H, d)`` heads, ``k^T`` as ``(B, H, d, T)``, single-head
``(B, T, d)``, decays as log-decays ``(1, H, 1)`` or gates ``(B, T, H)``, or only inside a
``λ^{i-j}`` mask. A :class:`LaspSpec` records, for one region, how to turn the graph's
tensors into canonical ones and the canonical output back::

    q (B,T,H,d) --permute(0,2,1,3)--> (B,H,T,d)         g (B,T,H) --exp, permute--> (B,H,T)
    mask (B,H,T,T) --[..., 1, 0]--> λ (B,H) --[0]--> (H,)

Specs are plain frozen records built at compile time from static shapes; the same
:meth:`LaspSpec.canonical` runs in detection (numeric certification against the reference
kernel) and at run time (in the LASP region module), so what was certified is what runs.

The ``cumsum`` form (a prefix sum ``y_t = sum_{s<=t} u_s`` along time, e.g. the KV states
``cumsum(k^T v)`` of the recurrent form or a normaliser ``cumsum(k)``) is linear attention
with ``q = k = 1`` and ``v = u`` flattened: the state is one step of ``u``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["TensorLayout", "DecaySpec", "LaspSpec", "layout_for", "decay_spec_for", "reference_attention"]


@dataclass(frozen=True)
class TensorLayout:
    """Permutation of a 3-D ``(B, T, d)`` or 4-D tensor to canonical ``(B, H, T, d)``."""

    rank: int
    perm: tuple[int, ...]  # rank 4: (b, h, t, f); rank 3: (b, t, f), a head dim is inserted

    @property
    def time_dim(self) -> int:
        return self.perm[-2]

    @property
    def feature_dim(self) -> int:
        return self.perm[-1]

    def to_canonical(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(self.perm)
        return x.unsqueeze(1) if self.rank == 3 else x

    def from_canonical(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 3:
            x = x.squeeze(1)
        inv = [0] * self.rank
        for i, p in enumerate(self.perm):
            inv[p] = i
        return x.permute(inv)

    def describe(self) -> str:
        names = ["?"] * self.rank
        labels = ("B", "H", "T", "d") if self.rank == 4 else ("B", "T", "d")
        for lab, p in zip(labels, self.perm):
            names[p] = lab
        return "(" + ",".join(names) + ")"


def layout_for(shape: tuple[int, ...], time_dim: int) -> Optional[TensorLayout]:
    """The layout of a q/k/v/output tensor with time along ``time_dim`` (None if unsupported)."""
    rank = len(shape)
    if rank not in (3, 4) or not 0 <= time_dim < rank:
        return None
    f = rank - 1 if time_dim != rank - 1 else rank - 2
    rest = [d for d in range(rank) if d not in (time_dim, f)]
    return TensorLayout(rank, (*rest, time_dim, f))


@dataclass(frozen=True)
class DecaySpec:
    """Where the decay comes from and how it becomes ``(H,)`` or ``(B, H, T)``.

    ``kind``: ``none``; ``head`` (constant per head); ``step`` (per step, data-dependent or
    not); ``mask`` (read ``λ = M[..., 1, 0]`` off a ``λ^{i-j}`` mask). ``transform``:
    ``identity`` (the source holds λ) or ``exp`` (it holds log λ).
    """

    kind: str = "none"
    transform: str = "identity"
    squeeze_dim: Optional[int] = None  # a singleton feature dim to drop first
    expand_shape: tuple[int, ...] = ()  # q's shape without its feature dim (q's layout order)
    wf_perm: tuple[int, ...] = ()  # that shape -> (B, [H,] T)
    single_head: bool = False  # q is (B, T, d): insert H = 1
    heads: int = 1
    src_perm: tuple[int, ...] = ()  # a gate with its own time axis: its dims -> (B, [H,] T)
    canon_shape: tuple[int, ...] = ()  # (B, H, T)
    baked: bool = False  # a constant decay (no parameter/buffer behind it), stored canonically

    def values(self, src: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The canonical decay from the source tensor (``None`` for ``kind == "none"``)."""
        if self.kind == "none" or src is None:
            return None
        if self.kind == "mask":
            lam = src[..., 1, 0]  # (..., H) or (..., 1): the leading dims are the scores' (B, H)
            lam = lam.reshape(-1, lam.shape[-1])[0] if lam.dim() else lam.reshape(1)
            return self._apply(lam.expand(self.heads))
        x = src
        if self.kind == "head" and x.dim() == 1 and x.shape[0] == self.heads:
            return self._apply(x)
        if self.squeeze_dim is not None:
            x = x.squeeze(self.squeeze_dim)
        if self.src_perm:
            x = x.permute(self.src_perm)
            if self.single_head:
                x = x.unsqueeze(1)
            x = x.expand(self.canon_shape)
        else:
            x = x.expand(self.expand_shape).permute(self.wf_perm)
            if self.single_head:
                x = x.unsqueeze(1)
        if self.kind == "head":
            return self._apply(x[0, :, 0])
        return self._apply(x).contiguous()

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x) if self.transform == "exp" else x

    def describe(self) -> str:
        if self.kind == "none":
            return "none"
        what = {"head": "constant per head", "step": "per step (gates)", "mask": "read off a λ^(i-j) mask"}[self.kind]
        return what + (" = exp(source)" if self.transform == "exp" else "")


def decay_spec_for(src_shape: tuple[int, ...], q_shape: tuple[int, ...], q_layout: TensorLayout,
                   kind: str, transform: str, src_time_dim: Optional[int] = None) -> Optional[DecaySpec]:
    """A :class:`DecaySpec` for a source of ``src_shape`` against q (None if it cannot fit).

    ``src_time_dim``: the time dim of a time-carrying gate; its other dims are read as
    ``(B, H)`` in order (``(B, T, H)`` and ``(B, H, T)`` gates alike). Without it the
    source is right-aligned with q's shape minus the feature dim.
    """
    heads = 1 if q_layout.rank == 3 else q_shape[q_layout.perm[1]]
    seq = q_shape[q_layout.time_dim]
    batch = q_shape[q_layout.perm[0]]
    f = q_layout.feature_dim
    if kind == "none":
        return DecaySpec()
    if src_time_dim is not None:
        dims = [d for d in range(len(src_shape)) if d != src_time_dim]
        squeeze = None
        want = 1 if q_layout.rank == 3 else 2
        if len(dims) == want + 1 and src_shape[dims[-1]] == 1:  # a trailing singleton (B, T, H, 1)
            squeeze = dims.pop()
        if len(dims) != want or src_shape[src_time_dim] != seq:
            return None
        if squeeze is not None:
            shifted = [d - (d > squeeze) for d in dims]
            t = src_time_dim - (src_time_dim > squeeze)
        else:
            shifted, t = dims, src_time_dim
        lead = [src_shape[d] for d in dims]
        if lead[0] not in (1, batch) or (want == 2 and lead[1] not in (1, heads)):
            return None
        return DecaySpec(kind, transform, squeeze, single_head=q_layout.rank == 3, heads=heads,
                         src_perm=(*shifted, t), canon_shape=(batch, heads, seq))
    if kind == "mask":
        if len(src_shape) < 2 or src_shape[-1] != seq or src_shape[-2] != seq or seq < 2:
            return None
        lead = src_shape[:-2]
        if lead and lead[-1] not in (1, heads):
            return None
        return DecaySpec("mask", transform, heads=heads)
    if kind == "head" and len(src_shape) == 1 and src_shape[0] == heads:
        return DecaySpec("head", transform, heads=heads)
    squeeze = None
    shape = list(src_shape)
    if len(shape) == q_layout.rank:
        if shape[f] != 1:
            return None
        squeeze = f
        del shape[f]
    wf_shape = tuple(s for i, s in enumerate(q_shape) if i != f)
    if len(shape) > len(wf_shape):
        return None
    for s, w in zip(reversed(shape), reversed(wf_shape)):
        if s not in (1, w):
            return None
    keep = [i for i in range(q_layout.rank) if i != f]
    wf_perm = tuple(keep.index(p) for p in q_layout.perm[:-1])
    return DecaySpec(kind, transform, squeeze, wf_shape, wf_perm, q_layout.rank == 3, heads)


@dataclass(frozen=True)
class LaspSpec:
    """One linear-attention region's mapping to ``lasp_attention`` (see the module doc).

    ``form``: ``kernel`` | ``masked`` | ``blockwise`` | ``recurrent`` | ``cumsum``.
    Module inputs, in order: q, k, v, then the decay source if ``decay.kind != "none"``,
    then the initial state if ``has_initial_state`` (``cumsum``: the summand only).
    """

    form: str
    q: Optional[TensorLayout]
    k: Optional[TensorLayout]
    v: Optional[TensorLayout]
    out: Optional[TensorLayout]
    decay: DecaySpec
    out_dtype: torch.dtype
    heads: int
    dk: int
    dv: int
    batch: int
    has_initial_state: bool = False
    scan_dim: int = 0  # cumsum form: time dim of the summand
    scan_shape: tuple[int, ...] = ()

    @property
    def num_inputs(self) -> int:
        if self.form == "cumsum":
            return 1
        return 3 + (self.decay.kind != "none" and not self.decay.baked) + self.has_initial_state

    def state_elements(self) -> int:
        """Elements of one KV state (what one rank sends per direction): B·H·dk·dv."""
        return self.batch * self.heads * self.dk * self.dv

    def canonical(self, *args: torch.Tensor, baked_decay: Optional[torch.Tensor] = None) -> tuple:
        """``(q, k, v, decay, initial_state)`` in canonical layouts from the module inputs.

        ``baked_decay``: the canonical decay of a ``baked`` spec (held by the region module).
        """
        if self.form == "cumsum":
            (u,) = args
            t = u.shape[self.scan_dim]
            x = u.movedim(self.scan_dim, 0).reshape(1, 1, t, -1)
            if not x.is_floating_point():
                x = x.to(torch.float64)
            ones = x.new_ones(1, 1, t, 1)
            return ones, ones, x, None, None
        q, k, v = args[:3]
        rest = list(args[3:])
        if self.decay.baked:
            decay = None if baked_decay is None else baked_decay.to(q.device)
        else:
            decay = self.decay.values(rest.pop(0) if self.decay.kind != "none" else None)
        s0 = rest.pop(0) if self.has_initial_state else None
        return self.q.to_canonical(q), self.k.to_canonical(k), self.v.to_canonical(v), decay, s0

    def restore(self, o: torch.Tensor) -> torch.Tensor:
        """The canonical output back in the graph's layout and dtype."""
        if self.form == "cumsum":
            t = o.shape[2]
            rest = [s for i, s in enumerate(self.scan_shape) if i != self.scan_dim]
            o = o.reshape(t, *rest).movedim(0, self.scan_dim)
            if not self.out_dtype.is_floating_point:
                o = o.round()
            return o.to(self.out_dtype)
        return self.out.from_canonical(o).to(self.out_dtype)

    def describe(self) -> str:
        if self.form == "cumsum":
            return f"prefix sum along dim {self.scan_dim} of {tuple(self.scan_shape)} (q=k=1)"
        return (f"q{self.q.describe()} k{self.k.describe()} v{self.v.describe()} -> "
                f"o{self.out.describe()}; decay {self.decay.describe()}")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: Optional[torch.Tensor],
                        initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Canonical causal linear attention in float64 with the torch reference kernel."""
    from gradshard.kernels import lightning_attention

    f64 = torch.float64
    o, _ = lightning_attention(q.to(f64), k.to(f64), v.to(f64), None if decay is None else decay.to(f64),
                               initial_state=None if initial_state is None else initial_state.to(f64),
                               chunk_size=64, backend="torch")
    return o

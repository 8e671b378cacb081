"""Small user-style recurrent models for the adjoint tests (written the way people write them).

Every model maps a float input ``x`` (batch, time, d) to an output of the same layout, so
gradients with respect to the model input can be checked too. ``scan`` selects how the
recurrence is written; :func:`truncated_scan_reference` is the brute-force reference of
``plan="truncated_adjoint"`` (every ``h_t`` recomputed from a detached ``h_{t-W}``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs


# --------------------------------------------------------------------------- scans


def scan_loop(a: torch.Tensor, u: torch.Tensor, h0: Optional[torch.Tensor]) -> torch.Tensor:
    h = h0 if h0 is not None else torch.zeros_like(u[:, 0])
    hs = []
    for t in range(u.shape[1]):
        h = a[:, t] * h + u[:, t]
        hs.append(h)
    return torch.stack(hs, 1)


def scan_gradshard(a, u, h0):
    return gs.kernels.linear_scan(a.expand_as(u), u, h0)


def scan_cumprod(a, u, h0):
    """``P * cumsum(u / P)`` with ``P = cumprod(a)`` (h0 folded into the first input)."""
    if h0 is not None:
        u = torch.cat([u[:, :1] + a[:, :1] * h0.unsqueeze(1), u[:, 1:]], 1)
    P = torch.cumprod(a.expand_as(u), 1)
    return P * torch.cumsum(u / P, 1)


def scan_associative(a, u, h0):
    from torch._higher_order_ops.associative_scan import associative_scan

    if h0 is not None:
        u = torch.cat([u[:, :1] + a[:, :1] * h0.unsqueeze(1), u[:, 1:]], 1)

    def combine(x, y):
        return y[0] * x[0], y[0] * x[1] + y[1]

    return associative_scan(combine, (a.expand_as(u), u), dim=1, combine_mode="generic")[1]


SCANS: dict[str, Callable] = {"loop": scan_loop, "gradshard": scan_gradshard, "cumprod": scan_cumprod,
                              "associative": scan_associative}


def truncated_scan_reference(window: int) -> Callable:
    """``h_t`` recomputed from ``h_{t-W}.detach()`` (``h0`` itself, not detached, when t-W < 0)."""

    def scan(a, u, h0):
        a = a.expand_as(u)
        T = u.shape[1]
        h_true = scan_loop(a, u, h0).detach()
        outs = []
        for t in range(T):
            start = t - window + 1  # first transition counted
            if start <= 0:
                h = h0 if h0 is not None else torch.zeros_like(u[:, 0])
                start = 0
            else:
                h = h_true[:, start - 1]
            for j in range(start, t + 1):
                h = a[:, j] * h + u[:, j]
            outs.append(h)
        return torch.stack(outs, 1)

    return scan


def truncated_dense_reference(window: int) -> Callable:
    def scan(A, u, h0):
        T = u.shape[1]
        with torch.no_grad():
            h = h0 if h0 is not None else torch.zeros_like(u[:, 0])
            true = []
            for t in range(T):
                h = A[:, t] @ h + u[:, t]
                true.append(h)
        outs = []
        for t in range(T):
            start = t - window + 1
            if start <= 0:
                h = h0 if h0 is not None else torch.zeros_like(u[:, 0])
                start = 0
            else:
                h = true[start - 1]
            for j in range(start, t + 1):
                h = A[:, j] @ h + u[:, j]
            outs.append(h)
        return torch.stack(outs, 1)

    return scan


# --------------------------------------------------------------------------- layers


class DiagonalSSM(nn.Module):
    """``h_t = sigmoid(W_a x_t) * h_{t-1} + (W_b x_t) x_t^T``, ``y_t = x + C(x_t) h_t`` (several layers).

    ``conv``: a causal depthwise conv1d (width 3) before the producers (a halo of 2 steps);
    ``h0``: a learned initial state; ``heads``: one decay per head (scalar per head).
    """

    def __init__(self, d: int = 6, n: int = 4, layers: int = 2, scan: str = "loop", conv: bool = False,
                 h0: bool = False, heads: int = 0, scan_fn: Optional[Callable] = None) -> None:
        super().__init__()
        self.d, self.n, self.heads = d, n, heads
        self.scan_fn = scan_fn or SCANS[scan]
        self.A = nn.ModuleList(nn.Linear(d, heads or n) for _ in range(layers))
        self.B = nn.ModuleList(nn.Linear(d, n) for _ in range(layers))
        self.C = nn.ModuleList(nn.Linear(d, n) for _ in range(layers))
        self.conv = nn.ModuleList(nn.Conv1d(d, d, 3, groups=d, padding=2) for _ in range(layers)) if conv else None
        shape = (heads, n, d // heads) if heads else (n, d)
        self.h0 = nn.ParameterList(nn.Parameter(0.3 * torch.randn(shape)) for _ in range(layers)) if h0 else None
        with torch.no_grad():
            for lin in self.A:
                lin.bias.uniform_(1.0, 3.0)

    def layer(self, i: int, y: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(y, (self.d,))
        if self.conv is not None:
            x = F.silu(self.conv[i](x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2))
        b = self.B[i](x)
        if self.heads:
            a = torch.sigmoid(self.A[i](x))[..., None, None]
            u = b[:, :, None, :, None] * x.unflatten(-1, (self.heads, -1))[:, :, :, None, :]
        else:
            a = torch.sigmoid(self.A[i](x)).unsqueeze(-1)
            u = b.unsqueeze(-1) * x.unsqueeze(-2)
        h0 = None if self.h0 is None else self.h0[i].expand(x.shape[0], *self.h0[i].shape)
        h = self.scan_fn(a, u, h0)
        c = self.C[i](x)
        if self.heads:
            return y + torch.einsum("btn,bthnp->bthp", c, h).flatten(-2)
        return y + torch.einsum("btn,btnp->btp", c, h)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.A)):
            y = self.layer(i, y)
        return y


class LoopProducersRNN(nn.Module):
    """A loop whose body computes its own gates from ``x_t`` (not precomputed), a user's first try:

        for t: x_t = x[:, t]; a = sigmoid(Wa x_t); h = a * h + Wb x_t; y_t = (Wc x_t) * h
    """

    def __init__(self, d: int = 5, h0: bool = False, unbind: bool = False) -> None:
        super().__init__()
        self.Wa, self.Wb, self.Wc = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.h0 = nn.Parameter(0.5 * torch.randn(d)) if h0 else None
        self.unbind = unbind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.h0.expand(x.shape[0], -1) if self.h0 is not None else x.new_zeros(x.shape[0], x.shape[2])
        ys = []
        steps = x.unbind(1) if self.unbind else [x[:, t] for t in range(x.shape[1])]
        for x_t in steps:
            a = torch.sigmoid(self.Wa(x_t))
            h = a * h + self.Wb(x_t)
            ys.append(self.Wc(x_t) * h)
        return x + torch.stack(ys, 1)


class DenseLoopSSM(nn.Module):
    """``h_t = A(x_t) @ h_{t-1} + B(x_t) x_t^T`` with a dense ``n x n`` transition (einsum-written)."""

    def __init__(self, d: int = 4, n: int = 3, layers: int = 2, h0: bool = False, scan_fn: Optional[Callable] = None) -> None:
        super().__init__()
        self.d, self.n = d, n
        self.A = nn.ModuleList(nn.Linear(d, n * n) for _ in range(layers))
        self.B = nn.ModuleList(nn.Linear(d, n) for _ in range(layers))
        self.C = nn.ModuleList(nn.Linear(d, n) for _ in range(layers))
        self.h0 = nn.ParameterList(nn.Parameter(0.3 * torch.randn(n, d)) for _ in range(layers)) if h0 else None
        self.scan_fn = scan_fn
        with torch.no_grad():
            for lin in self.A:
                lin.weight.mul_(0.2)
                lin.bias.copy_((0.7 * torch.eye(n)).flatten())

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.A)):
            x = F.layer_norm(y, (self.d,))
            A = self.A[i](x).unflatten(-1, (self.n, self.n))
            u = self.B[i](x).unsqueeze(-1) * x.unsqueeze(-2)
            c = self.C[i](x)
            h0 = None if self.h0 is None else self.h0[i].expand(x.shape[0], self.n, self.d)
            if self.scan_fn is not None:
                hs = self.scan_fn(A, u, h0)
            else:
                h = h0 if h0 is not None else x.new_zeros(x.shape[0], self.n, self.d)
                out = []
                for t in range(x.shape[1]):
                    h = torch.einsum("bij,bjp->bip", A[:, t], h) + u[:, t]
                    out.append(h)
                hs = torch.stack(out, 1)
            y = y + torch.einsum("btn,btnp->btp", c, hs)
        return y


class CumsumMixer(nn.Module):
    """``y = x + W_out(cumsum(W_in x, dim=1))`` -- a running sum (``a = 1``)."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(torch.cumsum(self.inp(x), dim=1))


class TanhRNN(nn.Module):
    """A non-linear recurrence ``h_t = tanh(W h_{t-1} + x_t)``: adjoint sharding must refuse it."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.W = nn.Linear(d, d)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], x.shape[2])
        ys = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.W(h) + x[:, t])
            ys.append(h)
        return torch.stack(ys, 1)


class FinalStateSSM(nn.Module):
    """Returns ``(y, h_T)``: the final state is a second output (used by the loss)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.A, self.B = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a = torch.sigmoid(self.A(x))
        u = self.B(x)
        h = gs.kernels.linear_scan(a, u)
        return x * h, h[:, -1]


class PositionalProducer(nn.Module):
    """A producer that reads absolute positions (``arange``): shards would shift them."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.A = nn.Linear(d, d)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype)[None, :, None] / 10.0
        a = torch.sigmoid(self.A(x) + pos)
        return gs.kernels.linear_scan(a, x)


def init_like_training(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic float64 parameters."""
    torch.manual_seed(seed)
    for p in model.parameters():
        with torch.no_grad():
            p.add_(0.05 * torch.randn_like(p))
    return model.double()


def weighted_loss(out) -> torch.Tensor:
    """A fixed non-uniform weighting of every output (tuples summed)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    total = 0.0
    for o in outs:
        w = torch.linspace(-1.0, 1.0, o.numel(), dtype=o.dtype).view_as(o)
        total = total + (o * w).sum() + 0.1 * (o ** 2).sum()
    return total


class StateInputSSM(nn.Module):
    """The initial state is a forward input: ``model(x, h0) -> (y, h_T)`` (stateful/streaming use)."""

    def __init__(self, d: int = 4, loop: bool = False) -> None:
        super().__init__()
        self.A, self.B = nn.Linear(d, d), nn.Linear(d, d)
        self.loop = loop

    def forward(self, x, h0):
        a = torch.sigmoid(self.A(x))
        u = self.B(x)
        if self.loop:
            h, hs = h0, []
            for t in range(x.shape[1]):
                h = a[:, t] * h + u[:, t]
                hs.append(h)
            hseq = torch.stack(hs, 1)
            return torch.tanh(hseq), h
        hseq = gs.kernels.linear_scan(a, u, h0)
        return torch.tanh(hseq), hseq[:, -1]


class StateFirstS4D(nn.Module):
    """S4D-style layer: time-invariant decay, the state term written first.

    ``h = dA * h + B * z[:, t, :, None]`` evaluates ``dA * h`` before ``z[:, t]`` is read, so
    the unrolled graph interleaves the op on the previous state with the next step's select
    (and step 0's ``dA * h0`` reads no step at all). State (B, D, N), readout by einsum.
    """

    def __init__(self, d: int = 5, n: int = 3):
        super().__init__()
        self.log_dt = nn.Parameter(torch.rand(d) - 2)
        self.A = nn.Parameter(-0.5 - torch.rand(d, n))
        self.B = nn.Parameter(torch.randn(d, n))
        self.C = nn.Parameter(torch.randn(d, n))
        self.D = nn.Parameter(torch.randn(d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x)
        dA = torch.exp(self.log_dt.exp()[:, None] * self.A)
        h = x.new_zeros(x.shape[0], x.shape[2], self.B.shape[1])
        ys = []
        for t in range(x.shape[1]):
            h = dA * h + self.B * z[:, t, :, None]
            ys.append(torch.einsum("bdn,dn->bd", h, self.C))
        return x + torch.nn.functional.gelu(torch.stack(ys, dim=1) + self.D * z)


class SsdLayer(nn.Module):
    """A Mamba-2 style mixer written with the canonical scan: a decay per head, ``u = x B^T``,
    ``y = h C`` (``layout="pn"``); or linear attention's ``S = k^T v`` read as ``q S``
    (``layout="kv"``). ``decay``: "exp" (SSD's ``exp(-softplus(dt) A)``), "sigmoid" (per step,
    not an exp), "const" (one ``exp`` per head, no time axis). ``final_state``: also return the
    last step's state."""

    def __init__(self, d: int = 6, heads: int = 3, p: int = 4, n: int = 5, decay: str = "exp",
                 learn_h0: bool = False, layout: str = "pn", final_state: bool = False):
        super().__init__()
        self.final_state = final_state
        self.heads, self.p, self.n, self.decay, self.layout = heads, p, n, decay, layout
        self.inp = nn.Linear(d, heads * p + 2 * n + heads)
        self.A_log = nn.Parameter(torch.rand(heads))
        self.D = nn.Parameter(torch.randn(heads))
        self.out = nn.Linear(heads * p, d)
        state = (p, n) if layout == "pn" else (n, p)
        self.h0 = nn.Parameter(torch.randn(heads, *state)) if learn_h0 else None

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, T, _ = u.shape
        x, B, C, dt = self.inp(u).split([self.heads * self.p, self.n, self.n, self.heads], -1)
        x = x.reshape(b, T, self.heads, self.p)
        B = B[:, :, None, :].expand(b, T, self.heads, self.n)
        C = C[:, :, None, :].expand(b, T, self.heads, self.n)
        if self.decay == "exp":  # SSD's discretisation: the region's shards run SSD's block form
            a = torch.exp(-F.softplus(dt) * torch.exp(self.A_log))[..., None, None]
        elif self.decay == "const":
            a = torch.exp(-torch.exp(self.A_log))[None, None, :, None, None]
        else:  # not an exp: the region runs the lightning_attention op on the decay itself
            a = torch.sigmoid(dt + self.A_log)[..., None, None]
        h0 = None if self.h0 is None else self.h0.expand(b, *self.h0.shape)
        if self.layout == "pn":
            h = gs.kernels.linear_scan(a, x[..., None] * B[..., None, :], h0)
            y = torch.einsum("blhpn,blhn->blhp", h, C)
        else:
            h = gs.kernels.linear_scan(a, B[..., None] * x[..., None, :], h0)
            y = torch.einsum("bthk,bthkv->bthv", C, h)
        y = u + self.out((y + self.D[:, None] * x).reshape(b, T, -1))
        return (y, h[:, -1]) if self.final_state else y


class SsdNet(nn.Module):
    def __init__(self, layers: int = 2, **kw):
        super().__init__()
        self.layers = nn.ModuleList(SsdLayer(**kw) for _ in range(layers))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            u = layer(u)
        return u

"""The adjoint-sharding paper's K-layer residual selective SSM language model.

Per layer k (paper, Sec. 3.2 and Alg. 3), with ``x_t = RMSNorm(y_{k-1, t})`` of width P:

    A_t = A(x_t),  B_t = B(x_t),  C_t = C(x_t)        each a single-layer network (nn.Linear)
    h_t = A_t ⊙ h_{t-1} + B_t ⊗ x_t                    state h_t in R^{N x P}
    ỹ_t = C_t^T h_t                                    in R^P
    y_{k, t} = y_{k-1, t} + ỹ_t                        residual

``A``, ``B`` and ``C`` each hold P·N + N parameters, as in the paper's memory count. The
decay is a sigmoid gate, ``A_t = sigmoid(W_A x_t + b_A) = exp(-softplus(-(W_A x_t + b_A)))``,
so every entry lies in (0, 1). Three kinds of recurrence are available (``decay``):

- ``"diagonal"``: one decay per state row n, ``A_t`` in (0, 1)^N (the paper's diagonal SSM);
- ``"scalar"``:   one decay per head (Mamba-2 style); channels split into H heads of P/H,
  ``B_t`` and ``C_t`` shared by the heads, state (H, N, P/H);
- ``"dense"``:    ``h_t = A_t h_{t-1} + B_t ⊗ x_t`` with ``A_t = 0.9·I + reshape(W_A x_t + b_A)``,
  a full N x N transition from a linear layer (the paper's "unstructured SSM").

Optional Mamba-style extras: a causal depthwise conv1d (+ SiLU) on ``x`` before A, B, C,
and a learned initial state ``h_0``.

Two model classes hold identical parameters (identical ``state_dict`` keys):

- :class:`SelectiveSSMLM` computes the recurrence with a vectorized scan chosen by
  ``SSMConfig.scan``: ``"loop_free_logcumsum"``, ``"associative_scan"`` or ``"gradshard"``;
- :class:`LoopSSMLM` runs the per-timestep Python loop that reference implementations use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from gradshard.examples.models.layers import RMSNorm

ScanKind = Literal["loop_free_logcumsum", "associative_scan", "gradshard"]
DecayKind = Literal["diagonal", "scalar", "dense"]

SCANS: tuple[str, ...] = ("loop_free_logcumsum", "associative_scan", "gradshard")
DECAYS: tuple[str, ...] = ("diagonal", "scalar", "dense")


@dataclass(frozen=True)
class SSMConfig:
    """Hyper-parameters of :class:`SelectiveSSMLM` / :class:`LoopSSMLM`."""

    vocab_size: int = 256
    d_model: int = 64  # P: width of the residual stream and of each state column
    n_layers: int = 2
    d_state: int = 16  # N: state rows
    decay: DecayKind = "diagonal"
    n_heads: int = 4  # heads for decay="scalar" (d_model must be divisible by it)
    scan: ScanKind = "loop_free_logcumsum"  # used by SelectiveSSMLM only
    conv_kernel: int = 0  # 0: no conv; 4: Mamba-style causal depthwise conv1d + SiLU
    learn_initial_state: bool = False
    dense_identity: float = 0.9  # decay="dense": A_t = dense_identity * I + learned part
    tie_embeddings: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"SSMConfig.decay={self.decay!r}; expected one of {DECAYS}")
        if self.scan not in SCANS:
            raise ValueError(f"SSMConfig.scan={self.scan!r}; expected one of {SCANS}")
        if self.decay == "scalar" and self.d_model % self.n_heads:
            raise ValueError(
                f"SSMConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads} "
                "(decay='scalar' splits the channels into heads)"
            )
        if self.decay == "dense" and self.scan in ("loop_free_logcumsum", "gradshard"):
            raise ValueError(
                f"SSMConfig: scan={self.scan!r} handles element-wise decays only; a dense "
                "transition A_t h_{t-1} needs scan='associative_scan' (or use LoopSSMLM)"
            )


# ----------------------------------------------------------------------------------------
# Vectorized scans: h_t = a_t * h_{t-1} + u_t along dim 1, h_0 = h0 (or 0).
# ----------------------------------------------------------------------------------------


def _fold_initial_state(a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None) -> torch.Tensor:
    """Fold ``h0`` (B, *state) into the first input: ``u_1 <- u_1 + a_1 * h0``."""
    if h0 is None:
        return u
    first = u[:, :1] + a[:, :1] * h0.unsqueeze(1)
    return torch.cat([first, u[:, 1:]], dim=1)


def scan_logcumsum(a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """Loop-free scan in log space: ``h_t = e^{L_t} · Σ_{s<=t} e^{-L_s} u_s``, ``L = cumsum(log a)``.

    Valid for ``a > 0`` (broadcastable to ``u``). ``e^{-L}`` overflows once ``-Σ log a``
    passes ~700 (float64) or ~88 (float32): fine for short sequences and slow decays only.
    """
    u = _fold_initial_state(a, u, h0)
    log_a = torch.log(a)
    cum = torch.cumsum(log_a, dim=1)
    return torch.exp(cum) * torch.cumsum(u * torch.exp(-cum), dim=1)


def _combine_diagonal(
    left: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    a1, u1 = left
    a2, u2 = right
    return a2 * a1, a2 * u1 + u2


def _combine_dense(
    left: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    a1, u1 = left
    a2, u2 = right
    return a2 @ a1, a2 @ u1 + u2


def scan_associative(a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """Element-wise scan with ``torch._higher_order_ops.associative_scan`` (generic mode)."""
    from torch._higher_order_ops.associative_scan import associative_scan

    a = a.expand_as(u)
    u = _fold_initial_state(a, u, h0)
    _, h = associative_scan(_combine_diagonal, (a, u), dim=1, combine_mode="generic")
    return h


def scan_associative_dense(
    a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense scan ``h_t = a_t @ h_{t-1} + u_t``; ``a``: (B, T, N, N), ``u``: (B, T, N, P)."""
    from torch._higher_order_ops.associative_scan import associative_scan

    if h0 is not None:
        first = u[:, :1] + a[:, :1] @ h0.unsqueeze(1)
        u = torch.cat([first, u[:, 1:]], dim=1)
    _, h = associative_scan(_combine_dense, (a, u), dim=1, combine_mode="generic")
    return h


def scan_gradshard(a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """Element-wise scan through the public kernel ``gradshard.kernels.linear_scan``."""
    from gradshard.kernels import linear_scan

    return linear_scan(a.expand_as(u), u, h0)


_DIAGONAL_SCANS = {
    "loop_free_logcumsum": scan_logcumsum,
    "associative_scan": scan_associative,
    "gradshard": scan_gradshard,
}


# ----------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------


class SelectiveSSMBlock(nn.Module):
    """One residual layer ``y + SSM(RMSNorm(y))`` with a vectorized scan."""

    def __init__(self, config: SSMConfig) -> None:
        super().__init__()
        self.config = config
        p, n = config.d_model, config.d_state
        self.norm = RMSNorm(p, config.norm_eps)
        self.conv1d: nn.Conv1d | None = None
        if config.conv_kernel > 0:
            k = config.conv_kernel
            self.conv1d = nn.Conv1d(p, p, kernel_size=k, groups=p, padding=k - 1)
        decay_width = {"diagonal": n, "scalar": config.n_heads, "dense": n * n}[config.decay]
        self.A = nn.Linear(p, decay_width)
        self.B = nn.Linear(p, n)
        self.C = nn.Linear(p, n)
        self.h0: nn.Parameter | None = None
        if config.learn_initial_state:
            self.h0 = nn.Parameter(0.1 * torch.randn(self.state_shape))
        self._init_decay()

    @property
    def state_shape(self) -> tuple[int, ...]:
        cfg = self.config
        if cfg.decay == "scalar":
            return (cfg.n_heads, cfg.d_state, cfg.d_model // cfg.n_heads)
        return (cfg.d_state, cfg.d_model)

    def _init_decay(self) -> None:
        """Slow decays at init: sigmoid(bias) uniform in [0.6, 0.95]; small dense part."""
        with torch.no_grad():
            if self.config.decay == "dense":
                n = self.config.d_state
                self.A.weight.mul_(0.1 / math.sqrt(n))
                self.A.bias.zero_()
            else:
                gate = torch.empty_like(self.A.bias).uniform_(0.6, 0.95)
                self.A.bias.copy_(torch.log(gate) - torch.log1p(-gate))

    # -- time-local producers (shared by both layer variants) -----------------------------

    def mixer_input(self, y: torch.Tensor) -> torch.Tensor:
        """Normalized (and optionally causally convolved) input ``x`` of shape (B, T, P)."""
        x = self.norm(y)
        if self.conv1d is not None:
            x = F.silu(self.conv1d(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2))
        return x

    def transition(self, x: torch.Tensor) -> torch.Tensor:
        """``A_t``: (B,T,N,1) diagonal, (B,T,H,1,1) scalar, or (B,T,N,N) dense."""
        z = self.A(x)
        if self.config.decay == "diagonal":
            return torch.sigmoid(z).unsqueeze(-1)
        if self.config.decay == "scalar":
            return torch.sigmoid(z)[..., None, None]
        n = self.config.d_state
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        return self.config.dense_identity * eye + z.unflatten(-1, (n, n))

    def scan_input(self, x: torch.Tensor) -> torch.Tensor:
        """``u_t = B_t ⊗ x_t``: (B,T,N,P), or (B,T,H,N,P/H) for scalar decay."""
        b = self.B(x)
        if self.config.decay == "scalar":
            heads = x.unflatten(-1, (self.config.n_heads, -1))  # (B, T, H, P/H)
            return b[:, :, None, :, None] * heads[:, :, :, None, :]
        return b.unsqueeze(-1) * x.unsqueeze(-2)

    def readout(self, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``ỹ = C^T h`` for a whole sequence: c (B,T,N), h (B,T,*state) -> (B,T,P)."""
        if self.config.decay == "scalar":
            return torch.einsum("btn,bthnp->bthp", c, h).flatten(-2)
        return torch.einsum("btn,btnp->btp", c, h)

    # -- recurrence ---------------------------------------------------------------------------

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        x = self.mixer_input(y)
        a = self.transition(x)
        u = self.scan_input(x)
        c = self.C(x)
        h0 = None if self.h0 is None else self.h0.expand(x.shape[0], *self.state_shape)
        if self.config.decay == "dense":
            h = scan_associative_dense(a, u, h0)
        else:
            h = _DIAGONAL_SCANS[self.config.scan](a, u, h0)
        return y + self.readout(c, h)


class LoopSelectiveSSMBlock(SelectiveSSMBlock):
    """Same layer and parameters; the recurrence is a per-timestep Python loop."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        x = self.mixer_input(y)
        a = self.transition(x)
        u = self.scan_input(x)
        c = self.C(x)
        batch = x.shape[0]
        if self.h0 is not None:
            h = self.h0.expand(batch, *self.state_shape)
        else:
            h = x.new_zeros(batch, *self.state_shape)
        scalar = self.config.decay == "scalar"
        ys = []
        for t in range(x.shape[1]):
            if self.config.decay == "dense":
                h = a[:, t] @ h + u[:, t]
            else:
                h = a[:, t] * h + u[:, t]
            if scalar:
                ys.append(torch.einsum("bn,bhnp->bhp", c[:, t], h).flatten(-2))
            else:
                ys.append(torch.einsum("bn,bnp->bp", c[:, t], h))
        return y + torch.stack(ys, dim=1)


# ----------------------------------------------------------------------------------------
# Language models
# ----------------------------------------------------------------------------------------


class _SSMLMBase(nn.Module):
    block_cls: type[SelectiveSSMBlock] = SelectiveSSMBlock

    def __init__(self, config: SSMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(self.block_cls(config) for _ in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` (B, T) int64 -> logits (B, T, vocab)."""
        y = self.embed(input_ids)
        for layer in self.layers:
            y = layer(y)
        return self.lm_head(self.norm_f(y))


class SelectiveSSMLM(_SSMLMBase):
    """Residual selective SSM LM with a vectorized scan (``config.scan``)."""

    block_cls = SelectiveSSMBlock


class LoopSSMLM(_SSMLMBase):
    """Residual selective SSM LM whose recurrence is a per-timestep Python loop."""

    block_cls = LoopSelectiveSSMBlock

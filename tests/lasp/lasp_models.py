"""Small linear-attention models in the styles LASP must recognise (and some it must refuse).

``TinyLM(impl, decay)``: embedding -> ``layers`` x (linear attention + MLP) -> logits, with
q, k from an ``elu + 1`` feature map. ``impl``:

- ``naive``: ``((q @ k^T) * M) @ v``; M = ``tril`` (no decay) or ``λ_h^{i-j}`` built with ``pow``
  from aranges (``decay="const"``, λ = sigmoid of a parameter: the decay is learned), or
  ``exp(c_i - c_j) * tril`` with ``c = cumsum(log g)`` (``decay="gated"``);
- ``einsum``: the same in (B, T, H, d) layout with einsum;
- ``recurrent``: the per-step loop ``kv = λ kv + k_t^T v_t; o_t = q_t kv`` and ``stack``;
- ``cumsum``: ``kv = cumsum(k^T v)`` states, normalised by ``q . cumsum(k)`` (Katharopoulos);
- ``softmax``: causal softmax attention (not linear attention);
- ``noncausal``: ``(q @ k^T) @ v`` without a mask (reads the future: not causal linear attention).

Options: ``positions`` adds a learned position embedding indexed by ``arange(T)``;
``token_shift`` mixes in the previous step and ``conv_kernel=K`` adds a causal depthwise
convolution: windows that LASP serves with a halo exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, HEADS, DH = 11, 6, 2, 3


class TinyAttention(nn.Module):
    def __init__(self, impl: str, decay: str) -> None:
        super().__init__()
        self.impl, self.decay = impl, decay
        self.wq, self.wk, self.wv = (nn.Linear(D, HEADS * DH) for _ in range(3))
        self.wo = nn.Linear(HEADS * DH, D)
        self.theta = nn.Parameter(torch.linspace(1.0, 3.0, HEADS))  # λ = sigmoid(θ)
        self.gate = nn.Linear(D, HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = F.elu(self.wq(x)).add(1).view(b, t, HEADS, DH)
        k = F.elu(self.wk(x)).add(1).view(b, t, HEADS, DH)
        v = self.wv(x).view(b, t, HEADS, DH)
        log_g = F.logsigmoid(self.gate(x) + 2.0).transpose(1, 2)  # (B, H, T) log-gates
        lam = torch.sigmoid(self.theta)
        if self.impl == "einsum":
            o = self._einsum(q, k, v, lam, log_g)
        else:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            o = getattr(self, "_" + self.impl)(q, k, v, lam, log_g).transpose(1, 2)
        return self.wo(o.reshape(b, t, HEADS * DH))

    def _mask(self, t: int, lam: torch.Tensor, log_g: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        if self.decay == "none":
            return causal.to(lam.dtype)
        if self.decay == "const":
            i = torch.arange(t)
            expo = (i[:, None] - i[None, :]).clamp(min=0).to(lam.dtype)
            return lam[:, None, None] ** expo * causal
        c = torch.cumsum(log_g, -1)
        return torch.exp(c[..., :, None] - c[..., None, :]) * causal

    def _naive(self, q, k, v, lam, log_g):
        return ((q @ k.transpose(-1, -2)) * self._mask(q.shape[2], lam, log_g)) @ v

    def _einsum(self, q, k, v, lam, log_g):  # (B, T, H, d) layout
        scores = torch.einsum("bthd,bshd->bhts", q, k) * self._mask(q.shape[1], lam, log_g)
        return torch.einsum("bhts,bshd->bthd", scores, v)

    def _recurrent(self, q, k, v, lam, log_g):
        b, h, t, d = q.shape
        kv = q.new_zeros(b, h, d, v.shape[-1])
        outs = []
        for i in range(t):
            if self.decay == "const":
                kv = lam[None, :, None, None] * kv
            elif self.decay == "gated":
                kv = torch.exp(log_g[:, :, i, None, None]) * kv
            kv = kv + k[:, :, i, :, None] @ v[:, :, i, None, :]
            outs.append((q[:, :, i, None, :] @ kv).squeeze(-2))
        return torch.stack(outs, dim=2)

    def _cumsum(self, q, k, v, lam, log_g):
        kv = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)  # (B, H, T, dk, dv)
        num = (q.unsqueeze(-2) @ kv).squeeze(-2)
        den = (q * torch.cumsum(k, dim=2)).sum(-1, keepdim=True)
        return num / den

    def _noncausal(self, q, k, v, lam, log_g):
        return (q @ k.transpose(-1, -2)) @ v

    def _softmax(self, q, k, v, lam, log_g):
        t = q.shape[2]
        mask = torch.full((t, t), float("-inf")).triu(1)
        return torch.softmax(q @ k.transpose(-1, -2) / DH**0.5 + mask, dim=-1) @ v


class TinyLM(nn.Module):
    def __init__(self, impl: str = "naive", decay: str = "none", layers: int = 2, positions: bool = False,
                 token_shift: bool = False, conv_kernel: int = 0, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(max_len, D) if positions else None
        self.attn = nn.ModuleList(TinyAttention(impl, decay) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(D, 7), nn.GELU(), nn.Linear(7, D)) for _ in range(layers))
        self.token_shift = token_shift
        self.conv = nn.Conv1d(D, D, conv_kernel, padding=conv_kernel - 1, groups=D) if conv_kernel else None
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1]))
        if self.token_shift:
            x = x + 0.5 * F.pad(x, (0, 0, 1, 0))[:, :-1]
        if self.conv is not None:  # short causal convolution (Mamba / GLA style)
            x = x + self.conv(x.transpose(1, 2))[..., : ids.shape[1]].transpose(1, 2)
        for attn, mlp in zip(self.attn, self.mlp):
            x = x + attn(x)
            x = x + mlp(x)
        return self.head(x)


def tiny_lm(impl: str = "naive", decay: str = "none", seq_len: int = 13, batch: int = 3, seed: int = 0,
            **kw) -> tuple[TinyLM, torch.Tensor]:
    """A float64 TinyLM and a batch of token ids (B, T)."""
    torch.manual_seed(seed)
    model = TinyLM(impl, decay, **kw).double()
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids

"""Small plain-PyTorch models used by the core tests (written as users write them)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Explicit softmax attention with a configurable mask style."""

    def __init__(self, d: int = 8, heads: int = 2, mask: str = "add"):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads, self.mask = heads, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (D // self.heads) ** 0.5
        if self.mask == "add":
            scores = scores + torch.full((T, T), float("-inf"), device=x.device).triu(1)
        elif self.mask == "masked_fill":
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        elif self.mask == "where":
            keep = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            scores = torch.where(keep, scores, torch.tensor(float("-inf"), dtype=x.dtype))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class SDPABlock(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2, causal: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + o.transpose(1, 2).reshape(B, T, D)
        return x + self.mlp(x)


class CausalConv(nn.Module):
    """Depthwise causal conv1d on (B, T, D), padded left the Mamba way."""

    def __init__(self, d: int = 8, k: int = 4):
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class CumsumMixer(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(self.lin(x), dim=1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)


class LoopRNN(nn.Module):
    """A per-timestep Python loop over a diagonal linear state."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.u = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(self.a(x[:, t])) * h + self.u(x[:, t])
            ys.append(h)
        return torch.stack(ys, dim=1)


class TimeFirst(nn.Module):
    """Takes (T, B, D): the time axis is dim 0, moved to dim 2 then back."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).permute(1, 2, 0)  # (B, D, T)
        y = torch.cumsum(y, dim=2)
        return torch.einsum("bdt->tbd", y)


class NoTime(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DataDependent(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y.cumsum(1)
        return y

"""Small causal models written the way users write them (not gradshard's examples).

Each stresses a different part of chunked execution: learned absolute positions sliced from
a parameter, boolean ``tril`` masks with ``masked_fill``, LayerNorm, a causal depthwise
convolution (a bounded window into the past), a running mean via ``cumsum``,
``gradshard.kernels.linear_scan`` with a learned initial state, RoPE from a cached buffer
sliced to ``T``, a token shift via ``F.pad``, MHA without GQA, GQA by ``repeat_interleave``.
The ``Bad*`` models read the future or drop time in ways chunking cannot split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import gradshard as gs


class GPTBlock(nn.Module):
    """Pre-LN block: explicit attention with a boolean tril mask, GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(t, t, device=x.device))
        att = att.masked_fill(mask == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """nanoGPT-style: token + learned absolute position embeddings (parameter sliced to T)."""

    def __init__(self, vocab: int = 50, d: int = 24, heads: int = 3, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, d))
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class ConvMixer(nn.Module):
    """Mamba-style causal depthwise conv (padding K-1, keep the first T outputs) + SiLU."""

    def __init__(self, d: int, k: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return x + self.lin(F.silu(self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)))


class RunningMean(nn.Module):
    """Prefix mean ``cumsum(x) / (t + 1)``: a recurrence written with cumsum and arange."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        steps = torch.arange(1, t + 1, device=x.device, dtype=x.dtype)
        return x + self.lin(torch.cumsum(x, dim=1) / steps[None, :, None])


class MHA(nn.Module):
    """Plain multi-head SDPA (no GQA, no RoPE), given causal via a float mask."""

    def __init__(self, d: int, heads: int, float_mask: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.heads = heads
        self.float_mask = float_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = (m(x).view(b, t, h, d // h).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.float_mask:
            mask = torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, d))


class ConvAttnLM(nn.Module):
    """Conv mixer -> running mean -> MHA (float mask) -> conv -> MHA (is_causal)."""

    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([ConvMixer(d), RunningMean(d), MHA(d, heads, float_mask=True),
                                     ConvMixer(d, k=3), MHA(d, heads)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CachedRoPEAttention(nn.Module):
    """Older-HF style: cos/sin cached in buffers of max length, sliced [:T]; GQA by repeat_interleave."""

    def __init__(self, d: int, heads: int, kv_heads: int, max_len: int = 64) -> None:
        super().__init__()
        self.hd = d // heads
        self.heads, self.kv_heads = heads, kv_heads
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos_cached[:t].to(x.dtype), self.sin_cached[:t].to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, d))


class ScanLayer(nn.Module):
    """Diagonal SSM through gradshard.kernels.linear_scan with a learned initial state."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.u, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.h0 = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(self.a(x))
        h = gs.kernels.linear_scan(a, self.u(x), self.h0.expand(x.shape[0], -1))
        return x + self.c(x) * h


class TokenShift(nn.Module):
    """RWKV-style token shift: mix each step with the previous one (F.pad then drop the last)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.rand(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
        return x + self.lin(self.mix * x + (1 - self.mix) * prev)


class ScanRoPELM(nn.Module):
    """linear_scan -> cached-RoPE GQA attention -> token shift -> attention; takes embeddings."""

    def __init__(self, d: int = 16, vocab: int = 30) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ScanLayer(d), CachedRoPEAttention(d, 4, 2), TokenShift(d),
                                     CachedRoPEAttention(d, 4, 1)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# --------------------------------------------------------------------------- unsupported


class BadBidirectional(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(x).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v).squeeze(1)


class BadFutureShift(nn.Module):
    """Mixes step t with step t+1 after an attention layer."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=True).squeeze(1)
        nxt = F.pad(y, (0, 0, 0, 1))[:, 1:]
        return self.lin(y + nxt)


class BadGlobalNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=True).squeeze(1)
        return y - y.mean(dim=1, keepdim=True)


class BadLastToken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=True).squeeze(1)
        return y[:, -1]


class BadReverseScan(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])


class BadDropout(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=True).squeeze(1)
        return self.drop(y)

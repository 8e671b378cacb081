"""A TransNormerLLM-style linear-attention language model (the model LASP trains).

Token mixer per layer (TransNormerLLM's NormLinearAttention, LASP Eq. 2):

    q, k, v = silu(W_q x), silu(W_k x), W_v x                  per head h
    kv_t = λ_t kv_{t-1} + k_t^T v_t,   o_t = q_t kv_t              i.e. O = (Q K^T ⊙ M) V
    out = W_o( silu(W_u x) ⊙ Norm(o) )

The decay is either a constant per head, ``λ_h = exp(-s_h · (1 - l/(L-1) + 1e-5))`` with
ALiBi slopes ``s_h`` and layer index ``l`` (TransNormerLLM), or a data-dependent per-step
gate ``λ_{t,h} = sigmoid(W_g x_t + b_g)^(1/τ)`` (GLA-style, ``decay="gated"``).

Three interchangeable implementations (``LinearAttentionConfig.attn_impl``):

- ``"blockwise"``: lightning attention written in plain torch — intra-block masked product
  with the decay mask, inter-block KV state carried by a Python loop over blocks;
- ``"naive"``: the quadratic form ``(Q K^T ⊙ M) V``;
- ``"gradshard"``: the public kernel ``gradshard.kernels.lightning_attention``.

Channel mixer: TransNormerLLM's SGLU. Pre-norms: SRMSNorm (or RMSNorm, ``norm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from gradshard.examples.models.layers import RMSNorm, SimpleGLU, SimpleRMSNorm

AttnImpl = Literal["blockwise", "naive", "gradshard"]
DecayMode = Literal["constant", "gated"]
NormKind = Literal["srms", "rms", "none"]


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Hyper-parameters of :class:`LinearAttentionLM`."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    glu_hidden: int = 128
    decay: DecayMode = "constant"
    gate_temperature: float = 16.0  # decay="gated": λ = sigmoid(.)^(1/τ), as GLA
    attn_impl: AttnImpl = "blockwise"
    block_size: int = 16
    norm: NormKind = "srms"  # pre-norms of both sub-layers
    output_norm: NormKind = "srms"  # normalization of the attention output o
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"LinearAttentionConfig: d_model={self.d_model} not divisible by n_heads={self.n_heads}"
            )
        if self.decay not in ("constant", "gated"):
            raise ValueError(f"LinearAttentionConfig.decay={self.decay!r}; expected 'constant' or 'gated'")
        if self.attn_impl not in ("blockwise", "naive", "gradshard"):
            raise ValueError(
                f"LinearAttentionConfig.attn_impl={self.attn_impl!r}; "
                "expected 'blockwise', 'naive' or 'gradshard'"
            )
        for name in ("norm", "output_norm"):
            value = getattr(self, name)
            if value not in ("srms", "rms", "none"):
                raise ValueError(f"LinearAttentionConfig.{name}={value!r}; expected 'srms', 'rms' or 'none'")
        if self.block_size < 1:
            raise ValueError(f"LinearAttentionConfig.block_size={self.block_size} must be >= 1")


# ----------------------------------------------------------------------------------------
# Linear attention kernels in plain torch. q, k: (B, H, T, dk); v: (B, H, T, dv);
# log_decay: log λ, broadcastable to (B, H, T), <= 0.
# ----------------------------------------------------------------------------------------


def _decay_mask(cum_log_decay: torch.Tensor) -> torch.Tensor:
    """``M[t, s] = exp(L_t - L_s)`` for ``s <= t``, 0 above the diagonal."""
    n = cum_log_decay.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=cum_log_decay.device).tril()
    diff = cum_log_decay[..., :, None] - cum_log_decay[..., None, :]
    return torch.exp(diff.masked_fill(~causal, float("-inf")))


def linear_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor
) -> torch.Tensor:
    """Quadratic form ``O = (Q K^T ⊙ M) V`` with ``M[t, s] = Π_{s<j<=t} λ_j``."""
    log_decay = log_decay.expand(q.shape[:3])
    mask = _decay_mask(torch.cumsum(log_decay, dim=-1))
    return ((q @ k.transpose(-1, -2)) * mask) @ v


def linear_attention_blockwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    block_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning attention: intra-block masked products + an inter-block KV state.

    Returns ``(o, kv)`` with ``kv`` the state after the last step, (B, H, dk, dv).
    """
    bsz, n_heads, seq_len, dk = q.shape
    kv = initial_state
    if kv is None:
        kv = q.new_zeros(bsz, n_heads, dk, v.shape[-1])
    log_decay = log_decay.expand(bsz, n_heads, seq_len)  # a per-head constant repeats over t
    outputs = []
    for start in range(0, seq_len, block_size):
        end = min(start + block_size, seq_len)
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        cum = torch.cumsum(log_decay[:, :, start:end], dim=-1)  # decay from block start to t
        o_intra = ((qb @ kb.transpose(-1, -2)) * _decay_mask(cum)) @ vb
        o_inter = (qb * torch.exp(cum).unsqueeze(-1)) @ kv
        outputs.append(o_intra + o_inter)
        total = cum[..., -1:]  # log decay across the whole block
        k_decayed = kb * torch.exp(total - cum).unsqueeze(-1)
        kv = torch.exp(total).unsqueeze(-1) * kv + k_decayed.transpose(-1, -2) @ vb
    return torch.cat(outputs, dim=2), kv


def tnl_decay_rates(n_heads: int, layer_idx: int, n_layers: int) -> torch.Tensor:
    """TransNormerLLM's per-head constant decay ``λ_h`` in (0, 1] for one layer."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    def slopes(n: int) -> list[float]:
        if math.log2(n).is_integer():
            return power_of_two_slopes(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_two_slopes(closest) + slopes(2 * closest)[0::2][: n - closest]

    depth = 1.0 - layer_idx / (n_layers - 1) if n_layers > 1 else 1.0
    rate = torch.tensor(slopes(n_heads), dtype=torch.float32) * (depth + 1e-5)
    return torch.exp(-rate)


def _make_norm(kind: NormKind, dim: int, eps: float) -> nn.Module:
    if kind == "srms":
        return SimpleRMSNorm(dim, eps)
    if kind == "rms":
        return RMSNorm(dim, eps)
    return nn.Identity()


class NormLinearAttention(nn.Module):
    """TransNormerLLM's token mixer (see the module docstring)."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.u_proj = nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.norm = _make_norm(config.output_norm, d, config.norm_eps)
        self.gate_proj: nn.Linear | None = None
        if config.decay == "gated":
            self.gate_proj = nn.Linear(d, config.n_heads)
        decay = tnl_decay_rates(config.n_heads, layer_idx, config.n_layers)
        self.register_buffer("decay_rate", decay, persistent=False)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """log λ, (B, H, T) when gated, else (1, H, 1)."""
        if self.gate_proj is not None:
            gate = F.logsigmoid(self.gate_proj(x)) / self.config.gate_temperature
            return gate.transpose(1, 2)
        return torch.log(self.decay_rate)[None, :, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        bsz, seq_len, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(bsz, seq_len, cfg.n_heads, d // cfg.n_heads).transpose(1, 2)

        q = heads(F.silu(self.q_proj(x)))
        k = heads(F.silu(self.k_proj(x)))
        v = heads(self.v_proj(x))
        log_decay = self.log_decay(x)
        if cfg.attn_impl == "naive":
            o = linear_attention_naive(q, k, v, log_decay)
        elif cfg.attn_impl == "blockwise":
            o, _ = linear_attention_blockwise(q, k, v, log_decay, cfg.block_size)
        else:
            from gradshard.kernels import lightning_attention

            decay = self.decay_rate if self.gate_proj is None else torch.exp(log_decay)
            o, _ = lightning_attention(q, k, v, decay, chunk_size=cfg.block_size)
        o = o.transpose(1, 2).reshape(bsz, seq_len, d)
        return self.out_proj(F.silu(self.u_proj(x)) * self.norm(o))


class LinearAttentionBlock(nn.Module):
    """``x + mixer(norm(x))`` then ``+ glu(norm(.))``."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int) -> None:
        super().__init__()
        self.token_norm = _make_norm(config.norm, config.d_model, config.norm_eps)
        self.token_mixer = NormLinearAttention(config, layer_idx)
        self.channel_norm = _make_norm(config.norm, config.d_model, config.norm_eps)
        self.channel_mixer = SimpleGLU(config.d_model, config.glu_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mixer(self.token_norm(x))
        return x + self.channel_mixer(self.channel_norm(x))


class LinearAttentionLM(nn.Module):
    """TransNormerLLM-style LM: ``input_ids`` (B, T) -> logits (B, T, vocab)."""

    def __init__(self, config: LinearAttentionConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LinearAttentionBlock(config, i) for i in range(config.n_layers))
        self.final_norm = _make_norm(config.norm, config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))

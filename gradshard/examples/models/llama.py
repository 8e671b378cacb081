"""A small Llama-style causal transformer, written the way Hugging Face's Llama is.

RMSNorm pre-norm blocks, rotary position embeddings computed from ``position_ids``,
grouped-query attention (``repeat_kv`` with expand + reshape, or ``repeat_interleave``),
a SwiGLU MLP, and either ``F.scaled_dot_product_attention(is_causal=True)`` or the explicit
``softmax(q @ k^T * scale + causal_mask) @ v`` (``LlamaConfig.attention``).

``LlamaConfig.checkpoint_layers=True`` recomputes every decoder layer in the backward
(``torch.utils.checkpoint``, non-reentrant), as Hugging Face's gradient checkpointing does:
only each layer's input is saved in the forward; gradients are unchanged.

:class:`LlamaLM` returns logits; :class:`LlamaForCausalLM` (same parameters) returns a
:class:`CausalLMOutput` and computes the shifted next-token loss when ``labels`` are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradshard.examples.models.layers import RMSNorm, SwiGLU

AttentionKind = Literal["sdpa", "explicit"]
KVRepeatKind = Literal["expand", "repeat_interleave"]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of :class:`LlamaLM`."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 172  # ~ 8/3 * d_model, as Llama
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention: AttentionKind = "sdpa"
    kv_repeat: KVRepeatKind = "expand"
    tie_embeddings: bool = False
    # Activation recomputation: keep only each decoder layer's input, recompute the layer in
    # the backward (torch.utils.checkpoint, non-reentrant). Active while grad is enabled.
    checkpoint_layers: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"LlamaConfig: d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("LlamaConfig: head_dim must be even for rotary embeddings")
        if self.attention not in ("sdpa", "explicit"):
            raise ValueError(f"LlamaConfig.attention={self.attention!r}; expected 'sdpa' or 'explicit'")
        if self.kv_repeat not in ("expand", "repeat_interleave"):
            raise ValueError(
                f"LlamaConfig.kv_repeat={self.kv_repeat!r}; expected 'expand' or 'repeat_interleave'"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class CausalLMOutput:
    """Hugging Face-style model output."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """``(cos, sin)`` of shape (B, T, head_dim) for the given ``position_ids``."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(self.inv_freq.dtype)[:, :, None] * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(1)  # (B, 1, T, head_dim): broadcast over heads
    sin = sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, KV, T, D) -> (B, KV * n_rep, T, D), as ``torch.repeat_interleave(x, n_rep, dim=1)``."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.n_heads * hd, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        bsz, seq_len, _ = x.shape
        q = self.q_proj(x).view(bsz, seq_len, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq_len, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

        n_rep = cfg.n_heads // cfg.n_kv_heads
        if cfg.kv_repeat == "expand":
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        else:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)

        if cfg.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scale = cfg.head_dim**-0.5
            causal_mask = torch.full((seq_len, seq_len), float("-inf"), dtype=q.dtype, device=q.device)
            causal_mask = torch.triu(causal_mask, diagonal=1)
            scores = q @ k.transpose(-1, -2) * scale + causal_mask
            out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(bsz, seq_len, cfg.n_heads * cfg.head_dim)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``+ mlp(norm(.))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """``arange(T)`` broadcast to (B, T)."""
    bsz, seq_len = input_ids.shape
    return torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(bsz, seq_len)


class LlamaLM(nn.Module):
    """Llama-style causal LM: ``input_ids`` (B, T) -> logits (B, T, vocab)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = default_position_ids(input_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids)
        recompute = self.config.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if recompute else layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class LlamaForCausalLM(LlamaLM):
    """Same model, Hugging Face calling convention: returns :class:`CausalLMOutput`.

    ``labels`` are aligned with ``input_ids`` (HF convention); the loss shifts them by one,
    and positions labelled ``-100`` are ignored.
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        logits = super().forward(input_ids, position_ids)
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss)

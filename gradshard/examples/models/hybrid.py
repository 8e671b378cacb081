"""A hybrid stack: selective-SSM layers interleaved with attention layers (Jamba-like).

Layer kinds (``HybridConfig.layers``): ``"ssm"`` (:class:`SelectiveSSMBlock`, or its loop
form with ``ssm_loop=True``), ``"attention"`` (:class:`LlamaDecoderLayer` with RoPE) and
``"linear_attention"`` (:class:`LinearAttentionBlock`). The sub-configs supply each kind's
hyper-parameters; their ``vocab_size``, ``d_model`` and ``n_layers`` are overridden by the
hybrid's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from gradshard.examples.models.layers import RMSNorm
from gradshard.examples.models.linear_attention import LinearAttentionBlock, LinearAttentionConfig
from gradshard.examples.models.llama import LlamaConfig, LlamaDecoderLayer, RotaryEmbedding, default_position_ids
from gradshard.examples.models.ssm import LoopSelectiveSSMBlock, SelectiveSSMBlock, SSMConfig

LAYER_KINDS: tuple[str, ...] = ("ssm", "attention", "linear_attention")


@dataclass(frozen=True)
class HybridConfig:
    """Hyper-parameters of :class:`HybridLM`."""

    vocab_size: int = 256
    d_model: int = 64
    layers: tuple[str, ...] = ("ssm", "attention", "ssm", "attention")
    ssm: SSMConfig = field(default_factory=SSMConfig)
    attention: LlamaConfig = field(default_factory=LlamaConfig)
    linear_attention: LinearAttentionConfig = field(default_factory=LinearAttentionConfig)
    ssm_loop: bool = False  # "ssm" layers use the per-timestep Python loop
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        unknown = [kind for kind in self.layers if kind not in LAYER_KINDS]
        if unknown:
            raise ValueError(f"HybridConfig.layers has unknown kinds {unknown}; expected {LAYER_KINDS}")

    def sub_config(self, kind: str) -> SSMConfig | LlamaConfig | LinearAttentionConfig:
        """The sub-config for ``kind`` with the hybrid's vocabulary, width and depth."""
        sub = {"ssm": self.ssm, "attention": self.attention, "linear_attention": self.linear_attention}[kind]
        return dataclasses.replace(
            sub, vocab_size=self.vocab_size, d_model=self.d_model, n_layers=len(self.layers)
        )


class HybridLM(nn.Module):
    """``input_ids`` (B, T) [+ ``position_ids``] -> logits (B, T, vocab)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        blocks: list[nn.Module] = []
        for idx, kind in enumerate(config.layers):
            sub = config.sub_config(kind)
            if kind == "ssm":
                blocks.append((LoopSelectiveSSMBlock if config.ssm_loop else SelectiveSSMBlock)(sub))
            elif kind == "attention":
                blocks.append(LlamaDecoderLayer(sub))
            else:
                blocks.append(LinearAttentionBlock(sub, idx))
        self.layers = nn.ModuleList(blocks)
        attn = config.sub_config("attention")
        self.rotary_emb = RotaryEmbedding(attn.head_dim, attn.rope_theta)
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = default_position_ids(input_ids)
        x = self.embed(input_ids)
        cos, sin = self.rotary_emb(position_ids)
        for layer in self.layers:
            if isinstance(layer, LlamaDecoderLayer):
                x = layer(x, cos, sin)
            else:
                x = layer(x)
        return self.lm_head(self.norm_f(x))

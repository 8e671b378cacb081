"""Model factories that ship with gradshard: ``gradshard show ssm_loop --plan adjoint``.

The CLI takes a bare factory name for the functions here (see :data:`FACTORIES`); the same
functions are ``gradshard.examples.factories:ssm_loop`` in ``MODULE:FACTORY`` form.

Each factory needs no arguments and returns ``(model_or_fn, example_inputs)`` with
``example_inputs`` a tuple, so that ``model_or_fn(*example_inputs)`` runs. Defaults are tiny
(d_model 32, 2 layers, T=32, batch 2, float32) and the inputs are real text bytes from the
standard library (:mod:`gradshard.examples.data`). Every factory accepts keyword overrides:
``seq_len``, ``batch``, ``dtype``, ``seed`` (parameter init and batch sampling) and any
field of the model's config (e.g. ``d_model=64``, ``n_layers=4``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradshard.examples.data import example_batch
from gradshard.examples.models.hybrid import HybridConfig, HybridLM
from gradshard.examples.models.linear_attention import LinearAttentionConfig, LinearAttentionLM
from gradshard.examples.models.llama import LlamaConfig, LlamaForCausalLM, LlamaLM
from gradshard.examples.models.ssm import LoopSSMLM, SelectiveSSMLM, SSMConfig

Factory = tuple[Any, tuple[Any, ...]]

_TINY_SSM = {"d_model": 32, "n_layers": 2, "d_state": 8, "n_heads": 4}
_TINY_LLAMA = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 86}
_TINY_LINEAR = {"d_model": 32, "n_layers": 2, "n_heads": 4, "glu_hidden": 64, "block_size": 8}


def _build(
    model_cls: type[nn.Module],
    config_cls: type,
    tiny: dict[str, Any],
    fixed: dict[str, Any],
    overrides: dict[str, Any],
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Model with ``tiny`` defaults, ``fixed`` choices and user ``overrides``; plus one batch."""
    seq_len = overrides.pop("seq_len", 32)
    batch = overrides.pop("batch", 2)
    dtype = overrides.pop("dtype", torch.float32)
    seed = overrides.pop("seed", 0)
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"unknown override(s) {unknown} for {config_cls.__name__}; accepted: seq_len, batch, "
            f"dtype, seed and the config fields {sorted(names)}"
        )
    config = config_cls(**{**tiny, **fixed, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    input_ids, labels = example_batch(batch, seq_len, seed=seed)
    return model, input_ids, labels


def ssm(**overrides: Any) -> Factory:
    """Selective SSM LM, vectorized log-space cumsum scan."""
    model, ids, _ = _build(SelectiveSSMLM, SSMConfig, _TINY_SSM, {}, overrides)
    return model, (ids,)


def ssm_loop(**overrides: Any) -> Factory:
    """Selective SSM LM with the per-timestep Python loop (reference-implementation style)."""
    model, ids, _ = _build(LoopSSMLM, SSMConfig, _TINY_SSM, {}, overrides)
    return model, (ids,)


def ssm_associative_scan(**overrides: Any) -> Factory:
    """Selective SSM LM, ``torch._higher_order_ops.associative_scan``."""
    model, ids, _ = _build(SelectiveSSMLM, SSMConfig, _TINY_SSM, {"scan": "associative_scan"}, overrides)
    return model, (ids,)


def ssm_gradshard_scan(**overrides: Any) -> Factory:
    """Selective SSM LM calling ``gradshard.kernels.linear_scan``."""
    model, ids, _ = _build(SelectiveSSMLM, SSMConfig, _TINY_SSM, {"scan": "gradshard"}, overrides)
    return model, (ids,)


def ssm_scalar_decay(**overrides: Any) -> Factory:
    """Selective SSM LM with one decay per head (Mamba-2 style), causal conv1d, learned h0."""
    fixed = {"decay": "scalar", "conv_kernel": 4, "learn_initial_state": True}
    model, ids, _ = _build(SelectiveSSMLM, SSMConfig, _TINY_SSM, fixed, overrides)
    return model, (ids,)


def ssm_dense(**overrides: Any) -> Factory:
    """SSM LM with a dense input-dependent transition ``A_t h_{t-1}``, loop form."""
    fixed = {"decay": "dense", "d_state": 4, "scan": "associative_scan"}
    model, ids, _ = _build(LoopSSMLM, SSMConfig, _TINY_SSM, fixed, overrides)
    return model, (ids,)


def llama(**overrides: Any) -> Factory:
    """Llama-style LM with ``F.scaled_dot_product_attention``."""
    model, ids, _ = _build(LlamaLM, LlamaConfig, _TINY_LLAMA, {}, overrides)
    return model, (ids,)


def llama_explicit_softmax(**overrides: Any) -> Factory:
    """Llama-style LM with ``softmax(q @ k^T * scale + mask) @ v``."""
    model, ids, _ = _build(LlamaLM, LlamaConfig, _TINY_LLAMA, {"attention": "explicit"}, overrides)
    return model, (ids,)


def llama_hf(**overrides: Any) -> Factory:
    """HF-style Llama returning ``CausalLMOutput(logits, loss)``; inputs (ids, position_ids, labels)."""
    model, ids, _ = _build(LlamaForCausalLM, LlamaConfig, _TINY_LLAMA, {}, overrides)
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    return model, (ids, position_ids, ids)


def llama_cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``batch = (input_ids, labels)``."""
    input_ids, labels = batch
    logits = model(input_ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def llama_loss(**overrides: Any) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """A loss function ``fn(model, batch) -> loss`` with example ``(model, batch)``."""
    model, ids, labels = _build(LlamaLM, LlamaConfig, _TINY_LLAMA, {}, overrides)
    return llama_cross_entropy, (model, (ids, labels))


def linear_attention(**overrides: Any) -> Factory:
    """TransNormerLLM-style LM, block-wise lightning attention in plain torch."""
    model, ids, _ = _build(LinearAttentionLM, LinearAttentionConfig, _TINY_LINEAR, {}, overrides)
    return model, (ids,)


def linear_attention_gated(**overrides: Any) -> Factory:
    """Linear attention with GLA-style data-dependent per-step decay gates."""
    fixed = {"decay": "gated"}
    model, ids, _ = _build(LinearAttentionLM, LinearAttentionConfig, _TINY_LINEAR, fixed, overrides)
    return model, (ids,)


def linear_attention_naive(**overrides: Any) -> Factory:
    """Linear attention as the quadratic ``(Q K^T ⊙ M) V``."""
    fixed = {"attn_impl": "naive"}
    model, ids, _ = _build(LinearAttentionLM, LinearAttentionConfig, _TINY_LINEAR, fixed, overrides)
    return model, (ids,)


def linear_attention_gradshard(**overrides: Any) -> Factory:
    """Linear attention calling ``gradshard.kernels.lightning_attention``."""
    fixed = {"attn_impl": "gradshard"}
    model, ids, _ = _build(LinearAttentionLM, LinearAttentionConfig, _TINY_LINEAR, fixed, overrides)
    return model, (ids,)


def hybrid(**overrides: Any) -> Factory:
    """SSM / attention / SSM / attention hybrid with tiny sub-layers."""
    fixed = {
        "ssm": SSMConfig(**_TINY_SSM),
        "attention": LlamaConfig(**_TINY_LLAMA),
        "linear_attention": LinearAttentionConfig(**_TINY_LINEAR),
    }
    tiny = {"d_model": 32}
    model, ids, _ = _build(HybridLM, HybridConfig, tiny, fixed, overrides)
    return model, (ids,)


FACTORIES: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        ssm,
        ssm_loop,
        ssm_associative_scan,
        ssm_gradshard_scan,
        ssm_scalar_decay,
        ssm_dense,
        llama,
        llama_explicit_softmax,
        llama_hf,
        llama_loss,
        linear_attention,
        linear_attention_gated,
        linear_attention_naive,
        linear_attention_gradshard,
        hybrid,
    )
}

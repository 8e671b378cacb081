"""A zoo of tiny random-weight Hugging Face causal LMs (float64, train mode, no dropout).

Every family is built with ``AutoModelForCausalLM.from_config`` at toy sizes (hidden <= 64,
intermediate <= 128, vocab 96, 4 query / 2 KV heads of dim 8 where the family has them, MoE
with 4 experts of which 2 are active) so that an eager forward+backward at T=37, batch 2,
takes a fraction of a second on one CPU core. Hybrids hold both kinds of layer in their
2 layers. Models stay in train mode; every dropout probability in the config is 0.

    >>> model, config = build("jamba")                       # doctest: +SKIP
    >>> batch = inputs(config, batch=2, T=37)                # doctest: +SKIP
    >>> model(**batch).loss.backward()                       # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "FAMILIES", "ATTN_IMPLS", "RECURRENT", "NO_ATTENTION", "UNAVAILABLE",
    "build", "inputs", "config_for", "causal_lm_loss", "float32_sites", "Float64Everywhere",
]

VOCAB = 96
HIDDEN = 32
MAX_POS = 256

#: Options every family gets (token ids inside the toy vocabulary).
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "use_cache": False,
}

#: Llama-style decoder sizes (4 query heads, 2 KV heads, head_dim 8).
_DECODER: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": MAX_POS,
}

#: Mamba2-style mixer sizes: 4 heads x 16 = expand(2) * hidden(32); chunk 16 < T.
_SSD: dict[str, Any] = {
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16,
}

#: model_type -> config keyword arguments (before ``_COMMON`` and the caller's overrides).
_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_DECODER),
    "qwen2": dict(_DECODER),
    "qwen3": dict(_DECODER),
    # sliding window shorter than the test length (T=37), so the window mask matters
    "mistral": {**_DECODER, "sliding_window": 16},
    "gemma2": {
        **_DECODER, "sliding_window": 16, "query_pre_attn_scalar": 8,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "gemma3_text": {
        **_DECODER, "sliding_window": 16, "query_pre_attn_scalar": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {k: v for k, v in _DECODER.items() if k != "head_dim"},
    "gpt2": {"n_embd": HIDDEN, "n_head": 4, "n_inner": 64, "n_positions": MAX_POS},
    "gpt_neox": {
        "hidden_size": HIDDEN, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": MAX_POS,
    },
    # ALiBi position bias, fused QKV, LayerNorm after the embedding (eager only)
    "bloom": {"hidden_size": HIDDEN, "n_head": 4},
    # ALiBi through attn_config, no biases, MPT's low-precision LayerNorm
    "mpt": {
        "d_model": HIDDEN, "n_heads": 4, "expansion_ratio": 2, "max_seq_len": MAX_POS,
        "attn_config": {"alibi": True, "alibi_bias_max": 8},
    },
    # ALiBi (not rotary), multi-query (1 KV head), attention and MLP in parallel
    "falcon": {
        "hidden_size": HIDDEN, "num_attention_heads": 4, "num_kv_heads": 1, "alibi": True,
        "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False,
        "bias": True, "ffn_hidden_size": 64, "max_position_embeddings": MAX_POS,
    },
    # multi-head latent attention (low-rank q and kv, split rope/nope head dims, interleaved
    # rope), layer 0 dense MLP, layer 1 grouped-top-k MoE with a shared expert
    "deepseek_v3": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": MAX_POS,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    },
    # attention sinks (learned per-head softmax sink logit), biased attention, sliding +
    # full layers, YaRN rope, MoE with clamped SwiGLU experts (eager only)
    "gpt_oss": {
        **_DECODER, "intermediate_size": 32, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2,
        "rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    },
    # top-2 of 4 sparse MoE on every layer, full attention
    "mixtral": {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
    # partial rotary (half of head_dim), q/k LayerNorm, attention and MLP in parallel
    "phi": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": MAX_POS, "qk_layernorm": True,
    },
    # interleaved partial rotary (rotary_dim 4 of 8), parallel attention + MLP
    "gptj": {"n_embd": HIDDEN, "n_head": 4, "rotary_dim": 4, "n_inner": 64, "n_positions": MAX_POS},
    # LayerNorm without bias (computed in float32), q/k norm, parallel block, logit scale
    "cohere": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, "logit_scale": 0.0625,
        "use_qk_norm": True,
    },
    # q/k RMSNorm over all heads, norms after attention and MLP (post-norm residual)
    "olmo2": {k: v for k, v in _DECODER.items() if k != "head_dim"},
    # biased projections, LayerNorm, GELU MLP, sliding window
    "starcoder2": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, "sliding_window": 16,
        "use_bias": True,
    },
    # muP-style multipliers on embeddings, residuals, attention scores and logits
    "granite": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.125, "logits_scaling": 8.0,
    },
    # learned positions (offset 2, from the attention mask's cumsum), embedding projections
    # in and out (word_embed_proj_dim 16 != hidden 32), ReLU MLP. No biases: without rotary,
    # k_proj.bias adds q.b_k to every key of a query alike, so its gradient is 0 in exact
    # arithmetic and a per-parameter relative error would compare rounding noise with noise.
    "opt": {
        "hidden_size": HIDDEN, "ffn_dim": 64, "num_attention_heads": 4,
        "max_position_embeddings": MAX_POS, "word_embed_proj_dim": 16, "enable_bias": False,
    },
    # NoPE every second layer (layer 1 has no rotary)
    "smollm3": {**_DECODER, "no_rope_layer_interval": 2},
    # sliding layers with rope, full layers without (NoPE), q/k norm, post-norms
    "exaone4": {
        **_DECODER, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
    },
    # interleaved partial rotary (factor 0.5), biased qkv, post-attention/MLP norms,
    # fused gate_up projection
    "glm4": {**_DECODER, "attention_bias": True},
    "mamba": {
        "hidden_size": HIDDEN, "state_size": 8, "intermediate_size": 64, "time_step_rank": 4,
        "conv_kernel": 4, "expand": 2,
    },
    "falcon_mamba": {
        "hidden_size": HIDDEN, "state_size": 8, "intermediate_size": 64, "time_step_rank": 4,
        "conv_kernel": 4, "expand": 2,
    },
    "mamba2": {
        "hidden_size": HIDDEN, "num_heads": 4, "head_dim": 16, "expand": 2, "state_size": 16,
        "n_groups": 1, "conv_kernel": 4, "chunk_size": 16, "time_step_rank": 4,
    },
    "jamba": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"},
        # layer 0 mamba + dense MLP, layer 1 attention + MoE
        "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1,
        "num_experts": 4, "num_experts_per_tok": 2,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": 4,
    },
    "bamba": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, **_SSD,
        "attn_layer_indices": [1],
    },
    "zamba2": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": MAX_POS,
        # layer 0 mamba2, layer 1 shared attention block + mamba2
        "layers_block_type": ["linear_attention", "hybrid"],
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
        "n_mamba_heads": 4, "chunk_size": 16,
        "num_mem_blocks": 1, "adapter_rank": 8,
    },
    "falcon_h1": {
        # every falcon_h1 layer runs attention and a mamba2 mixer in parallel
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, **_SSD,
        "mamba_d_ssm": 64,
    },
    "nemotron_h": {
        **_DECODER, "layers_block_type": ["linear_attention", "full_attention"],
        "ssm_state_size": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1,
        "conv_kernel": 4, "expand": 2, "chunk_size": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
    "granitemoehybrid": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, **_SSD,
        "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32,
    },
    "recurrent_gemma": {
        "hidden_size": HIDDEN, "lru_width": HIDDEN, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
        "attention_window_size": 16, "conv1d_width": 4, "logits_soft_cap": 30.0,
        "block_types": ["recurrent", "attention"],
    },
    "lfm2": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"},
        "layer_types": ["conv", "full_attention"],
        "block_auto_adjust_ff_dim": False, "block_multiple_of": 8,
    },
    "qwen3_next": {
        **_DECODER, "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
    },
    "xlstm": {
        # mode "inference" (the default): chunkwise kernel over whole chunks of 16, then
        # the step recurrence for the tail. ("train" needs T % chunk_size == 0, and
        # "train_with_padding" is broken in 5.24: the block unpacks h over the batch.)
        "hidden_size": HIDDEN, "embedding_dim": HIDDEN, "num_heads": 4,
        "chunk_size": 16, "ffn_proj_factor": 2.0, "ffn_round_up_to_multiple_of": 16,
        "norm_reduction_force_float32": False, "autocast_kernel_dtype": "float32",
        "max_inference_chunksize": 64,
    },
    "rwkv": {
        "hidden_size": HIDDEN, "attention_hidden_size": HIDDEN, "intermediate_size": 64,
        "context_length": MAX_POS,
    },
    "minimax": {
        **_DECODER, "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16,
    },
    # --- families added for code we did not write (second wave) ---
    # partial rotary (half of head_dim 8), per-head q/k LayerNorm, biased qkv, parallel residual
    "stablelm": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": MAX_POS, "qk_layernorm": True,
        "use_qkv_bias": True, "use_parallel_residual": True, "partial_rotary_factor": 0.5,
    },
    # sliding layers with rope, full layers without (NoPE), interleaved rope, bias-free
    # LayerNorm, parallel block, logit scale
    "cohere2": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"], "logit_scale": 0.0625,
    },
    # q/k RMSNorm over all heads, clip_qkv clamp, top-2 of 4 MoE without renormalisation
    "olmoe": {
        **{k: v for k, v in _DECODER.items() if k != "head_dim"}, "num_experts": 4,
        "num_experts_per_tok": 2, "clip_qkv": 0.5,
    },
    # MoE with a shared expert behind a sigmoid gate, biased qkv; layer 1 dense (mlp_only_layers)
    "qwen2_moe": {
        **_DECODER, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32, "mlp_only_layers": [1],
    },
    # fused Wqkv clamped to clip_qkv, GQA, LayerNorm without bias, top-2 of 4 experts
    "dbrx": {
        "d_model": HIDDEN, "n_heads": 4, "max_seq_len": MAX_POS,
        # rope_theta: DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig
        # lacks in 5.24 (AttributeError without it); the rotary itself uses rope_parameters
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # mixture of attention heads (routed q/o projections, top-2 of 4) and an MoE MLP
    "jetmoe": {
        "hidden_size": HIDDEN, "intermediate_size": 32, "num_key_value_heads": 2, "kv_channels": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": MAX_POS,
    },
    # squared-ReLU MLP (no gate), LayerNorm1P (weight + 1), partial rotary (half of head_dim)
    "nemotron": {**_DECODER, "hidden_act": "relu2"},
    # q/k LayerNorm, partial rotary (half), squared ReLU, fused qkv, biased projections
    "persimmon": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
        "max_position_embeddings": MAX_POS, "qk_layernorm": True,
    },
    # multi-head latent attention (complex-multiply rope), layer 0 dense, layer 1 greedy top-2
    # MoE with a shared expert
    "deepseek_v2": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": MAX_POS,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
        "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "topk_method": "greedy",
    },
    # dynamic mask attention (value-dependent additive mask, top-k of keys kept when T exceeds
    # keep_window_size), residual scales; cross-domain MoE (product-key routed experts + shared)
    "doge": {
        **_DECODER, "keep_window_size": 16, "is_moe": True, "num_experts": 16,
        "num_experts_per_tok": 2,
    },
    # layer 0 mamba (v1, multi-head), layer 1 shared attention block on concat(h, embeddings)
    # + mamba
    "zamba": {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": MAX_POS, "n_mamba_heads": 2,
        "layers_block_type": ["linear_attention", "hybrid"], "mamba_d_state": 8,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4,
    },
    # xIELU activation (learned alpha_p / alpha_n), q/k RMSNorm, non-gated MLP
    "apertus": {
        **_DECODER, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
            "original_max_position_embeddings": 64, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        },
    },
}

#: Every family, in a stable order (attention, pure recurrent, hybrids).
FAMILIES: list[str] = list(_CONFIGS)

#: Families without any attention layer: the attention implementation does not apply.
NO_ATTENTION: set[str] = {"mamba", "falcon_mamba", "mamba2", "xlstm", "rwkv"}

#: Families with a linear recurrence (SSM scan, RG-LRU, gated delta rule, mLSTM, WKV,
#: lightning attention). ``lfm2`` is absent: its non-attention layers are short causal
#: convolutions (width ``conv_L_cache``=3) with input gates, a finite window, not a scan.
RECURRENT: set[str] = {
    "mamba", "falcon_mamba", "mamba2", "jamba", "bamba", "zamba2", "falcon_h1", "nemotron_h",
    "granitemoehybrid", "recurrent_gemma", "qwen3_next", "xlstm", "rwkv", "minimax", "zamba",
}

#: Families that cannot be built in this transformers version, with the reason.
UNAVAILABLE: dict[str, str] = {}


def _model_class(family: str) -> type:
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    return AutoModelForCausalLM._model_mapping[CONFIG_MAPPING[family]]


def _attn_impls(family: str) -> tuple[str, ...]:
    """("sdpa", "eager") where the model class declares SDPA support, else ("eager",).

    gemma2 declares none (SDPA has no logit soft-capping); families without attention
    layers (``NO_ATTENTION``) are listed as eager-only: the setting does not apply.
    """
    if family in NO_ATTENTION:
        return ("eager",)
    try:
        sdpa = bool(getattr(_model_class(family), "_supports_sdpa", False))
    except (KeyError, ImportError):
        return ("eager",)
    return ("sdpa", "eager") if sdpa else ("eager",)


#: Attention implementations each family supports ("sdpa" and/or "eager").
ATTN_IMPLS: dict[str, tuple[str, ...]] = {f: _attn_impls(f) for f in FAMILIES}


def _zero_dropout(config: Any) -> None:
    """Set every dropout probability the config holds to 0."""
    for key, value in list(vars(config).items()):
        low = key.lower()
        if ("dropout" in low or "pdrop" in low) and isinstance(value, float):
            setattr(config, key, 0.0)


def config_for(family: str, *, attn: str = "sdpa", layers: int = 2, **overrides: Any) -> Any:
    """The tiny config of ``family`` (a transformers ``model_type``) with ``overrides``."""
    from transformers import AutoConfig

    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if family in UNAVAILABLE:
        raise RuntimeError(f"family {family!r} is unavailable here: {UNAVAILABLE[family]}")
    impls = ATTN_IMPLS[family]
    if attn not in ("sdpa", "eager"):
        raise ValueError(f"attn must be 'sdpa' or 'eager', got {attn!r}")
    if attn not in impls and family not in NO_ATTENTION:
        raise ValueError(f"family {family!r} supports attn in {impls}, not {attn!r}")
    kwargs: dict[str, Any] = {**_CONFIGS[family], **_COMMON}
    kwargs.update(_layer_count(family, layers, kwargs))
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    _zero_dropout(config)
    config._attn_implementation = "eager" if family in NO_ATTENTION else attn
    return config


def _layer_count(family: str, layers: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Layer-count keywords; layer-type patterns are repeated to ``layers`` entries."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    out: dict[str, Any] = {}
    if family == "gpt2":
        return {"n_layer": layers}
    if family == "xlstm":
        return {"num_hidden_layers": layers, "num_blocks": layers}
    out["num_hidden_layers"] = layers
    for key in ("layer_types", "layers_block_type", "block_types"):
        if key in kwargs:
            pattern = list(kwargs[key])
            out[key] = (pattern * layers)[:layers]
    if family == "bamba":
        out["attn_layer_indices"] = [i for i in range(layers) if i % 2 == 1]
    return out


def build(family: str, *, attn: str = "sdpa", layers: int = 2, seed: int = 0,
          fp64_loss: bool = True, experts: str = "batched_mm",
          **overrides: Any) -> tuple[torch.nn.Module, Any]:
    """A tiny random-weight causal LM of ``family`` in float64 and train mode.

    ``attn`` is ignored for families without attention (``NO_ATTENTION``). Weights come
    from ``seed`` (the global RNG state is restored afterwards). MoE experts run the
    ``experts`` implementation: transformers' default ``grouped_mm`` rejects float64 on
    CPU; ``batched_mm`` (the default here) computes every expert densely with bmm (no
    data-dependent control flow); ``eager`` loops over the experts that were hit.
    ``fp64_loss=True`` swaps the model's ``loss_function`` for :func:`causal_lm_loss`
    (``ForCausalLMLoss`` without its ``logits.float()``, which in a float64 model is a
    downcast to float32); ``False`` keeps transformers' loss. (Mamba, FalconMamba, Mamba2,
    NemotronH and xLSTM cast their logits to float32 themselves, so their loss stays float32.)
    """
    from transformers import AutoModelForCausalLM

    config = config_for(family, attn=attn, layers=layers, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=config._attn_implementation, experts_implementation=experts)
    model = model.double()
    model.train()
    if fp64_loss:
        model.loss_function = causal_lm_loss
    return model, config


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` in the logits' own dtype (next-token cross-entropy,
    mean over non-ignored tokens, or sum / ``num_items_in_batch``)."""
    import torch.nn.functional as F

    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def inputs(config: Any, batch: int, T: int, seed: int = 0, *, mask: bool = False,
           pad: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` (equal, LongTensor (batch, T)) from ``seed``.

    ``mask=True`` adds an all-ones ``attention_mask``; ``pad > 0`` adds one whose last row is
    right-padded by ``pad`` tokens (pad ids, labels -100). Right, not left: with left padding
    the first query rows see no key at all, and transformers' eager attention returns NaN there.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config.vocab_size, (batch, T), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if mask or pad:
        attention_mask = torch.ones(batch, T, dtype=torch.long)
        if pad:
            attention_mask[-1, T - pad:] = 0
            out["input_ids"][-1, T - pad:] = config.pad_token_id or 0
            out["labels"][-1, T - pad:] = -100
        out["attention_mask"] = attention_mask
    return out


_LOW = (torch.float32, torch.float16, torch.bfloat16)


def float32_sites(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """Call ``fn(*args, **kwargs)``; return its result and the torch functions (at most 8,
    first seen first) that produced a float32/16 tensor requiring grad.

    A float64 model whose differentiable path passes through float32 (transformers' RMSNorm
    variance, eager softmax, Mamba's scan, RWKV's WKV, ...) matches a rewritten gradient only
    to float32 precision when the rewrite reorders those float32 reductions.
    """
    sites: list[str] = []

    class _Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            if len(sites) < 8:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor) and t.dtype in _LOW and t.requires_grad:
                        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
                        if name not in sites:
                            sites.append(name)
                        break
            return out

    with _Probe():
        result = fn(*args, **kwargs)
    return result, sites



_UPCAST_METHODS = {torch.Tensor.float: torch.Tensor.double, torch.Tensor.half: torch.Tensor.double,
                   torch.Tensor.bfloat16: torch.Tensor.double}


def _upcast(x: Any) -> Any:
    return torch.float64 if x in _LOW else x


class Float64Everywhere(TorchFunctionMode):
    """Run a float64 model's float32 islands in float64: every dtype argument that names
    float32/16 becomes float64, and ``.float()``/``.half()``/``.bfloat16()`` become
    ``.double()``. Under it, a model that casts to float32 internally computes in float64
    throughout, so a rewritten gradient can be checked to float64 precision even where the
    float32 computation is ill-conditioned (qwen3_next's gated delta rule: eager in float32
    is 0.35 away from float64 on ``A_log``). Capture traces under the mode too.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        func = _UPCAST_METHODS.get(func, func)
        args = tuple(_upcast(a) for a in args)
        kwargs = {k: _upcast(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

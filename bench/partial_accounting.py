"""bench_partial's model configurations, result records, the paper's accounting and the sympy
time model of DDP against a DiLoCo outer loop (what the run measures into, and the report reads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import sympy

from gradshard.examples.models.llama import LlamaConfig

GBIT = 1e9 / 8  # bytes/s in one Gbit/s
BANDWIDTHS_GBIT = (1.0, 10.0, 100.0)
NODES = (4, 8)
SYNC_EVERY = (20, 100)
STEPS = 1000
PROJECTED_SCALE = 0.01  # "the same step 100x faster": a projection, labelled as such in the report



# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelConfig:
    """The benchmarked LM and batch. Defaults: ~26M parameters, proportions of the paper's
    GPT-3 XL (tied embeddings ~4% of parameters, LM head ~4% of FLOPs, S/d = 1/2)."""

    vocab_size: int = 2048
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 8
    intermediate_size: int = 1376  # SwiGLU, ~8/3 d: the parameters of a 4d GELU MLP
    tie_embeddings: bool = True
    batch: int = 4
    seq_len: int = 256

    def llama(self, checkpoint_layers: bool = False) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                           n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           intermediate_size=self.intermediate_size, tie_embeddings=self.tie_embeddings,
                           checkpoint_layers=checkpoint_layers)

    def describe(self) -> str:
        return (f"Llama-style LM (`gradshard.examples.models.llama.LlamaLM`): d_model {self.d_model}, {self.n_layers} "
                f"layers, {self.n_heads} heads ({self.n_kv_heads} kv heads), SwiGLU hidden "
                f"{self.intermediate_size}, vocab {self.vocab_size}, "
                f"{'tied' if self.tie_embeddings else 'untied'} embeddings, float32; batch {self.batch} x "
                f"{self.seq_len} tokens of random ids; AdamW (betas 0.9/0.99, weight decay 0.1, the paper's)")


FULL = ModelConfig()
QUICK = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                    intermediate_size=176, batch=2, seq_len=32)


# The paper's Table 1 (1.3B GPT-3 XL, 32 nodes): memory GB, trainable parameters (B).
# "full" is its Streaming DiLoCo row (all 1.3B parameters trained).
PAPER_TABLE1: dict[str, tuple[float, float]] = {
    "full": (19.36, 1.3), "mlp_1_2": (14.87, 0.87), "mlp_1_4": (12.77, 0.67),
    "mlp_1_8": (11.72, 0.57), "mlp_heads_1_4": (10.41, 0.44),
}
PAPER_MEMORY_TARGET = 0.40  # >= 40% less memory for 1/4 MLPs + 1/4 heads
PAPER_FLOPS_TARGET = 0.15  # ~15% fewer training FLOPs


@dataclass(frozen=True)
class RowResult:
    """Measured memory and FLOPs of one variant (bytes; FLOPs of one training step)."""

    key: str
    label: str
    num_slices: int
    targets: tuple[str, ...]
    total_params: int  # elements of the full model
    trainable_params: int  # elements that receive a gradient
    resident_param_bytes: int  # distinct storages of parameters + buffers
    trainable_bytes: int
    frozen_bytes: int  # frozen-slice buffers
    other_buffer_bytes: int  # non-parameter buffers (rotary inv_freq)
    grad_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int  # gs.measure peak above params + grads + optimizer state
    peak_op: str | None
    peak_phase: str
    saved_bytes: int
    per_node_bytes: int
    forward_flops: int
    backward_flops: int
    flops: int
    predicted_backward_saved: int
    step_seconds: float
    step_seconds_all: tuple[float, ...]
    first_call_seconds: float
    optimizer_tensors: int  # parameters with AdamW state
    path: str = "compiled"  # "compiled" (gs.compile) or "eager" (slice_linears)
    recompute: bool = False  # torch.utils.checkpoint around every decoder layer
    grad_max_abs_diff: float | None = None  # recompute rows: first-step .grad vs the same path without

    @property
    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state (what the paper's accounting covers)."""
        return self.resident_param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class CommResult:
    """Bytes one rank all-reduces (payload, as ``CommCounter`` counts it) for one variant."""

    key: str
    ddp_bytes_per_step: int | None  # reduce_gradients of every trainable gradient (full model only)
    sync_bytes: int  # PartialDiLoCo: one sync of all parameters (fragments=1)
    setup_bytes: int  # PartialDiLoCo construction: replica check + count vector (once)
    trained_entry_bytes: int  # what the trained entries alone would take in float32 (not sent)
    outer_state_bytes: int  # global parameters + outer momentum + count vector held by the loop
    syncs_seen: int


# --------------------------------------------------------------------------- time model (sympy)

K, M, BW, T_COMP, H, S = sympy.symbols("K M B T_comp H S", positive=True)
T_RING = 2 * (K - 1) / K * M / BW  # the paper's bandwidth-optimal ring all-reduce (no latency term)
DDP_TOTAL = S * sympy.Max(T_COMP, T_RING)  # perfect overlap of compute and gradient all-reduce
LOWCOMM_TOTAL = S * T_COMP + (S / H) * T_RING  # no overlap; one sync every H steps

_t_ring = sympy.lambdify((K, M, BW), T_RING)
_ddp_total = sympy.lambdify((S, T_COMP, K, M, BW), DDP_TOTAL)
_lowcomm_total = sympy.lambdify((S, T_COMP, H, K, M, BW), LOWCOMM_TOTAL)


def ring_allreduce_seconds(nbytes: float, nodes: int, bandwidth_bytes_s: float) -> float:
    """``2 (K-1)/K * M / B`` (paper, section 3.1)."""
    return float(_t_ring(nodes, nbytes, bandwidth_bytes_s))


def simulate(rows: Sequence[RowResult], comms: Sequence[CommResult], *, steps: int = STEPS,
             nodes: Sequence[int] = NODES, sync_every: Sequence[int] = SYNC_EVERY,
             bandwidths_gbit: Sequence[float] = BANDWIDTHS_GBIT, compute_scale: float = 1.0) -> list[dict[str, Any]]:
    """Simulated wall-clock of ``steps`` steps per method, node count and bandwidth.

    ``compute_scale`` multiplies every measured step time (a projection to a faster device
    that keeps the measured ratios between variants; 1.0 = as measured)."""
    by_row = {r.key: r for r in rows}
    by_comm = {c.key: c for c in comms}
    full, full_comm = by_row["full"], by_comm["full"]
    out: list[dict[str, Any]] = []
    for k in nodes:
        for bw in bandwidths_gbit:
            b = bw * GBIT
            ddp = _ddp_total(steps, full.step_seconds * compute_scale, k, full_comm.ddp_bytes_per_step, b)
            out.append({"method": "DDP (every step)", "key": "full", "H": 1, "K": k, "gbit": bw,
                        "payload": full_comm.ddp_bytes_per_step, "compute_s": full.step_seconds * compute_scale,
                        "comm_s": ring_allreduce_seconds(full_comm.ddp_bytes_per_step, k, b),
                        "total_s": float(ddp), "vs_ddp": 1.0})
            for key in by_comm:
                row, comm = by_row[key], by_comm[key]
                name = "DiLoCo (full training)" if key == "full" else f"PartialDiLoCo, {row.label}"
                for h in sync_every:
                    t_comp = row.step_seconds * compute_scale
                    total = float(_lowcomm_total(steps, t_comp, h, k, comm.sync_bytes, b))
                    out.append({"method": name, "key": key, "H": h, "K": k, "gbit": bw,
                                "payload": comm.sync_bytes, "compute_s": t_comp,
                                "comm_s": ring_allreduce_seconds(comm.sync_bytes, k, b),
                                "total_s": total, "vs_ddp": float(ddp) / total})
    return out


# --------------------------------------------------------------------------- the paper's accounting


def paper_trainable_params(d: int, layers: int, vocab: int, dff: int, n: int, heads: bool) -> int:
    """Trainable parameters per node for the paper's GPT-3 XL (tied embeddings, 2-matrix MLP)."""
    attn, mlp = 4 * d * d, 2 * d * dff
    qkv_frozen = 3 * d * d * (n - 1) // n if heads else 0
    return vocab * d + layers * (attn + mlp - mlp * (n - 1) // n - qkv_frozen)


def paper_step_flops(rho_mlp: float, rho_attn: float, *, B: int = 16, S: int = 1024, H: int = 2048,
                     L: int = 24, V: int = 32000, dff: int = 8192) -> float:
    """Forward + backward FLOPs of one step, the paper's Appendix C.2 formulas."""
    emb = B * S * H
    mha = 6 * B * S * H * H + 4 * B * S * S * H + 2 * B * S * H * H
    ffn = 4 * B * S * H * dff
    out = 2 * B * S * H * V + 3 * B * S * V
    fwd = emb + L * (mha + ffn) + out
    mha_bwd = 8 * B * S * S * H + (10 + 6 * rho_attn) * B * S * H * H
    ffn_bwd = 4 * B * S * H * dff * (1 + rho_mlp)
    return fwd + 2 * emb + L * (mha_bwd + ffn_bwd) + 2 * out


def paper_memory_bytes(total_params: int, trainable_params: int) -> int:
    """The paper's per-node accounting (section 3.1): fp32 master weights, bf16 gradients and
    fp32 Adam moments for trainable parameters; activations recomputed (not counted); outer
    optimizer state offloaded (not counted)."""
    return 4 * total_params + (2 + 8) * trainable_params

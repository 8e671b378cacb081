"""Benchmark partial parameter updates (issue 6): per-node memory, FLOPs, communication model.

The rows of the paper's Table 1 -- full training, 1/2, 1/4 and 1/8 MLPs, 1/4 MLPs + 1/4
attention heads -- are run through the real compiled plan (``gs.compile(model,
plan="partial_update", num_slices=N, slice_index=0, targets=...)``; full training is
``plan="none"``) on a Llama-style LM (``gradshard.examples.models.llama``, SwiGLU MLPs, tied
embeddings, multi-head attention like the paper's GPT-3 XL) with AdamW. Per row, measured:

- parameter bytes: resident (distinct storages of parameters and buffers), split into the
  trainable entries (parameters that receive a ``.grad``) and the frozen slices (buffers);
- gradient bytes: the ``.grad`` tensors that exist after a backward;
- AdamW state bytes: every tensor in ``optimizer.state`` after an ``optimizer.step()``;
- activation peak: ``gs.measure`` of one training step (zero_grad(set_to_none=False),
  forward, cross-entropy, backward, optimizer.step) -- bytes allocated during the step
  above everything that already lived (parameters, gradients, optimizer state);
- per-node memory = parameters + gradients + optimizer state + activation peak (additive,
  because the gradients and the state are kept between steps);
- forward/backward FLOPs (``torch.utils.flop_counter`` formulas via ``gs.measure``), checked
  against :func:`gradshard.plans.partial_update.runtime.predicted_backward_flops_saved`.

With activation recomputation (the paper's setting, section 3.1): every variant again with
``LlamaConfig(checkpoint_layers=True)`` (``torch.utils.checkpoint`` around each decoder layer).
``gs.compile`` traces through ``torch.utils.checkpoint`` (make_fx inlines it: the compiled
graph saves every activation again), so these rows slice the model eagerly with
:func:`gradshard.plans.partial_update.runtime.slice_linears` and the same layouts the compiled plan finds
(checked: identical ``parameter_slices``), as ``gradshard.examples.train_partial`` does without
``--compile``. The same eager path is measured without recomputation too, and its gradients
after the first step are compared with the recomputed ones.

Communication: the paper's ring all-reduce estimate ``T_comm = 2 (K-1)/K * M / B`` (no
latency term: the paper neglects it) for every-step DDP (``M`` = the gradient bytes
all-reduced by :func:`gradshard.runtime.reduce.reduce_gradients`) and for the DiLoCo
outer loop every ``H`` steps (``M`` = the bytes :class:`~gradshard.distributed.diloco.PartialDiLoCo`
all-reduces at a sync). Both payloads are counted with ``CommCounter`` on real objects (two
threaded gloo ranks). Combined with the measured compute time per step into simulated
wall-clock per 1000 steps, with the paper's assumptions: DDP overlaps perfectly
(``max(T_comp, T_comm)``), DiLoCo does not (``T_comp + T_comm / H``).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py            # full; writes RESULTS.md
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py --quick    # tiny model, prints only
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py --no-recompute   # compiled rows only
    .venv/bin/python bench/bench_partial.py --repeat 5 --no-write --json /tmp/p.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the shared RESULTS.md writer

import gradshard as gs  # noqa: E402
from gradshard.examples.models.llama import LlamaConfig, LlamaLM  # noqa: E402
from gradshard.examples.train_partial import layouts_for  # noqa: E402
from gradshard.runtime.comm import CommCounter  # noqa: E402
from gradshard.distributed.diloco import PartialDiLoCo  # noqa: E402
from gradshard.runtime.reduce import GRAD_LABEL, reduce_gradients  # noqa: E402
from gradshard.distributed.testing import run_threaded  # noqa: E402
from gradshard.measure import describe_device, format_bytes, measure  # noqa: E402
from gradshard.plans.partial_update.runtime import (  # noqa: E402
    SlicedLinear,
    parameter_slices,
    predicted_backward_flops_saved,
    slice_linears,
)
from results_md import OUTPUT_DIR, RESULTS, write_section  # noqa: E402

JSON_OUT = OUTPUT_DIR / "out" / "partial.json"
HEADING = "## Partial parameter updates (issue 6)"

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


@dataclass(frozen=True)
class Variant:
    """One row of the paper's Table 1. ``num_slices == 1`` is full training (plan none)."""

    key: str
    label: str
    num_slices: int
    targets: tuple[str, ...] = ()

    @property
    def plan(self) -> str:
        return "none" if self.num_slices == 1 else "partial_update"

    def compile(self, model: nn.Module, slice_index: int = 0) -> nn.Module:
        if self.num_slices == 1:
            return gs.compile(model, plan="none")
        return gs.compile(model, plan="partial_update", num_slices=self.num_slices,
                          slice_index=slice_index, targets=self.targets)

    def slice_eager(self, model: LlamaLM, slice_index: int = 0) -> LlamaLM:
        """Slice ``model`` in place with :func:`slice_linears` and the layouts the compiled plan
        finds (MLP up/gate rows + down columns; q/k/v by head groups); full training: as is."""
        if self.num_slices == 1:
            return model
        return slice_linears(model, layouts_for(model.config, self.num_slices, slice_index, set(self.targets)))


VARIANTS: tuple[Variant, ...] = (
    Variant("full", "full training", 1),
    Variant("mlp_1_2", "1/2 MLPs", 2, ("mlp",)),
    Variant("mlp_1_4", "1/4 MLPs", 4, ("mlp",)),
    Variant("mlp_1_8", "1/8 MLPs", 8, ("mlp",)),
    Variant("mlp_heads_1_4", "1/4 MLPs + 1/4 heads", 4, ("mlp", "attention")),
)

# The paper's Table 1 (1.3B GPT-3 XL, 32 nodes): memory GB, trainable parameters (B).
# "full" is its Streaming DiLoCo row (all 1.3B parameters trained).
PAPER_TABLE1: dict[str, tuple[float, float]] = {
    "full": (19.36, 1.3), "mlp_1_2": (14.87, 0.87), "mlp_1_4": (12.77, 0.67),
    "mlp_1_8": (11.72, 0.57), "mlp_heads_1_4": (10.41, 0.44),
}
PAPER_MEMORY_TARGET = 0.40  # >= 40% less memory for 1/4 MLPs + 1/4 heads
PAPER_FLOPS_TARGET = 0.15  # ~15% fewer training FLOPs


def make_model(cfg: ModelConfig, seed: int = 0, recompute: bool = False) -> LlamaLM:
    torch.manual_seed(seed)
    return LlamaLM(cfg.llama(checkpoint_layers=recompute))


def make_batch(cfg: ModelConfig, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    b = cfg.batch if batch is None else batch
    x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# --------------------------------------------------------------------------- memory / FLOPs


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _resident_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters and buffers."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _sliced_layers(module: nn.Module) -> list[SlicedLinear]:
    out, seen = [], set()
    for m in module.modules():
        if isinstance(m, SlicedLinear) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


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


@dataclass
class Prepared:
    """A compiled variant with its AdamW optimizer and training step, ready to measure and time."""

    variant: Variant
    cm: nn.Module
    opt: torch.optim.Optimizer
    step: Callable[[], torch.Tensor]
    total_params: int
    tokens: int
    first_call_seconds: float
    path: str = "compiled"
    recompute: bool = False


def prepare_variant(cfg: ModelConfig, variant: Variant, *, path: str = "compiled",
                    recompute: bool = False) -> Prepared:
    """Build ``variant`` on a fresh (identically seeded) model; one warm-up training step.

    ``path="compiled"``: ``gs.compile``; ``path="eager"``: :meth:`Variant.slice_eager`.
    ``recompute=True`` (eager only) checkpoints every decoder layer."""
    if path not in ("compiled", "eager"):
        raise ValueError(f"prepare_variant: path={path!r}; expected 'compiled' or 'eager'")
    if recompute and path == "compiled":
        raise ValueError("prepare_variant: recompute=True needs path='eager': gs.compile traces through "
                         "torch.utils.checkpoint and the compiled graph saves every activation again")
    model = make_model(cfg, recompute=recompute)
    total_params = sum(p.numel() for p in model.parameters())
    cm = variant.compile(model) if path == "compiled" else variant.slice_eager(model)
    x, y = make_batch(cfg)
    t0 = time.perf_counter()
    with torch.no_grad():
        cm(x)  # capture + compile; the slices exist after this call
    first_call = time.perf_counter() - t0
    # as gradshard.examples.train_partial: every parameter that requires grad; the full weights of
    # sliced layers never get a .grad, so AdamW allocates no state for them
    opt = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-5,
                            betas=(0.9, 0.99), weight_decay=0.1)

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)  # keep .grad allocated: it is part of the resident state
        loss = lm_loss(cm, x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    train_step()  # allocates the gradients and the AdamW state
    return Prepared(variant, cm, opt, train_step, total_params, x.numel(), first_call, path, recompute)


def measure_prepared(p: Prepared) -> RowResult:
    """Static sizes of parameters, gradients and AdamW state; ``measure`` of one training step."""
    cm, opt, variant = p.cm, p.opt, p.variant
    with_grad = [q for q in cm.parameters() if q.grad is not None]
    trainable_params = sum(q.numel() for q in with_grad)
    grad_bytes = sum(_nbytes(q.grad) for q in with_grad)
    optimizer_bytes = sum(_nbytes(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    layers = _sliced_layers(cm)
    frozen = [getattr(layer, n) for layer in layers for n in layer.frozen_buffer_names()]
    frozen_bytes = sum(_nbytes(b) for b in frozen)
    frozen_ids = {id(b) for b in frozen}
    other_buffers = sum(_nbytes(b) for b in cm.buffers() if id(b) not in frozen_ids)
    resident = _resident_bytes(cm)
    trainable_bytes = sum(_nbytes(q) for q in with_grad)
    if resident != trainable_bytes + frozen_bytes + other_buffers:
        raise RuntimeError(
            f"{variant.key}: resident parameter storage {resident} B != trainable {trainable_bytes} + frozen "
            f"{frozen_bytes} + buffers {other_buffers}; slices are expected to be views of the full weights")
    m = measure(p.step, repeat=0)
    return RowResult(
        key=variant.key, label=variant.label, num_slices=variant.num_slices, targets=variant.targets,
        total_params=p.total_params, trainable_params=trainable_params, resident_param_bytes=resident,
        trainable_bytes=trainable_bytes, frozen_bytes=frozen_bytes, other_buffer_bytes=other_buffers,
        grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, activation_peak_bytes=m.peak_bytes,
        peak_op=m.peak_op, peak_phase=m.peak_phase, saved_bytes=m.saved_bytes,
        per_node_bytes=resident + grad_bytes + optimizer_bytes + m.peak_bytes,
        forward_flops=m.forward_flops, backward_flops=m.backward_flops, flops=m.flops,
        predicted_backward_saved=predicted_backward_flops_saved(cm, p.tokens) if layers else 0,
        step_seconds=0.0, step_seconds_all=(), first_call_seconds=p.first_call_seconds,
        optimizer_tensors=len(opt.state), path=p.path, recompute=p.recompute,
    )


def time_interleaved(prepared: Sequence[Prepared], rounds: int) -> list[tuple[float, ...]]:
    """Wall time of one training step of each of ``prepared`` (same order), ``rounds``
    interleaved rounds (shared cores)."""
    times: list[list[float]] = [[] for _ in prepared]
    for _ in range(rounds):
        for i, p in enumerate(prepared):
            t0 = time.perf_counter()
            p.step()
            times[i].append(time.perf_counter() - t0)
    return [tuple(t) for t in times]


def grad_max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest ``|a.grad - b.grad|`` over parameters of the same name (both must have the same
    parameters with gradients)."""
    ga = {n: p.grad for n, p in a.named_parameters() if p.grad is not None}
    gb = {n: p.grad for n, p in b.named_parameters() if p.grad is not None}
    if ga.keys() != gb.keys() or not ga:
        raise RuntimeError(f"grad_max_abs_diff: different parameters with gradients: "
                           f"{sorted(ga.keys() ^ gb.keys())[:6]}")
    return max(float((ga[n] - gb[n]).abs().max()) for n in ga)


def probe_compiled_checkpointing(cfg: ModelConfig) -> int:
    """Activation bytes saved by one forward of ``gs.compile(plan="none")`` on the model with
    ``checkpoint_layers=True`` (captured with grad enabled, so tracing sees the checkpoints)."""
    x, y = make_batch(cfg)
    cm = gs.compile(make_model(cfg, recompute=True), plan="none")
    lm_loss(cm, x, y).backward()  # capture + compile
    saved = measure(lambda: lm_loss(cm, x, y).backward(), repeat=0).saved_bytes
    del cm
    gc.collect()
    return saved


def check_same_slicing(compiled: nn.Module, eager: nn.Module, variant: Variant) -> None:
    """The eager layouts slice the same entries of the same weights as the compiled plan."""
    if variant.num_slices == 1:
        return
    want = sorted(compiled.parameter_slices().values())
    got = sorted(parameter_slices(eager).values())
    if want != got:
        raise RuntimeError(f"{variant.key}: slice_linears layouts differ from the compiled plan's slices: "
                           f"{sorted(set(want) ^ set(got))[:4]}")


# --------------------------------------------------------------------------- communication


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


def _comm_rank(rank: int, group: Any, models: Sequence[nn.Module], variant: Variant,
               x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    cm = models[rank]
    out: dict[str, int] = {}
    if variant.num_slices == 1:  # every-step DDP: the gradient all-reduce of all parameters
        lm_loss(cm, x, y).backward()
        with CommCounter(group) as counter:
            reduce_gradients(cm.parameters(), group)
        out["ddp"] = counter.bytes(label=GRAD_LABEL, direction="allreduce")
        for p in cm.parameters():
            p.grad = None
    # DiLoCo needs the sliced view (parameter_slices etc.): the compiled module for
    # partial_update, the user's module for plan none (every parameter trained in full)
    module = cm if variant.num_slices > 1 else cm.model
    inner = torch.optim.SGD([p for p in cm.parameters() if p.requires_grad], lr=1e-5)
    with CommCounter(group) as setup:
        outer = PartialDiLoCo(module, inner, sync_every=1, group=group, timeout_s=120.0)
    lm_loss(cm, x, y).backward()
    with CommCounter(group) as counter:
        synced = outer.step()  # inner step, then the sync (sync_every=1)
    out["sync"] = counter.bytes(direction="allreduce")
    out["setup"] = setup.bytes(direction="allreduce")
    out["syncs"] = int(synced is not None)
    masks = outer.masks
    out["trained"] = sum(int(masks[n].expand_as(g).sum()) * 4 for n, g in outer.global_parameters.items())
    out["outer_state"] = (sum(_nbytes(g) for g in outer.global_parameters.values())
                          + sum(_nbytes(b) for b in outer._momentum.values())
                          + sum(_nbytes(c) for c in outer.counts.values()))
    return out


def measure_comm(cfg: ModelConfig, variant: Variant, *, world: int = 2) -> CommResult:
    """Count what every-step DDP and one PartialDiLoCo sync all-reduce, on ``world`` threaded ranks."""
    models = []
    x, y = make_batch(cfg, batch=1)  # the payloads do not depend on the batch
    for r in range(world):
        cm = variant.compile(make_model(cfg), slice_index=r % variant.num_slices)
        with torch.no_grad():
            cm(x)  # capture on the main thread (make_fx is not thread-safe)
        models.append(cm)
    res = run_threaded(world, _comm_rank, models, variant, x, y, timeout_s=1200.0, group_timeout_s=300.0)
    r0 = res[0]
    for r in res[1:]:
        if r["sync"] != r0["sync"] or r.get("ddp") != r0.get("ddp"):
            raise RuntimeError(f"{variant.key}: ranks all-reduced different payloads: {res}")
    out = CommResult(key=variant.key, ddp_bytes_per_step=r0.get("ddp"), sync_bytes=r0["sync"],
                     setup_bytes=r0["setup"], trained_entry_bytes=r0["trained"],
                     outer_state_bytes=r0["outer_state"], syncs_seen=r0["syncs"])
    del models, res
    gc.collect()
    return out


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


# --------------------------------------------------------------------------- the whole run


def _log_row(log: Callable[[str], None], r: RowResult) -> None:
    tag = f"{r.label}{' [recompute]' if r.recompute else ' [eager]' if r.path == 'eager' else ''}"
    log(f"{tag:36s} trainable {r.trainable_params:>11,} | grads {format_bytes(r.grad_bytes):>10s} | "
        f"adam {format_bytes(r.optimizer_bytes):>10s} | act peak {format_bytes(r.activation_peak_bytes):>10s} | "
        f"per node {format_bytes(r.per_node_bytes):>10s} | bwd {r.backward_flops / 1e9:7.2f} GFLOP | "
        f"{r.step_seconds:.2f} s/step")


def run(cfg: ModelConfig, variants: Sequence[Variant] = VARIANTS, *, repeat: int = 5, comm: bool = True,
        recompute: bool = True, comm_world: int = 2,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every variant (and their communication payloads); returns a JSON-able dict.

    ``recompute``: also every variant on the eager path with and without activation
    recomputation (``eager_rows`` / ``recompute_rows``); the recompute rows are timed in the
    same interleaved rounds as the compiled ones."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if not variants or variants[0].key != "full":
        raise ValueError("run: the first variant must be full training (key 'full'), the reference")
    prepared = [prepare_variant(cfg, v) for v in variants]
    rows = [measure_prepared(p) for p in prepared]
    eager_rows: list[RowResult] = []
    recomputed: list[Prepared] = []
    rec_rows: list[RowResult] = []
    compiled_ckpt_saved = None
    if recompute:
        compiled_ckpt_saved = probe_compiled_checkpointing(cfg)
        for v, compiled in zip(variants, prepared):
            plain = prepare_variant(cfg, v, path="eager")
            rec = prepare_variant(cfg, v, path="eager", recompute=True)
            check_same_slicing(compiled.cm, rec.cm, v)
            diff = grad_max_abs_diff(plain.cm, rec.cm)  # same weights and batch: the first step's .grad
            eager_rows.append(measure_prepared(plain))
            rec_rows.append(replace(measure_prepared(rec), grad_max_abs_diff=diff))
            recomputed.append(rec)
            del plain
            gc.collect()
    timed = time_interleaved(prepared + recomputed, max(1, repeat))
    rows = [replace(r, step_seconds=min(t), step_seconds_all=t) for r, t in zip(rows, timed)]
    rec_rows = [replace(r, step_seconds=min(t), step_seconds_all=t) for r, t in zip(rec_rows, timed[len(rows):])]
    del prepared, recomputed
    gc.collect()
    for r in [*rows, *eager_rows, *rec_rows]:
        _log_row(log, r)
    comms: list[CommResult] = []
    if comm:
        for v in variants:
            c = measure_comm(cfg, v, world=comm_world)
            comms.append(c)
            log(f"{v.label:24s} sync payload {format_bytes(c.sync_bytes):>10s}"
                + (f" | DDP grad payload/step {format_bytes(c.ddp_bytes_per_step)}" if c.ddp_bytes_per_step else ""))
    sim = simulate(rows, comms) if comms else []
    projected = simulate(rows, comms, compute_scale=PROJECTED_SCALE) if comms else []
    return {
        "config": asdict(cfg),
        "machine": machine(),
        "rows": [asdict(r) | {"state_bytes": r.state_bytes} for r in rows],
        "eager_rows": [asdict(r) | {"state_bytes": r.state_bytes} for r in eager_rows],
        "recompute_rows": [asdict(r) | {"state_bytes": r.state_bytes} for r in rec_rows],
        "compiled_checkpoint_saved_bytes": compiled_ckpt_saved,
        "comm": [asdict(c) for c in comms],
        "comm_world": comm_world,
        "simulation": sim,
        "simulation_projected": projected,
        "projected_scale": PROJECTED_SCALE,
        "formulas": {"t_ring": str(T_RING), "ddp_total": str(DDP_TOTAL), "lowcomm_total": str(LOWCOMM_TOTAL)},
    }


def machine() -> str:
    return (f"{describe_device('cpu')}; Python {platform.python_version()}, torch {torch.__version__}; "
            f"the cores are shared with other jobs")


# --------------------------------------------------------------------------- report


def _pct(new: float, ref: float) -> str:
    return f"{100 * (1 - new / ref):.1f}%" if ref else "-"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _rows_of(result: dict[str, Any], key: str) -> list[RowResult]:
    return [RowResult(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in r.items() if k != "state_bytes"})
            for r in result.get(key) or []]


def render(result: dict[str, Any]) -> str:
    rows = _rows_of(result, "rows")
    eager_rows, rec_rows = _rows_of(result, "eager_rows"), _rows_of(result, "recompute_rows")
    comms = [CommResult(**c) for c in result["comm"]]
    cfg = ModelConfig(**result["config"])
    full = rows[0]
    tokens = cfg.batch * cfg.seq_len
    parts = [f"Machine: {result['machine']}.\n",
             f"Model: {cfg.describe()}. {full.total_params:,} parameters. Each row is the real compiled plan "
             f"(`gs.compile(model, plan=\"partial_update\", num_slices=N, slice_index=0, targets=...)`; full "
             f"training: `plan=\"none\"`) from the same initial weights"
             + (", except the rows with activation recomputation (eager slicing, see there)" if rec_rows else "")
             + ".\n"]

    parts.append("### Per-node memory (measured, MiB)\n")
    parts.append(
        "Parameters: distinct storages of parameters and buffers (trainable entries + frozen-slice buffers; the "
        "slices are views of the full weights, nothing is duplicated). Gradients: the `.grad` tensors after a "
        "backward. AdamW: the tensors in `optimizer.state` after `step()`. Activation peak: `gs.measure` of one "
        "training step (zero_grad keeping `.grad`, forward, cross-entropy, backward, `optimizer.step()`), bytes "
        "allocated during the step above all of the former. Per node = the sum. No activation recomputation "
        "(with recomputation: below).\n")
    lines = ["| variant | trainable params | params: trainable + frozen | grads | AdamW state | activation peak "
             "| per node | per node vs full | params+grads+AdamW vs full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.trainable_params:,} ({100 * r.trainable_params / r.total_params:.0f}%) | "
            f"{_mib(r.trainable_bytes)} + {_mib(r.frozen_bytes)} | {_mib(r.grad_bytes)} | {_mib(r.optimizer_bytes)} | "
            f"{_mib(r.activation_peak_bytes)} | {_mib(r.per_node_bytes)} | {_pct(r.per_node_bytes, full.per_node_bytes)} | "
            f"{_pct(r.state_bytes, full.state_bytes)} |")
    parts.append("\n".join(lines) + "\n")
    parts.append(f"The activation peak is reached at `{full.peak_op}` ({full.peak_phase}) for full training; "
                 f"activations saved for backward: {_mib(full.saved_bytes)} MiB (full) vs "
                 f"{_mib(rows[-1].saved_bytes)} MiB ({rows[-1].label}) -- slicing does not change what the forward "
                 f"saves (the paper's Appendix D). Non-parameter buffers (rotary `inv_freq`): "
                 f"{full.other_buffer_bytes} B.\n")

    parts.append("### FLOPs per training step (measured, `torch.utils.flop_counter` via `gs.measure`)\n")
    lines = ["| variant | forward GFLOP | backward GFLOP | total GFLOP | backward vs full | total vs full "
             "| backward saved: measured | predicted (`predicted_backward_flops_saved`) | step time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        saved = full.backward_flops - r.backward_flops
        ok = "equal" if saved == r.predicted_backward_saved else f"differs by {saved - r.predicted_backward_saved:,}"
        lines.append(
            f"| {r.label} | {r.forward_flops / 1e9:.2f} | {r.backward_flops / 1e9:.2f} | {r.flops / 1e9:.2f} | "
            f"{_pct(r.backward_flops, full.backward_flops)} | {_pct(r.flops, full.flops)} | {saved:,} | "
            f"{r.predicted_backward_saved:,} ({ok}) | {r.step_seconds:.2f} s |")
    parts.append("\n".join(lines) + "\n")
    parts.append(f"{tokens:,} tokens per step. Step time (forward, backward, AdamW; uninstrumented): minimum over "
                 f"{len(full.step_seconds_all)} rounds in which every variant runs one step in turn, so that load "
                 f"from other jobs on the shared cores hits all variants alike. The minima still vary by ~15% between runs "
                 f"on this shared machine; the FLOP counts are exact and reproducible.\n")

    if rec_rows:
        parts.append(_recompute_section(rows, eager_rows, rec_rows, cfg, result.get("compiled_checkpoint_saved_bytes")))
    parts.append(_paper_comparison(rows, tokens, rec_rows))
    if comms:
        parts.append(_comm_section(result, rows, comms))
    return "\n".join(parts)


def _recompute_section(rows: Sequence[RowResult], eager: Sequence[RowResult], rec: Sequence[RowResult],
                       cfg: ModelConfig, compiled_ckpt_saved: int | None = None) -> str:
    """Tables of the eager rows with and without activation recomputation."""
    compiled = {r.key: r for r in rows}
    plain = {r.key: r for r in eager}
    full_p, full_r = plain["full"], rec[0]
    parts = ["### With activation recomputation (the paper's setting; measured, MiB)\n"]
    drift = max(abs(plain[r.key].per_node_bytes - compiled[r.key].per_node_bytes) for r in rec if r.key in compiled)
    diffs = [r.grad_max_abs_diff for r in rec if r.grad_max_abs_diff is not None]
    worst = max(diffs) if diffs else None
    grads = ("bit-identical in every row (max |difference| 0)" if worst == 0 else
             f"max |difference| {worst:.3g}" if worst is not None else "not compared")
    if compiled_ckpt_saved is None:
        probe = "(not probed in this run)"
    else:
        same = "the same as" if compiled_ckpt_saved == compiled["full"].saved_bytes else "vs"
        probe = (f"(measured: `gs.compile(plan=\"none\")` of the model with `checkpoint_layers=True` saves "
                    f"{_mib(compiled_ckpt_saved)} MiB for backward, {same} {_mib(compiled['full'].saved_bytes)} MiB "
                    f"without checkpointing; eager with checkpointing: {_mib(full_r.saved_bytes)} MiB)")
    parts.append(
        "Every variant again with `LlamaConfig(checkpoint_layers=True)`: non-reentrant `torch.utils.checkpoint` "
        "around each decoder layer, so the forward keeps only each layer's input and the backward recomputes one "
        "layer at a time (the paper trains with full activation recomputation, section 3.1). `gs.compile` does not "
        "keep this: make_fx traces through `torch.utils.checkpoint`, so the compiled graph saves every activation "
        f"again {probe}. These rows therefore slice the model eagerly, `gradshard.plans.partial_update.runtime.slice_linears` with the layouts of "
        "`gradshard.examples.train_partial` (as it does without `--compile`); every row checks that the eager slices are "
        "the compiled plan's (`parameter_slices` identical). 'no recompute' is the same eager path without "
        f"checkpointing: its per-node memory is within {_mib(drift)} MiB of the compiled rows above. Gradients "
        f"after the first step (same weights, same batch), with vs without recomputation: {grads}.\n")
    lines = ["| variant | params: trainable + frozen | grads | AdamW state | activation peak: no recompute "
             "| activation peak: recompute | per node: no recompute | per node: recompute "
             "| per node vs full: no recompute | per node vs full: recompute |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec:
        p = plain[r.key]
        lines.append(
            f"| {r.label} | {_mib(r.trainable_bytes)} + {_mib(r.frozen_bytes)} | {_mib(r.grad_bytes)} | "
            f"{_mib(r.optimizer_bytes)} | {_mib(p.activation_peak_bytes)} | {_mib(r.activation_peak_bytes)} | "
            f"{_mib(p.per_node_bytes)} | {_mib(r.per_node_bytes)} | {_pct(p.per_node_bytes, full_p.per_node_bytes)} | "
            f"**{_pct(r.per_node_bytes, full_r.per_node_bytes)}** |")
    parts.append("\n".join(lines) + "\n")
    parts.append(
        f"Full training, recompute: activations saved by the forward {_mib(full_r.saved_bytes)} MiB (without: "
        f"{_mib(full_p.saved_bytes)} MiB); the activation peak is reached at `{full_r.peak_op}` ({full_r.peak_phase})"
        + (", the same bytes in every row" if len({r.activation_peak_bytes for r in rec}) == 1 else "") + ". "
        f"Parameters, gradients and AdamW state are the same bytes with and without recomputation.\n")

    parts.append("FLOPs per training step with recomputation (measured). `gs.measure` counts the recomputed "
                 "forward inside the backward (the autograd engine runs it); 'recompute' = backward with "
                 "recomputation - backward of the same eager row without.\n")
    lines = ["| variant | forward GFLOP | recompute GFLOP | backward GFLOP (excl. recompute) | total GFLOP "
             "| total vs full (both recompute) | total vs same variant without recompute "
             "| backward saved excl. recompute = predicted | step time: recompute | step time: compiled, no recompute |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    again_full = full_r.backward_flops - full_p.backward_flops
    down_gemms = 2 * cfg.batch * cfg.seq_len * cfg.intermediate_size * cfg.d_model * cfg.n_layers
    extra: list[str] = []
    for r in rec:
        p = plain[r.key]
        again = r.backward_flops - p.backward_flops
        saved = full_p.backward_flops - p.backward_flops  # the backward proper, recompute excluded
        ok = "yes" if saved == r.predicted_backward_saved else f"no ({saved - r.predicted_backward_saved:+,})"
        c = compiled.get(r.key)
        lines.append(
            f"| {r.label} | {r.forward_flops / 1e9:.2f} | {again / 1e9:.2f} | {p.backward_flops / 1e9:.2f} | "
            f"{r.flops / 1e9:.2f} | {_pct(r.flops, full_r.flops)} | +{100 * (r.flops / p.flops - 1):.1f}% | {ok} | "
            f"{r.step_seconds:.2f} s | {f'{c.step_seconds:.2f} s' if c else '-'} |")
        if "mlp" in r.targets:
            extra.append("equal" if again - again_full == down_gemms else f"{r.label}: {again - again_full:,}")
    parts.append("\n".join(lines) + "\n")
    note = ("Step times: the recompute rows run in the same interleaved timing rounds as the compiled rows "
            "(minimum of each). Recomputation adds the layers' forward again to every row (slicing changes only "
            "weight gradients, not the forward), so it dilutes the relative FLOP saving")
    if extra:
        same = all(e == "equal" for e in extra)
        note += (
            f"; the rows with sliced MLPs even recompute more than full training: "
            + (f"{down_gemms / 1e9:.3g} GFLOP more in every such row" if same else
               f"expected {down_gemms / 1e9:.3g} GFLOP more, measured: " + ", ".join(extra))
            + f", exactly 2 x tokens x d_model x hidden x layers, one MLP down-projection GEMM per layer. Torch's "
            f"non-reentrant checkpoint stops a layer's recomputation as soon as every tensor its backward needs "
            f"is back (early stop, the default), which skips the layer's last GEMM, the down projection, for an "
            f"`nn.Linear`; a `SlicedLinear` is a custom `autograd.Function`, whose saved tensors are packed only "
            f"after its forward has run, so the recomputation runs the sliced down projection's GEMMs too "
            f"(`tests/test_bench_partial.py` checks both: with `torch.utils.checkpoint.set_checkpoint_early_stop(False)` "
            f"full training recomputes the same FLOPs as the sliced rows)")
    parts.append(note + ".\n")
    return "\n".join(parts)


def _paper_comparison(rows: Sequence[RowResult], tokens: int, rec: Sequence[RowResult] = ()) -> str:
    full = rows[0]
    by_key = {r.key: r for r in rows}
    rec_by = {r.key: r for r in rec}
    full_rec = rec_by.get("full")
    ref_flops = paper_step_flops(1.0, 1.0)
    rho = {"full": (1, 1), "mlp_1_2": (1 / 2, 1), "mlp_1_4": (1 / 4, 1), "mlp_1_8": (1 / 8, 1),
           "mlp_heads_1_4": (1 / 4, 1 / 4)}
    slicing = {"full": (1, False), "mlp_1_2": (2, False), "mlp_1_4": (4, False), "mlp_1_8": (8, False),
               "mlp_heads_1_4": (4, True)}
    xl_total = paper_trainable_params(2048, 24, 32000, 8192, 1, False)
    lines = ["| variant | paper: trainable (B) | our rule on GPT-3 XL (B) | paper: memory vs full | "
             "paper accounting, our model | measured per node (ours) "
             + ("| measured per node, recompute (ours) " if rec_by else "")
             + "| measured params+grads+AdamW | Appendix C FLOPs/step vs full (paper config) "
             "| measured FLOPs/step vs full (ours) " + ("| measured FLOPs/step vs full, recompute (ours) " if rec_by else "")
             + "|", "|---|" + "---:|" * (10 if rec_by else 8)]
    for key, (mem, trainable) in PAPER_TABLE1.items():
        r = by_key.get(key)
        if r is None:
            continue
        n, heads = slicing[key]
        ours_xl = paper_trainable_params(2048, 24, 32000, 8192, n, heads) / 1e9
        acc = paper_memory_bytes(r.total_params, r.trainable_params)
        acc_full = paper_memory_bytes(full.total_params, full.trainable_params)
        rr = rec_by.get(key)
        rec_mem = (f"{_pct(rr.per_node_bytes, full_rec.per_node_bytes)} | " if rr and full_rec else
                   "- | " if rec_by else "")
        rec_flops = (f" {_pct(rr.flops, full_rec.flops)} |" if rr and full_rec else " - |" if rec_by else "")
        lines.append(
            f"| {r.label} | {trainable:.2f} | {ours_xl:.3f} | {_pct(mem, PAPER_TABLE1['full'][0])} | "
            f"{_pct(acc, acc_full)} | {_pct(r.per_node_bytes, full.per_node_bytes)} | {rec_mem}"
            f"{_pct(r.state_bytes, full.state_bytes)} | {_pct(paper_step_flops(*rho[key]), ref_flops)} | "
            f"{_pct(r.flops, full.flops)} |{rec_flops}")
    target = by_key.get("mlp_heads_1_4")
    verdict = ""
    if target is not None:
        mem_cut = 1 - target.per_node_bytes / full.per_node_bytes
        state_cut = 1 - target.state_bytes / full.state_bytes
        acc_cut = 1 - paper_memory_bytes(target.total_params, target.trainable_params) / paper_memory_bytes(
            full.total_params, full.trainable_params)
        flop_cut = 1 - target.flops / full.flops
        yes = lambda ok: "met" if ok else "NOT met"  # noqa: E731
        tr = rec_by.get("mlp_heads_1_4")
        like = ""
        if tr is not None and full_rec is not None:
            rec_cut = 1 - tr.per_node_bytes / full_rec.per_node_bytes
            rec_flop_cut = 1 - tr.flops / full_rec.flops
            like = (f" Measured like for like, with activation recomputation (the paper's setting): per-node memory "
                    f"**{rec_cut:.1%} less ({yes(rec_cut >= PAPER_MEMORY_TARGET)})** "
                    f"({_mib(tr.per_node_bytes)} vs {_mib(full_rec.per_node_bytes)} MiB).")
        verdict = (
            f"\nTargets for 1/4 MLPs + 1/4 heads. Memory >= {PAPER_MEMORY_TARGET:.0%} less.{like} Without "
            f"recomputation: measured per-node memory {mem_cut:.1%} less ({yes(mem_cut >= PAPER_MEMORY_TARGET)}); "
            f"parameters + gradients + AdamW state {state_cut:.1%} less ({yes(state_cut >= PAPER_MEMORY_TARGET)}); "
            f"the paper's accounting applied to our parameter counts {acc_cut:.1%} less "
            f"({yes(acc_cut >= PAPER_MEMORY_TARGET)}). Training FLOPs about {PAPER_FLOPS_TARGET:.0%} fewer: measured "
            f"{flop_cut:.1%} fewer per step without recomputation ({yes(flop_cut >= PAPER_FLOPS_TARGET)})"
            + (f", {rec_flop_cut:.1%} fewer with it ({yes(rec_flop_cut >= PAPER_FLOPS_TARGET)}: the recomputed "
               f"forward, which slicing does not shrink, is added to every row; the paper's Appendix C counts no "
               f"recomputation)" if like else "") + ".")
        # activations at which the measured per-node saving would reach the target (same state bytes)
        budget = (full.state_bytes - target.state_bytes) / PAPER_MEMORY_TARGET - full.state_bytes
        per_token = full.activation_peak_bytes / tokens
        verdict += (
            f" Without recomputation the activations decide: {_mib(full.activation_peak_bytes)} MiB at this batch "
            f"({100 * full.activation_peak_bytes / full.per_node_bytes:.0f}% of full training's per-node memory, "
            f"identical in every row). With the same parameter, gradient and AdamW bytes, >= "
            f"{PAPER_MEMORY_TARGET:.0%} needs an activation peak <= {_mib(max(0, budget))} MiB "
            f"(~{max(0, budget) / per_token:,.0f} tokens per step at the measured {per_token / 1024:.0f} KiB/token)")
        if like:
            verdict += (f"; recomputation brings it to {_mib(full_rec.activation_peak_bytes)} MiB (full training) and "
                        f"{_mib(tr.activation_peak_bytes)} MiB (1/4 MLPs + 1/4 heads).\n")
        else:
            verdict += ", or activation recomputation as in the paper.\n"
    why = (
        "\nWhy the numbers differ from the paper's, and by how much:\n"
        "- Memory accounting. The paper (section 3.1) trains in bf16 with *full activation recomputation*, "
        "so its per-node memory is parameters + gradients + optimizer state (+ outer state): fp32 master "
        "weights for all parameters (4 B), bf16 gradients (2 B) and fp32 Adam moments (8 B) for the trainable "
        "ones. Its Table 1 is fit by 4.5 B/parameter (1.27B) + 10.5 B per trainable parameter (its own column) to "
        "within 0.06 GB. Our "
        "measurement is fp32, so gradients cost 4 B, and the activation peak is counted: without recomputation "
        "the activations (the same for every row, because the forward and the input gradients are unchanged) "
        "dilute the relative saving of the per-node total; how large their share is depends on batch x sequence "
        "length (here chosen so that a step takes a few seconds on this CPU). With recomputation what remains "
        "is each layer's input, one layer's recomputed activations and the LM head's logits and their gradient. "
        "The parameters + gradients + AdamW column is what the paper's accounting covers, and the 'paper "
        "accounting' column applies the paper's byte sizes to our measured parameter counts.\n"
        "- Trainable fraction. The paper's model ties embeddings and has a 2-matrix 4d GELU MLP; ours a SwiGLU "
        "MLP with the same parameter count per layer and tied embeddings of a smaller share (vocab 2048 x 512 "
        "is 4% of our parameters; 32000 x 2048 is 5% of GPT-3 XL), so slightly more of our model is sliceable. "
        "Our slicing rule reproduces the paper's trainable counts exactly on GPT-3 XL (column 3).\n"
        "- FLOPs. The paper's '15% fewer' is total FLOPs of *performance-matched* runs (the sliced runs need "
        "more tokens, e.g. 28B instead of 26B for the heads variants), not a per-step figure. Per step, its own "
        "Appendix C formulas give the 'Appendix C' column for GPT-3 XL (B=16, S=1024); our measured per-step "
        "reductions are the 'measured FLOPs/step' columns. Per step is what a benchmark can measure; the token overhead is a "
        "training-quality question this benchmark does not answer.\n")
    return ("### Against the paper's Table 1 (reductions vs full training)\n\n"
            + "\n".join(lines) + "\n" + verdict + why)


def _comm_section(result: dict[str, Any], rows: Sequence[RowResult], comms: Sequence[CommResult]) -> str:
    by_row = {r.key: r for r in rows}
    full_comm = next(c for c in comms if c.key == "full")
    parts = ["### Communication: what is all-reduced (counted on real objects)\n"]
    parts.append(
        f"`CommCounter` payloads on {result['comm_world']} threaded gloo ranks (the payload per rank does not depend "
        f"on the number of ranks). DDP: `reduce_gradients` of every gradient after one backward, each step. "
        f"DiLoCo: one `PartialDiLoCo.sync` (fragments=1, every H steps). `PartialDiLoCo` all-reduces the *dense* "
        f"float32 delta of every full parameter, with zeros outside this rank's trained entries (the count vector "
        f"divides element-wise afterwards), so its payload is the full model whatever the slicing -- the same "
        f"bandwidth as DiLoCo, as in the paper ('the same bandwidth'). 'Trained entries' is what this rank "
        f"actually changed (a sparse exchange is not implemented). 'One-time setup' is the construction's replica "
        f"check (parameter hashes) and count-vector all-reduce (float64 masks). The outer loop also keeps float32 global "
        f"parameters + Nesterov momentum (+ count vector) on `outer_device` (host memory in the paper; not "
        f"included in the per-node numbers above).\n")
    lines = ["| variant | DDP payload / step | DiLoCo payload / sync | trained entries (fp32) | one-time setup "
             "| outer-loop state |", "|---|---:|---:|---:|---:|---:|"]
    for c in comms:
        r = by_row[c.key]
        ddp = format_bytes(c.ddp_bytes_per_step) if c.ddp_bytes_per_step else "-"
        lines.append(f"| {r.label} | {ddp} | {format_bytes(c.sync_bytes)} | {format_bytes(c.trained_entry_bytes)} | "
                     f"{format_bytes(c.setup_bytes)} | {format_bytes(c.outer_state_bytes)} |")
    parts.append("\n".join(lines) + "\n")

    check = ring_allreduce_seconds(2.6e9, 32, 2.875e9)
    parts.append("### Simulated wall-clock per 1000 steps\n")
    parts.append(
        f"The paper's model (section 3.1, Appendix B), evaluated with sympy: `T_comm = {T_RING}` per all-reduce "
        f"(bandwidth-optimal ring, no latency term; the paper's example M=2.6 GB, K=32, B=2.875 GB/s gives "
        f"{check:.2f} s, as in Appendix B). DDP: `{DDP_TOTAL}` (perfect overlap, the paper's best case for DDP); "
        f"DiLoCo / PartialDiLoCo: `{LOWCOMM_TOTAL}` (no overlap). `T_comp` = the measured step time above on this "
        f"CPU (full: {by_row['full'].step_seconds:.2f} s); M = the counted payloads. Same steps (tokens) for every "
        f"method: the extra tokens low-communication methods need to reach the same loss (1.7x in the paper's "
        f"Figure 3) are not included.\n")
    sim = result["simulation"]
    cols = sorted({(s["K"], s["gbit"]) for s in sim})
    lines = _sim_table(sim, rows)
    parts.append("\n".join(lines) + "\n")
    ddp = full_comm.ddp_bytes_per_step or 0
    comp = by_row["full"].step_seconds
    comm_lines, bound = [], []
    for k, b in cols:
        t = ring_allreduce_seconds(ddp, k, b * GBIT)
        comm_lines.append(f"{t:.3g} s (K={k}, {b:g} Gbit/s)")
        (bound if t > comp else []).append(f"K={k} at {b:g} Gbit/s")
    where = ("communication-bound (T_comm > T_comp) only at " + ", ".join(bound)) if bound else \
        "compute-bound at every simulated bandwidth"
    parts.append(
        f"(x) = speed-up over DDP at the same K and bandwidth. One ring all-reduce of the full model's gradients "
        f"({format_bytes(ddp)}) takes " + "; ".join(comm_lines)
        + f". With {comp:.2f} s of compute per step on this CPU, DDP is {where}. DDP's best case hides the "
          f"communication behind compute, so the low-communication methods can only win where it is "
          f"communication-bound; elsewhere the comparison is the compute per step, where the partial variants "
          f"save the skipped weight-gradient FLOPs and DiLoCo pays its (small, amortised) sync without overlap. "
          f"An accelerator computes the same step one to two orders of magnitude faster (the paper: 0.44 s/step "
          f"for 1.3B parameters on an H100, 1.75 s of communication at 2.875 GB/s with K=32), which moves every "
          f"bandwidth here towards the communication-bound regime. PartialDiLoCo and DiLoCo send the same bytes; "
          f"any difference between them is compute.\n")
    projected = result.get("simulation_projected") or []
    if projected:
        scale = result.get("projected_scale", PROJECTED_SCALE)
        parts.append(
            f"Projection, not a measurement: the same table with every measured step time multiplied by "
            f"{scale:g} (full training {comp * scale * 1e3:.0f} ms/step; the measured ratios between variants are "
            f"kept), i.e. a device {1 / scale:g}x faster than this CPU with the same network. No GPU was available "
            f"to this task to measure it.\n")
        parts.append("\n".join(_sim_table(projected, rows)) + "\n")
    return "\n".join(parts)


def _sim_table(sim: Sequence[dict[str, Any]], rows: Sequence[RowResult]) -> list[str]:
    """Markdown rows: one per (method, H), one column per (K, bandwidth)."""
    cols = sorted({(s["K"], s["gbit"]) for s in sim})
    lines = ["| method | H | " + " | ".join(f"K={k}, {b:g} Gbit/s" for k, b in cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    order = {r.key: i for i, r in enumerate(rows)}
    keys: list[tuple[str, str, int]] = []
    for s in sim:
        if (s["method"], s["key"], s["H"]) not in keys:
            keys.append((s["method"], s["key"], s["H"]))
    keys.sort(key=lambda t: (not t[0].startswith("DDP"), order[t[1]], t[2]))
    for method, key, h in keys:
        cells = []
        for k, b in cols:
            s = next(s for s in sim if (s["method"], s["H"], s["K"], s["gbit"]) == (method, h, k, b))
            extra = "" if method.startswith("DDP") else f" ({s['vs_ddp']:.2f}x)"
            t = s["total_s"]
            cells.append((f"{t:,.0f} s" if t >= 100 else f"{t:.1f} s") + extra)
        lines.append(f"| {method} | {h if h > 1 else 'every step'} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model (d_model 64, 2 layers); prints the report, writes neither RESULTS.md nor JSON")
    p.add_argument("--repeat", type=int, default=5,
                   help="timing rounds: one step of every variant per round, interleaved; the minimum is used")
    p.add_argument("--batch", type=int, default=None, help="override the batch size")
    p.add_argument("--seq-len", type=int, default=None, help="override the sequence length")
    p.add_argument("--variants", default=",".join(v.key for v in VARIANTS),
                   help="comma-separated subset of " + ", ".join(v.key for v in VARIANTS) + " (full is always run)")
    p.add_argument("--no-comm", action="store_true", help="skip the communication payload runs and the time model")
    p.add_argument("--no-recompute", action="store_true",
                   help="skip the rows with activation recomputation (and the eager rows without it)")
    p.add_argument("--no-write", action="store_true", help="do not write RESULTS.md")
    p.add_argument("--json", default=None, help=f"JSON output path (default {JSON_OUT}; "
                                                "none with --quick)")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="re-render the report from a saved JSON (no measurement); writes RESULTS.md unless --no-write")
    args = p.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        text = render(result) + f"\nCommand: `{result.get('command', '?')}` ({result['wall_seconds'] / 60:.1f} min).\n"
        print(text)
        if not args.no_write:
            write_section(HEADING, text, RESULTS)
        return 0
    cfg = QUICK if args.quick else FULL
    if args.batch:
        cfg = replace(cfg, batch=args.batch)
    if args.seq_len:
        cfg = replace(cfg, seq_len=args.seq_len)
    wanted = {k.strip() for k in args.variants.split(",") if k.strip()} | {"full"}
    unknown = wanted - {v.key for v in VARIANTS}
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {[v.key for v in VARIANTS]}")
    variants = [v for v in VARIANTS if v.key in wanted]
    t0 = time.perf_counter()
    result = run(cfg, variants, repeat=args.repeat, comm=not args.no_comm, recompute=not args.no_recompute)
    result["wall_seconds"] = time.perf_counter() - t0
    text = render(result)
    command = "OMP_NUM_THREADS=1 .venv/bin/python bench/bench_partial.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:]) if (argv or sys.argv[1:]) else "")
    result["command"] = command.strip()
    text += f"\nCommand: `{result['command']}` ({result['wall_seconds'] / 60:.1f} min).\n"
    print(text)
    json_path = Path(args.json) if args.json else (None if args.quick else JSON_OUT)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1, default=str))
    if not args.quick and not args.no_write:
        write_section(HEADING, text, RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

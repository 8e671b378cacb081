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

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the shared RESULTS.md writer

import gradshard as gs  # noqa: E402
from gradshard.examples.models.llama import LlamaLM  # noqa: E402
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
from partial_accounting import (  # noqa: E402  (re-exported: tests read them from this module)
    BANDWIDTHS_GBIT, DDP_TOTAL, FULL, GBIT, LOWCOMM_TOTAL, NODES, PAPER_TABLE1, PROJECTED_SCALE, QUICK, STEPS,
    T_RING, CommResult, ModelConfig, RowResult, paper_step_flops, paper_trainable_params, ring_allreduce_seconds,
    simulate,
)
from partial_report import render  # noqa: E402

JSON_OUT = OUTPUT_DIR / "out" / "partial.json"
HEADING = "## Partial parameter updates (issue 6)"


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

"""Benchmark adjoint sharding on the paper's SSM LM (4 layers, P=128, N=16, diagonal), CPU.

For T in {1K, 4K, 16K, 64K} and each method -- plain autograd (``plan="none"``), per-layer
``torch.utils.checkpoint``, ``plan="adjoint"``, ``plan="truncated_adjoint"`` with
``W = sqrt(T)`` and ``W = 1024`` -- one training step (forward, cross-entropy, backward) is
measured with ``gs.measure``: peak memory above the parameters, bytes saved for backward,
FLOPs (``torch.utils.flop_counter``) and wall time, reported as a ratio to plain autograd
in the same process. Writes the table to ``RESULTS.md`` (``bench/`` in a checkout, the current
folder for an installed gradshard) under "## Adjoint sharding (issue 3)" (other sections are kept).

    python bench/bench_adjoint.py                       # everything (slow on 2 cores)
    python bench/bench_adjoint.py --seq-lens 1k,4k --repeat 3
    python bench/bench_adjoint.py --skip none@64k --no-write
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the shared RESULTS.md writer

import gradshard as gs  # noqa: E402
from gradshard.examples.models.ssm import SelectiveSSMLM, SSMConfig  # noqa: E402
from gradshard.units import format_bytes
from results_md import RESULTS, write_section  # noqa: E402

HEADING = "## Adjoint sharding (issue 3)"
NOTES = (
    "Notes. Targets (T=16K): peak >= 10x below autograd, >= 3x below per-layer checkpointing, time <= 1.5x. "
    "With adjoint the peak is in the cross-entropy backward (`gs.measure` reports it at "
    "`_log_softmax_backward_data`); per token (P=128, vocab 256, float32) it holds: 4096 B of loss tensors outside "
    "the compiled model -- the logits (held by the step), the log-softmax saved by the loss, the gradient from "
    "`nll_loss_backward` and the logits' gradient being written, 1 KiB each; 2048 B the plan keeps -- the inputs "
    "of layers 1-3 (512 B each) and the input of the final RMSNorm + LM head (512 B); and 62 B of state "
    "checkpoints (4 layers x T/512 states of N*P floats): 6206 B/token in all (97.0 MiB at 16K). Layer 0's "
    "input, the token embedding, is not kept: the region recomputes it from the ids in each backward shard. "
    "The final norm and LM head are pointwise in time; the plan runs them as `tail_0`, which keeps its input "
    "only and recomputes itself shard by shard in the backward, where plain autograd kept 1540 B/token (the "
    "head input, the normalised input, its scaled copy, the inverse RMS). Before these two changes the peak was "
    "7746 B/token (121.0 MiB at 16K, 9.6x): +512 B for the stored embedding, +1028 B for the head's autograd "
    "intermediates. 'saved for backward' is the four 512 B residual-stream tensors, the loss's log-softmax and "
    "the checkpoints (3134 B/token); the recomputed head adds one LM-head forward to the FLOPs. "
    "The truncated plan adds O(W) buffers (the next W-1 steps of (a, g) and one block of F), "
    "visible at W=1024 and short T. Step times on this shared 2-core machine vary by 2-5x between runs "
    "(other jobs); plain autograd at 64K is additionally slowed by multi-GB allocations.")
MLP_HEADING = "## Adjoint sharding, MLP blocks between the SSM layers (issue 3)"
MLP_NOTES = (
    "Notes. Every MLP block (between two SSM layers, and after the last one) is a time-local segment: the plan "
    "runs it as a `local_recompute` region that keeps only the residual stream entering it and recomputes the "
    "block shard by shard in the backward, where plain autograd keeps the normalised input, the MLP's hidden "
    "pre- and post-activation (2 x 4P floats) and more per token and layer. Before the segments between "
    "recurrences were recomputed (only the tail after the last layer was), adjoint peaked at 361.2 MiB at 16K "
    "(313.2 MiB saved for backward), 3.0x above the figure here. `python bench/bench_adjoint.py "
    "--mlp 4 --methods none,checkpoint,adjoint --seq-lens 4k,16k`."
)
METHODS = ("none", "checkpoint", "adjoint", "trunc_sqrt", "trunc_1024")


def parse_len(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


class ResidualMLP(torch.nn.Module):
    """``y + W2 gelu(W1 rmsnorm(y))``: the MLP block hybrid models put after each SSM layer."""

    def __init__(self, d: int, mult: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.up = torch.nn.Linear(d, mult * d)
        self.down = torch.nn.Linear(mult * d, d)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.down(F.gelu(self.up(self.norm(y))))


def make_model(seed: int = 0, mlp: int = 0) -> SelectiveSSMLM:
    """The paper's SSM LM; ``mlp > 0`` puts a ``mlp x d`` MLP block after every SSM layer."""
    torch.manual_seed(seed)
    model = SelectiveSSMLM(SSMConfig(vocab_size=256, d_model=128, n_layers=4, d_state=16, decay="diagonal",
                                     scan="gradshard"))
    if mlp:
        d = model.config.d_model
        model.layers = torch.nn.ModuleList(torch.nn.Sequential(block, ResidualMLP(d, mlp)) for block in model.layers)
    return model


def checkpointed(model: SelectiveSSMLM):
    def run(ids: torch.Tensor) -> torch.Tensor:
        y = model.embed(ids)
        for layer in model.layers:
            y = checkpoint(layer, y, use_reentrant=False)
        return model.lm_head(model.norm_f(y))

    return run


def runner(method: str, model: SelectiveSSMLM, T: int, shard: int):
    if method == "none":
        return gs.compile(model, plan="none"), "plain autograd (plan='none')"
    if method == "checkpoint":
        return checkpointed(model), "torch.utils.checkpoint per layer"
    if method == "adjoint":
        return gs.compile(model, plan="adjoint", shard_size=shard), f"adjoint, shard {shard}"
    W = int(round(math.sqrt(T))) if method == "trunc_sqrt" else 1024
    return gs.compile(model, plan="truncated_adjoint", window=W, shard_size=shard), f"truncated, W={W}, shard {shard}"


def measure_one(method: str, T: int, batch: int, shard: int, repeat: int, mlp: int = 0) -> dict:
    model = make_model(mlp=mlp)
    run, label = runner(method, model, T, shard)
    ids = torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(T))
    labels = torch.roll(ids, -1, 1)

    def step(ids: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        logits = run(ids)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()

    t0 = time.perf_counter()
    step(ids)  # warm-up: capture and compile happen here
    compile_s = time.perf_counter() - t0
    m = gs.measure(step, ids, repeat=repeat)
    out = {"method": method, "label": label, "T": T, "peak": m.peak_bytes, "saved": m.saved_bytes,
           "flops": m.flops, "seconds": m.seconds, "first_call_s": compile_s}
    del model, run, m
    gc.collect()
    return out



def table(rows: list[dict]) -> str:
    base = {r["T"]: r for r in rows if r["method"] == "none"}
    ck = {r["T"]: r for r in rows if r["method"] == "checkpoint"}
    lines = ["| T | method | peak memory | saved for backward | GFLOP | step time | time / autograd | peak: autograd / this | peak: checkpoint / this |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b, c = base.get(r["T"]), ck.get(r["T"])
        ratio_t = f"{r['seconds'] / b['seconds']:.2f}x" if b and b["seconds"] and r["seconds"] else "-"
        ratio_m = f"{b['peak'] / r['peak']:.1f}x" if b and r["peak"] else "-"
        ratio_c = f"{c['peak'] / r['peak']:.1f}x" if c and r["peak"] else "-"
        lines.append(f"| {r['T']} | {r['label']} | {format_bytes(r['peak'])} | {format_bytes(r['saved'])} | {r['flops'] / 1e9:.1f} | "
                     f"{r['seconds']:.2f} s | {ratio_t} | {ratio_m} | {ratio_c} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1k,4k,16k,64k")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--repeat", type=int, default=1, help="timed steps per point (median)")
    p.add_argument("--skip", default="", help="comma-separated method@len to skip, e.g. none@64k")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--mlp", type=int, default=0,
                   help="put an MLP block (hidden = MLP x d_model) after every SSM layer; own RESULTS section")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lens = [parse_len(s) for s in args.seq_lens.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    skip = {(s.split("@")[0], parse_len(s.split("@")[1])) for s in args.skip.split(",") if "@" in s}
    rows, skipped = [], []
    for T in lens:
        for method in methods:
            if (method, T) in skip:
                skipped.append(f"{method}@{T}")
                continue
            r = measure_one(method, T, args.batch, args.shard_size, args.repeat, args.mlp)
            rows.append(r)
            print(f"T={T:6d} {r['label']:40s} peak {format_bytes(r['peak']):>10s} saved {format_bytes(r['saved']):>10s} "
                  f"{r['flops'] / 1e9:8.1f} GFLOP {r['seconds']:7.2f} s (first call {r['first_call_s']:.1f} s)",
                  flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    model_desc = "the paper's SSM LM" + (
        f" with an MLP block (RMSNorm, {args.mlp}x{128} GELU MLP, residual) after each SSM layer" if args.mlp else "")
    text = (
        f"Model: {model_desc}, 4 layers, P=128, N=16, diagonal decay, vocab 256, batch {args.batch}, "
        f"float32, `gradshard.kernels.linear_scan` (torch backend); shard size {args.shard_size}. "
        f"Machine: {cpu}, {os.cpu_count()} cores shared with other jobs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); times are single-run medians of {args.repeat} step(s) and noisy. "
        "Peak memory and saved bytes from `gs.measure` (dispatch tracker, above the parameters); FLOPs from "
        "`torch.utils.flop_counter` (its formulas skip the scan kernel's elementwise work).\n\n"
        + table(rows)
        + (f"\n\nSkipped (time budget): {', '.join(skipped)}." if skipped else "")
        + "\n\n" + (MLP_NOTES if args.mlp else NOTES)
    )
    print(text)
    if not args.no_write:
        write_section(MLP_HEADING if args.mlp else HEADING, text, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

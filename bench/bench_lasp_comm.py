"""Benchmark LASP: bytes per layer and direction, per-rank step time and peak memory.

A linear-attention stack (projections, per-step gates, ``lasp_attention``, MLP) is trained
for one step on world sizes 1, 2, 4 (threaded gloo groups in one process) and several
sequence lengths. Per configuration it reports

- the KV bytes one rank sends per layer in the forward and the dKV bytes per layer in the
  backward (``CommCounter``; expected: one state, B·H·dk·dv·element_size, whatever T is),
- the gradient all-reduce payload per rank,
- per-rank step time (median of ``--repeat`` timed steps, the slowest rank) and peak memory
  above the baseline (``gradshard.measure``; the largest rank).

Threaded ranks share the machine's cores, so step times at W > 1 measure overhead and
load balance, not the speed-up of W real devices. Run::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_lasp_comm.py
    .venv/bin/python bench/bench_lasp_comm.py --seq-lens 1024 4096 16384 --repeat 5 --out table.md
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradshard.distributed.comm import CommCounter
from gradshard.distributed.reduce import reduce_gradients
from gradshard.distributed.testing import run_threaded
from gradshard.measure import describe_device, format_bytes, measure
from gradshard.runtime.lasp import dkv_label, kv_label, lasp_attention, local_slice


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, dk: int, dv: int) -> None:
        super().__init__()
        self.heads, self.dk, self.dv = heads, dk, dv
        self.qkv = nn.Linear(d_model, heads * (2 * dk + dv))
        self.gate = nn.Linear(d_model, heads)
        self.out = nn.Linear(heads * dv, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, attention: Any) -> torch.Tensor:
        b, t, _ = x.shape
        h, dk, dv = self.heads, self.dk, self.dv
        q, k, v = self.qkv(x).view(b, t, h, 2 * dk + dv).transpose(1, 2).split([dk, dk, dv], -1)
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        decay = torch.sigmoid(self.gate(x) + 3.0).transpose(1, 2)  # (B, H, T) gates near 0.95
        o = attention(q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous())
        x = x + self.out(o.transpose(1, 2).reshape(b, t, h * dv))
        return x + self.mlp(x)


@dataclass(frozen=True)
class RankResult:
    kv_bytes: tuple[int, ...]  # per layer, sent in the forward
    dkv_bytes: tuple[int, ...]  # per layer, sent in the backward
    p2p_messages: int
    allreduce_bytes: int
    seconds: float
    peak_bytes: int


def _rank(rank: int, group: Any, model: nn.Module, x: torch.Tensor, args: argparse.Namespace) -> RankResult:
    model = copy.deepcopy(model)
    world = group.size()
    xl = local_slice(x, rank, world, dim=1).contiguous()
    n_global = x.shape[0] * x.shape[1]

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        h = xl
        for i, block in enumerate(model):
            h = block(h, lambda q, k, v, d, i=i: lasp_attention(
                q, k, v, d, group=group, layer_id=i, chunk_size=args.chunk))
        loss = h.float().pow(2).sum() / n_global
        loss.backward()
        reduce_gradients(model.parameters(), group)

    with CommCounter(group) as counter:  # one counted step (also the warm-up)
        step()
    m = measure(step, repeat=args.repeat)
    layers = range(len(model))
    return RankResult(
        kv_bytes=tuple(counter.bytes(kv_label(i), "send") for i in layers),
        dkv_bytes=tuple(counter.bytes(dkv_label(i), "send") for i in layers),
        p2p_messages=counter.messages(direction="send"),
        allreduce_bytes=counter.bytes(label="grad_allreduce", direction="allreduce"),
        seconds=m.seconds or 0.0,
        peak_bytes=m.peak_bytes,
    )


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dk", type=int, default=32)
    p.add_argument("--dv", type=int, default=32)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--out", help="also append the table to this markdown file")
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.d_model, args.heads, args.dk, args.dv) for _ in range(args.layers)]).to(dtype)
    state_bytes = args.batch * args.heads * args.dk * args.dv * torch.finfo(dtype).bits // 8

    header = (
        "| W | T | tokens/rank | KV sent/layer (fwd) | dKV sent/layer (bwd) | p2p msgs/rank | "
        "grad all-reduce/rank | step time (slowest rank) | peak mem (largest rank) | peak vs W=1 |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows, base_peak = [], {}
    for t in args.seq_lens:
        x = torch.randn(args.batch, t, args.d_model, dtype=dtype)
        for w in args.world_sizes:
            res: list[RankResult] = run_threaded(w, _rank, model, x, args, timeout_s=3600.0)
            kv = sorted({b for r in res for b in r.kv_bytes if b})
            dkv = sorted({b for r in res for b in r.dkv_bytes if b})
            peak = max(r.peak_bytes for r in res)
            base_peak.setdefault(t, peak if w == 1 else None)
            ratio = f"{peak / base_peak[t]:.2f}x" if base_peak.get(t) else "-"
            fmt = lambda v: " / ".join(f"{b} B" for b in v) if v else "0 B"  # noqa: E731
            rows.append(
                f"| {w} | {t} | {t // w}{'+' if t % w else ''} | {fmt(kv)} | {fmt(dkv)} | "
                f"{max(r.p2p_messages for r in res)} | {format_bytes(max(r.allreduce_bytes for r in res))} | "
                f"{max(r.seconds for r in res) * 1e3:.1f} ms | {format_bytes(peak)} | {ratio} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)

    machine = (
        f"{describe_device('cpu')}; Python {platform.python_version()}, torch {torch.__version__}; "
        f"ranks are threads with gloo groups over loopback"
    )
    config = (
        f"B={args.batch}, H={args.heads}, dk={args.dk}, dv={args.dv}, d_model={args.d_model}, "
        f"layers={args.layers}, chunk={args.chunk}, {args.dtype}, per-step gates; expected state "
        f"= B·H·dk·dv·{torch.finfo(dtype).bits // 8} = {state_bytes} B per layer and direction"
    )
    table = f"### LASP communication, time and memory\n\nMachine: {machine}\n\nConfig: {config}\n\n"
    table += header + "\n".join(rows) + "\n"
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
    return table


if __name__ == "__main__":
    main()

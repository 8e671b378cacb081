"""Benchmark LASP: bytes per layer and direction, per-rank step time and peak memory.

A linear-attention stack (projections, per-step gates, ``lasp_attention``, MLP) is trained
for one step on world sizes 1, 2, 4 (threaded gloo groups in one process) and several
sequence lengths. Per configuration it reports

- the KV bytes one rank sends per layer in the forward and the dKV bytes per layer in the
  backward (``CommCounter``; expected: one state, B·H·dk·dv·element_size, whatever T is),
- the gradient all-reduce payload per rank,
- per-rank step time (median of ``--repeat`` timed steps, the slowest rank) and peak memory
  above the baseline (``gradshard.measure``; the largest rank).

``--compiled`` measures the same through the compiled plan instead: the example
linear-attention LM (``gradshard.examples.models.linear_attention``) under ``gs.compile(model,
plan="lasp")`` (regions detected in the captured graph, gradients all-reduced by the plan),
against ``plan="none"`` on one process; ``--max-len BUDGET`` finds the longest sequence each
world size can train under a per-rank memory budget (the paper's Figure 3): bisection on the
local length with ``gradshard.measure``, then a measured check of the whole world at
``W x`` that length. ``--results`` writes the tables into ``bench/RESULTS.md`` under
``## LASP (issue 5)`` (replacing that section only).

Threaded ranks share the machine's cores, so step times at W > 1 measure overhead and
load balance, not the speed-up of W real devices. Run::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_lasp_comm.py
    .venv/bin/python bench/bench_lasp_comm.py --seq-lens 1024 4096 16384 --repeat 5 --out table.md
    .venv/bin/python bench/bench_lasp_comm.py --compiled --max-len 64MiB --results
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

from gradshard.runtime.comm import CommCounter
from gradshard.runtime.reduce import reduce_gradients
from gradshard.distributed.testing import run_threaded
from gradshard.measure import describe_device, format_bytes, measure
from gradshard.plans.lasp.runtime import dkv_label, kv_label, lasp_attention, local_slice

SECTION = "## LASP (issue 5)"
_HERE = str(__import__("pathlib").Path(__file__).resolve().parent)
if _HERE not in sys.path:  # this folder: the shared RESULTS.md writer
    sys.path.insert(0, _HERE)
from results_md import RESULTS, write_section  # noqa: E402


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


# --------------------------------------------------------------------------- compiled plan


def _example_model(args: argparse.Namespace) -> nn.Module:
    """The example TransNormer-style LM calling the lightning kernel (float32)."""
    from gradshard.examples.models.linear_attention import LinearAttentionConfig, LinearAttentionLM

    torch.manual_seed(0)
    cfg = LinearAttentionConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                                n_heads=args.heads, glu_hidden=2 * args.d_model, attn_impl="gradshard",
                                block_size=args.chunk)
    return LinearAttentionLM(cfg)


def _compiled_rank(rank: int, group: Any, model: nn.Module, ids: torch.Tensor, args: argparse.Namespace,
                   plan: str = "lasp") -> RankResult:
    """One rank: compile (first call), one counted step, then gs.measure of the step."""
    import gradshard as gs

    model = copy.deepcopy(model)
    world = group.size() if group is not None else 1
    opts = {"group": group, "chunk_size": args.chunk} if plan == "lasp" else {}
    cm = gs.compile(model, plan=plan, **opts)
    x = local_slice(ids, rank, world) if world > 1 else ids
    n_global = ids.numel()

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        logits = cm(x)
        (logits.float().logsumexp(-1).sum() / n_global).backward()

    step()  # capture, compile, handshake
    with CommCounter(group) as counter:
        step()
    m = measure(step, repeat=args.repeat)
    layers = range(args.layers)
    return RankResult(
        kv_bytes=tuple(counter.bytes(kv_label(i), "send") for i in layers),
        dkv_bytes=tuple(counter.bytes(dkv_label(i), "send") for i in layers),
        p2p_messages=counter.messages(direction="send"),
        allreduce_bytes=counter.bytes(label="grad_allreduce", direction="allreduce"),
        seconds=m.seconds or 0.0,
        peak_bytes=m.peak_bytes,
    )


def _run_world(world: int, model: nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> list[RankResult]:
    if world == 1:  # a single-rank group: the same program without peers
        return [_compiled_rank(0, None, model, ids, args)]
    return run_threaded(world, _compiled_rank, model, ids, args, timeout_s=3600.0)


def compiled_table(args: argparse.Namespace) -> str:
    """Bytes per layer and direction, step time and per-rank peak through plan="lasp"."""
    model = _example_model(args)
    dk = args.d_model // args.heads
    state = args.batch * args.heads * dk * dk * 4
    rows = []
    for t in args.seq_lens:
        ids = torch.randint(0, 256, (args.batch, t), generator=torch.Generator().manual_seed(t))
        base = _compiled_rank(0, None, model, ids, args, plan="none")
        rows.append(f"| none | 1 | {t} | {t} | - | - | - | {base.seconds * 1e3:.1f} ms | "
                    f"{format_bytes(base.peak_bytes)} | 1.00x |")
        print(rows[-1], file=sys.stderr, flush=True)
        for w in args.world_sizes:
            res = _run_world(w, model, ids, args)
            kv = sorted({b for r in res for b in r.kv_bytes if b})
            dkv = sorted({b for r in res for b in r.dkv_bytes if b})
            fmt = lambda v: " / ".join(f"{b:,} B" for b in v) if v else "0 B"  # noqa: E731
            peak = max(r.peak_bytes for r in res)
            rows.append(
                f"| lasp | {w} | {t} | {-(-t // w)} | {fmt(kv)} | {fmt(dkv)} | "
                f"{format_bytes(max(r.allreduce_bytes for r in res))} | "
                f"{max(r.seconds for r in res) * 1e3:.1f} ms | {format_bytes(peak)} | "
                f"{peak / base.peak_bytes:.2f}x |")
            print(rows[-1], file=sys.stderr, flush=True)
    header = ("| plan | W | T | tokens/rank (max) | KV sent/layer (fwd) | dKV sent/layer (bwd) | "
              "grad all-reduce/rank | step time (slowest rank) | peak mem (largest rank) | peak vs none |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n")
    config = (f"example LM (`LinearAttentionLM`, kernel op), B={args.batch}, H={args.heads}, "
              f"dk=dv={dk}, d_model={args.d_model}, layers={args.layers}, vocab 256, float32, "
              f"chunk {args.chunk}; expected state = B·H·dk·dv·4 = {state:,} B per layer and direction")
    return f"### Through the compiled plan\n\nConfig: {config}\n\n" + header + "\n".join(rows) + "\n"


def _peak_at(local_len: int, model: nn.Module, args: argparse.Namespace) -> int:
    ids = torch.randint(0, 256, (args.batch, local_len), generator=torch.Generator().manual_seed(1))
    return _compiled_rank(0, None, model, ids, args).peak_bytes


def max_len_table(args: argparse.Namespace, budget: int) -> str:
    """Longest sequence per world size under ``budget`` bytes per rank (Figure 3 shape)."""
    model = _example_model(args)
    step = args.granularity
    lo, hi = step, step
    while _peak_at(hi, model, args) <= budget:  # doubling
        lo, hi = hi, hi * 2
    if lo == hi:
        raise SystemExit(f"--max-len: even {step} tokens exceed the budget {format_bytes(budget)}")
    while hi - lo > step:  # bisection on the local length, to `step` tokens
        mid = (lo + hi) // 2 // step * step
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _peak_at(mid, model, args) <= budget else (lo, mid)
    rows = []
    for w in args.world_sizes:
        t = lo * w
        ids = torch.randint(0, 256, (args.batch, t), generator=torch.Generator().manual_seed(2))
        res = _run_world(w, model, ids, args)
        peak = max(r.peak_bytes for r in res)
        ok = "yes" if peak <= budget else "NO"
        rows.append(f"| {w} | {t:,} | {lo:,} | {format_bytes(peak)} | {ok} | "
                    f"{max(r.seconds for r in res) * 1e3:.0f} ms |")
        print(rows[-1], file=sys.stderr, flush=True)
    header = ("| W | max T (global) | tokens/rank | measured peak (largest rank) | within budget | step time |\n"
              "|---|---|---|---|---|---|\n")
    return (f"### Longest trainable sequence under {format_bytes(budget)} per rank\n\n"
            f"Bisection of the local length (granularity {step} tokens) with `gradshard.measure` on one "
            f"rank, then one measured step of all W ranks at W x that length. Same model as above.\n\n"
            + header + "\n".join(rows) + "\n")


def _parse_bytes(text: str) -> int:
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for u, f in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * f)
    return int(float(t))


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
    p.add_argument("--compiled", action="store_true", help="measure through gs.compile(plan='lasp')")
    p.add_argument("--max-len", metavar="BUDGET", help="longest sequence per world size under BUDGET per rank")
    p.add_argument("--granularity", type=int, default=256, help="--max-len: bisection step in tokens")
    p.add_argument("--results", action="store_true", help="write the section '## LASP (issue 5)' of RESULTS.md")
    args = p.parse_args(argv)
    if args.compiled or args.max_len:
        return _main_compiled(args)

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


def _machine() -> str:
    return (f"{describe_device('cpu')}; Python {platform.python_version()}, torch {torch.__version__}; "
            f"ranks are threads with gloo groups over loopback (they share the cores)")


def _main_compiled(args: argparse.Namespace) -> str:
    if args.dtype != "float32":
        raise SystemExit("--compiled / --max-len measure the float32 example model")
    parts = [f"Machine: {_machine()}\n"]
    if args.compiled:
        parts.append(compiled_table(args))
    if args.max_len:
        parts.append(max_len_table(args, _parse_bytes(args.max_len)))
    body = "\n".join(parts)
    print(body)
    if args.results:
        write_section(SECTION, body, RESULTS)
    return body


if __name__ == "__main__":
    main()

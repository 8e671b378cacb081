"""Low-communication training with partial parameter updates and a DiLoCo outer loop.

Each rank trains one slice (``rank mod num_slices``) of every MLP projection and of the
attention q/k/v head groups of a small Llama-style byte-level LM on its own stream of
real text (the Python standard library's sources, no download); every ``--sync-every``
local steps the ranks average their deltas element-wise by the count vector and take an
outer Nesterov step (:class:`gradshard.distributed.diloco.PartialDiLoCo`)::

    torchrun --nproc-per-node 4 -m gradshard.examples.train_partial --steps 200 --sync-every 20
    torchrun --nproc-per-node 2 -m gradshard.examples.train_partial --fragments 2      # streaming
    python -m gradshard.examples.train_partial --steps 50                             # one process
    torchrun --nproc-per-node 2 -m gradshard.examples.train_partial --compile         # via gs.compile

Without ``--compile`` the projections are sliced eagerly by module name
(:func:`gradshard.plans.partial_update.runtime.slice_linears`); with it, ``gs.compile(model,
plan="partial_update")`` finds them in the captured graph by structure.

gloo on CPU, nccl when CUDA is available (one GPU per local rank). ``--ckpt DIR`` saves
every rank's whole state after each sync; ``--resume`` continues bit-for-bit from it.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradshard.examples.data import iterate_batches, load_corpus
from gradshard.examples.models.llama import LlamaConfig, LlamaLM
from gradshard.distributed.diloco import PartialDiLoCo
from gradshard.plans.partial_update.runtime import (
    SliceLayout,
    attention_layouts,
    mlp_in_layout,
    mlp_out_layout,
    slice_linears,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="local (inner) steps per rank")
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps between syncs")
    p.add_argument("--fragments", type=int, default=1, help="streaming fragments (1 = plain DiLoCo)")
    p.add_argument("--num-slices", type=int, default=0, help="N slices (default: min(world size, 2))")
    p.add_argument("--targets", default="mlp,attention", help="what to slice: mlp, attention, or both")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt", default="", help="directory for per-rank checkpoints (saved at syncs)")
    p.add_argument("--resume", action="store_true", help="resume from --ckpt")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective gives up")
    p.add_argument("--compile", action="store_true", help="slice via gs.compile(plan='partial_update')")
    return p.parse_args(argv)


def setup() -> tuple[int, int, torch.device]:
    """Init torch.distributed under torchrun (gloo on CPU, nccl on GPU); else one process."""
    if "RANK" not in os.environ:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, dev
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    return dist.get_rank(), dist.get_world_size(), dev


def layouts_for(cfg: LlamaConfig, num_slices: int, index: int, targets: set[str]) -> dict[str, SliceLayout]:
    """MLP up/gate by hidden rows, down by hidden columns; q/k/v by (GQA-consistent) head groups."""
    out: dict[str, SliceLayout] = {}
    for i in range(cfg.n_layers):
        if "mlp" in targets:
            p = f"layers.{i}.mlp."
            out[p + "gate_proj"] = mlp_in_layout(cfg.intermediate_size, num_slices, index)
            out[p + "up_proj"] = mlp_in_layout(cfg.intermediate_size, num_slices, index)
            out[p + "down_proj"] = mlp_out_layout(cfg.intermediate_size, num_slices, index)
        if "attention" in targets:
            q, kv = attention_layouts(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, num_slices, index)
            p = f"layers.{i}.self_attn."
            out.update({p + "q_proj": q, p + "k_proj": kv, p + "v_proj": kv})
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace, device) -> float:
    losses = []
    for x, y in iterate_batches(tokens, args.batch, args.seq_len, seed=12345, num_batches=4, device=device):
        logits = model(x)
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item())
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world, device = setup()
    num_slices = args.num_slices or min(world, 2)
    targets = {t.strip() for t in args.targets.split(",") if t.strip()}

    torch.manual_seed(0)  # identical replicas on every rank (checked by PartialDiLoCo)
    cfg = LlamaConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                      intermediate_size=(8 * args.d_model) // 3)
    model = LlamaLM(cfg).to(device)
    full_numel = sum(p.numel() for p in model.parameters())
    corpus = load_corpus(max_bytes=2_000_000)
    if args.compile:
        import gradshard as gs

        model = gs.compile(model, plan="partial_update", num_slices=num_slices,
                           slice_index=rank % num_slices, targets=tuple(sorted(targets)))
        with torch.no_grad():  # gradshard captures at the first call; the slices exist after it
            model(next(iterate_batches(corpus.train, args.batch, args.seq_len, device=device))[0])
    else:
        slice_linears(model, layouts_for(cfg, num_slices, rank % num_slices, targets))
    # the full weights of sliced layers get no gradient: only slices and unsliced parameters train
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    outer = PartialDiLoCo(
        model, opt, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        sync_every=args.sync_every, fragments=args.fragments, timeout_s=args.timeout,
    )
    ckpt = os.path.join(args.ckpt, "rank{rank}.pt") if args.ckpt else ""
    if args.resume:
        if not ckpt:
            raise SystemExit("--resume needs --ckpt DIR")
        outer.load(ckpt)

    trained = sum(
        outer.masks[n].expand_as(v).sum().item() for n, v in outer.global_parameters.items()
    )
    if rank == 0:
        print(f"world {world} ({device}), {num_slices} slice(s) of {sorted(targets)}; "
              f"trainable {trained:,} of {full_numel:,} parameters per rank "
              f"({100 * trained / full_numel:.0f}%); H={args.sync_every}, fragments={args.fragments}",
              flush=True)
        print(f"initial val loss {evaluate(model, corpus.val, args, device):.4f} "
              f"(uniform: {math.log(256):.4f})", flush=True)

    # each rank reads its own shard of the stream: a different sampling seed per rank,
    # advanced past the batches consumed before a resume
    batches = iterate_batches(corpus.train, args.batch, args.seq_len, seed=1000 + rank, device=device)
    for _ in range(outer.inner_steps):
        next(batches)
    t0, running = time.perf_counter(), []
    for step in range(outer.inner_steps + 1, args.steps + 1):
        x, y = next(batches)
        model.train()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        running.append(loss.item())
        synced = outer.step()
        if rank == 0 and (step % args.log_every == 0 or synced is not None):
            msg = f"step {step:5d}  train loss {sum(running) / len(running):.4f}"
            running = []
            if synced is not None:
                msg += f"  | synced fragment {synced}"
                if synced == len(outer.fragments) - 1:
                    # with fragments > 1 the earlier fragments have trained locally since
                    # their sync: this is rank 0's model, the global one only for fragments=1
                    which = "global model" if len(outer.fragments) == 1 else "rank 0"
                    msg += f", val loss ({which}) {evaluate(model, corpus.val, args, device):.4f}"
            print(msg + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        if ckpt and synced is not None:
            os.makedirs(args.ckpt, exist_ok=True)
            outer.save(ckpt)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train the paper's selective SSM LM with adjoint sharding (single process or layer-sharded).

Single process::

    python -m gradshard.examples.train_ssm --plan adjoint --seq-len 2048 --steps 20
    python -m gradshard.examples.train_ssm --plan truncated_adjoint --window 256

Layers sharded over ranks (paper Algorithms 3-4; gloo on CPU, nccl on GPU)::

    torchrun --nproc-per-node 2 -m gradshard.examples.train_ssm --distributed --layers 4

Each rank builds the same model (same seed), keeps only its block of layers (rank 0 also the
embedding, the last rank the final norm and LM head), its optimizer state and its saved
tensors; activations go forward rank to rank and dL/dy comes back.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from gradshard.examples.data import example_batch
from gradshard.examples.models.ssm import SelectiveSSMLM, SSMConfig


class SSMStage(nn.Module):
    """A contiguous block of an SSM LM's layers (plus the embedding / the head at the ends)."""

    def __init__(self, model: SelectiveSSMLM, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm_f = model.norm_f if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            y = layer(y)
        if self.lm_head is not None:
            y = self.lm_head(self.norm_f(y))
        return y


def ssm_stage(model: SelectiveSSMLM, rank: int, world: int) -> SSMStage:
    """This rank's stage of ``model`` (layers split by :func:`gradshard.distributed.adjoint.split_layers`)."""
    from gradshard.distributed.adjoint import split_layers

    blocks = split_layers(len(model.layers), world)
    return SSMStage(model, blocks[rank], rank == 0, rank == world - 1)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="adjoint", choices=["none", "adjoint", "truncated_adjoint"])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--distributed", action="store_true", help="shard the layers over torchrun's ranks")
    args = p.parse_args(argv)

    import gradshard as gs

    torch.manual_seed(0)
    model = SelectiveSSMLM(SSMConfig(d_model=args.d_model, n_layers=args.layers, d_state=args.d_state, scan="gradshard"))
    options = {} if args.plan == "none" else {"shard_size": args.shard_size}
    if args.plan == "truncated_adjoint":
        options["window"] = args.window
    if args.distributed:
        import torch.distributed as dist

        from gradshard.distributed.adjoint import PipelineStage

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        stage_module = ssm_stage(model, rank, world)
        stage = PipelineStage(stage_module, dist.group.WORLD, plan=args.plan, **options)
        opt = torch.optim.AdamW(stage_module.parameters(), lr=args.lr)
        for step in range(args.steps):
            ids, labels = example_batch(args.batch, args.seq_len, seed=step)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = stage.step(ids, lambda out: lm_loss(out, labels))
            opt.step()
            if loss is not None:
                print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.2f}s  (rank {rank}/{world})")
        dist.destroy_process_group()
        return 0
    cm = gs.compile(model, plan=args.plan, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        ids, labels = example_batch(args.batch, args.seq_len, seed=step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(cm(ids), labels)
        loss.backward()
        opt.step()
        print(f"step {step:3d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

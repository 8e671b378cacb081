"""Train the TransNormer-style linear-attention LM with LASP sequence parallelism.

Every rank of the job holds one contiguous slice of each sequence; ``gs.compile(model,
plan="lasp")`` finds the linear-attention layers in the captured graph and runs them with
LASP (KV states passed rank to rank, dKV back in the backward), and all-reduces the
parameter gradients so every rank takes the same optimizer step::

    torchrun --nproc-per-node 2 -m gradshard.examples.train_lasp --steps 20 --seq-len 256
    torchrun --nproc-per-node 4 -m gradshard.examples.train_lasp --impl blockwise --decay gated
    python -m gradshard.examples.train_lasp --steps 5                     # one process (world size 1)

Data: real text bytes (the Python standard library's sources, no download). All ranks draw
the same batch (same seed); labels are shifted on the full sequence *before* slicing, so
the next-token target of a rank's last position is the next rank's first token. The loss is
the mean over all tokens of the job: each rank divides its token-loss sum by the global
token count (:func:`gradshard.runtime.reduce.global_mean`), so the per-rank losses sum
to the full-sequence loss and the all-reduced gradients are its gradient.

gloo on CPU, nccl when CUDA is available (one GPU per local rank); every communication has a
timeout (``--timeout``), so a failing rank makes the others stop with an error, not hang.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradshard as gs
from gradshard.examples.data import VOCAB_SIZE, iterate_batches, load_corpus
from gradshard.examples.models.linear_attention import LinearAttentionConfig, LinearAttentionLM
from gradshard.runtime.comm import set_default_timeout
from gradshard.runtime.reduce import global_mean, sum_over_group
from gradshard.plans.lasp.runtime import sequence_slice


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length (split over ranks)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--impl", choices=["gradshard", "blockwise", "naive"], default="gradshard",
                   help="how the model writes linear attention (gradshard detects all three)")
    p.add_argument("--decay", choices=["constant", "gated"], default="constant")
    p.add_argument("--chunk", type=int, default=64, help="LASP local kernel block size")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for a peer")
    p.add_argument("--corpus-bytes", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed under torchrun (gloo on CPU, nccl on GPU)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=max(args.timeout, 30.0)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main(args: argparse.Namespace) -> None:
    rank, world, device = setup(args)
    set_default_timeout(args.timeout)
    torch.manual_seed(args.seed)  # identical initial parameters on every rank
    config = LinearAttentionConfig(vocab_size=VOCAB_SIZE, d_model=args.d_model, n_layers=args.layers,
                                   n_heads=args.heads, glu_hidden=2 * args.d_model, decay=args.decay,
                                   attn_impl=args.impl, block_size=min(args.chunk, 64))
    model = LinearAttentionLM(config).to(device)
    cm = gs.compile(model, plan="lasp", chunk_size=args.chunk, timeout_s=args.timeout)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    group = dist.group.WORLD if world > 1 else None
    start, stop = sequence_slice(args.seq_len, rank, world)
    corpus = load_corpus(args.corpus_bytes)
    batches = iterate_batches(corpus.train, args.batch, args.seq_len, seed=args.seed, device=device)
    if rank == 0:
        print(f"LASP over {world} rank(s): {args.seq_len} tokens per sequence, rank 0 holds "
              f"[{start}, {stop}); impl={args.impl}, decay={args.decay}, device={device}", flush=True)
    t0 = time.perf_counter()
    for step in range(args.steps):
        input_ids, labels = next(batches)  # same batch on every rank; labels already shifted
        x, y = input_ids[:, start:stop], labels[:, start:stop]
        logits = cm(x)
        token_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum")
        loss = global_mean(token_sum, y.numel(), group) if group is not None else token_sum / y.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # gradients are all-reduced over the ranks by the compiled plan
        opt.step()
        total = sum_over_group(loss, group) if group is not None else loss.detach()
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {total.item():.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if rank == 0 and cm.lasp is not None:
        layers = ", ".join(f"{l.site} ({l.form}, {l.state_bytes:,} B/direction)" for l in cm.lasp.layers)
        print(f"done; LASP layers: {layers}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())

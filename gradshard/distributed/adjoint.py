"""Distributed adjoint sharding: layers sharded over the ranks of a group (paper, Algs. 3-4).

Rank ``r`` of ``W`` holds a contiguous block of layers (:func:`split_layers`), their
parameters, their optimizer state and everything its layers save for backward (with
``plan="adjoint"``: each layer's input and its state checkpoints). One training step::

    forward:   rank 0 runs its layers on the batch  -> sends y to rank 1 -> ... -> rank W-1: loss
    backward:  rank W-1: dL/dy_in                    -> sends to rank W-2 -> ... -> rank 0
               (each rank's adjoint scans and VJP shards run locally on its own layers)

Unlike the paper's Algorithm 4 (which drops the cross-layer terms so every rank can start
at once), the cotangent each rank receives is the exact ``dL/dy`` of its block output, so the
gradients equal single-process gradients; ranks work one after another within a step.
Messages: one activation (B x T x P) per boundary and direction. Every wait has a timeout
(:class:`~gradshard.runtime.comm.Communicator`); a dead peer is a ``CommTimeoutError``.

Launch with ``torchrun --nproc-per-node W examples/train_ssm.py --distributed`` (gloo on CPU,
nccl on GPU), or use :func:`gradshard.distributed.testing.run_threaded` in tests.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from gradshard.runtime.comm import Communicator

__all__ = ["split_layers", "PipelineStage", "TAG_SHAPE", "TAG_ACT", "TAG_GRAD"]

TAG_SHAPE, TAG_ACT, TAG_GRAD = 310, 311, 312
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def split_layers(n_layers: int, world_size: int) -> list[range]:
    """Contiguous layer blocks, one per rank (the first ``n_layers % W`` ranks take one more)."""
    if world_size < 1 or n_layers < world_size:
        raise ValueError(f"cannot split {n_layers} layers over {world_size} ranks: need at least one layer per rank")
    base, extra = divmod(n_layers, world_size)
    out, start = [], 0
    for r in range(world_size):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class PipelineStage:
    """This rank's block of layers in a layer-sharded pipeline (see the module doc).

    ``module``: this rank's layers as one ``nn.Module`` (rank 0 takes the model input, the
    others the previous rank's activation); it is compiled with ``plan`` (e.g. ``"adjoint"``).
    ``step(inputs, loss_fn)`` runs forward and backward (``inputs``: the model input, used on
    rank 0); on the last rank it returns the loss ``loss_fn(output)``, elsewhere ``None``. Gradients land in ``module``'s parameters.
    """

    def __init__(self, module: nn.Module, group: Any, *, plan: str = "adjoint", timeout_s: float = 60.0,
                 **options: Any) -> None:
        import gradshard as gs

        self.module = module
        self.comm = Communicator(group, timeout_s=timeout_s)
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.compiled = gs.compile(module, plan=plan, **options) if plan != "eager" else module

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    # ------------------------------------------------------------------ messages

    def _send_act(self, y: Tensor) -> None:
        meta = torch.tensor([_DTYPES.index(y.dtype), y.dim(), *y.shape], dtype=torch.int64)
        header = torch.zeros(8, dtype=torch.int64)
        header[: meta.numel()] = meta
        self.comm.send(header, self.rank + 1, tag=TAG_SHAPE, label="adjoint.activation_shape")
        self.comm.send(y.detach().contiguous(), self.rank + 1, tag=TAG_ACT, label="adjoint.activation",
                       description=f"the activation of the layers of rank {self.rank}")

    def _recv_act(self) -> Tensor:
        header = torch.zeros(8, dtype=torch.int64)
        self.comm.recv(header, self.rank - 1, tag=TAG_SHAPE, label="adjoint.activation_shape")
        dtype, nd = _DTYPES[int(header[0])], int(header[1])
        buf = torch.empty([int(s) for s in header[2:2 + nd]], dtype=dtype)
        return self.comm.recv(buf, self.rank - 1, tag=TAG_ACT, label="adjoint.activation",
                              description=f"the activation of the layers of rank {self.rank - 1}")

    # ------------------------------------------------------------------ one step

    def forward(self, batch: Any) -> tuple[Tensor, Optional[Tensor]]:
        """Run this rank's layers; returns ``(output, input_leaf)`` (input_leaf None on rank 0)."""
        if self.first:
            x, leaf = batch, None
            out = self.compiled(x)
        else:
            leaf = self._recv_act().requires_grad_(True)
            out = self.compiled(leaf)
        if not self.last:
            self._send_act(out)
        return out, leaf

    def backward(self, out: Tensor, leaf: Optional[Tensor], loss: Optional[Tensor]) -> None:
        """Backward through this rank's layers with the exact incoming dL/dy; pass dL/dx on."""
        if self.last:
            assert loss is not None
            loss.backward()
        else:
            grad = torch.empty_like(out)
            self.comm.recv(grad, self.rank + 1, tag=TAG_GRAD, label="adjoint.cotangent",
                           description=f"dL/dy of the layers of rank {self.rank}")
            out.backward(grad)
        if leaf is not None:
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self.comm.send(g.contiguous(), self.rank - 1, tag=TAG_GRAD, label="adjoint.cotangent",
                           description=f"dL/dy of the layers of rank {self.rank - 1}")

    def step(self, inputs: Any = None, loss_fn: Optional[Callable[[Tensor], Tensor]] = None) -> Optional[Tensor]:
        """Forward and backward of one batch over the whole pipeline; the loss on the last rank."""
        if self.first and inputs is None:
            raise ValueError("PipelineStage.step: rank 0 needs the model input")
        out, leaf = self.forward(inputs)
        loss = None
        if self.last:
            if loss_fn is None:
                raise ValueError("PipelineStage.step: the last rank needs loss_fn(output) -> loss")
            loss = loss_fn(out)
        self.backward(out, leaf, loss)
        return loss.detach() if loss is not None else None

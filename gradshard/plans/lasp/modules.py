"""Region modules the ``lasp`` rewrite installs on the graph (each lists its stages).

- :class:`LaspAttentionRegion`: one linear-attention layer run by
  :func:`gradshard.plans.lasp.runtime.lasp_attention` on this rank's slice (receive the KV state
  from rank-1, local lightning kernel, send the updated state to rank+1; backward mirrors it
  with dKV);
- :class:`LaspGradSync`: an identity on the parameters whose backward SUM-all-reduces their
  gradients over the group, so ``.grad`` on every rank is the full-sequence gradient;
- :class:`LaspGlobalMean`: ``loss_sum / N`` with ``N`` the number of counted targets over all
  ranks (a mean-reduced cross-entropy / NLL under sequence parallelism).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from gradshard.runtime.reduce import GRAD_LABEL
from gradshard.ir import Stage
from gradshard.plans.lasp.runtime import lasp_attention

from gradshard.plans.lasp.group import LaspGroup
from gradshard.passes.linear_attention_spec import LaspSpec
from gradshard.ops.lightning import lightning_attention_flops

__all__ = ["LaspAttentionRegion", "LaspGradSync", "LaspGlobalMean", "state_dtype"]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV state travels in (at least float32; see gradshard.plans.lasp.runtime)."""
    if not dtype.is_floating_point:
        return torch.float64
    return torch.promote_types(dtype, torch.float32)


class LaspAttentionRegion(nn.Module):
    """One linear-attention layer under LASP (see the module doc).

    Inputs are the graph's own tensors (``spec`` maps them to canonical layouts); the output
    has the replaced node's layout and dtype. ``layer_id`` is the layer's index among the
    LASP regions of the graph (message tags ``2*layer_id`` forward, ``2*layer_id + 1`` backward).
    """

    def __init__(self, site: str, layer_id: int, spec: LaspSpec, group: LaspGroup, chunk_size: int,
                 local_len: int, source: str = "", decay_value: torch.Tensor | None = None) -> None:
        super().__init__()
        # a decay fixed in the model's code (spec.decay.baked), canonical (H,) or (B, H, T)
        self.register_buffer("decay_value", decay_value, persistent=False)
        self.site, self.layer_id, self.spec = site, layer_id, spec
        self.group = group
        self.chunk_size = chunk_size
        self.local_len = local_len
        self.source = source
        self.kernel_backend: str | None = None  # set by lower_kernels

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        baked = self.decay_value.to(args[0].dtype) if self.decay_value is not None else None
        q, k, v, decay, s0 = self.spec.canonical(*args, baked_decay=baked)
        o = lasp_attention(
            q.contiguous(), k.contiguous(), v.contiguous(),
            None if decay is None else decay.contiguous(),
            comm=self.group.comm, layer_id=self.layer_id, chunk_size=self.chunk_size,
            initial_state=None if s0 is None else s0.contiguous(), backend=self.kernel_backend,
        )
        return self.spec.restore(o)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, form={self.spec.form}, {self.spec.describe()}"

    # ------------------------------------------------------------------ stages

    def state_bytes(self) -> int:
        """Bytes of one KV state: what this layer sends per direction (B·H·dk·dv·elem)."""
        return self.spec.state_elements() * state_dtype(self.spec.out_dtype).itemsize

    def stages(self) -> list[Stage]:
        """Forward: recv KV, local kernel, combine, send KV. Backward: recv dKV, local
        backward, send dKV, combine — in the order the runtime executes them."""
        s, g, i = self.spec, self.group, self.layer_id
        t = self.local_len
        itemsize = s.out_dtype.itemsize if s.out_dtype.is_floating_point else 8
        chunk = min(self.chunk_size, max(t, 1))
        bh = s.batch * s.heads
        kernel_flops = lightning_attention_flops((s.batch, s.heads, t, s.dk), (s.batch, s.heads, t, s.dv), chunk)
        combine_flops = 4 * bh * t * s.dk * s.dv
        saved = bh * t * (2 * s.dk + s.dv) * itemsize + self.state_bytes()
        nbytes = self.state_bytes()
        first, last = g.rank == 0, g.rank == g.world_size - 1
        prev = "none: rank 0 holds the first slice" if first else f"from rank {g.rank - 1}"
        nxt = "none: this rank holds the last slice" if last else f"to rank {g.rank + 1}"
        if g.world_size == 1:
            prev = nxt = "no peer at world size 1 (runs over a group of N ranks under torchrun)"
        site, where = self.site, self.source
        kname = f"{self.kernel_backend or 'auto'}:lightning_attention"
        return [
            Stage(f"{site}:recv_kv", "recv", "forward", site, memory_bytes=nbytes, kernel="p2p:irecv",
                  note=f"KV state of layer {i} ({nbytes:,} B, tag {2 * i}) {prev}; posted before the kernel"),
            Stage(f"{site}:local", "forward_chunk", "forward", site, memory_bytes=saved, flops=kernel_flops,
                  kernel=kname, note=f"intra + inter-chunk terms of {t} local steps from a zero state; {where}"),
            Stage(f"{site}:combine", "forward", "forward", site, memory_bytes=nbytes, flops=combine_flops,
                  kernel="torch", note="o += P_t q_t S; F = F_loc + G S (S: received state)"),
            Stage(f"{site}:send_kv", "send", "forward", site, memory_bytes=nbytes, kernel="p2p:isend",
                  note=f"KV state of layer {i} ({nbytes:,} B, tag {2 * i}) {nxt}"),
            Stage(f"{site}:recv_dkv", "recv", "backward", site, memory_bytes=nbytes, kernel="p2p:irecv",
                  note=f"dKV of layer {i} ({nbytes:,} B, tag {2 * i + 1}) "
                       f"{nxt.replace('to rank', 'from rank')}; posted before the local backward"),
            Stage(f"{site}:local_backward", "vjp_shard", "backward", site, memory_bytes=saved,
                  flops=2 * kernel_flops, kernel=kname + "_backward",
                  note=f"kernel backward for do (KV state cached from the forward, not recomputed); "
                       f"frees {site}:local"),
            Stage(f"{site}:send_dkv", "send", "backward", site, memory_bytes=nbytes, kernel="p2p:isend",
                  note=f"dS = dS_0 + G D ({nbytes:,} B, tag {2 * i + 1}) {prev.replace('from rank', 'to rank')}"),
            Stage(f"{site}:combine_backward", "accumulate", "backward", site, memory_bytes=nbytes,
                  flops=2 * combine_flops, kernel="torch",
                  note=f"dq += P do S^T, dk/dv += R (D terms), decay gradient scans; frees {site}:combine",
                  ),
        ]


# --------------------------------------------------------------------------- gradient reduction


class _SyncGrads(torch.autograd.Function):
    """Identity forward; backward SUM-all-reduces the incoming gradients over the group."""

    @staticmethod
    def forward(ctx: Any, group: LaspGroup, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.group = group
        ctx.meta = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        full = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                for g, (shape, dtype, device) in zip(grads, ctx.meta)]
        if ctx.group.world_size > 1:
            full = all_reduce_flat(ctx.group, full)
        return (None, *full)


def all_reduce_flat(group: LaspGroup, tensors: Sequence[torch.Tensor], bucket_bytes: int = 25 * 2**20,
                    label: str = GRAD_LABEL) -> list[torch.Tensor]:
    """SUM-all-reduce ``tensors`` in flat buckets per dtype/device; returns new tensors."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[list[int]]] = {}
    sizes: dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in buckets or (sizes[key] + nbytes > bucket_bytes and sizes[key] > 0):
            buckets.setdefault(key, []).append([])
            sizes[key] = 0
        buckets[key][-1].append(i)
        sizes[key] += nbytes
    for key in buckets:
        for idx in buckets[key]:
            flat = torch.cat([tensors[i].reshape(-1) for i in idx]).contiguous()
            group.comm.all_reduce(flat, label=label)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[offset: offset + n].view_as(tensors[i])
                offset += n
    return out  # type: ignore[return-value]


class LaspGradSync(nn.Module):
    """Identity on the parameters; its backward all-reduces their gradients (``reduce_grads``)."""

    def __init__(self, group: LaspGroup, names: Sequence[str], numels: Sequence[int], itemsize: int) -> None:
        super().__init__()
        self.group = group
        self.names = tuple(names)
        self.numels = tuple(numels)
        self.itemsize = itemsize

    def forward(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _SyncGrads.apply(self.group, *params)

    def extra_repr(self) -> str:
        return f"{len(self.names)} parameters, {sum(self.numels):,} elements"

    def stages(self) -> list[Stage]:
        nbytes = sum(self.numels) * self.itemsize
        where = ("no peer at world size 1" if self.group.world_size == 1
                 else f"over {self.group.world_size} ranks")
        return [
            Stage("lasp_grad_sync", "forward", "forward", "lasp_grad_sync", kernel="identity",
                  note="marks the parameters; its backward runs once every gradient of this step is ready"),
            Stage("lasp_grad_sync:all_reduce", "allreduce", "backward", "lasp_grad_sync",
                  memory_bytes=nbytes, kernel="collective:all_reduce",
                  note=f"SUM of {len(self.names)} parameter gradients ({nbytes:,} B) {where}: every rank "
                       f"gets the full-sequence gradient"),
        ]


# --------------------------------------------------------------------------- global means


class LaspGlobalMean(nn.Module):
    """``loss_sum / N``: ``N`` counts the targets ``!= ignore_index`` over every rank."""

    def __init__(self, site: str, group: LaspGroup, ignore_index: int | None) -> None:
        super().__init__()
        self.site, self.group, self.ignore_index = site, group, ignore_index

    def forward(self, loss_sum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.ignore_index is None:
                count = torch.full((1,), float(target.numel()), dtype=torch.float64, device=target.device)
            else:
                count = (target != self.ignore_index).sum().reshape(1).to(torch.float64)
            if self.group.world_size > 1:
                self.group.comm.all_reduce(count, label="lasp.token_count")
        return loss_sum / count.to(loss_sum.device, loss_sum.dtype).reshape(())

    def stages(self) -> list[Stage]:
        return [Stage(f"{self.site}:count", "allreduce", "forward", self.site, kernel="collective:all_reduce",
                      note="global number of counted targets (8 B); the loss share is sum / count")]

"""Distributed runtimes: LASP sequence parallelism, the DiLoCo-family outer loop, comm helpers.

All collectives take any ``torch.distributed`` ProcessGroup (gloo on CPU, nccl on GPU) and
wait with timeouts, so a dead peer raises :class:`CommTimeoutError` instead of hanging.
"""

from gradshard.runtime.comm import CommCounter, CommError, CommTimeoutError, Communicator
from gradshard.distributed.diloco import DiLoCo, PartialDiLoCo
from gradshard.runtime.reduce import global_mean, global_token_count, reduce_gradients

__all__ = ["Communicator", "CommCounter", "CommError", "CommTimeoutError", "DiLoCo", "PartialDiLoCo",
           "reduce_gradients", "global_mean", "global_token_count"]

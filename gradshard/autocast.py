"""The autocast state a forward ran under, re-entered where its backward recomputes it.

A captured graph is replayed op by op, so ``torch.autocast`` casts its ops when it runs. Eager
autograd's backward follows the dtypes its forward recorded, whatever the autocast state at
``loss.backward()`` (PyTorch's AMP recipe calls it outside the ``autocast`` block). A plan that
recomputes forward work in its backward (seco/spaco chunks, adjoint shards, local segments)
must recompute it under the forward's state, or it differentiates another function: in
bfloat16 the gradient of a recompute without the forward's casts was 2.4x further from float64
than eager's (seco, SSM example, T=64). ``torch.utils.checkpoint`` does the same.

:meth:`AutocastState.off` is the state with autocast off everywhere: where a recogniser proves
a region numerically (a compile runs at the first call, which may sit inside the user's
``torch.autocast`` block).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["AutocastState"]

_DEVICES = ("cpu", "cuda")


def _state_of(device: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


@dataclass(frozen=True)
class AutocastState:
    """Per device type: autocast enabled and its dtype; and whether autocast caches casts."""

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def current(cls) -> "AutocastState":
        return cls(tuple((d, *_state_of(d)) for d in _DEVICES), torch.is_autocast_cache_enabled())

    @classmethod
    def off(cls) -> "AutocastState":
        return cls(tuple((d, False, torch.get_autocast_dtype(d)) for d in _DEVICES), torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        """Run the block under this state (only the device types whose state differs are entered)."""
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.devices:
                if _state_of(device) != (enabled, dtype) and (enabled or torch.is_autocast_enabled(device)):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                       cache_enabled=self.cache_enabled))
            yield

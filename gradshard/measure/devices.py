"""Which device a measurement runs on, and one line describing it for reports."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from gradshard.units import format_bytes

__all__ = ["describe_device", "infer_device", "synchronize"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device(device: torch.device | str) -> str:
    """One line describing ``device`` for reports: ``'cuda:0 (NVIDIA H100, 79.2 GiB)'``."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({props.name}, {format_bytes(props.total_memory)})"
    if device.type == "cpu":
        return f"cpu ({_cpu_model()}, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads)"
    return str(device)


def infer_device(device: torch.device | str | None, args: tuple, kwargs: dict[str, Any]) -> torch.device:
    """``device`` if given, else that of the first tensor (or module parameter) in the arguments, else CPU."""
    found = torch.device("cpu") if device is None else torch.device(device)
    if device is None:
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                found = leaf.device
                break
            if isinstance(leaf, torch.nn.Module):
                param = next(leaf.parameters(), None)
                if param is not None:
                    found = param.device
                    break
    if found.type == "cuda" and found.index is None:
        found = torch.device("cuda", torch.cuda.current_device())
    return found


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

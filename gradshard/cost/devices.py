"""Device profiles (datasheet numbers) and a roofline time estimate.

A :class:`DeviceProfile` holds what a what-if query needs: memory capacity, HBM bandwidth,
peak dense FLOP rates per dtype and link bandwidths. Numbers are the vendors' datasheet
values for dense math (no structured sparsity), per direction for links:

========  =========  ==========  ===========  ==========  ==============  ===========
device    memory     HBM         bf16 dense   fp32        NVLink/dir      PCIe/dir
========  =========  ==========  ===========  ==========  ==============  ===========
h100      80 GiB     3.35 TB/s   989 TFLOP/s  67 TFLOP/s  450 GB/s (NV4)  64 GB/s (5.0)
h200      141 GiB    4.8 TB/s    989 TFLOP/s  67 TFLOP/s  450 GB/s (NV4)  64 GB/s (5.0)
a100      80 GiB     2.04 TB/s   312 TFLOP/s  19.5        300 GB/s (NV3)  32 GB/s (4.0)
rtx3090   24 GiB     0.936 TB/s  71 TFLOP/s   35.6        56 GB/s (NV3)   32 GB/s (4.0)
========  =========  ==========  ===========  ==========  ==============  ===========

(H100/H200: SXM parts; A100: SXM4 80GB; RTX 3090: GA102, bf16 tensor math with fp32
accumulate.) Every profile also lists ``ethernet`` (100 GbE, 12.5 GB/s) and
``infiniband`` (NDR 400 Gb/s, 50 GB/s) for multi-node groups.

:func:`roofline_seconds` is a *roofline estimate*, a lower bound rather than a prediction:
``max(flops / peak_flops, hbm_bytes / hbm_bandwidth) + comm_bytes / link_bandwidth``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["DeviceProfile", "DEVICES", "get_device", "devices", "register_device", "roofline_seconds",
           "RooflineEstimate"]

GiB = 2**30
_NETWORK = {"ethernet": 12.5e9, "infiniband": 50e9}


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator: capacity, bandwidths (bytes/s) and peak dense FLOP/s per dtype."""

    name: str
    description: str
    memory_bytes: int
    hbm_bandwidth: float
    peak_flops: Mapping[str, float]
    links: Mapping[str, float] = field(default_factory=dict)
    default_link: str = "nvlink"

    def flops_per_second(self, dtype: torch.dtype | str) -> float:
        """Peak dense FLOP/s for ``dtype`` (fp16 uses the bf16 rate; fp64 the fp32 rate if unlisted)."""
        key = _dtype_key(dtype)
        if key in self.peak_flops:
            return self.peak_flops[key]
        fallback = {"float16": "bfloat16", "float64": "float32"}.get(key)
        if fallback and fallback in self.peak_flops:
            return self.peak_flops[fallback]
        raise KeyError(f"device {self.name!r} has no peak FLOP rate for {key}; known: {sorted(self.peak_flops)}")

    def link_bandwidth(self, link: str | None = None) -> float:
        """Bytes/s per direction of ``link`` (default: the profile's ``default_link``)."""
        name = link or self.default_link
        if name not in self.links:
            raise KeyError(f"device {self.name!r} has no link {name!r}; known: {sorted(self.links)}")
        return self.links[name]


def _dtype_key(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    s = str(dtype).removeprefix("torch.").lower()
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "tf32": "tfloat32", "fp64": "float64", "double": "float64"}.get(s, s)


DEVICES: dict[str, DeviceProfile] = {}


def register_device(profile: DeviceProfile, *aliases: str) -> DeviceProfile:
    """Add ``profile`` under its name and ``aliases`` (lower case)."""
    for key in (profile.name, *aliases):
        DEVICES[key.lower()] = profile
    return profile


register_device(DeviceProfile(
    name="h100", description="NVIDIA H100 SXM5 80GB (HBM3)",
    memory_bytes=80 * GiB, hbm_bandwidth=3.35e12,
    peak_flops=MappingProxyType({"bfloat16": 989.4e12, "tfloat32": 494.7e12, "float32": 66.9e12,
                                 "float64": 33.5e12}),
    links=MappingProxyType({"nvlink": 450e9, "pcie": 64e9, **_NETWORK}),
), "h100-80gb", "h100-sxm")
register_device(DeviceProfile(
    name="h200", description="NVIDIA H200 SXM 141GB (HBM3e)",
    memory_bytes=141 * GiB, hbm_bandwidth=4.8e12,
    peak_flops=MappingProxyType({"bfloat16": 989.4e12, "tfloat32": 494.7e12, "float32": 66.9e12,
                                 "float64": 33.5e12}),
    links=MappingProxyType({"nvlink": 450e9, "pcie": 64e9, **_NETWORK}),
), "h200-141gb")
register_device(DeviceProfile(
    name="a100", description="NVIDIA A100 SXM4 80GB (HBM2e)",
    memory_bytes=80 * GiB, hbm_bandwidth=2.039e12,
    peak_flops=MappingProxyType({"bfloat16": 312e12, "tfloat32": 156e12, "float32": 19.5e12,
                                 "float64": 9.7e12}),
    links=MappingProxyType({"nvlink": 300e9, "pcie": 32e9, **_NETWORK}),
), "a100-80gb")
register_device(DeviceProfile(
    name="rtx3090", description="NVIDIA GeForce RTX 3090 24GB (GDDR6X)",
    memory_bytes=24 * GiB, hbm_bandwidth=936e9,
    peak_flops=MappingProxyType({"bfloat16": 71e12, "float16": 71e12, "float32": 35.6e12,
                                 "float64": 0.556e12}),
    links=MappingProxyType({"nvlink": 56.25e9, "pcie": 32e9, **_NETWORK}),
    default_link="pcie",
), "3090", "rtx-3090")


def devices() -> list[str]:
    """Names of the registered profiles (without aliases)."""
    return sorted({p.name for p in DEVICES.values()})


def get_device(name: str | DeviceProfile) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive; aliases like ``"3090"`` work)."""
    if isinstance(name, DeviceProfile):
        return name
    key = str(name).strip().lower()
    if key not in DEVICES:
        raise KeyError(f"unknown device {name!r}; known devices: {', '.join(devices())} "
                       "(or register one with gradshard.cost.devices.register_device)")
    return DEVICES[key]


@dataclass(frozen=True)
class RooflineEstimate:
    """A roofline *estimate* (a lower bound) of one step's time, with its parts in seconds."""

    seconds: float
    compute_seconds: float
    memory_seconds: float
    comm_seconds: float
    bound: str  # "compute" | "memory"
    label: str = "roofline estimate (lower bound): max(compute, HBM traffic) + communication"


def roofline_seconds(device: DeviceProfile | str, *, flops: float, hbm_bytes: float, comm_bytes: float = 0.0,
                     dtype: torch.dtype | str = torch.bfloat16, link: str | None = None) -> RooflineEstimate:
    """``max(flops / peak(dtype), hbm_bytes / bandwidth) + comm_bytes / link`` (see module doc)."""
    dev = get_device(device)
    compute = float(flops) / dev.flops_per_second(dtype)
    memory = float(hbm_bytes) / dev.hbm_bandwidth
    comm = float(comm_bytes) / dev.link_bandwidth(link) if comm_bytes else 0.0
    return RooflineEstimate(max(compute, memory) + comm, compute, memory, comm,
                            "compute" if compute >= memory else "memory")

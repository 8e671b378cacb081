"""The diagonal linear scan on CPU as one compiled C++ loop.

``h_t = a_t h_{t-1} + u_t`` is sequential in ``t`` and elementwise in the state: on CPU the
fastest form is the definition itself, one pass over time with the state row in cache. In
Python even the chunked form (:mod:`gradshard.kernels.scan_torch`, about ``3.9 sqrt(T)``
vectorised steps) pays one dispatch per step: at a shard of 256 steps over 96 channels that is
~200 us against ~11 us for the loop. The loop here is built by Inductor's C++ toolchain (the
compiler ``torch.compile`` uses on CPU, ``-O3``, cached on disk by source hash), once per
accumulation dtype and process, and called through its Python bindings with data pointers.

Per batch row and block of 256 state elements (the blocks run on ``torch.get_num_threads()``
OpenMP threads) the loop walks time in order (or reversed), reading the previous output row as
the state: no copy, no division, no log, so ``a`` may hold zeros and any sign, and the result is
the naive loop's to the last bit. ``a`` broadcasts to ``u`` = ``(batch, time, *state)`` without
being expanded when its non-broadcast state dims are one contiguous run (per channel, per head,
one scalar): ``a``'s element for state index ``s`` is ``(s // R) % M``.

Without a C++ compiler (or with ``GRADSHARD_CPU_SCAN=0``) :func:`scan_cpu` returns None and the
chunked torch ops run; a failed build warns once, naming the error.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["scan_cpu", "cpu_scan_available"]

_SOURCE = r"""
#include <algorithm>
#include <cstdint>

typedef SCALAR T;

// One batch row's state elements [s0, s1) over all L steps; a's element for s is (s / R) % M.
static void scan_block(const T* a, const T* u, const T* h0, T* out, int64_t L, int64_t S, int64_t sta,
                       int64_t R, int64_t M, bool reverse, int64_t s0, int64_t s1) {
    const T* hp = h0;  // the previous state row (nullptr: zero)
    for (int64_t k = 0; k < L; ++k) {
        const int64_t t = reverse ? L - 1 - k : k;
        const T* ut = u + t * S;
        const T* at = a + t * sta;
        T* ot = out + t * S;
        if (hp == nullptr) {
            for (int64_t s = s0; s < s1; ++s) ot[s] = ut[s];
        } else if (R == 1 && M == S) {
            for (int64_t s = s0; s < s1; ++s) ot[s] = at[s] * hp[s] + ut[s];
        } else {
            for (int64_t s = s0; s < s1;) {
                const int64_t q = s / R;
                const int64_t e = std::min(s1, (q + 1) * R);
                const T av = at[q % M];
                for (; s < e; ++s) ot[s] = av * hp[s] + ut[s];
            }
        }
        hp = ot;
    }
}

extern "C" void kernel(const T* a, const T* u, const T* h0, T* out, int64_t B, int64_t L, int64_t S,
                       int64_t sba, int64_t sta, int64_t R, int64_t M, int64_t reverse, int64_t has_h0,
                       int64_t threads) {
    const int64_t block = 256;
    const int64_t blocks = (S + block - 1) / block;
    const int64_t tasks = B * blocks;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && tasks > 1 && B * L * S >= 65536)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t b = task / blocks, s0 = (task % blocks) * block;
        scan_block(a + b * sba, u + b * L * S, has_h0 ? h0 + b * S : nullptr, out + b * L * S, L, S, sta, R, M,
                   reverse != 0, s0, std::min(S, s0 + block));
    }
}
"""

_ARGTYPES = ["const {0}*", "const {0}*", "const {0}*", "{0}*"] + ["int64_t"] * 10
_CTYPES = {torch.float32: "float", torch.float64: "double"}
_kernels: dict[torch.dtype, Any] = {}
_failed: Optional[str] = None


def _enabled() -> bool:
    return os.environ.get("GRADSHARD_CPU_SCAN", "1").strip().lower() not in ("0", "false", "off", "no")


def _kernel(dtype: torch.dtype) -> Any:
    """The compiled loop for ``dtype`` (float32/float64), or None when it cannot be built here."""
    global _failed
    if dtype in _kernels:
        return _kernels[dtype]
    if _failed is not None or dtype not in _CTYPES:
        return None
    ctype = _CTYPES[dtype]
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        fn = CppPythonBindingsCodeCache.load_pybinding([t.format(ctype) for t in _ARGTYPES],
                                                       _SOURCE.replace("SCALAR", ctype))
    except Exception as exc:  # no compiler, or an Inductor without this cache: the torch ops run instead
        _failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        warnings.warn(f"gradshard.kernels: the compiled CPU scan could not be built ({_failed}); linear scans "
                      "on CPU run as chunked torch ops (slower). Set GRADSHARD_CPU_SCAN=0 to skip the attempt.",
                      RuntimeWarning, stacklevel=3)
        return None
    _kernels[dtype] = fn
    return fn


def cpu_scan_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`scan_cpu` runs the compiled loop for ``dtype``'s accumulation dtype."""
    from .backend import accumulation_dtype

    return _enabled() and _kernel(accumulation_dtype(dtype)) is not None


def _coefficient_layout(a: Tensor, state: tuple[int, ...]) -> tuple[Tensor, int, int]:
    """``a``'s state dims as ``(a (Ba, La, M), R, M)`` with element ``(s // R) % M`` for state index
    ``s``; expanded over the state when its non-broadcast dims are not one contiguous run."""
    dims = [i for i, n in enumerate(state) if n != 1]  # size-1 dims of u do not index anything
    full = [i for i in dims if a.shape[2 + i] == state[i]]
    if full and any(a.shape[2 + i] == 1 for i in dims if full[0] <= i <= full[-1]):
        a = a.expand(*a.shape[:2], *state)  # e.g. (H, 1, N) over (H, P, N): a run with a gap
        full = dims
    M = math.prod(state[i] for i in full) if full else 1
    R = math.prod(state[i] for i in dims if i > full[-1]) if full else math.prod(state)
    return a.reshape(a.shape[0], a.shape[1], M), R, M


def scan_cpu(a: Tensor, u: Tensor, h0: Optional[Tensor], reverse: bool, out_dtype: torch.dtype,
             acc: torch.dtype) -> Optional[Tensor]:
    """``h`` shaped like ``u`` in ``out_dtype``, computed in ``acc`` by the compiled loop; None when the
    loop is not available (not CPU, disabled, no compiler, an accumulation dtype it lacks)."""
    if u.device.type != "cpu" or not _enabled():
        return None
    kernel = _kernel(acc)
    if kernel is None:
        return None
    batch, length, state = u.shape[0], u.shape[1], tuple(u.shape[2:])
    size = math.prod(state)
    out = torch.empty((batch, length, size), dtype=acc)
    if out.numel() == 0:
        return out.view(u.shape).to(out_dtype)
    ac, R, M = _coefficient_layout(a, state)
    ac = ac.to(acc).contiguous()
    uc = u.to(acc).contiguous().view(batch, length, size)
    hc = uc if h0 is None else h0.to(acc).contiguous().view(batch, size)
    kernel(ac, uc, hc, out, batch, length, size, ac.shape[1] * M if ac.shape[0] > 1 else 0,
           M if ac.shape[1] > 1 else 0, R, M, int(reverse), int(h0 is not None), torch.get_num_threads())
    out = out.view(u.shape)
    return out if out_dtype == acc else out.to(out_dtype)

"""Time gradshard.kernels against peers; report GB/s, GFLOP/s and the fraction of the roofline.

Usage::

    python bench/bench_kernels.py --results   # the GPU run: CUDA, float32 + bfloat16, all peers -> RESULTS.md
    python bench/bench_kernels.py             # full shapes on CUDA if present, else on CPU
    python bench/bench_kernels.py --quick     # small shapes (seconds on CPU)

Optional peers: ``pip install -e .[peers]`` (fla-core) and ``pip install mamba-ssm`` (CUDA only).

What is timed, per device, dtype and shape (gradshard: backend torch, plus triton on CUDA):

* ``linear_scan`` fwd / fwd+bwd and ``adjoint_shard`` on ``(B, T, N)``; scan peers compute the same
  recurrence ``h_t = a_t h_{t-1} + u_t`` from the same ``a, u``:

  - ``torch associative_scan``: ``torch._higher_order_ops.associative_scan`` with the diagonal
    combine ``(a2 a1, a2 u1 + u2)`` over time, in float32, under ``torch.compile`` with
    ``combine_mode='pointwise'`` on CUDA, eager ``combine_mode='generic'`` elsewhere;
  - ``torch log-space cumsum``: eager chunked ``h = P cumsum(u / P)``, ``P = exp(cumsum(log a))``
    within chunks of 64 steps, chunk carries by a doubling scan over the chunks (needs ``a > 0``);
  - ``mamba_ssm selective_scan_fn`` (CUDA, when installed), see :func:`mamba_inputs`.

* ``lightning_attention`` fwd / fwd+bwd on ``(B, H, T, d)`` with a constant decay per head
  ``(H,)``; peer: flash-linear-attention's ``fla.ops.simple_gla.chunk_simple_gla`` (fla-core) on
  ``(B, T, H, d)`` tensors with ``scale=1.0`` (fla's default is ``d ** -0.5``), once with the
  per-step log-decay ``g = log(decay)`` broadcast over time (it returns the decay gradient, as
  gradshard does) and once with ``g_gamma = log(decay)`` (constant per head, no decay gradient).
  ``fla.ops.lightning_attn.chunk_lightning_attn`` is ``chunk_simple_gla(g_gamma=...)`` with decays
  fixed by the layer index, so it is covered by the ``g_gamma`` row.

Before a peer is timed its output (and, for lightning attention, final state) is compared with
gradshard's at the bench shape: ``max|peer - ref| / max|ref|`` must stay within :func:`tolerance`;
otherwise :class:`PeerMismatch` is raised, the peer is not timed and the script exits 1.
A peer that is not installed or cannot run here is skipped with the reason printed.

Rates use the *minimum* traffic and the FLOPs of the algorithm (the same numbers for every
implementation of a function), so they are lower bounds of what the hardware did:

* scan fwd: read a, u, write h (3 tensors); 2 FLOPs per element.
* scan fwd+bwd: fwd, then read a, g, h, write da, du (8 tensors); 2 + 4 FLOPs per element.
* adjoint_shard: read a, u, g, write grad_a, grad_u (5 tensors); 6 FLOPs per element.
* lightning fwd (chunk C): read q, k, v, write o; FLOPs per (b, h) =
  2 T C (dk + dv) + 4 T dk dv  (intra-chunk QK^T and (.)V, inter-chunk Q S and K^T V).
* lightning fwd+bwd: forward, then read q, k, v, do, write dq, dk, dv; backward FLOPs =
  2 T C (3 dk + 3 dv) + 10 T dk dv  (+ 2 T C^2 for the exact decay gradient).

Roofline (CUDA): the device's HBM bandwidth and peak FLOP rate come from the
:mod:`gradshard.cost.devices` profile matched by :func:`roofline_profile` (``--profile`` forces
one); ``% roofline`` is ``roofline_seconds(flops, bytes) / measured`` and ``bound`` says which
roof applies. The FLOP peak is the one of the precision the matmuls run in: gradshard's Triton
lightning kernels use exact fp32 dots for fp32 inputs and tf32 for half inputs, fla's use tf32
for fp32 inputs (Triton's default) and bf16 tensor cores for bf16, the torch backend computes in
fp32. Issue 7's goal: >= 70% of the memory-bandwidth roofline for the Triton scans at T >= 16K.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

import gradshard.kernels as gk
from gradshard.cost.devices import DeviceProfile, get_device, roofline_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared RESULTS.md writer
from results_md import write_subsection  # noqa: E402

SECTION = "Kernels (issue 7)"
GOAL_FRACTION, GOAL_MIN_LENGTH = 0.70, 16384
SCAN_KERNELS = ("linear_scan fwd", "linear_scan fwd+bwd", "adjoint_shard")
LOGSPACE_CHUNK = 64

# (scan shapes (B, T, N), lightning shapes (B, H, T, dk, dv, chunk)) per (device type, quick).
SHAPES: dict[tuple[str, bool], tuple[list[tuple[int, ...]], list[tuple[int, ...]]]] = {
    ("cpu", True): ([(2, 4096, 64)], [(1, 2, 2048, 64, 64, 64)]),
    ("cpu", False): ([(2, 65536, 256)], [(1, 4, 16384, 64, 64, 64)]),
    ("cuda", True): ([(2, 16384, 256)], [(2, 4, 4096, 64, 64, 64)]),
    ("cuda", False): ([(4, 16384, 2048), (1, 65536, 2048)],
                      [(8, 16, 16384, 64, 64, 64), (4, 16, 16384, 128, 128, 64)]),
}


class PeerMismatch(AssertionError):
    """A peer computed something other than gradshard's kernel."""


@dataclass(frozen=True)
class Case:
    """One timed call: what it computes, who computes it, and its minimum traffic and FLOPs."""

    kernel: str
    impl: str
    shape: str
    length: int
    fn: Callable[[], object]
    nbytes: float
    flops: float
    flop_dtype: str  # the peak FLOP rate the roofline uses (see module doc)


@dataclass(frozen=True)
class Row:
    """One measurement."""

    device: str
    dtype: str
    kernel: str
    impl: str
    shape: str
    length: int
    seconds: float
    gbps: float
    gflops: float
    roofline: Optional[float]
    bound: Optional[str]


@dataclass(frozen=True)
class Check:
    """A peer-equality check: relative error of ``what`` and the tolerance it passed."""

    device: str
    dtype: str
    impl: str
    what: str
    shape: str
    rel_err: float
    tol: float


@dataclass
class Report:
    """Everything one run measured, checked, skipped or failed."""

    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    skips: list[tuple[str, str, str]] = field(default_factory=list)  # (device, impl, reason)
    failures: list[tuple[str, str, str]] = field(default_factory=list)  # (device, what, error)
    profiles: dict[str, Optional[DeviceProfile]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def skip(self, device: str, impl: str, reason: str, log: Callable[[str], None]) -> None:
        if (device, impl, reason) not in self.skips:
            self.skips.append((device, impl, reason))
            log(f"skip {impl} on {device}: {reason}")


# --------------------------------------------------------------------------- machine and roofline


def describe_device(device: torch.device) -> str:
    """One line naming the machine the numbers come from."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def roofline_profile(device_name: str) -> Optional[DeviceProfile]:
    """The :mod:`gradshard.cost.devices` profile of ``torch.cuda.get_device_name()``, or None.

    Only the exact parts the profiles describe match (H100/H200 SXM, A100 SXM4 80GB, RTX 3090):
    PCIe and NVL variants have other bandwidths and peaks, so they do not.
    """
    name = " ".join(device_name.lower().replace("-", " ").replace("_", " ").split())
    words = set(name.split())
    if words & {"pcie", "nvl"}:
        return None
    if "h200" in words:
        return get_device("h200")
    if "h100" in words:
        return get_device("h100")
    if "a100" in words and "80gb" in words:
        return get_device("a100")
    if "3090" in words and "ti" not in words:
        return get_device("rtx3090")
    return None


def peak_flops(profile: DeviceProfile, flop_dtype: str) -> float:
    """Peak FLOP/s of ``flop_dtype``; tf32 falls back to fp32 for profiles that do not list it."""
    try:
        return profile.flops_per_second(flop_dtype)
    except KeyError:
        return profile.flops_per_second("float32")


def roofline_fraction(profile: DeviceProfile, case: Case, seconds: float) -> tuple[float, str]:
    """(roofline time / measured time, "memory" or "compute")."""
    dtype = flop_dtype_in(profile, case.flop_dtype)
    est = roofline_seconds(profile, flops=case.flops, hbm_bytes=case.nbytes, dtype=dtype)
    return est.seconds / seconds, est.bound


def flop_dtype_in(profile: DeviceProfile, flop_dtype: str) -> str:
    """``flop_dtype`` if the profile lists a peak for it, else float32."""
    try:
        profile.flops_per_second(flop_dtype)
        return flop_dtype
    except KeyError:
        return "float32"


def tolerance(dtype: torch.dtype, device: torch.device, kernel: str) -> float:
    """Max ``max|peer - ref| / max|ref|`` accepted: rounding of the dtype (tf32 on CUDA matmuls)."""
    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        return 1e-2 if (device.type == "cuda" and kernel == "lightning") else 1e-3
    return 5e-2


def rel_err(x: Tensor, ref: Tensor) -> float:
    """``max|x - ref| / max|ref|`` in float64."""
    x, ref = x.detach().double(), ref.detach().double()
    if x.shape != ref.shape:
        raise PeerMismatch(f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}")
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def check_same(impl: str, what: str, out: Tensor, ref: Tensor, tol: float) -> float:
    """Relative error of ``out`` against gradshard's ``ref``; raise :class:`PeerMismatch` above ``tol``."""
    err = rel_err(out, ref)
    if not err <= tol:  # also catches NaN
        raise PeerMismatch(
            f"{impl} does not compute gradshard's {what}: max|peer - gradshard| / max|gradshard| = "
            f"{err:.3g} > {tol:.1g}; it is not timed (a peer computing something else is no comparison)."
        )
    return err


def timeit(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` runs after one warm-up (which also compiles / autotunes)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- scans


def scan_inputs(device: torch.device, dtype: torch.dtype, batch: int, length: int, state: int):
    """Deterministic ``a`` in [0.9, 1) (kept < 1 after rounding to ``dtype``), ``u`` and ``grad``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = (0.9 + 0.1 * torch.rand(batch, length, state, generator=g)).to(dtype)
    a = a.clamp_(max=1.0 - torch.finfo(dtype).eps).to(device)
    u = torch.randn(batch, length, state, generator=g).to(device, dtype)
    grad = torch.randn(batch, length, state, generator=g).to(device, dtype)
    return a, u, grad


def scan_traffic(a: Tensor) -> dict[str, tuple[float, float]]:
    """{kernel: (min bytes, FLOPs)} of the three scan kernels (module doc)."""
    numel, size = a.numel(), a.element_size()
    return {"linear_scan fwd": (3 * numel * size, 2 * numel),
            "linear_scan fwd+bwd": (8 * numel * size, 6 * numel),
            "adjoint_shard": (5 * numel * size, 6 * numel)}


def scan_cases(device, dtype, batch, length, state, backend) -> list[Case]:
    """gradshard's linear_scan fwd, fwd+bwd and adjoint_shard with ``backend``."""
    a, u, grad = scan_inputs(device, dtype, batch, length, state)
    a_g, u_g = a.clone().requires_grad_(True), u.clone().requires_grad_(True)
    traffic, impl, shape = scan_traffic(a), f"gradshard/{backend}", f"B={batch} T={length} N={state}"

    def fwd():
        return gk.linear_scan(a, u, backend=backend)

    def fwd_bwd():
        return torch.autograd.grad(gk.linear_scan(a_g, u_g, backend=backend), (a_g, u_g), grad)

    def adjoint():
        return gk.adjoint_shard(a, u, grad, backend=backend)

    return [Case(k, impl, shape, length, fn, *traffic[k], "float32")
            for k, fn in (("linear_scan fwd", fwd), ("linear_scan fwd+bwd", fwd_bwd), ("adjoint_shard", adjoint))]


def combine_affine(x: tuple[Tensor, Tensor], y: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Compose ``h -> a1 h + u1`` then ``h -> a2 h + u2``: ``(a2 a1, a2 u1 + u2)``."""
    a1, u1 = x
    a2, u2 = y
    return a2 * a1, a2 * u1 + u2


def _acc(a: Tensor, u: Tensor) -> tuple[torch.dtype, torch.dtype]:
    out = torch.promote_types(a.dtype, u.dtype)
    return out, (torch.float64 if out == torch.float64 else torch.float32)


def scan_associative(a: Tensor, u: Tensor, combine_mode: str = "generic") -> Tensor:
    """``linear_scan(a, u)`` by ``torch._higher_order_ops.associative_scan`` over dim 1, in float32."""
    from torch._higher_order_ops import associative_scan

    out, acc = _acc(a, u)
    a32, u32 = a.to(acc).expand_as(u), u.to(acc)
    _, h = associative_scan(combine_affine, (a32, u32), dim=1, combine_mode=combine_mode)
    return h.to(out)


def scan_logspace(a: Tensor, u: Tensor, chunk: int = LOGSPACE_CHUNK) -> Tensor:
    """``linear_scan(a, u)`` from cumulative sums of ``log a`` in chunks (needs ``a > 0``), in float32.

    Within a chunk ``h = P * cumsum(u / P)`` with ``P = exp(cumsum(log a))`` (one cumsum each,
    all chunks at once); the chunks' incoming states come from a doubling scan over the
    ``T / chunk`` chunk summaries. ``1 / P`` must stay finite: ``-sum(log a)`` over one chunk
    below ~80 (``a >= 0.9`` and 64 steps: 6.7).
    """
    out, acc = _acc(a, u)
    a, u = a.to(acc).expand_as(u), u.to(acc)
    batch, length, rest = u.shape[0], u.shape[1], u.shape[2:]
    n = max(1, -(-length // chunk))
    pad = n * chunk - length
    if pad:
        a = torch.cat([a, a.new_ones((batch, pad, *rest))], 1)
        u = torch.cat([u, u.new_zeros((batch, pad, *rest))], 1)
    logp = torch.cumsum(torch.log(a.reshape(batch, n, chunk, *rest)), 2)
    p = torch.exp(logp)
    local = p * torch.cumsum(u.reshape(batch, n, chunk, *rest) * torch.exp(-logp), 2)
    ends = scan_doubling(p[:, :, -1], local[:, :, -1])  # state at every chunk's end
    h_in = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)
    h = local + p * h_in.unsqueeze(2)
    return h.reshape(batch, n * chunk, *rest)[:, :length].to(out)


def scan_doubling(a: Tensor, u: Tensor) -> Tensor:
    """``linear_scan(a, u)`` by Hillis-Steele doubling over dim 1: ``ceil(log2 T)`` vectorised steps."""
    k = 1
    while k < u.shape[1]:
        u = torch.cat([u[:, :k], torch.addcmul(u[:, k:], a[:, k:], u[:, :-k])], 1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], 1)
        k *= 2
    return u


def mamba_inputs(a: Tensor, u: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """``selective_scan_fn`` arguments computing ``linear_scan(a, u)`` (``a`` in (0, 1)), and its grad.

    mamba's recurrence is ``x_t = exp(delta_t A) x_{t-1} + delta_t B_t u_t``, ``y_t = C_t x_t`` on
    ``u, delta: (B, D, L)``, ``A: (D, N)``, ``B, C: (B, N, L)``. With ``D`` = our N channels, one
    state (``N = 1``), ``A = -1``, ``delta = -log a``, ``u' = u / delta`` and ``B = C = 1`` it is
    ``x_t = a_t x_{t-1} + u_t = y_t``. Inputs are laid out (B, N, T) before timing.
    """
    batch, length, chans = u.shape
    delta32 = -torch.log(a.float())
    ones = torch.ones(batch, 1, length, device=u.device, dtype=u.dtype)
    return {
        "u": (u.float() / delta32).to(u.dtype).transpose(1, 2).contiguous(),
        "delta": delta32.to(u.dtype).transpose(1, 2).contiguous(),
        "A": -torch.ones(chans, 1, device=u.device, dtype=torch.float32),
        "B": ones, "C": ones.clone(),
        "grad": grad.transpose(1, 2).contiguous(),
    }


def mamba_peer(selective_scan_fn: Callable, a: Tensor, u: Tensor, grad: Tensor):
    """(fwd(a, u) -> h as (B, T, N), fwd+bwd closure) of ``selective_scan_fn`` on :func:`mamba_inputs`.

    The inputs are prepared once in mamba's layout, so the timed calls ignore ``fwd``'s arguments.
    """
    m = mamba_inputs(a, u, grad)
    leaves = [m["u"].clone().requires_grad_(True), m["delta"].clone().requires_grad_(True)]

    def fwd(_a: Tensor, _u: Tensor) -> Tensor:
        return selective_scan_fn(m["u"], m["delta"], m["A"], m["B"], m["C"]).transpose(1, 2)

    def fwd_bwd():
        y = selective_scan_fn(leaves[0], leaves[1], m["A"], m["B"], m["C"])
        return torch.autograd.grad(y, leaves, m["grad"])

    return fwd, fwd_bwd


def import_mamba() -> tuple[Optional[Callable], str]:
    """(mamba_ssm's selective_scan_fn, "") or (None, why not)."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as e:  # ImportError, or the CUDA extension failing to load
        return None, f"mamba_ssm not importable ({type(e).__name__}: {_first_line(e)}); pip install mamba-ssm (CUDA only)"
    return selective_scan_fn, ""


def scan_peer_cases(device: torch.device, dtype: torch.dtype, batch: int, length: int, state: int,
                    report: Report, log: Callable[[str], None] = print) -> list[Case]:
    """Peers of the scans, each checked against ``gk.linear_scan`` at this shape before it is listed."""
    a, u, grad = scan_inputs(device, dtype, batch, length, state)
    ref = gk.linear_scan(a, u)
    traffic, shape, dev = scan_traffic(a), f"B={batch} T={length} N={state}", describe_device(device)
    tol = tolerance(dtype, device, "scan")
    cases: list[Case] = []

    def add(impl: str, fn: Callable[[Tensor, Tensor], Tensor], grad_fn: Optional[Callable[[], object]] = None) -> None:
        try:
            err = check_same(impl, "linear_scan output", fn(a, u), ref, tol)
        except PeerMismatch as e:
            report.failures.append((dev, f"{impl} ({dtype_name(dtype)}, {shape})", str(e)))
            log(f"PEER MISMATCH: {e}")
            return
        except Exception as e:  # a peer that cannot run here is skipped, not fatal
            report.skip(dev, impl, f"failed to run: {type(e).__name__}: {_first_line(e)}", log)
            return
        report.checks.append(Check(dev, dtype_name(dtype), impl, "linear_scan output", shape, err, tol))
        cases.append(Case("linear_scan fwd", impl, shape, length, lambda: fn(a, u), *traffic["linear_scan fwd"], "float32"))
        if grad_fn is None:
            a_g, u_g = a.clone().requires_grad_(True), u.clone().requires_grad_(True)
            grad_fn = lambda: torch.autograd.grad(fn(a_g, u_g), (a_g, u_g), grad)  # noqa: E731
        cases.append(Case("linear_scan fwd+bwd", impl, shape, length, grad_fn, *traffic["linear_scan fwd+bwd"], "float32"))

    if device.type == "cuda":
        torch._dynamo.reset()  # one compile per shape and dtype, never the recompile limit's eager fallback
        compiled = torch.compile(functools.partial(scan_associative, combine_mode="pointwise"), dynamic=False)
        add("torch associative_scan (compiled, pointwise)", compiled)
    else:
        add("torch associative_scan (eager, generic)", scan_associative)
    add("torch log-space cumsum (eager)", scan_logspace)

    if device.type != "cuda":
        report.skip(dev, "mamba_ssm selective_scan_fn", "needs CUDA", log)
        return cases
    selective_scan_fn, why = import_mamba()
    if selective_scan_fn is None:
        report.skip(dev, "mamba_ssm selective_scan_fn", why, log)
        return cases
    # UNTESTED on CUDA: mamba_ssm needs CUDA, so this path was written against its documented signature
    # selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
    # return_last_state=False) and has only run with a torch transcription of mamba's reference
    # recurrence in its place (tests/kernels/test_bench_kernels.py); the equality check guards it.
    mamba_fwd, mamba_fwd_bwd = mamba_peer(selective_scan_fn, a, u, grad)
    add("mamba_ssm selective_scan_fn (B,N,T layout)", mamba_fwd, mamba_fwd_bwd)
    return cases


# --------------------------------------------------------------------------- lightning attention


def lightning_inputs(device: torch.device, dtype: torch.dtype, batch: int, heads: int, length: int, dk: int, dv: int):
    """Deterministic q, k (scaled by dk^-1/2), v in ``dtype`` and a float32 decay per head in [0.9, 1)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k = (torch.randn(batch, heads, length, dk, generator=g).div(dk**0.5).to(device, dtype) for _ in range(2))
    v = torch.randn(batch, heads, length, dv, generator=g).to(device, dtype)
    decay = (0.9 + 0.1 * torch.rand(heads, generator=g)).to(device)
    return q, k, v, decay


def lightning_traffic(q: Tensor, dv: int, chunk: int) -> dict[str, tuple[float, float]]:
    """{kernel: (min bytes, FLOPs)} of lightning fwd and fwd+bwd (module doc)."""
    batch, heads, length, dk = q.shape
    bh, size = batch * heads, q.element_size()
    io = bh * length * (2 * dk + 2 * dv) * size
    f_fwd = bh * (2 * length * chunk * (dk + dv) + 4 * length * dk * dv)
    f_bwd = bh * (2 * length * chunk * (3 * dk + 3 * dv) + 10 * length * dk * dv + 2 * length * chunk * chunk)
    return {"lightning fwd": (io, f_fwd),
            "lightning fwd+bwd": (io + bh * length * (3 * dk + 3 * dv) * size, f_fwd + f_bwd)}


def lightning_flop_dtype(impl: str, dtype: torch.dtype) -> str:
    """Precision the matmuls of ``impl`` run in (module doc), for the FLOP roof."""
    half = dtype in (torch.bfloat16, torch.float16)
    if dtype == torch.float64:
        return "float64"
    if impl == "gradshard/triton":
        return "tfloat32" if half else "float32"
    if impl.startswith("fla"):
        return dtype_name(dtype) if half else "tfloat32"
    return "float32" if torch.get_float32_matmul_precision() == "highest" else "tfloat32"


def lightning_cases(device, dtype, batch, heads, length, dk, dv, chunk, backend) -> list[Case]:
    """gradshard's lightning_attention fwd and fwd+bwd (gradients of q, k, v and the decay)."""
    q, k, v, decay = lightning_inputs(device, dtype, batch, heads, length, dk, dv)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, decay)]
    impl, traffic = f"gradshard/{backend}", lightning_traffic(q, dv, chunk)

    def fwd():
        return gk.lightning_attention(q, k, v, decay, chunk_size=chunk, backend=backend)

    def fwd_bwd():
        o, s = gk.lightning_attention(*leaves, chunk_size=chunk, backend=backend)
        return torch.autograd.grad(o.sum() + s.sum(), leaves)

    shape = f"B={batch} H={heads} T={length} dk={dk} dv={dv} C={chunk}"
    fd = lightning_flop_dtype(impl, dtype)
    return [Case("lightning fwd", impl, shape, length, fwd, *traffic["lightning fwd"], fd),
            Case("lightning fwd+bwd", impl, shape, length, fwd_bwd, *traffic["lightning fwd+bwd"], fd)]


def import_fla() -> tuple[Optional[Callable], str]:
    """(fla's chunk_simple_gla, "") or (None, why not)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:
        return None, f"fla-core not importable ({type(e).__name__}: {_first_line(e)}); pip install -e .[peers]"
    return chunk_simple_gla, ""


FLA_MODES = {
    "g": "fla chunk_simple_gla (g = log decay per step)",
    "g_gamma": "fla chunk_simple_gla (g_gamma = log decay; no decay grad)",
}


def to_fla(x: Tensor) -> Tensor:
    """(B, H, T, d) -> fla's (B, T, H, d), contiguous."""
    return x.transpose(1, 2).contiguous()


def lightning_fla(chunk_simple_gla: Callable, q: Tensor, k: Tensor, v: Tensor, decay: Tensor,
                  mode: str) -> tuple[Tensor, Tensor]:
    """``lightning_attention(q, k, v, decay)`` by fla on (B, T, H, d) tensors; returns fla's (o, final state).

    ``o_t = scale q_t S_t``, ``S_t = exp(g_t) S_{t-1} + k_t^T v_t``: ``scale = 1`` and ``g = log decay``.
    """
    log_decay = torch.log(decay.float())
    if mode == "g":
        batch, length, heads = q.shape[:3]
        kw = {"g": log_decay.view(1, 1, heads).expand(batch, length, heads)}
    elif mode == "g_gamma":
        kw = {"g_gamma": log_decay}
    else:
        raise ValueError(f"lightning_fla: mode must be one of {sorted(FLA_MODES)}, got {mode!r}")
    return chunk_simple_gla(q, k, v, scale=1.0, output_final_state=True, **kw)


def lightning_peer_cases(device: torch.device, dtype: torch.dtype, batch: int, heads: int, length: int, dk: int,
                         dv: int, chunk: int, report: Report, log: Callable[[str], None] = print,
                         on_cpu: bool = False) -> list[Case]:
    """fla's chunk kernels, each checked against ``gk.lightning_attention`` (output and final state).

    ``on_cpu``: run them on CPU too (under ``TRITON_INTERPRET=1`` inside :func:`fla_interpreter_patches`;
    the tests' check, never a timing).
    """
    dev, shape = describe_device(device), f"B={batch} H={heads} T={length} dk={dk} dv={dv} C={chunk}"
    if device.type != "cuda" and not on_cpu:  # decided before importing fla (its import warns on machines without a GPU)
        why = ("fla-core not installed (pip install -e .[peers])" if importlib.util.find_spec("fla") is None else
               "fla's Triton kernels need CUDA (on CPU they run only under TRITON_INTERPRET=1, far too slow to "
               "time; tests/kernels/test_bench_kernels.py checks their equality there)")
        for impl in FLA_MODES.values():
            report.skip(dev, impl, why, log)
        return []
    chunk_simple_gla, why = import_fla()
    if chunk_simple_gla is None:
        for impl in FLA_MODES.values():
            report.skip(dev, impl, why, log)
        return []
    q, k, v, decay = lightning_inputs(device, dtype, batch, heads, length, dk, dv)
    ref_o, ref_s = gk.lightning_attention(q, k, v, decay, chunk_size=chunk)
    qf, kf, vf = to_fla(q), to_fla(k), to_fla(v)
    traffic, tol = lightning_traffic(q, dv, chunk), tolerance(dtype, device, "lightning")
    cases: list[Case] = []
    for mode, impl in FLA_MODES.items():
        try:
            o, s = lightning_fla(chunk_simple_gla, qf, kf, vf, decay, mode)
            errs = (check_same(impl, "lightning output", o.transpose(1, 2), ref_o, tol),
                    check_same(impl, "lightning final state", s, ref_s, tol))
        except PeerMismatch as e:
            report.failures.append((dev, f"{impl} ({dtype_name(dtype)}, {shape})", str(e)))
            log(f"PEER MISMATCH: {e}")
            continue
        except Exception as e:
            report.skip(dev, impl, f"failed to run: {type(e).__name__}: {_first_line(e)}", log)
            continue
        for what, err in zip(("lightning output", "lightning final state"), errs):
            report.checks.append(Check(dev, dtype_name(dtype), impl, what, shape, err, tol))
        leaves = [t.clone().requires_grad_(True) for t in (qf, kf, vf)]
        d_leaf = decay.clone().requires_grad_(mode == "g")

        def fwd(mode=mode):
            return lightning_fla(chunk_simple_gla, qf, kf, vf, decay, mode)

        def fwd_bwd(mode=mode, leaves=leaves, d_leaf=d_leaf):
            o, s = lightning_fla(chunk_simple_gla, *leaves, d_leaf, mode)
            wrt = leaves + ([d_leaf] if d_leaf.requires_grad else [])
            return torch.autograd.grad(o.sum() + s.sum(), wrt)

        fd = lightning_flop_dtype(impl, dtype)
        cases += [Case("lightning fwd", impl, shape, length, fwd, *traffic["lightning fwd"], fd),
                  Case("lightning fwd+bwd", impl, shape, length, fwd_bwd, *traffic["lightning fwd+bwd"], fd)]
    return cases


@contextlib.contextmanager
def fla_interpreter_patches() -> Iterator[None]:
    """Let fla's Triton kernels run under ``TRITON_INTERPRET=1`` (CPU checks only, never timing).

    Two gaps of the interpreter are bridged while the context is open: autotuning (it benchmarks
    configs through a GPU driver; here the first config is used) and loop induction variables
    (fla calls ``i_t.to(tl.int64)`` on them; the interpreter's are Python ints, here they are
    wrapped as tensors). Kernels first run inside the context stay rewritten for the process.
    """
    import ast

    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    prune = autotuner.Autotuner.prune_configs
    had_for = "visit_For" in interpreter.ASTTransformer.__dict__
    old_for = interpreter.ASTTransformer.__dict__.get("visit_For")

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    def visit_for(self, node):
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            wrap = ast.Assign(
                targets=[ast.Name(id=name, ctx=ast.Store())],
                value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                  attr="to_tensor", ctx=ast.Load()),
                               args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)], keywords=[]))
            node.body.insert(0, ast.fix_missing_locations(ast.copy_location(wrap, node)))
        return node

    autotuner.Autotuner.prune_configs = first_config
    interpreter.ASTTransformer.visit_For = visit_for
    try:
        yield
    finally:
        autotuner.Autotuner.prune_configs = prune
        if had_for:
            interpreter.ASTTransformer.visit_For = old_for
        else:
            del interpreter.ASTTransformer.visit_For


# --------------------------------------------------------------------------- driver and report


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def time_cases(cases: list[Case], device: torch.device, dtype: torch.dtype, reps: int, report: Report,
               log: Callable[[str], None] = print) -> None:
    """Time every case into ``report.rows`` (a failing case is recorded in ``report.failures``)."""
    dev = describe_device(device)
    profile = report.profiles.get(dev)
    for c in cases:
        try:
            sec = timeit(c.fn, device, reps)
        except Exception as e:
            err = f"{type(e).__name__}: {_first_line(e)}"
            if not c.impl.startswith("gradshard/"):  # a peer that cannot run a case is skipped, not a failure
                report.skip(dev, c.impl, f"{c.kernel} failed to run ({dtype_name(dtype)}, {c.shape}): {err}", log)
                continue
            report.failures.append((dev, f"{c.impl} {c.kernel} ({dtype_name(dtype)}, {c.shape})", err))
            log(f"FAILED {c.impl} {c.kernel} {c.shape}:\n{traceback.format_exc()}")
            continue
        frac, bound = roofline_fraction(profile, c, sec) if profile is not None else (None, None)
        report.rows.append(Row(dev, dtype_name(dtype), c.kernel, c.impl, c.shape, c.length, sec,
                               c.nbytes / sec / 1e9, c.flops / sec / 1e9, frac, bound))
        log(f"  {c.impl:55s} {c.kernel:20s} {c.shape:40s} {1e3 * sec:10.3f} ms")


def run(devices: list[torch.device], dtypes: list[torch.dtype], quick: bool, reps: Optional[int] = None,
        profile_name: Optional[str] = None, peers: bool = True, shapes: Optional[dict] = None,
        log: Callable[[str], None] = print) -> Report:
    """Measure gradshard's kernels (and their peers) on ``devices`` x ``dtypes``; return the report."""
    report = Report()
    shapes = SHAPES if shapes is None else shapes
    for device in devices:
        dev = describe_device(device)
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            profile = get_device(profile_name) if profile_name else roofline_profile(name)
            if profile is None:
                report.notes.append(f"{dev}: no gradshard.cost device profile matches {name!r} (profiles: h100, h200, "
                                    "a100 SXM4 80GB, rtx3090); the roofline column is '-' (force one with --profile).")
                log(report.notes[-1])
            else:
                report.notes.append(f"{dev}: roofline from profile {profile.name!r} ({profile.description}): "
                                    f"HBM {profile.hbm_bandwidth / 1e12:.2f} TB/s, fp32 "
                                    f"{peak_flops(profile, 'float32') / 1e12:.1f} / tf32 "
                                    f"{peak_flops(profile, 'tfloat32') / 1e12:.0f} / bf16 "
                                    f"{peak_flops(profile, 'bfloat16') / 1e12:.0f} TFLOP/s.")
            report.profiles[dev] = profile
        else:
            report.profiles[dev] = None
            if os.environ.get("TRITON_INTERPRET") == "1":
                log("note: TRITON_INTERPRET=1 is set; the interpreter is far too slow to benchmark, timing torch only")
        backends = ["torch"] + (["triton"] if device.type == "cuda" and "triton" in gk.available_backends() else [])
        device_reps = reps if reps is not None else (20 if device.type == "cuda" else 3)
        scan_shapes, light_shapes = shapes[(device.type, quick)]
        for dtype in dtypes:
            log(f"== {dev} {dtype_name(dtype)}")
            for kernel_shapes, own_cases, peer_cases in ((scan_shapes, scan_cases, scan_peer_cases),
                                                         (light_shapes, lightning_cases, lightning_peer_cases)):
                for shape in kernel_shapes:
                    for backend in backends:
                        time_cases(own_cases(device, dtype, *shape, backend), device, dtype, device_reps, report, log)
                    if peers:
                        time_cases(peer_cases(device, dtype, *shape, report, log), device, dtype, device_reps,
                                   report, log)
                    _release(device)
    return report


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def goal_lines(report: Report) -> list[str]:
    """Issue 7's goal per device: Triton scans at T >= 16K reach >= 70% of the HBM roofline."""
    lines = []
    for dev, profile in report.profiles.items():
        rows = [r for r in report.rows if r.device == dev and r.impl == "gradshard/triton"
                and r.kernel in SCAN_KERNELS and r.length >= GOAL_MIN_LENGTH]
        head = (f"Goal (issue 7) on {dev}: Triton scans at T >= 16K >= {GOAL_FRACTION:.0%} of the "
                "memory-bandwidth roofline:")
        if profile is None or not rows:
            if profile is None:
                why = "CPU run, no HBM roofline" if dev.startswith("CPU") else "no device profile matched"
            else:
                why = "no Triton scan rows at T >= 16K"
            lines.append(f"{head} not evaluated ({why}).")
            continue
        low = [r for r in rows if r.roofline is None or r.roofline < GOAL_FRACTION]
        worst = min(rows, key=lambda r: r.roofline or 0.0)
        verdict = "MET" if not low else "NOT MET"
        detail = "; ".join(f"{r.kernel} {r.dtype} {r.shape}: {100 * (r.roofline or 0):.0f}%" for r in (low or [worst]))
        lines.append(f"{head} **{verdict}** ({'below: ' if low else 'lowest: '}{detail}).")
    return lines


def render(report: Report, command: str) -> str:
    """The report as markdown: per device, notes, one table per dtype, goal, checks, skips, failures."""
    out: list[str] = []
    for dev in report.profiles:
        out.append(f"Device: {dev}. Command: `{command}`.\n")
        out += [n + "\n" for n in report.notes if n.startswith(dev)]
        for dtype in dict.fromkeys(r.dtype for r in report.rows if r.device == dev):
            out.append(f"**{dtype}**\n")
            out.append("| kernel | implementation | shape | time (ms) | GB/s (min traffic) | GFLOP/s "
                       "| % roofline (bound) |")
            out.append("|---|---|---|---:|---:|---:|---:|")
            for r in report.rows:
                if r.device == dev and r.dtype == dtype:
                    roof = "-" if r.roofline is None else f"{100 * r.roofline:.1f}% ({r.bound})"
                    out.append(f"| {r.kernel} | {r.impl} | {r.shape} | {1e3 * r.seconds:.3f} | {r.gbps:.1f} | "
                               f"{r.gflops:.1f} | {roof} |")
            out.append("")
        out += [g + "\n" for g in goal_lines(report) if f" on {dev}:" in g]
        checks = [c for c in report.checks if c.device == dev]
        if checks:
            out.append("Peer equality at the bench shapes (max|peer - gradshard| / max|gradshard|): " + "; ".join(
                f"{c.impl} {c.what} {c.dtype} {c.shape}: {c.rel_err:.1e} (tol {c.tol:.0e})" for c in checks) + ".\n")
        skips = [s for s in report.skips if s[0] == dev]
        if skips:
            by_reason: dict[str, list[str]] = {}
            for _, impl, why in skips:
                by_reason.setdefault(why, []).append(impl)
            out.append("Skipped peers: " + "; ".join(f"{', '.join(impls)}: {why}" for why, impls in by_reason.items())
                       + ".\n")
        fails = [f for f in report.failures if f[0] == dev]
        if fails:
            out.append("**Failures**: " + "; ".join(f"{what}: {err}" for _, what, err in fails) + ".\n")
    return "\n".join(out).strip() + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per case (default: 20 on CUDA, 3 on CPU)")
    parser.add_argument("--dtypes", default=None, help="comma-separated float32,bfloat16,float16 "
                        "(default: float32,bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated cpu,cuda (default: cuda if available, else cpu)")
    parser.add_argument("--profile", default=None,
                        help="force a gradshard.cost device profile for the roofline (e.g. h100)")
    parser.add_argument("--no-peers", action="store_true", help="time gradshard only")
    parser.add_argument("--results", action="store_true",
                        help=f"write the tables into the '## {SECTION}' section of RESULTS.md "
                             "(one '### Measured: ...' subsection per device)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    devices = [torch.device(d) for d in (args.devices or ("cuda" if cuda else "cpu")).split(",")]
    if any(d.type == "cuda" for d in devices) and not cuda:
        parser.error("--devices cuda: CUDA is not available here")
    names = (args.dtypes or ("float32,bfloat16" if cuda else "float32")).split(",")
    if not set(names) <= {"float32", "bfloat16", "float16", "float64"}:
        parser.error(f"--dtypes: use float32, bfloat16, float16 or float64, got {args.dtypes!r}")
    dtypes = [getattr(torch, d) for d in names]
    command = "python bench/bench_kernels.py" + (" " + " ".join(sys.argv[1:] if argv is None else argv)).rstrip()
    report = run(devices, dtypes, args.quick, args.reps, args.profile, peers=not args.no_peers)
    text = render(report, command)
    print("\n## gradshard.kernels\n\n" + text)
    if args.results:
        for dev in report.profiles:
            one = Report([r for r in report.rows if r.device == dev], [c for c in report.checks if c.device == dev],
                         [s for s in report.skips if s[0] == dev], [f for f in report.failures if f[0] == dev],
                         {dev: report.profiles[dev]}, [n for n in report.notes if n.startswith(dev)])
            write_subsection(SECTION, f"Measured: {dev.split(' (')[0].split(',')[0]}", render(one, command))
        print(f"wrote the '## {SECTION}' section of bench/RESULTS.md")
    if report.failures:
        print(f"{len(report.failures)} failure(s); see above.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

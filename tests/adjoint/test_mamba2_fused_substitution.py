"""Mamba-2's fused training path ``mamba_split_conv1d_scan_combined`` gets a one-scan twin too.

The stand-in kernel needs real storage and computes the fused op with SSD's chunked algorithm
(:mod:`.ssd_reference`) and its own causal conv and grouped gated RMSNorm, written apart from
gradshard's twin.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from gradshard.capture.twins_mamba import mamba_split_conv1d_scan_reference

from .helpers import assert_same_grads
from .standin import OpaqueKernel, standin_package
from .ssd_reference import ssd_chunk_scan

F64 = torch.float64


def split_conv_ssd(zxbcdt, w, bias, dt_bias, A, D, chunk, h0, norm_w, eps, out_w, out_b, headdim, ngroups,
                   norm_before_gate):
    """The fused op, computed step by step with SSD (its docstring's contract)."""
    nheads = D.shape[0]
    dim = nheads * headdim
    dstate = (w.shape[0] - dim) // ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    b, L = xBC.shape[:2]
    xpad = F.pad(xBC.transpose(1, 2), (w.shape[-1] - 1, 0))  # causal: only the past
    conv = F.silu(F.conv1d(xpad, w[:, None, :], bias, groups=w.shape[0]).transpose(1, 2))
    x, B, C = torch.split(conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    zh = z.reshape(b, L, nheads, headdim)
    y = ssd_chunk_scan(x.reshape(b, L, nheads, headdim), dt, A, B.reshape(b, L, ngroups, dstate),
                       C.reshape(b, L, ngroups, dstate), chunk, D=D, z=None if norm_w is not None else zh,
                       dt_bias=dt_bias, initial_states=h0, dt_softplus=True).reshape(b, L, dim)
    if norm_w is not None:
        gate = F.silu(z)
        y = y if norm_before_gate else y * gate
        yg = y.reshape(b, L, ngroups, dim // ngroups)
        y = (yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + eps)).reshape(b, L, dim) * norm_w
        y = y * gate if norm_before_gate else y
    if d_nonssm:
        y = torch.cat([F.silu(zx0[..., :d_nonssm]) * zx0[..., d_nonssm:], y], dim=-1)
    return F.linear(y, out_w, out_b)


def _mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                      initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                      return_final_states=False, activation="silu", rmsnorm_weight=None,
                                      rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                      ngroups=1, norm_before_gate=True):
    assert activation == "silu" and seq_idx is None and not return_final_states

    def fn(zxbcdt, w, b, dt_bias, A, D, h0, norm_w, out_w, out_b):
        return split_conv_ssd(zxbcdt, w, b, dt_bias, A, D, chunk_size, h0, norm_w, rmsnorm_eps, out_w, out_b,
                              headdim, ngroups, norm_before_gate)

    return OpaqueKernel.apply(fn, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight,
                              outproj_weight, outproj_bias)


USER_CODE = textwrap.dedent('''
    import torch
    from torch import nn
    from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined


    class Mamba2(nn.Module):
        """mamba_ssm's Mamba2 training path (use_mem_eff_path=True)."""

        def __init__(self, d_model=5, d_state=3, headdim=2, nheads=4, ngroups=2, d_conv=3, chunk_size=4,
                     rmsnorm=True, norm_before_gate=False, d_nonssm=0):
            super().__init__()
            self.headdim, self.ngroups, self.chunk_size = headdim, ngroups, chunk_size
            self.norm_before_gate = norm_before_gate
            d_inner = nheads * headdim
            conv_dim = d_inner + 2 * ngroups * d_state
            self.in_proj = nn.Linear(d_model, 2 * d_nonssm + 2 * d_inner + 2 * ngroups * d_state + nheads, bias=False)
            self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
            self.dt_bias = nn.Parameter(torch.rand(nheads) - 1.0)
            self.A_log = nn.Parameter(torch.log(torch.empty(nheads).uniform_(1, 4)))
            self.D = nn.Parameter(torch.ones(nheads))
            self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(d_inner)) if rmsnorm else None
            self.out_proj = nn.Linear(d_nonssm + d_inner, d_model, bias=False)

        def forward(self, u):
            out = mamba_split_conv1d_scan_combined(
                self.in_proj(u), self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, -torch.exp(self.A_log),
                D=self.D, chunk_size=self.chunk_size, activation="silu", rmsnorm_weight=self.norm_weight,
                rmsnorm_eps=1e-5, outproj_weight=self.out_proj.weight, outproj_bias=self.out_proj.bias,
                headdim=self.headdim, ngroups=self.ngroups, norm_before_gate=self.norm_before_gate)
            return u + out


    class Mamba2LM(nn.Module):
        def __init__(self, layers=2, **kw):
            super().__init__()
            self.layers = nn.ModuleList(Mamba2(**kw) for _ in range(layers))

        def forward(self, u):
            for layer in self.layers:
                u = layer(u)
            return u
''')


@pytest.fixture
def user_module():
    kernels = {"mamba_split_conv1d_scan_combined": _mamba_split_conv1d_scan_combined}
    with standin_package("mamba_ssm.ops.triton.ssd_combined", kernels, USER_CODE, "user_mamba2_fused_model") as user:
        yield user


@pytest.mark.parametrize("rmsnorm,norm_before_gate,d_nonssm", [(True, False, 0), (True, True, 2), (False, False, 2)])
def test_the_fused_twin_equals_the_ssd_computation(rmsnorm, norm_before_gate, d_nonssm):
    g = torch.Generator().manual_seed(7)
    b, L, nheads, headdim, ngroups, dstate, width = 2, 11, 4, 3, 2, 5, 4
    dim = nheads * headdim
    zxbcdt = torch.randn(b, L, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads, generator=g, dtype=F64)
    w = torch.randn(dim + 2 * ngroups * dstate, width, generator=g, dtype=F64)
    bias = torch.randn(w.shape[0], generator=g, dtype=F64)
    dt_bias, D = torch.randn(nheads, generator=g, dtype=F64), torch.randn(nheads, generator=g, dtype=F64)
    A = -torch.rand(nheads, generator=g, dtype=F64) * 2
    h0 = torch.randn(b, nheads, headdim, dstate, generator=g, dtype=F64)
    norm_w = torch.randn(dim, generator=g, dtype=F64) if rmsnorm else None
    out_w = torch.randn(7, d_nonssm + dim, generator=g, dtype=F64)
    leaves = [t for t in (zxbcdt, w, bias, dt_bias, A, D, h0, norm_w, out_w) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    got = mamba_split_conv1d_scan_reference(zxbcdt, w, bias, dt_bias, A, D, 4, initial_states=h0,
                                            rmsnorm_weight=norm_w, rmsnorm_eps=1e-5, outproj_weight=out_w,
                                            headdim=headdim, ngroups=ngroups, norm_before_gate=norm_before_gate)
    ref = split_conv_ssd(zxbcdt, w, bias, dt_bias, A, D, 4, h0, norm_w, 1e-5, out_w, None, headdim, ngroups,
                         norm_before_gate)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    wgt = torch.randn(got.shape, generator=g, dtype=F64)
    for a, r in zip(torch.autograd.grad((got * wgt).sum(), leaves), torch.autograd.grad((ref * wgt).sum(), leaves)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rmsnorm", [True, False])
def test_a_fused_mamba2_model_compiles_with_adjoint_and_matches(user_module, rmsnorm):
    torch.manual_seed(1)
    model = user_module.Mamba2LM(rmsnorm=rmsnorm, d_nonssm=0 if rmsnorm else 2).double()
    x = torch.randn(2, 13, 5, dtype=F64)
    cm = assert_same_grads(model, (x,), shard_size=4)
    assert len([r for r in cm.regions if r.kind == "linear_recurrence"]) == 2
    assert "mamba_split_conv1d_scan_combined" in cm.explain()


@pytest.mark.parametrize("plan,opts", [("none", {}), ("seco", {"chunk_size": 4})])
def test_other_plans_run_the_twin_exactly(user_module, plan, opts):
    torch.manual_seed(4)
    model = user_module.Mamba2LM().double()
    assert_same_grads(model, (torch.randn(2, 12, 5, dtype=F64),), plan=plan, **opts)

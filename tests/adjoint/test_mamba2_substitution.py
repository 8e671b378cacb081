"""Mamba-2's ``mamba_chunk_scan_combined`` is swapped for a one-scan twin while capturing.

mamba_ssm needs CUDA, so a stand-in package plays its part: its kernel needs real storage
(``data_ptr``, like the Triton kernels) and computes the SSD algorithm itself -- the chunked
``exp(segsum(A))`` form of ``mamba_ssm/modules/ssd_minimal.py`` -- so the eager reference
the compiled model is checked against is Mamba-2's own math, not gradshard's twin.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from gradshard.capture.twins_mamba import mamba_chunk_scan_reference

from .helpers import assert_same_grads
from .standin import OpaqueKernel, standin_package
from .ssd_reference import ssd_chunk_scan

F64 = torch.float64


def _mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                               seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                               return_final_states=False, return_varlen_states=False):
    assert not return_final_states and seq_idx is None

    def fn(x, dt, A, B, C, D, z, dt_bias, h0):
        return ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, h0, dt_softplus)

    return OpaqueKernel.apply(fn, x, dt, A, B, C, D, z, dt_bias, initial_states)


USER_CODE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined


    class Mamba2(nn.Module):
        """mamba_ssm's Mamba2 mixer (use_mem_eff_path=False, z gate passed to the kernel)."""

        def __init__(self, d_model=5, d_state=3, headdim=2, nheads=4, ngroups=2, d_conv=3, chunk_size=4,
                     learn_h0=False):
            super().__init__()
            self.d_inner, self.d_state, self.headdim = nheads * headdim, d_state, headdim
            self.nheads, self.ngroups, self.chunk_size = nheads, ngroups, chunk_size
            conv_dim = self.d_inner + 2 * ngroups * d_state
            self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + nheads, bias=False)
            self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
            self.dt_bias = nn.Parameter(torch.rand(nheads) - 1.0)
            self.A_log = nn.Parameter(torch.log(torch.empty(nheads).uniform_(1, 4)))
            self.D = nn.Parameter(torch.ones(nheads))
            self.h0 = nn.Parameter(0.3 * torch.randn(nheads, headdim, d_state)) if learn_h0 else None
            self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

        def forward(self, u):
            batch, seqlen, _ = u.shape
            zxbcdt = self.in_proj(u)
            A = -torch.exp(self.A_log)
            z, xBC, dt = torch.split(
                zxbcdt, [self.d_inner, self.d_inner + 2 * self.ngroups * self.d_state, self.nheads], dim=-1)
            xBC = F.silu(self.conv1d(xBC.transpose(1, 2)).transpose(1, 2)[:, :seqlen])
            x, B, C = torch.split(xBC, [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
            h0 = None if self.h0 is None else self.h0.expand(batch, *self.h0.shape)
            y = mamba_chunk_scan_combined(
                x.reshape(batch, seqlen, self.nheads, self.headdim), dt, A,
                B.reshape(batch, seqlen, self.ngroups, self.d_state), C.reshape(batch, seqlen, self.ngroups, self.d_state),
                chunk_size=self.chunk_size, D=self.D, z=z.reshape(batch, seqlen, self.nheads, self.headdim),
                dt_bias=self.dt_bias, initial_states=h0, dt_softplus=True)
            return u + self.out_proj(y.reshape(batch, seqlen, self.d_inner))


    class Mamba2LM(nn.Module):
        def __init__(self, layers=2, **kw):
            super().__init__()
            self.layers = nn.ModuleList(Mamba2(**kw) for _ in range(layers))
            self.norm = nn.LayerNorm(kw.get("d_model", 5))

        def forward(self, u):
            for layer in self.layers:
                u = layer(self.norm(u))
            return u
''')


@pytest.fixture
def user_module():
    with standin_package("mamba_ssm.ops.triton.ssd_combined", {"mamba_chunk_scan_combined": _mamba_chunk_scan_combined},
                         USER_CODE, "user_mamba2_model") as user:
        yield user


@pytest.mark.parametrize("T,chunk", [(11, 4), (16, 8)])
@pytest.mark.parametrize("d_shape", ["heads", "heads x headdim"])
def test_the_twin_equals_the_ssd_algorithm(T, chunk, d_shape):
    g = torch.Generator().manual_seed(T)
    b, h, p, n, groups = 2, 4, 3, 5, 2
    x, z = (torch.randn(b, T, h, p, generator=g, dtype=F64) for _ in range(2))
    dt = torch.randn(b, T, h, generator=g, dtype=F64)
    A = -torch.rand(h, generator=g, dtype=F64) * 3
    B, C = (torch.randn(b, T, groups, n, generator=g, dtype=F64) for _ in range(2))
    D = torch.randn(h, generator=g, dtype=F64) if d_shape == "heads" else torch.randn(h, p, generator=g, dtype=F64)
    dt_bias = torch.randn(h, generator=g, dtype=F64)
    h0 = torch.randn(b, h, p, n, generator=g, dtype=F64)
    leaves = [x, dt, A, B, C, D, z, dt_bias, h0]
    for t in leaves:
        t.requires_grad_(True)
    kw = dict(D=D, z=z, dt_bias=dt_bias, initial_states=h0, dt_softplus=True, return_final_states=True)
    y, final = mamba_chunk_scan_reference(x, dt, A, B, C, chunk, **kw)
    y_ref, final_ref = ssd_chunk_scan(x, dt, A, B, C, chunk, **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(y.shape, generator=g, dtype=F64)
    got = torch.autograd.grad((y * w).sum() + final.sum(), leaves)
    ref = torch.autograd.grad((y_ref * w).sum() + final_ref.sum(), leaves)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_packed_sequences_are_refused_clearly():
    x = torch.zeros(1, 4, 2, 1)
    with pytest.raises(NotImplementedError, match="packed sequences"):
        mamba_chunk_scan_reference(x, x[..., 0], x[0, 0, :, 0], x, x, 2, seq_idx=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("learn_h0", [False, True])
def test_a_mamba2_model_compiles_with_adjoint_and_matches_ssd(user_module, learn_h0):
    torch.manual_seed(0)
    model = user_module.Mamba2LM(learn_h0=learn_h0).double()
    x = torch.randn(3, 13, 5, dtype=F64)
    cm = assert_same_grads(model, (x,), shard_size=4)
    regions = [r for r in cm.regions if r.kind == "linear_recurrence"]
    assert len(regions) == 2 and {r.options["written_as"] for r in regions} == {"gradshard.kernels.linear_scan"}
    assert "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined" in cm.explain()
    assert user_module.mamba_chunk_scan_combined is _mamba_chunk_scan_combined  # restored after capture


def test_torch_compile_backend_after_installing_the_twins(user_module):
    """Dynamo traces the model before gradshard sees it: the twins must be installed first."""
    import copy

    import gradshard as gs
    from gradshard.capture.substitutions import install_traceable_twins

    torch.manual_seed(3)
    model = user_module.Mamba2LM().double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 13, 5, dtype=F64)
    ref(x).square().sum().backward()  # before installing: the stand-in's own (SSD) kernel
    assert install_traceable_twins() == ["mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined"]
    assert user_module.mamba_chunk_scan_combined is mamba_chunk_scan_reference
    assert install_traceable_twins() == []  # idempotent
    # inductor=False: what is checked is the twins under Dynamo; Inductor's compile of the segments
    # is tested in tests/compose and tests/hf/test_hf_backend.py (here it cost ~2 min on a cold cache)
    be = gs.backend("adjoint", shard_size=4, inductor=False)
    compiled = torch.compile(model, backend=be, dynamic=False)
    compiled(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert any(r.kind == "linear_recurrence" for e in be.compiled for r in e.regions)

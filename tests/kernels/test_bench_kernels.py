"""bench/bench_kernels.py on tiny shapes: roofline lookup, peer equality, the quick path, the writer.

The fla-core peer (optional extra ``peers``) runs its Triton kernels on CPU only under the Triton
interpreter, so its checks run in a child pytest process started with TRITON_INTERPRET=1 (skipped
when fla-core is not installed).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import gradshard.kernels as gk
from tests.bench_modules import load_bench
from tests.interpreted import INTERPRETED, run_under_interpreter

CPU, F32, F64 = torch.device("cpu"), torch.float32, torch.float64


bk = load_bench("bench_kernels")
TINY = {("cpu", True): ([(2, 200, 3)], [(1, 2, 70, 16, 16, 16)])}


def _grads(fn, a, u, grad):
    leaves = [a.clone().requires_grad_(True), u.clone().requires_grad_(True)]
    got = torch.autograd.grad(fn(*leaves), leaves, grad, allow_unused=True)  # T == 1: a is unused (dh/da = 0)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, got)]


if not INTERPRETED:

    @pytest.mark.parametrize("name, expected", [
        ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 SXM5 80GB", "h100"), ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
        ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA GeForce RTX 3090 Ti", None), ("Tesla T4", None), ("", None),
    ])
    def test_roofline_profile_matches_only_the_profiled_parts(name, expected):
        profile = bk.roofline_profile(name)
        assert (profile.name if profile is not None else None) == expected

    def test_roofline_fraction_uses_the_bound_that_applies():
        h100 = bk.get_device("h100")
        scan = bk.Case("linear_scan fwd", "x", "s", 1, lambda: None, nbytes=3.35e12, flops=1.0, flop_dtype="float32")
        assert bk.roofline_fraction(h100, scan, 2.0) == pytest.approx((0.5, "memory"))
        light = bk.Case("lightning fwd", "x", "s", 1, lambda: None, nbytes=1.0, flops=66.9e12, flop_dtype="float32")
        assert bk.roofline_fraction(h100, light, 4.0) == pytest.approx((0.25, "compute"))
        tf32 = bk.Case("lightning fwd", "x", "s", 1, lambda: None, nbytes=1.0, flops=494.7e12, flop_dtype="tfloat32")
        assert bk.roofline_fraction(h100, tf32, 1.0)[0] == pytest.approx(1.0)
        # the RTX 3090 profile lists no tf32 peak: its fp32 peak is used
        assert bk.roofline_fraction(bk.get_device("rtx3090"), tf32, 1.0)[0] == pytest.approx(494.7 / 35.6)

    @pytest.mark.parametrize("peer", [bk.scan_associative, functools.partial(bk.scan_logspace, chunk=16),
                                      bk.scan_logspace, bk.scan_doubling])
    @pytest.mark.parametrize("shape", [(2, 333, 3), (1, 16, 5), (3, 1, 2)])
    def test_scan_peers_equal_linear_scan_with_gradients(peer, shape):
        g = torch.Generator().manual_seed(1)
        a = (0.6 + 0.4 * torch.rand(*shape, generator=g, dtype=F64))
        u, grad = (torch.randn(*shape, generator=g, dtype=F64) for _ in range(2))
        ref = gk.linear_scan(a, u, backend="torch")
        assert bk.rel_err(peer(a, u), ref) <= 1e-12
        want_grads = _grads(lambda x, y: gk.linear_scan(x, y, backend="torch"), a, u, grad)
        for got, want in zip(_grads(peer, a, u, grad), want_grads):
            assert (got - want).abs().max() <= 1e-11 * max(1.0, want.abs().max().item())

    def test_check_same_rejects_another_function_and_nan():
        g = torch.Generator().manual_seed(2)
        a, u = 0.9 + 0.1 * torch.rand(2, 50, 4, generator=g), torch.randn(2, 50, 4, generator=g)
        ref = gk.linear_scan(a, u)
        assert bk.check_same("peer", "out", bk.scan_logspace(a, u), ref, 1e-3) < 1e-5
        with pytest.raises(bk.PeerMismatch, match="does not compute"):
            bk.check_same("reverse", "out", gk.linear_scan(a, u, reverse=True), ref, 1e-3)
        with pytest.raises(bk.PeerMismatch):
            bk.check_same("nan", "out", torch.full_like(ref, float("nan")), ref, 1e-3)
        with pytest.raises(bk.PeerMismatch, match="shape"):
            bk.check_same("short", "out", ref[:, 1:], ref, 1e-3)

    def selective_scan_transcribed(u, delta, A, B, C):
        """mamba_ssm's documented recurrence (its selective_scan_ref loop, variable B/C of shape (B, N, L)),
        in float64: x_t = exp(delta_t A) x_{t-1} + delta_t B_t u_t, y_t = C_t x_t; y is (B, D, L) in u's dtype."""
        d64, u64, A64, B64, C64 = delta.double(), u.double(), A.double(), B.double(), C.double()
        x, ys = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=F64), []
        for t in range(u.shape[2]):
            x = torch.exp(d64[:, :, t, None] * A64) * x + (d64[:, :, t] * u64[:, :, t])[..., None] * B64[:, None, :, t]
            ys.append(torch.einsum("bdn,bn->bd", x, C64[:, :, t]))
        return torch.stack(ys, 2).to(u.dtype)

    @pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
    def test_mamba_peer_computes_linear_scan(dtype):
        """mamba_inputs fed to mamba's recurrence give linear_scan; du' = delta * dL/du (the real kernel needs CUDA)."""
        a, u, grad = bk.scan_inputs(CPU, dtype, 2, 300, 5)
        assert bool((a < 1).all()) and bool((a > 0).all())  # delta = -log a > 0 even after bf16 rounding
        m = bk.mamba_inputs(a, u, grad)
        assert m["u"].shape == m["delta"].shape == m["grad"].shape == (2, 5, 300) and m["A"].shape == (5, 1)
        assert m["B"].shape == m["C"].shape == (2, 1, 300) and m["B"].dtype == m["delta"].dtype == dtype
        assert m["A"].dtype == F32 and m["u"].stride(-1) == m["delta"].stride(-1) == 1
        fwd, fwd_bwd = bk.mamba_peer(selective_scan_transcribed, a, u, grad)
        tol = 1e-5 if dtype == F32 else 3e-2
        assert bk.rel_err(fwd(a, u), gk.linear_scan(a.double(), u.double())) <= tol
        du_m, _ = fwd_bwd()
        _, lam = _grads(lambda x, y: gk.linear_scan(x, y), a.double(), u.double(), grad.double())
        assert bk.rel_err(du_m, m["delta"].double() * lam.transpose(1, 2)) <= tol

    def test_quick_path_times_gradshard_and_the_torch_peers():
        logs: list[str] = []
        report = bk.run([CPU], [F32], quick=True, reps=1, shapes=TINY, log=logs.append)
        assert not report.failures, report.failures
        got = {(r.kernel, r.impl) for r in report.rows}
        for kernel in ("linear_scan fwd", "linear_scan fwd+bwd", "adjoint_shard", "lightning fwd", "lightning fwd+bwd"):
            assert (kernel, "gradshard/torch") in got
        for impl in ("torch associative_scan (eager, generic)", "torch log-space cumsum (eager)"):
            assert {("linear_scan fwd", impl), ("linear_scan fwd+bwd", impl)} <= got
        assert {c.impl for c in report.checks} == {"torch associative_scan (eager, generic)",
                                                    "torch log-space cumsum (eager)"}
        assert all(c.rel_err <= 1e-5 for c in report.checks)
        assert all(r.roofline is None and r.seconds > 0 for r in report.rows)
        skipped = {impl: why for _, impl, why in report.skips}
        assert skipped["mamba_ssm selective_scan_fn"] == "needs CUDA"
        assert set(bk.FLA_MODES.values()) <= set(skipped)
        text = bk.render(report, "python bench/bench_kernels.py --quick")
        assert "| kernel | implementation | shape |" in text and "not evaluated (CPU run" in text
        assert "Skipped peers:" in text and "Peer equality at the bench shapes" in text

    def test_goal_lines_judge_the_triton_scans_at_16k():
        dev, h100 = "NVIDIA H100 80GB HBM3 (80 GiB), torch x", bk.get_device("h100")

        def row(kernel, length, frac, impl="gradshard/triton"):
            return bk.Row(dev, "float32", kernel, impl, f"T={length}", length, 1.0, 1.0, 1.0, frac, "memory")

        report = bk.Report(profiles={dev: h100})
        report.rows = [row("linear_scan fwd", 16384, 0.8), row("adjoint_shard", 65536, 0.75),
                       row("linear_scan fwd", 4096, 0.1), row("linear_scan fwd", 65536, 0.2, "gradshard/torch")]
        assert "**MET**" in bk.goal_lines(report)[0]
        report.rows.append(row("linear_scan fwd+bwd", 65536, 0.5))
        line = bk.goal_lines(report)[0]
        assert "**NOT MET**" in line and "linear_scan fwd+bwd float32 T=65536: 50%" in line
        assert "not evaluated (no device profile matched)" in bk.goal_lines(bk.Report(profiles={dev: None}))[0]

    def test_main_quick_results_writes_a_kernels_subsection(tmp_path, monkeypatch):
        results = tmp_path / "RESULTS.md"
        results.write_text("# Benchmark results\n\n## Kernels (issue 7)\n\nNo GPU was available.\n\n## Other\n\nkept\n")
        monkeypatch.setattr(bk, "SHAPES", TINY)
        monkeypatch.setattr(bk, "write_subsection", functools.partial(bk.write_subsection, path=results))
        assert bk.main(["--quick", "--reps", "1", "--results"]) == 0
        text = results.read_text()
        kernels, other = text.partition("## Kernels (issue 7)")[2].split("## Other")
        assert "No GPU was available." in kernels and "### Measured: CPU" in kernels
        assert "`python bench/bench_kernels.py --quick --reps 1 --results`" in kernels
        assert "| linear_scan fwd | torch log-space cumsum (eager) |" in kernels and "kept" in other

    def test_fla_peer_under_interpreter():
        if importlib.util.find_spec("fla") is None:
            pytest.skip("fla-core is not installed (optional extra 'peers'); its checks need it")
        run_under_interpreter(__file__, timeout_s=240.0)

else:
    from fla.ops.simple_gla import chunk_simple_gla

    @pytest.fixture(scope="module", autouse=True)
    def _patched():
        with bk.fla_interpreter_patches():
            yield

    def _lightning(dtype=F32, b=2, h=3, t=77, dk=16, dv=16):
        q, k, v, decay = bk.lightning_inputs(CPU, dtype, b, h, t, dk, dv)
        return q, k, v, decay

    @pytest.mark.parametrize("mode", sorted(bk.FLA_MODES))
    def test_fla_computes_lightning_attention_with_gradients(mode):
        q, k, v, decay = _lightning()
        g = torch.Generator().manual_seed(3)
        go, gs = torch.randn(2, 3, 77, 16, generator=g), torch.randn(2, 3, 16, 16, generator=g)
        ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, decay)]
        o, s = gk.lightning_attention(*ref_leaves, chunk_size=16, backend="torch")
        ref = torch.autograd.grad((o * go).sum() + (s * gs).sum(), ref_leaves)
        leaves = [bk.to_fla(t).requires_grad_(True) for t in (q, k, v)] + [decay.clone().requires_grad_(mode == "g")]
        of, sf = bk.lightning_fla(chunk_simple_gla, *leaves, mode)
        assert bk.check_same("fla", "output", of.transpose(1, 2), o, 1e-5) <= 1e-5
        assert bk.check_same("fla", "final state", sf, s, 1e-5) <= 1e-5
        wrt = leaves if mode == "g" else leaves[:3]
        grads = torch.autograd.grad((of.transpose(1, 2) * go).sum() + (sf * gs).sum(), wrt)
        for got, want in zip(grads, ref):
            want = bk.to_fla(want) if want.dim() == 4 else want
            assert bk.rel_err(got, want) <= 1e-5

    def test_fla_default_scale_is_another_function():
        q, k, v, decay = _lightning()
        o, _ = gk.lightning_attention(q, k, v, decay, backend="torch")
        of, _ = chunk_simple_gla(bk.to_fla(q), bk.to_fla(k), bk.to_fla(v), g_gamma=torch.log(decay),
                                 output_final_state=True)  # scale defaults to dk ** -0.5
        with pytest.raises(bk.PeerMismatch):
            bk.check_same("fla (default scale)", "output", of.transpose(1, 2), o, 1e-3)

    def test_bench_lightning_peer_cases_check_and_run_on_cpu():
        report, logs = bk.Report(), []
        cases = bk.lightning_peer_cases(CPU, F32, 1, 2, 70, 16, 16, 16, report, log=logs.append, on_cpu=True)
        assert not report.failures and not report.skips, (report.failures, report.skips, logs)
        assert [(c.kernel, c.impl) for c in cases] == [(k, impl) for impl in bk.FLA_MODES.values()
                                                       for k in ("lightning fwd", "lightning fwd+bwd")]
        assert len(report.checks) == 4 and all(c.rel_err <= 1e-5 for c in report.checks)
        for c in cases:
            out = c.fn()
            assert all(torch.isfinite(t).all() for t in out)

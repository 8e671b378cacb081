"""Low precision: every plan's gradient error against float64, next to eager's in the same dtype.

    python bench/bench_low_precision.py                        # T=4096, bf16 + fp16, every plan
    python bench/bench_low_precision.py --models ssm --dtypes bfloat16 --seq-len 1024 --no-results
    python bench/bench_low_precision.py --device cuda            # on a GPU: its own section

For each model, dtype and plan: the model is built in float32 from a fixed seed, copied to
float64 (the reference) and to the dtype; eager autograd in the dtype and ``gs.compile`` in the
dtype each compute the gradient of the same weighted sum of the outputs (weights in float64).
The error of a run is the worst parameter's ``max |g - g64| / max |g64|``. A plan is as good as
eager when its error is at most eager's (times a small slack: rounding differs with the order
of operations). Results go to the "Low precision (issue 20)" section of ``RESULTS.md``.

The example SSM here uses the associative-scan form: the loop-free log-space form
(``SSMConfig.scan="loop_free_logcumsum"``) computes ``exp(-cumsum(log a))``, which overflows
once the cumulative decay passes ``e^-88`` (the float32/bfloat16 range), so its eager gradients
are NaN at long T in every dtype but float64 (gradshard's adjoint plan rewrites it into a scan
that never forms that term and stays finite).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: where results go
from results_md import write_section  # noqa: E402

import torch  # noqa: E402

import gradshard as gs  # noqa: E402
from gradshard.examples import factories  # noqa: E402

PLAN_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "seco": {"chunk_size": 512},
    "spaco": {"chunk_size": 512, "budget": 10**9},
    "adjoint": {"shard_size": 512},
    "truncated_adjoint": {"shard_size": 512, "window": 10**9},
    "partial_update": {},
}
RECURRENT_PLANS = {"adjoint", "truncated_adjoint"}
MODELS = {"ssm": ("ssm_associative_scan", True), "llama": ("llama", False)}


def build(name: str, T: int, d_model: int = 64) -> tuple[torch.nn.Module, torch.Tensor]:
    factory, _ = MODELS[name]
    model, (ids,) = getattr(factories, factory)(seq_len=T, batch=1, d_model=d_model, n_layers=2,
                                                dtype=torch.float32)
    return model, ids


def grads(model: torch.nn.Module, run: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """float64 gradients of a fixed weighted sum of ``run(ids)``."""
    for p in model.parameters():
        p.grad = None
    out = run(ids)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=torch.float64, device=out.device).reshape(out.shape)
    (out.double() * w).sum().backward()
    return [p.grad.double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
            for p in model.parameters()]


def error(got: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    """Worst parameter's ``max|g - g64| / max|g64|`` (inf if any gradient is not finite)."""
    worst = 0.0
    for g, t in zip(got, truth):
        if not torch.isfinite(g).all():
            return float("inf")
        worst = max(worst, float((g - t).abs().max() / t.abs().max().clamp_min(1e-30)))
    return worst


def measure(name: str, dtype: torch.dtype, T: int, plans: list[str], d_model: int = 64,
            device: str = "cpu") -> list[dict[str, Any]]:
    """Rows ``{model, dtype, run, error}``: eager first, then each plan that applies."""
    model, ids = build(name, T, d_model)
    model, ids = model.to(device), ids.to(device)
    ref = copy.deepcopy(model).double()
    truth = grads(ref, ref, ids)
    eager = copy.deepcopy(model).to(dtype)
    rows = [{"model": name, "dtype": str(dtype).split(".")[-1], "run": "eager",
             "error": error(grads(eager, eager, ids), truth)}]
    for plan in plans:
        if plan in RECURRENT_PLANS and not MODELS[name][1]:
            continue
        mine = copy.deepcopy(model).to(dtype)
        cm = gs.compile(mine, plan=plan, **PLAN_OPTIONS[plan])
        try:
            err = error(grads(mine, cm, ids), truth)
        except gs.GradshardError as exc:
            err = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}..."
        if plan == "partial_update":  # only the trainable slice gets a gradient: compare it there
            err = _partial_error(cm, mine, ids, truth, err)
        rows.append({"model": name, "dtype": rows[0]["dtype"], "run": plan, "error": err})
    return rows


def _partial_error(cm: Any, model: torch.nn.Module, ids: torch.Tensor, truth: list[torch.Tensor],
                   err: Any) -> Any:
    """partial_update's error on the parameters it trains (the frozen slices have no gradient)."""
    if isinstance(err, str):
        return err
    got = grads(model, cm, ids)
    names = [n for n, _ in model.named_parameters()]
    sliced = {cm.parameter_slices()[k][0] for k in cm.parameter_slices()} if cm.parameter_slices() else set()
    pairs = [(g, t) for n, g, t in zip(names, got, truth) if n not in sliced and g.abs().max() > 0]
    return error([g for g, _ in pairs], [t for _, t in pairs])


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | dtype | run | gradient error vs float64 | x eager |", "|---|---|---|---|---|"]
    base: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["model"], r["dtype"])
        if r["run"] == "eager":
            base[key] = r["error"]
        err = r["error"]
        if isinstance(err, str):
            lines.append(f"| {r['model']} | {r['dtype']} | {r['run']} | {err} | - |")
            continue
        ratio = err / base[key] if base.get(key) not in (None, 0.0, float("inf")) else float("nan")
        lines.append(f"| {r['model']} | {r['dtype']} | {r['run']} | {err:.3e} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--plans", default=",".join(PLAN_OPTIONS))
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        for dt in args.dtypes.split(","):
            rows += measure(name, getattr(torch, dt), args.seq_len, args.plans.split(","), device=args.device)
            print(table(rows).splitlines()[-1], flush=True)
    where = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if args.device.startswith("cuda") else
             f"CPU ({platform.machine()}, {os.environ.get('OMP_NUM_THREADS')} thread)")
    body = (f"Machine: {where}, torch "
            f"{torch.__version__}, {time.strftime('%Y-%m-%d')}. `python bench/bench_low_precision.py`: T = "
            f"{args.seq_len}, batch 1, d_model 64, 2 layers; chunk and shard 512. Error: the worst parameter's "
            "max |g - g64| / max |g64| against the same model in float64 (partial_update: over the "
            "parameters it trains).\n\n" + table(rows))
    if not args.no_results:
        write_section("Low precision (issue 20)" if args.device == "cpu" else "Low precision on GPU (issue 20)", body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

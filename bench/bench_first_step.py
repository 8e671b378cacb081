"""The first training step against the steady one: peak memory, memory left behind, capture time.

    python bench/bench_first_step.py                          # examples + HF llama/mamba, T = 1K/4K/16K
    python bench/bench_first_step.py --models ssm --plans adjoint --seq-lens 1024 --no-results

For each model, plan and length, a fresh worker process builds the model, compiles it
(``gs.compile``; "eager" is the model itself) and runs three steps (forward, mean of the
output or the LM loss, backward). For each step it records

- the CPU allocator's peak of live bytes during the step, above what was live at its start
  (:class:`gradshard.measure.CpuAllocatorTrace`: every tensor the c10 allocator hands out,
  capture and the plan's self-checks included; deterministic for a given program);
- the resident set size left behind: RSS after the step minus before it, the heap trimmed
  before (:func:`gradshard.measure.rss.rss_bytes`), so "left by step 1 - left by step 3" is what
  the first step keeps resident (graphs, caches, compiled code); measured in a second fresh
  worker whose steps run without the allocator trace (its profiler's buffers are not the step's);
- its wall time.

A second table times ``cm.compile_first(inputs)`` -- what the first call compiles: capture on
fake tensors (at the probe length for plans that serve longer calls from it), the plan's
passes, the re-specialisation; no real forward -- at T = 1K ... 64K. Results go to the "First step (issue 17)"
section of ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: where results go
from results_md import CHECKOUT, write_section  # noqa: E402

#: The warm-up call's length: above twice the 67-step probe (see ``run_steps``).
WARM_UP_LENGTH = 150

PLAN_OPTIONS: dict[str, dict[str, Any]] = {
    "eager": {},
    "none": {},
    "seco": {"chunk_size": 256},
    "spaco": {"chunk_size": 256, "budget": 10**9},
    "adjoint": {"shard_size": 256},
    "truncated_adjoint": {"shard_size": 256, "window": 1024},
    "partial_update": {},
}
#: Plans that rewrite a recurrence: only on models that have one.
RECURRENT_PLANS = {"adjoint", "truncated_adjoint"}
MODELS: dict[str, bool] = {  # name -> has a linear recurrence
    "ssm": True, "llama": False, "hf:llama": False, "hf:mamba": True, "hf:mamba2": True,
}


def _build(name: str, T: int) -> tuple[Any, dict[str, Any]]:
    """The model and its call keywords/positional inputs at length ``T`` (batch 1, float32)."""
    import torch

    if name.startswith("hf:"):
        if CHECKOUT is None:
            raise SystemExit("hf:* models come from tests/hf/zoo.py: run this in a source checkout")
        sys.path.insert(0, str(CHECKOUT))
        from tests.hf.zoo import build, inputs

        model, config = build(name[3:], fp64_loss=False)
        model = model.float()
        return model, {"input_ids": inputs(config, batch=1, T=T)["input_ids"]}
    from gradshard.examples import factories

    model, (ids,) = getattr(factories, name)(seq_len=T, batch=1, d_model=64, n_layers=2, dtype=torch.float32)
    return model, {"args": (ids,)}


def _loss(module: Any, call: dict[str, Any]) -> Any:
    kwargs = {k: v for k, v in call.items() if k != "args"}
    out = module(*call.get("args", ()), **kwargs)
    logits = out if hasattr(out, "float") else out.logits
    return logits.float().mean()


def _trim_malloc() -> None:
    """Give glibc's free heap pages back to the OS (``malloc_trim(0)``), where there is glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def measure_cell(name: str, plan: str, T: int, steps: int = 3) -> dict[str, Any]:
    """Peak allocator bytes and seconds of each of ``steps`` steps (traced), then, in a second
    fresh worker, the RSS each step leaves behind (untraced: the profiler the allocator trace
    runs on keeps event buffers in proportion to the ops it saw, and a first step runs many
    more ops -- the capture's fake ones -- so traced steps would charge its heap to the step)."""
    traced = _in_worker(run_steps, name, plan, T, steps, True)
    if "refused" in traced:
        return traced
    untraced = _in_worker(run_steps, name, plan, T, steps, False)
    for row, rss in zip(traced["steps"], untraced["steps"]):
        row["rss_left"], row["rss_left_trimmed"] = rss["rss_left"], rss["rss_left_trimmed"]
    return traced


def run_steps(name: str, plan: str, T: int, steps: int, traced: bool) -> dict[str, Any]:
    """``steps`` steps of a fresh compiled module: allocator peak (``traced``), RSS left, seconds."""
    import contextlib
    import gc

    import torch

    import gradshard as gs
    from gradshard.measure import CpuAllocatorTrace
    from gradshard.measure.rss import rss_bytes

    # Warm the process first (imports, op registrations, the profiler's own buffers) with the
    # same model and plan at a short length: what is measured below is what *this* model's
    # first step costs, not the library's one-time start-up. The length is above twice the
    # probe, so the warm-up also runs the code paths a long first call runs (the probe compile,
    # the cross-check capture, the re-specialisation), whose one-time start-up a warm-up at 64
    # steps left to the measured step (hf:mamba under adjoint: 9.0 MiB RSS kept, 2.5 after).
    warm, warm_call = _build(name, WARM_UP_LENGTH)
    warm_module = warm if plan == "eager" else gs.compile(warm, plan=plan, **PLAN_OPTIONS[plan])
    trace_step = CpuAllocatorTrace if traced else contextlib.nullcontext
    try:
        with trace_step():
            _loss(warm_module, warm_call).backward()
    except gs.GradshardError as exc:
        return {"model": name, "plan": plan, "T": T, "refused": str(exc).splitlines()[0][:120]}
    del warm, warm_call, warm_module
    torch.manual_seed(0)
    model, call = _build(name, T)
    module = model if plan == "eager" else gs.compile(model, plan=plan, **PLAN_OPTIONS[plan])
    rows = []
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        gc.collect()
        _trim_malloc()  # both ends trimmed: what the step keeps, not what an earlier one freed
        before = rss_bytes() or 0
        t0 = time.perf_counter()
        try:
            with trace_step() as trace:
                _loss(module, call).backward()
        except gs.GradshardError as exc:  # the plan does not apply to this model: a row that says so
            return {"model": name, "plan": plan, "T": T, "refused": str(exc).splitlines()[0][:120]}
        seconds = time.perf_counter() - t0
        gc.collect()
        left = (rss_bytes() or 0) - before
        _trim_malloc()
        rows.append({"peak": trace.peak_bytes if traced else None, "rss_left": left, "rss_left_trimmed": (rss_bytes() or 0) - before,
                     "seconds": seconds})
    return {"model": name, "plan": plan, "T": T, "steps": rows}


def time_specialize(name: str, plan: str, T: int, repeat: int = 3) -> dict[str, Any]:
    """Seconds (the least wall and CPU time of ``repeat`` compiles) and allocator peak (the
    first) of what a first call compiles at length ``T`` (``cm.compile_first``: capture -- at
    the probe length for plans that serve other lengths from it -- passes, and the serving
    re-specialisation; no real forward)."""
    import contextlib

    import gradshard as gs
    from gradshard.measure import CpuAllocatorTrace

    model, call = _build(name, T)
    cm = gs.compile(model, plan=plan, **PLAN_OPTIONS[plan])
    kwargs = {k: v for k, v in call.items() if k != "args"}
    cm.compile_first(call.get("args", ()), kwargs)  # warm: imports, op registrations
    walls, cpus = [], []
    for i in range(repeat):  # a fresh module each time; the least of the runs (a shared machine adds, never removes)
        model, call = _build(name, T)
        cm = gs.compile(model, plan=plan, **PLAN_OPTIONS[plan])
        t0, c0 = time.perf_counter(), time.process_time()
        with CpuAllocatorTrace() if i == 0 else contextlib.nullcontext() as trace:
            entry = cm.compile_first(call.get("args", ()), {k: v for k, v in call.items() if k != "args"})
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        if i == 0:
            peak, served_from = trace.peak_bytes, entry.extras.get("respecialized_from")
    return {"model": name, "plan": plan, "T": T, "seconds": min(walls), "cpu_seconds": min(cpus), "peak": peak,
            "served_from": served_from}


def _in_worker(fn: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def first_step_table(cells: list[dict[str, Any]]) -> str:
    lines = ["| model | T | run | first step peak MiB | steady peak MiB | first / steady | "
             "RSS left by step 1 - by step 3, MiB | same after malloc_trim, MiB | first step s | steady s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if "refused" in c:
            lines.append(f"| {c['model']} | {c['T']} | {c['plan']} | refused: {c['refused']} |" + " |" * 6)
            continue
        first, steady = c["steps"][0], c["steps"][-1]
        ratio = first["peak"] / steady["peak"] if steady["peak"] else float("nan")
        lines.append(f"| {c['model']} | {c['T']} | {c['plan']} | {_mib(first['peak'])} | {_mib(steady['peak'])} | "
                     f"{ratio:.2f} | {_mib(first['rss_left'] - steady['rss_left'])} | "
                     f"{_mib(first['rss_left_trimmed'] - steady['rss_left_trimmed'])} | {first['seconds']:.2f} | "
                     f"{steady['seconds']:.2f} |")
    return "\n".join(lines)


def capture_table(rows: list[dict[str, Any]]) -> str:
    lens = sorted({r["T"] for r in rows})
    head = "| model | plan | " + " | ".join(f"T={t}" for t in lens) + " | max / min |"
    lines = [head, "|---|---|" + "---|" * (len(lens) + 1)]
    groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["plan"]), {})[r["T"]] = r
    for (model, plan), by_t in groups.items():
        secs = [by_t[t]["seconds"] for t in lens if t in by_t]
        cells = " | ".join(f"{by_t[t]['seconds']:.2f} s ({by_t[t].get('cpu_seconds', math.nan):.2f} s CPU), "
                           f"{_mib(by_t[t]['peak'])} MiB" if t in by_t else "-" for t in lens)
        lines.append(f"| {model} | {plan} | {cells} | {max(secs) / min(secs):.2f} |")
    return "\n".join(lines)


def report(cells: list[dict[str, Any]], captures: list[dict[str, Any]]) -> str:
    """The RESULTS.md section body for measured ``cells`` and ``captures``."""
    import torch

    machine = (f"CPU ({platform.machine()}, {os.environ.get('OMP_NUM_THREADS')} thread), torch {torch.__version__}, "
               f"{time.strftime('%Y-%m-%d')}")
    return "\n\n".join([
        f"Machine: {machine}. `python bench/bench_first_step.py` (a fresh process per cell, batch 1, "
        "float32, d_model 64 / 2 layers for the examples, the `tests/hf/zoo.py` tiny configs for `hf:*`; "
        "chunk and shard 256, truncated window 1024). Peak: the CPU allocator's peak of live bytes during "
        "the step above its start, capture and self-checks included. RSS left: RSS after a step minus "
        "before it (the heap trimmed before; measured in a second fresh process, without the allocator "
        "trace, whose profiler keeps event buffers in proportion to the ops it saw); the column is what step 1 leaves resident beyond what a steady step leaves, first as the OS "
        "sees it, then after `malloc_trim(0)` returns glibc's free heap pages (what is left then is "
        "memory something still holds). Each worker first "
        f"runs the same model and plan once at T={WARM_UP_LENGTH} (above twice the probe: the probe, "
        "cross-check and re-specialisation paths run once), so library start-up (imports, op "
        "registration, the profiler's buffers) is not counted.",
        first_step_table(cells),
        "What a first call compiles (`cm.compile_first`: capture on fake tensors -- at the 67-step probe, "
        "every plan here serving longer calls from it (plain autograd on a loop-written model runs the "
        "module itself at the call's length) -- "
        "the plan's passes, and the re-specialisation to T; no real forward), after a warm-up compile in "
        "the same process; seconds (the least wall time of 3 compiles, each of a fresh module; CPU "
        "time in parentheses) and the allocator peak:",
        capture_table(captures),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plans", default=",".join(PLAN_OPTIONS))
    ap.add_argument("--seq-lens", default="1024,4096,16384")
    ap.add_argument("--capture-lens", default="1024,4096,16384,65536")
    ap.add_argument("--capture-plans", default="none,seco,adjoint")
    ap.add_argument("--no-results", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--from-json", default=None, help="report these comma-separated --json files instead of measuring")
    args = ap.parse_args(argv)
    if args.from_json:
        cells, captures = [], []
        for path in str(args.from_json).split(","):
            data = json.loads(Path(path).read_text())
            cells += data["cells"]
            captures += data["captures"]
        body = report(cells, captures)
        if not args.no_results:
            write_section("First step (issue 17)", body)
        print(body)
        return 0
    models = args.models.split(",")
    cells = []
    for name in models:
        for T in map(int, filter(None, args.seq_lens.split(","))):  # --seq-lens "": capture times only
            for plan in args.plans.split(","):
                if plan in RECURRENT_PLANS and not MODELS.get(name, True):
                    continue
                cells.append(measure_cell(name, plan, T))
                print(first_step_table(cells[-1:]).splitlines()[-1], flush=True)
                if args.json:  # after every cell: a long run that stops keeps what it measured
                    args.json.write_text(json.dumps({"cells": cells, "captures": []}, indent=1))
    captures = []
    for name in models:
        for plan in args.capture_plans.split(","):
            if plan in RECURRENT_PLANS and not MODELS.get(name, True):
                continue
            for T in map(int, filter(None, args.capture_lens.split(","))):  # "": no capture table
                captures.append(_in_worker(time_specialize, name, plan, T))
                print(captures[-1], flush=True)
    body = report(cells, captures)
    if args.json:
        args.json.write_text(json.dumps({"cells": cells, "captures": captures}, indent=1))
    if not args.no_results:
        write_section("First step (issue 17)", body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Steady step time of several methods, interleaved in one process (a fair A/B on a noisy machine).

``bench_compose.py`` measures one method at a time, minutes apart; on a shared machine the step
time drifts by more than the differences worth seeing. Here every method is built and warmed up
first, then one step of each runs in turn, ``--repeat`` rounds; the minimum and median per method
are printed against the first method. The methods are ``bench_compose``'s (``compile``,
``gs_adjoint``, ``gs_seco``, ...) plus ``gs_adjoint_graphs``: the adjoint plan with each per-step
shard and tail shard run graph by graph instead of as one compiled function (what ran before the
whole-shard functions). The cross-entropy is inside the compiled module. Nothing is written.

    python bench/bench_interleaved.py --model mingru --seq-len 4k --methods compile,gs_adjoint_graphs,gs_adjoint
    python bench/bench_interleaved.py --model hf_mamba2 --seq-len 4k --methods compile,gs_seco --chunk-size 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_compose as bc  # noqa: E402
from gradshard.runtime.compiled import RegionGraphs  # noqa: E402


def graph_by_graph(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` (a ``gs.compile``'d adjoint module) with its regions' and tail segments' whole-shard
    functions switched off after its first call (the compile hands them their compiler there)."""
    state = {"first": True}

    def call(*args: Any) -> Any:
        out = run(*args)
        if state["first"]:
            state["first"] = False
            for m in run.graph.modules():
                if isinstance(getattr(m, "graphs", None), RegionGraphs):
                    m.graphs.calls = None
        return out

    return call


def build(method: str, name: str, T: int, shard: int, chunk: int) -> Callable[[], None]:
    """One training step of ``method`` on model ``name`` at length ``T``."""
    model, ids, _ = bc.make_model(name, T, 1)
    model = bc.WithLoss(model)
    labels = torch.roll(ids, -1, 1)
    if method == "gs_adjoint_graphs":
        run, _ = bc.runner("gs_adjoint", model, shard=shard, chunk=chunk)
        run = graph_by_graph(run)
    else:
        run, _ = bc.runner(method, model, shard=shard, chunk=chunk)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        run(ids, labels).backward()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mingru", help=f"one of {','.join(bc.MODELS)}")
    p.add_argument("--seq-len", default="4k")
    p.add_argument("--methods", default="compile,gs_adjoint_graphs,gs_adjoint")
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    T = bc.parse_len(a.seq_len)
    bc.warm_up_inductor(torch.device("cpu"))
    steps: dict[str, Callable[[], None]] = {}
    for m in a.methods.split(","):
        steps[m] = build(m, a.model, T, a.shard_size, a.chunk_size)
        t0 = time.perf_counter()
        steps[m]()
        steps[m]()
        print(f"{m}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(a.repeat):
        for m, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[m].append(time.perf_counter() - t0)
    base = min(next(iter(times.values())))
    print(f"{a.model}, T={T}, {a.threads} thread(s), min of {a.repeat} interleaved steps (x: against the first method)")
    for m, ts in times.items():
        best, median = min(ts) * 1e3, statistics.median(ts) * 1e3
        print(f"  {m:22s} {best:9.1f} ms  {min(ts) / base:5.2f}x   median {median:9.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

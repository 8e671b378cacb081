"""Hugging Face families: peak step memory and step time, gradshard plans against eager
autograd and per-layer activation checkpointing (``gradient_checkpointing_enable``).

    python bench/bench_hf.py --families llama,mamba,mamba2,bamba --seq-lens 1024,4096 [--results]

Tiny random-weight models from ``tests/hf/zoo.py`` (hidden 32, 2 layers) in float32, batch 1;
one step = forward, mean of the logits, backward. Memory is ``gs.measure``'s peak of live
bytes during the step (parameters and inputs excluded), time its wall time on this machine.
``torch.compile`` with ``activation_memory_budget`` is not in this table yet (see README).
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: where results go
from results_md import CHECKOUT, RESULTS  # noqa: E402

if CHECKOUT is None:
    raise SystemExit("bench_hf builds its models from the test suite's zoo (tests/hf/zoo.py), which ships only "
                     "in a source checkout: run `gradshard bench hf` (or `python bench/bench_hf.py`) in a clone "
                     "of the repository, installed with `pip install -e .[dev]` (for transformers)")
sys.path.insert(0, str(CHECKOUT))

import gradshard as gs  # noqa: E402
from tests.hf.zoo import build, inputs  # noqa: E402

PLANS: dict[str, dict[str, Any]] = {"seco": {"chunk_size": 256}, "adjoint": {"shard_size": 256}}
RECURRENT = {"mamba", "falcon_mamba", "mamba2", "bamba", "zamba2", "falcon_h1", "nemotron_h", "jamba"}


def _step(model: Callable[..., Any], ids: torch.Tensor, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    def run() -> None:
        for p in params:
            p.grad = None
        model(input_ids=ids).logits.mean().backward()

    return run


def measure_family(family: str, T: int) -> list[tuple[str, float, float]]:
    """``(what, peak MiB, seconds)`` rows for one family at length ``T``."""
    model, config = build(family, fp64_loss=False)
    model = model.float()
    ids = inputs(config, batch=1, T=T)["input_ids"]
    params = list(model.parameters())
    rows = []
    targets: list[tuple[str, Any]] = [("eager", model)]
    ckpt = copy.deepcopy(model)
    if getattr(ckpt, "supports_gradient_checkpointing", False):
        ckpt.gradient_checkpointing_enable()
        targets.append(("per-layer checkpointing", ckpt))
    for plan, options in PLANS.items():
        if plan == "adjoint" and family not in RECURRENT:
            continue
        targets.append((f"gradshard {plan}", gs.compile(model, plan=plan, **options)))
    for what, target in targets:
        ps = list(ckpt.parameters()) if target is ckpt else params
        m = gs.measure(_step(target, ids, ps), warmup=1, repeat=2)
        rows.append((what, m.peak_bytes / 2**20, m.seconds))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama,mamba,mamba2,bamba")
    ap.add_argument("--seq-lens", default="1024,4096")
    ap.add_argument("--results", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"### Hugging Face families (CPU, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__})", "",
             "| family | T | run | peak MiB | x eager | step s | x eager |", "|---|---|---|---|---|---|---|"]
    for family in args.families.split(","):
        for T in (int(t) for t in args.seq_lens.split(",")):
            rows = measure_family(family, T)
            base_mem, base_s = rows[0][1], rows[0][2]
            for what, mib, sec in rows:
                lines.append(f"| {family} | {T} | {what} | {mib:.1f} | {mib / base_mem:.2f} | {sec:.2f} | "
                             f"{sec / base_s:.2f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.results:
        with open(RESULTS, "a") as f:
            f.write("\n" + text)
    else:
        print(text)


if __name__ == "__main__":
    main()

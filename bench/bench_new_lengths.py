"""What a call at a new sequence length costs (issue 17): served from a kept graph, or captured again.

One compiled module is called at a sequence of lengths (each call: compile or serve, then one
training step). Per call: its wall time, how it was handled, and the steady step at that length.
``transformers`` Mamba-2 pads time to a multiple of its chunk (64 here), sizes the time facts
cannot follow: from the second length on the graph captured at the first is traced with
symbolic sizes (``gradshard/passes/symbolic_sizes.py``); a length that is a multiple of the
chunk breaks the model's own ``if pad_size > 0`` and is captured again. HF Llama is the control
(its lengths are served from the time facts alone).

    python bench/bench_new_lengths.py [--models hf_mamba2,hf_llama] [--plan none]
"""

from __future__ import annotations

import argparse
import time

import torch

import gradshard as gs
from gradshard.bench.bench_compose import make_model

LENGTHS = (1024, 1500, 2000, 3000, 4096, 5000)


def how(cm: gs.CompiledModule) -> str:
    """How the last call was handled, from its entry and ``explain()``."""
    text = cm.explain()
    extras = cm.current.extras
    if extras.get("respecialized_from") is not None:
        sym = "capture with symbolic sizes" in text
        return f"served from T={extras['respecialized_from']}" + (" (symbolic sizes)" if sym else "")
    return "captured again" if "captured again" in text else "captured"


def run(name: str, plan: str) -> list[str]:
    model, ids, _ = make_model(name, max(LENGTHS), batch=2)
    cm = gs.compile(model, plan=plan)
    rows = []
    for T in LENGTHS:
        x = ids[:, :T]
        t0 = time.perf_counter()
        cm(x).float().pow(2).mean().backward()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        cm(x).float().pow(2).mean().backward()
        steady = time.perf_counter() - t0
        rows.append(f"| {name} | {plan} | {T} | {first:.2f} s | {how(cm)} | {steady:.2f} s |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hf_mamba2,hf_llama")
    ap.add_argument("--plan", default="none")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print("| model | plan | T | first call (compile or serve + step) | handled | steady step |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        run(name, args.plan)


if __name__ == "__main__":
    main()

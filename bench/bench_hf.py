"""Hugging Face families: peak step memory and step time, gradshard plans against eager
autograd, per-layer activation checkpointing (``gradient_checkpointing_enable``), and
``torch.compile`` with and without ``activation_memory_budget=0.1``.

    python bench/bench_hf.py --families llama,mamba2,bamba,mamba --seq-lens 1024,4096,16384 [--results]

Tiny random-weight models from ``tests/hf/zoo.py`` (hidden 32, 2 layers) in float32, batch 1;
one step = forward, mean of the logits, backward. Every row takes one untimed first step
(capture and compilation happen there; its wall time is the "first step" column), then
``gs.measure``: one instrumented step for memory and ``--repeat`` timed steps (median).
Peak memory is the CPU allocator's peak during the step above what was live before it
(``gs.measure``'s ``allocator_peak_bytes``, from ``torch.profiler`` memory events; the same
instrument for every row, since the script compiles a tiny function first), parameters and
inputs excluded. Rows:

- ``eager``: the model as written; ``per-layer checkpointing``: a copy with
  ``gradient_checkpointing_enable()``;
- ``torch.compile``: ``torch.compile(model, dynamic=False)`` (Inductor);
  ``torch.compile (activation_memory_budget=0.1)``: the same, compiled under
  ``torch._functorch.config.patch(activation_memory_budget=0.1)`` (AOTAutograd's partitioner
  recomputes activations to keep 10% of the saved bytes);
- ``gradshard seco`` (chunk 256), ``gradshard adjoint`` (shard 256; recurrent families only).

A plan that gradshard refuses is a row too ("refused", with the first line of the reason).
Rows are kept in ``out/bench_hf.json``; a run replaces the rows (family, T, method) it
measures and keeps the others, so long points can be measured in separate runs (``--fresh``
drops the kept rows). ``--results`` writes the table of all kept rows to the "Real models
(issue 16)" section of ``RESULTS.md`` (subsection "Hugging Face families"), replacing the
subsection of an earlier run.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: where results go
from results_md import CHECKOUT, OUTPUT_DIR, RESULTS, write_subsection  # noqa: E402

if CHECKOUT is None:
    raise SystemExit("bench_hf builds its models from the test suite's zoo (tests/hf/zoo.py), which ships only "
                     "in a source checkout: run `gradshard bench hf` (or `python bench/bench_hf.py`) in a clone "
                     "of the repository, installed with `pip install -e .[dev]` (for transformers)")
sys.path.insert(0, str(CHECKOUT))

import gradshard as gs  # noqa: E402
from gradshard.errors import GradshardError  # noqa: E402
from tests.hf.zoo import build, inputs  # noqa: E402

SECTION, SUBSECTION = "Real models (issue 16)", "Hugging Face families"
PLANS: dict[str, dict[str, Any]] = {"seco": {"chunk_size": 256}, "adjoint": {"shard_size": 256}}
RECURRENT = {"mamba", "falcon_mamba", "mamba2", "bamba", "zamba2", "falcon_h1", "nemotron_h", "jamba"}
METHODS = ("eager", "checkpoint", "compile", "compile_budget", "seco", "adjoint")
LABELS = {"eager": "eager", "checkpoint": "per-layer checkpointing", "compile": "torch.compile",
          "compile_budget": "torch.compile (activation_memory_budget=0.1)", "seco": "gradshard seco",
          "adjoint": "gradshard adjoint"}
#: Families whose transformers forward (without the CUDA kernels) loops over every step in
#: Python: eager costs seconds per 1K tokens, and Dynamo unrolls the loop. Default --max-len.
SLOW_PATH = {"mamba": 1024, "falcon_mamba": 1024}
RAW = OUTPUT_DIR / "out" / "bench_hf.json"


def _step(model: Callable[..., Any], ids: torch.Tensor, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    def run() -> None:
        for p in params:
            p.grad = None
        model(input_ids=ids).logits.mean().backward()

    return run


def _warm_up_inductor() -> None:
    """Compile something tiny first: Inductor's one-time start-up is charged to no row, and
    ``gs.measure`` traces the CPU allocator for every row (it does once anything has compiled)."""
    fn = torch.compile(lambda x: (x.sin() * 2).sum(), dynamic=False)
    fn(torch.randn(8, requires_grad=True)).backward()
    torch._dynamo.reset()


def _target(method: str, family: str, model: torch.nn.Module) -> tuple[Any, list[torch.nn.Parameter]] | None:
    """What one row calls, and the parameters whose gradients it zeroes; None if it does not apply."""
    if method == "eager":
        return model, list(model.parameters())
    if method == "checkpoint":
        ckpt = copy.deepcopy(model)
        if not getattr(ckpt, "supports_gradient_checkpointing", False):
            return None
        ckpt.gradient_checkpointing_enable()
        return ckpt, list(ckpt.parameters())
    if method in ("compile", "compile_budget"):
        torch._dynamo.reset()  # every compile row compiles afresh, under its own config
        return torch.compile(model, dynamic=False), list(model.parameters())
    if method == "adjoint" and family not in RECURRENT:
        return None
    return gs.compile(model, plan=method, **PLANS[method]), list(model.parameters())


def measure_row(family: str, T: int, method: str, repeat: int) -> dict[str, Any] | None:
    """One row: peak bytes, median step seconds and first-step seconds, or the refusal's first
    line (None: the method does not apply to the family)."""
    model, config = build(family, fp64_loss=False)
    model = model.float()
    ids = inputs(config, batch=1, T=T)["input_ids"]
    made = _target(method, family, model)
    if made is None:
        return None
    step = _step(made[0], ids, made[1])
    row: dict[str, Any] = {"family": family, "T": T, "method": method}
    with torch._functorch.config.patch(activation_memory_budget=0.1 if method == "compile_budget" else 1.0):
        t0 = time.perf_counter()
        try:
            step()  # capture and compilation (forward and backward) happen here
        except GradshardError as exc:
            return {**row, "refused": _summary(exc), "first": time.perf_counter() - t0}
        first = time.perf_counter() - t0
        m = gs.measure(step, repeat=repeat)
    peak = m.allocator_peak_bytes if m.allocator_peak_bytes is not None else m.peak_bytes
    source = "cpu_allocator" if m.allocator_peak_bytes is not None else m.peak_source
    return {**row, "peak": peak, "source": source, "seconds": m.seconds, "first": first}


def _summary(exc: GradshardError) -> str:
    """The refusal's first line and its ``why:`` line, for a table cell."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines()]
    why = next((ln.removeprefix("why: ") for ln in lines[1:] if ln.startswith("why: ")), "")
    text = lines[0] + (f": {why}" if why else "")
    return text if len(text) <= 240 else text[:237] + "..."


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table; ratios are to eager at the same family and T."""
    base = {(r["family"], r["T"]): r for r in rows if r["method"] == "eager" and "refused" not in r}
    lines = ["| family | T | run | peak MiB | x eager | step s | x eager | first step s |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['family']} | {r['T']} | {LABELS[r['method']]} | refused: {r['refused'].replace('|', '/')} "
                         f"| - | - | - | {r['first']:.1f} |")
            continue
        b = base.get((r["family"], r["T"]))
        xm = f"{r['peak'] / b['peak']:.2f}" if b and b["peak"] else "-"
        xs = f"{r['seconds'] / b['seconds']:.2f}" if b and b["seconds"] else "-"
        lines.append(f"| {r['family']} | {r['T']} | {LABELS[r['method']]} | {r['peak'] / 2**20:.1f} | {xm} | "
                     f"{r['seconds']:.2f} | {xs} | {r['first']:.1f} |")
    return "\n".join(lines)


def _key(r: dict[str, Any]) -> str:
    return f"{r['family']}@{r['T']}@{r['method']}"


def _merge(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``kept`` rows whose (family, T, method) is not in ``new``, then ``new``; sorted by family
    (first seen first), T, then method order."""
    measured = {_key(r) for r in new}
    rows = [r for r in kept if _key(r) not in measured] + new
    order = {f: i for i, f in enumerate(dict.fromkeys(r["family"] for r in rows))}
    return sorted(rows, key=lambda r: (order[r["family"]], r["T"], METHODS.index(r["method"])))


def _limits(text: str) -> dict[str, int]:
    out = dict(SLOW_PATH)
    for item in filter(None, (s.strip() for s in text.split(","))):
        family, _, T = item.partition("=")
        out[family] = int(T)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama,mamba2,bamba,mamba")
    ap.add_argument("--seq-lens", default="1024,4096,16384")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"any of {','.join(METHODS)}")
    ap.add_argument("--max-len", default="", help="FAMILY=T,...: skip longer T for FAMILY (listed under the "
                    f"table); default {','.join(f'{k}={v}' for k, v in SLOW_PATH.items())}")
    ap.add_argument("--repeat", type=int, default=2, help="timed steps per row (median)")
    ap.add_argument("--notes", default="", help="text added under the table (kept across runs)")
    ap.add_argument("--fresh", action="store_true", help=f"drop the rows kept in {RAW} from earlier runs")
    ap.add_argument("--render", action="store_true", help="measure nothing: only render the kept rows")
    ap.add_argument("--results", action="store_true",
                    help=f"write the table to '## {SECTION}' / '### {SUBSECTION}' of bench/RESULTS.md")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {','.join(METHODS)}")
    limits = _limits(args.max_len)
    saved = {} if args.fresh or not RAW.exists() else json.loads(RAW.read_text())
    if not args.render:
        _warm_up_inductor()
    rows, skipped, t_start = [], [], time.perf_counter()
    for family in [] if args.render else args.families.split(","):
        for T in (int(t) for t in args.seq_lens.split(",")):
            if T > limits.get(family, T):
                skipped.append(f"{family} at T={T}")
                continue
            for method in methods:
                row = measure_row(family, T, method, args.repeat)
                if row is not None:
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
    minutes = (time.perf_counter() - t_start) / 60
    words = list(sys.argv[1:] if argv is None else argv)
    argv_text = " ".join('"..."' if i and words[i - 1] == "--notes" else w for i, w in enumerate(words))
    run = {"command": f"`OMP_NUM_THREADS={torch.get_num_threads()} python bench/bench_hf.py {argv_text}` "
                      f"({minutes:.0f} min)", "skipped": skipped, "notes": args.notes,
           "points": sorted(_key(r) for r in rows)}
    runs = [r for r in saved.get("runs", []) if set(r["points"]) - set(run["points"])] + ([] if args.render else [run])
    all_rows = _merge(saved.get("rows", []), rows)
    RAW.parent.mkdir(parents=True, exist_ok=True)
    RAW.write_text(json.dumps({"rows": all_rows, "runs": runs}, indent=1))
    notes = ["Commands: " + "; ".join(r["command"] for r in runs) + f". Machine: CPU, "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}.",
             "Tiny random-weight models (hidden 32, 2 layers, float32, batch 1). Peak: the CPU allocator's peak "
             "during a step above what was live before it (`gs.measure`, `allocator_peak_bytes`), the same "
             "instrument for every row. Step time: median of the timed steps after a first step and an "
             "instrumented step; first step: capture + plan, or Dynamo + Inductor compile of forward and backward."]
    skipped_all = [s for r in runs for s in r["skipped"]]
    if skipped_all:
        notes.append("Not run (`--max-len`): " + ", ".join(skipped_all) + ". By default mamba and falcon_mamba "
                     "stop at T=1024: transformers' slow path for them, without the `mamba_ssm` CUDA kernels, "
                     "loops over every step in Python, and gradshard's capture unrolls the loop before rolling it "
                     "back into a scan (a first step of about a minute per 1K tokens).")
    notes += [r["notes"] for r in runs if r["notes"]]
    body = table(all_rows) + "\n\n" + "\n\n".join(notes)
    if args.results:
        write_subsection(SECTION, SUBSECTION, body)
        print(f"wrote '### {SUBSECTION}' under '## {SECTION}' in {RESULTS}")
    else:
        print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

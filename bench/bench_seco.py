"""SeCO / SpaCO vs. plain autograd and per-layer checkpointing: peak memory and step time.

A small Llama-style model (RoPE, GQA, SwiGLU, SDPA; ``gradshard.examples.models.llama``) trained with
the mean next-token cross-entropy *inside* the compiled function (so SeCO/SpaCO never
materialise full-sequence logits), at T = 1K .. 16K on CPU. For each T:

- ``autograd``: plain ``loss.backward()``;
- ``ckpt/layer``: ``torch.utils.checkpoint`` around every decoder layer;
- ``seco c=..``: ``gs.compile(fn, plan="seco", chunk_size=c)``;
- ``spaco t=8``: ``gs.compile(fn, plan="spaco", chunk_size=256, budget=8)`` (Bernoulli);
- ``forward``: a no-grad forward (what SpaCO's time should approach as T grows).

Peak memory is ``gs.measure``'s (live tensor bytes above the baseline, CPU tracker); the
KV cache column is what SeCO keeps across chunks. Times are the minimum over ``--reps``
interleaved rounds (the machine is shared: minima are the least disturbed runs).

    python bench/bench_seco.py                 # full table into bench/RESULTS.md
    python bench/bench_seco.py --quick         # T = 256, 512 (a smoke run)
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
import torch.utils.checkpoint as ckpt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: the shared RESULTS.md writer

import gradshard as gs  # noqa: E402
from gradshard.examples.factories import llama_loss  # noqa: E402
from gradshard.measure import describe_device, measure  # noqa: E402
from results_md import OUTPUT_DIR, RESULTS, write_subsection  # noqa: E402

SECTION = "## SeCO / SpaCO (issue 4)"
MODEL = {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 344}


# --------------------------------------------------------------------------- RESULTS.md


def machine() -> str:
    return (f"{describe_device('cpu')}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"Python {platform.python_version()}; the 2 cores are shared with other agents, so "
            "times are minima over interleaved rounds and ratios are more reliable than seconds")


def write_seco_subsection(sub: str, body: str) -> None:
    """Replace subsection ``### sub`` of this issue's section in bench/RESULTS.md (create it if
    missing); the section's 'Machine:' line is refreshed."""
    write_subsection(SECTION, sub, body, RESULTS, intro=f"Machine: {machine()}.")


# --------------------------------------------------------------------------- configurations


def checkpoint_layers(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose decoder layers run under torch.utils.checkpoint."""
    m = copy.deepcopy(model)
    for layer in m.layers:
        inner = layer.forward
        layer.forward = lambda *a, _f=inner: ckpt.checkpoint(_f, *a, use_reentrant=False)
    return m


def configs(fn: Callable, model: torch.nn.Module, batch: Any, seq_len: int, chunks: list[int]) -> dict[str, tuple[Callable, Any]]:
    """name -> (step function, compiled module or None)."""
    out: dict[str, tuple[Callable, Any]] = {}
    ck = checkpoint_layers(model)

    def autograd() -> None:
        fn(model, batch).backward()

    def layer_ckpt() -> None:
        fn(ck, batch).backward()

    def forward() -> None:
        with torch.no_grad():
            fn(model, batch)

    out["autograd"] = (autograd, None)
    out["ckpt/layer"] = (layer_ckpt, None)
    for c in chunks:
        if c <= seq_len:
            cm = gs.compile(fn, plan="seco", chunk_size=c)
            out[f"seco c={c}"] = ((lambda cm=cm: cm(model, batch).backward()), cm)
    cm = gs.compile(fn, plan="spaco", chunk_size=min(256, seq_len), budget=8,
                    generator=torch.Generator().manual_seed(0))
    out["spaco t=8 c=256"] = ((lambda: cm(model, batch).backward()), cm)
    out["forward"] = (forward, None)
    return out


def _region(cm: Any) -> Any:
    return next(m for m in cm.graph.children() if hasattr(m, "program"))


def run_length(seq_len: int, chunks: list[int], reps: int) -> list[dict[str, Any]]:
    fn, (model, batch) = llama_loss(seq_len=seq_len, batch=1, **MODEL)
    cfgs = configs(fn, model, batch, seq_len, chunks)
    rows: dict[str, dict[str, Any]] = {}
    for name, (step, cm) in cfgs.items():
        model.zero_grad(set_to_none=True)
        m = measure(step, device="cpu", warmup=1, repeat=0)
        kv = _region(cm).program.cache_bytes() if cm is not None else 0
        rows[name] = {"T": seq_len, "config": name, "peak_bytes": m.peak_bytes, "kv_bytes": kv,
                      "seconds": float("inf"), "rounds": reps}
        print(f"  T={seq_len} {name:16s} peak {m.peak_bytes / 2**20:8.1f} MiB", flush=True)
    for _ in range(reps):
        for name, (step, _) in cfgs.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step()
            rows[name]["seconds"] = min(rows[name]["seconds"], time.perf_counter() - t0)
    base, fwd = rows["autograd"]["seconds"], rows["forward"]["seconds"]
    for r in rows.values():
        r["vs_autograd"] = r["seconds"] / base
        r["vs_forward"] = r["seconds"] / fwd
        print(f"  T={seq_len} {r['config']:16s} {r['seconds']:8.3f} s  x{r['vs_autograd']:.2f} autograd  "
              f"x{r['vs_forward']:.2f} forward", flush=True)
    return list(rows.values())


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| T | config | peak MiB | KV cache MiB | step s | × autograd | × forward | rounds |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kv = f"{r['kv_bytes'] / 2**20:.2f}" if r["kv_bytes"] else ""
        lines.append(f"| {r['T']} | {r['config']} | {r['peak_bytes'] / 2**20:.1f} | {kv} | {r['seconds']:.3f} | "
                     f"{r['vs_autograd']:.2f} | {r['vs_forward']:.2f} | {r.get('rounds', '')} |")
    return "\n".join(lines)


def slopes(rows: list[dict[str, Any]]) -> str:
    """Peak bytes per token between the shortest and longest T, per config."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    out = ["| config | peak growth per token (bytes) | KV cache per token (bytes) |", "|---|---:|---:|"]
    for name, rs in by.items():
        rs = sorted(rs, key=lambda r: r["T"])
        if len(rs) < 2:
            continue
        dt = rs[-1]["T"] - rs[0]["T"]
        grow = (rs[-1]["peak_bytes"] - rs[0]["peak_bytes"]) / dt
        kv = (rs[-1]["kv_bytes"] - rs[0]["kv_bytes"]) / dt
        out.append(f"| {name} | {grow:,.0f} | {kv:,.0f} |" if kv else f"| {name} | {grow:,.0f} | |")
    return "\n".join(out)


def targets(rows: list[dict[str, Any]]) -> str:
    """The paper's targets, checked on these rows."""
    by = {(r["T"], r["config"]): r for r in rows}
    lens = sorted({r["T"] for r in rows})
    seco = ", ".join(f"T={t}: {by[(t, 'seco c=512')]['vs_autograd']:.2f}x" for t in lens if (t, "seco c=512") in by)
    spaco = ", ".join(f"T={t}: {by[(t, 'spaco t=8 c=256')]['vs_forward']:.2f}x" for t in lens
                      if (t, "spaco t=8 c=256") in by)
    mem = ", ".join(f"T={t}: {by[(t, 'autograd')]['peak_bytes'] / by[(t, 'seco c=512')]['peak_bytes']:.1f}x"
                    for t in lens if (t, "seco c=512") in by)
    return ("Paper targets on this machine: SeCO time at chunk 512 vs autograd (target <= 1.35x): " + seco
            + ". SpaCO (t=8) time vs a forward-only pass (should approach 1 as T grows): " + spaco
            + ". Peak memory, autograd / SeCO c=512: " + mem + ".")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1024,2048,4096,8192,16384")
    p.add_argument("--chunks", default="64,128,256,512")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="T = 256, 512; chunks 64, 128; 1 rep; no RESULTS.md")
    p.add_argument("--rewrite", action="store_true", help="only rewrite RESULTS.md from out/seco.json")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of other sequence lengths from bench/out/seco.json (re-run some T only)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lens = [256, 512] if args.quick else [int(x) for x in args.seq_lens.split(",")]
    chunks = [64, 128] if args.quick else [int(x) for x in args.chunks.split(",")]
    reps = 1 if args.quick else args.reps
    rows: list[dict[str, Any]] = []
    out = OUTPUT_DIR / "out"
    if args.rewrite:
        rows = json.loads((out / "seco.json").read_text())
        lens = []
    for t in lens:
        rows += run_length(t, chunks, reps)
    out.mkdir(exist_ok=True)
    if args.merge and (out / "seco.json").exists():
        old = [r for r in json.loads((out / "seco.json").read_text()) if r["T"] not in lens]
        rows = sorted(old + rows, key=lambda r: r["T"])
    (out / "seco.json").write_text(json.dumps(rows, indent=1, default=str))
    if args.quick:
        print(table(rows))
        return 0
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    body = (f"Llama-style LM ({cfg}, vocab 256, RoPE, GQA 4:2, SwiGLU, SDPA), batch 1, float32, mean "
            f"cross-entropy inside the compiled function. Peak = `gs.measure` peak live bytes of one "
            f"training step above the baseline (parameters and inputs excluded). Step time = min over "
            f"the interleaved rounds of its T (column `rounds`). `spaco t=8 c=256`: Bernoulli, keep probability 8/k.\n\n"
            + table(rows) + "\n\nPeak-memory growth per token (from the shortest to the longest T):\n\n"
            + slopes(rows) + "\n\n" + targets(rows) + "\n\n"
            "Reading: plain autograd and per-layer checkpointing grow with every activation per token; SeCO/SpaCO "
            "grow only with the KV cache (the cache itself, its cotangent buffer, and the transient gradient "
            "of the cached prefix inside one chunk's backward: about 3x the cache per token). `forward` is a "
            "no-grad forward of the same model.")
    write_seco_subsection("Memory and time vs. sequence length (bench/bench_seco.py)", body)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

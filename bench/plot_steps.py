"""Plot step memory and step time against T per method (issue 19): bench_compose's rows as one PNG.

One row of two log-log panels per model: the peak memory of one training step (forward,
cross-entropy, backward) and its step time, against the sequence length T, one line per method
of ``bench_compose.py``: eager, per-layer checkpointing, ``torch.compile``, ``torch.compile`` with
``activation_memory_budget=0.1``, and each gradshard plan that applies (adjoint on the recurrent
models, seco on the attention models; with Inductor solid, without it dashed). The rows are
``bench_compose.py``'s (``out/bench_compose.json``, written by ``gradshard bench compose``), or,
with ``--run``, measured here with its ``measure_one`` (saved to ``out/steps_vs_T.json``; the
compose table in ``RESULTS.md`` is left alone). Draws ``steps_vs_T.png`` and links it from the
"Step memory and time vs T" subsection of "## Composing with Inductor (issue 19)" in ``RESULTS.md``
(``bench/`` in a checkout, the current folder for an installed gradshard). Needs matplotlib
(``pip install gradshard[plot]``).

    python bench/plot_steps.py                                   # replot out/bench_compose.json
    python bench/plot_steps.py --run --models ssm,llama --seq-lens 1k,2k,4k,8k --repeat 1
    python bench/plot_steps.py --rows bench/out/steps_vs_T.json  # replot a --run's rows
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: bench_compose and the RESULTS.md writer

import torch  # noqa: E402

import bench_compose as bc  # noqa: E402
from results_md import OUTPUT_DIR, RESULTS, write_section  # noqa: E402

#: A section of its own: bench_compose rewrites its whole section on every run.
HEADING = "## Step memory and time vs T (issue 19)"
HEADING_GPU = "## Step memory and time vs T on GPU (issue 19)"
#: What ``--run`` measures (rows of a plan that does not apply to a model are skipped).
RUN_METHODS = ("eager", "ckpt", "compile", "compile_budget", "gs_adjoint", "gs_adjoint_eager", "gs_seco",
               "gs_seco_eager")
#: Legend label, colour and line style of each method, in legend order.
STYLE: dict[str, tuple[str, str, str]] = {
    "eager": ("eager", "tab:gray", "-"),
    "ckpt": ("eager, per-layer checkpointing", "tab:brown", "--"),
    "compile": ("torch.compile", "tab:blue", "-"),
    "compile_budget": ("torch.compile, activation budget 0.1", "tab:cyan", "--"),
    "gs_none": ("gradshard plan none (Inductor)", "tab:olive", "-"),
    "gs_adjoint": ("gradshard adjoint (Inductor)", "tab:red", "-"),
    "gs_adjoint_eager": ("gradshard adjoint (no Inductor)", "tab:red", ":"),
    "gs_seco": ("gradshard seco (Inductor)", "tab:green", "-"),
    "gs_seco_eager": ("gradshard seco (no Inductor)", "tab:green", ":"),
    "backend_none": ("torch.compile(backend=gradshard none)", "tab:pink", "-."),
    "backend_adjoint": ("torch.compile(backend=gradshard adjoint)", "tab:purple", "-."),
    "backend_seco": ("torch.compile(backend=gradshard seco)", "tab:purple", "-."),
}
MIB = 1024 ** 2


def default_rows(device: str) -> Path:
    """``bench_compose.py``'s raw rows for ``device``."""
    return OUTPUT_DIR / "out" / f"bench_compose{'_' + device if device != 'cpu' else ''}.json"


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows saved at ``path``, with a clear error when there are none."""
    if not path.is_file():
        raise SystemExit(f"plot_steps: no rows at {path}: run `gradshard bench compose` (bench/bench_compose.py) "
                         "first, or measure here with `--run`")
    rows = json.loads(path.read_text())
    if not rows:
        raise SystemExit(f"plot_steps: {path} holds no rows")
    return rows


def run_rows(models: list[str], lens: list[int], methods: list[str], *, batch: int, shard: int, chunk: int,
             repeat: int, device: torch.device) -> list[dict[str, Any]]:
    """Measure one row per (model, T, method that applies) with ``bench_compose.measure_one``."""
    bc.warm_up_inductor(device)
    rows = []
    for model in models:
        for T in lens:
            for method in methods:
                if not bc.applies(method, model):
                    continue
                r = bc.measure_one(model, method, T, batch, shard, chunk, repeat, device)
                gc.collect()
                rows.append(r)
                print(f"{model:8s} T={T:6d} {STYLE[method][0]:40s} {r['seconds']:8.3f} s  peak "
                      f"{r['peak'] / MIB:9.1f} MiB  first call {r['first_call_s']:.1f} s", flush=True)
    return rows


def _length(T: int) -> str:
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def import_pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a clear exit when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("plot_steps needs matplotlib: pip install gradshard[plot] (or pip install matplotlib)") \
            from exc
    return plt


def draw(rows: list[dict[str, Any]], title: str = "") -> Any:
    """The figure: per model (in row order) a memory panel and a time panel, log-log, one line per method."""
    plt = import_pyplot()
    from matplotlib.ticker import LogFormatter, NullLocator

    class Plain(LogFormatter):  # log ticks as plain numbers (0.1, 30), where matplotlib labels them
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    for (ax_mem, ax_time), model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        methods = sorted({r["method"] for r in mine}, key=lambda m: (list(STYLE).index(m) if m in STYLE else 99, m))
        for method in methods:
            pts = sorted((r["T"], r["peak"], r["seconds"]) for r in mine if r["method"] == method)
            label, color, ls = STYLE.get(method, (method, None, "-"))
            Ts = [p[0] for p in pts]
            ax_mem.plot(Ts, [p[1] / MIB for p in pts], ls, color=color, marker="o", ms=4, label=label)
            ax_time.plot(Ts, [p[2] for p in pts], ls, color=color, marker="o", ms=4, label=label)
        Ts = sorted({r["T"] for r in mine})
        what = mine[0].get("model_desc", model).split(":")[0].replace("`", "")
        for ax, name in ((ax_mem, "peak step memory (MiB)"), (ax_time, "step time (s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(Ts, [_length(T) for T in Ts])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(Plain())
            ax.yaxis.set_minor_formatter(Plain())
            ax.set(xlabel="sequence length T (tokens)", ylabel=name, title=f"{model} ({what}): {name.split(' (')[0]}")
            ax.grid(alpha=0.3, which="both")
        ax_mem.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Draw ``rows`` (see :func:`draw`) into the PNG ``path``."""
    fig = draw(rows, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def caption(rows: list[dict[str, Any]]) -> str:
    """The figure's title: what one step is, batch, and the device."""
    batch = {r.get("batch") for r in rows}
    device = {r.get("device", "cpu") for r in rows}
    b = f", batch {batch.pop()}" if len(batch) == 1 and None not in batch else ""
    d = device.pop().upper() if len(device) == 1 else "mixed devices"
    return f"One training step (forward, cross-entropy, backward), float32{b}, {d}; median step time, allocator peak"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=None, help="rows to plot (default: out/bench_compose.json; with --run: "
                                                "where the measured rows are saved, out/steps_vs_T.json)")
    p.add_argument("--run", action="store_true", help="measure the rows here with bench_compose.measure_one")
    p.add_argument("--models", default="ssm,llama", help=f"with --run: any of {','.join(bc.MODELS)}")
    p.add_argument("--seq-lens", default="1k,2k,4k,8k", help="with --run")
    p.add_argument("--methods", default=",".join(RUN_METHODS), help=f"with --run: any of {','.join(bc.METHODS)}")
    p.add_argument("--repeat", type=int, default=3, help="with --run: timed steps per point (median)")
    p.add_argument("--quick", action="store_true", help="with --run: T=1K,2K and one timed step per point")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (with --run: where to measure)")
    p.add_argument("--png", default=None, help="default: steps_vs_T.png (steps_vs_T_cuda.png for cuda) beside "
                                              "RESULTS.md")
    p.add_argument("--no-write", action="store_true", help="leave RESULTS.md (and the rows file) alone")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    import_pyplot()  # before minutes of measuring
    device = torch.device(args.device)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    if args.run:
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device is available here")
        if args.quick:
            args.seq_lens, args.repeat = "1k,2k", 1
        if args.threads:
            torch.set_num_threads(args.threads)
        models = [m for m in args.models.split(",") if m]
        methods = [m for m in args.methods.split(",") if m]
        bad = sorted(set(methods) - set(bc.METHODS)) + sorted(set(models) - set(bc.MODELS))
        if bad:
            p.error(f"unknown method/model {bad}; methods: {bc.METHODS}, models: {bc.MODELS}")
        lens = [bc.parse_len(s) for s in args.seq_lens.split(",") if s]
        rows = run_rows(models, lens, methods, batch=args.batch, shard=args.shard_size, chunk=args.chunk_size,
                        repeat=args.repeat, device=device)
        source = Path(args.rows) if args.rows else OUTPUT_DIR / "out" / f"steps_vs_T{suffix}.json"
        if not args.no_write:
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text(json.dumps(rows, indent=1))
    else:
        source = Path(args.rows) if args.rows else default_rows(device.type)
        rows = load_rows(source)
    png = plot(rows, Path(args.png) if args.png else OUTPUT_DIR / f"steps_vs_T{suffix}.png", caption(rows))
    print(f"plot: {png}")
    if args.no_write:
        return 0
    command = "python bench/plot_steps.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                  else argv))
    body = (f"![Peak step memory and step time against T, log-log, one line per method]({png.name})\n\n"
            "Peak memory and median time of one training step against T for eager, per-layer checkpointing, "
            "`torch.compile`, `torch.compile` with `activation_memory_budget=0.1` and the gradshard plans "
            "that apply (Inductor solid, without it dotted), measured as in \"Composing with Inductor\"; from "
            f"`{command.strip()}` (`gradshard bench plot` takes the same arguments).")
    write_section(HEADING if device.type == "cpu" else HEADING_GPU, body, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``gradshard`` command line: show, cost, whatif, bench, demo, plans, factories.

Where a model is needed a command takes a target naming a factory, a function that returns
``(model_or_fn, example_inputs)``: ``NAME`` (one that ships with gradshard, see
``gradshard factories``), ``MODULE:FACTORY`` or ``FILE.py:FACTORY`` (:mod:`gradshard.cli.load`).
Everything the commands need ships in the package: the example models and factories
(:mod:`gradshard.examples`) and the benchmark scripts (``gradshard.bench``).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from gradshard.errors import GradshardError

from .load import TARGET_HELP

console = Console()

__all__ = ["main", "build_parser"]


def _add_target(p: argparse.ArgumentParser, seq_len: bool = True) -> None:
    p.add_argument("target", help=TARGET_HELP)
    if seq_len:
        p.add_argument("--seq-len", type=int, default=None, help="sequence length passed to the factory")
    else:
        p.add_argument("--example-seq-len", dest="seq_len", type=int, default=None,
                       help="sequence length of the example the model is captured at")
    p.add_argument("--batch", type=int, default=None, help="batch size passed to the factory")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                   help="plan option, repeatable (e.g. -o shard_size=128 -o window=64)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradshard",
        description="gradshard: a compiler for the backward pass of long-context models.",
        epilog="Targets: NAME (a factory shipped with gradshard: `gradshard factories`), MODULE:FACTORY\n"
               "or FILE.py:FACTORY; a factory returns (model_or_fn, example_inputs).\n\n"
               "Examples:\n"
               "  gradshard show ssm_loop --plan adjoint\n"
               "  gradshard show gradshard.examples.factories:llama --plan seco -o chunk_size=8\n"
               "  gradshard show ./my_model.py:build --plan adjoint\n"
               "  gradshard cost llama --plan none,seco --seq-len 1k,64k,1M --device h100\n"
               "  gradshard whatif ssm --plan truncated_adjoint -o window=1024 --max-seq-len --memory 80GB\n"
               "  gradshard whatif ssm --choose-plan --memory 2MB --example-seq-len 512\n"
               "  gradshard bench list\n"
               "  gradshard bench seco --quick\n"
               "  gradshard demo --steps 10",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("show", help="capture a model, run a plan, and show regions, every pass and the stage program")
    _add_target(p)
    p.add_argument("--plan", default="none", help="plan to run (see `gradshard plans`)")
    p.add_argument("--full", action="store_true", help="print whole graphs and diffs, not the first lines")
    p.add_argument("--max-lines", type=int, default=40, help="lines of each graph/diff to show (default 40)")
    p.add_argument("--graph", action="store_true", help="also print the captured graph")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("plans", help="list the plans, their options and gradient semantics")
    p.set_defaults(func=cmd_plans)

    p = sub.add_parser("factories", help="list the model factories that ship with gradshard (targets by NAME)")
    p.set_defaults(func=cmd_factories)

    p = sub.add_parser("cost", help="predict memory/FLOPs/communication per plan and sequence length (sympy cost model)")
    _add_target(p, seq_len=False)
    p.add_argument("--plan", default="none", help="comma-separated plans, e.g. adjoint,seco")
    p.add_argument("--seq-len", dest="seq_lens", default="1k,64k,1M", help="comma-separated lengths, e.g. 1k,64k,1M")
    p.add_argument("--device", default=None, help="device profile for roofline time estimates (h100, h200, a100, rtx3090)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="plot memory vs. sequence length per plan")
    p.add_argument("--expressions", action="store_true", help="print the symbolic expressions")
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("whatif", help="answer inverse questions: the longest sequence that fits a memory budget")
    _add_target(p, seq_len=False)
    p.add_argument("--plan", default="none", help="comma-separated plans")
    p.add_argument("--max-seq-len", action="store_true", help="report the longest sequence that fits --memory")
    p.add_argument("--choose-plan", action="store_true",
                   help="the plan and options gs.compile(plan='auto', memory_budget=--memory) would choose for "
                        "the factory's example (--example-seq-len, --batch); --plan is ignored")
    p.add_argument("--allow-approximate", action="store_true",
                   help="with --choose-plan: also consider truncated_adjoint and spaco")
    p.add_argument("--memory", default=None, help="memory budget, e.g. 80GB, 24GiB (default: the --device memory, else 80GB)")
    p.add_argument("--device", default=None, help="device profile: its memory is the budget unless --memory is given")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="plot memory vs. sequence length per plan")
    p.set_defaults(func=cmd_whatif)

    p = sub.add_parser("bench", help="list or run the benchmark scripts shipped as gradshard.bench; tables go to "
                                      "bench/RESULTS.md in a source checkout, else ./RESULTS.md")
    p.add_argument("name", nargs="?", default="list", help="benchmark NAME (bench_NAME.py, or 'plot'), 'all' or 'list' (default)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="train the SSM LM on offline text with a plan, showing loss, memory and the rewritten graph")
    p.add_argument("--plan", default="adjoint")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_demo)
    return parser


# --------------------------------------------------------------------------- commands


def cmd_show(args: argparse.Namespace) -> int:
    import gradshard as gs
    from gradshard.plans import get_plan

    from .load import call_factory, load_factory, parse_options
    from .render import graph_text, pass_panel, program_table, regions_table, summary_panel

    target, inputs = call_factory(load_factory(args.target), seq_len=args.seq_len, batch=args.batch)
    cm = gs.compile(target, plan=args.plan, **parse_options(args.option))
    with console.status(f"capturing and compiling with plan {args.plan!r}..."):
        entry = cm.compiled_for(*inputs)
    limit = None if args.full else args.max_lines
    console.print(summary_panel(entry, get_plan(args.plan).gradient))
    console.print(regions_table(entry.regions))
    if args.graph:
        console.rule("captured graph")
        console.print(graph_text(entry.original.code, limit))
    console.rule("passes")
    for i, rec in enumerate(entry.records):
        console.print(pass_panel(i, rec, limit))
    console.print(program_table(entry.program))
    return 0


def cmd_plans(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.table import Table

    from gradshard.plans import get_plan, plans

    t = Table(title="gradshard plans")
    for c in ("plan", "options", "gradient", "passes"):
        t.add_column(c, overflow="fold")
    for name in plans():
        spec = get_plan(name)
        opts = ", ".join(f.name + ("" if f.default is dataclasses.MISSING else f"={f.default!r}")
                         for f in dataclasses.fields(spec.options))
        t.add_row(name, opts or "-", spec.gradient, "\n".join(p.name for p in spec.pipeline()))
    console.print(t)
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    from .cost_cmd import run_cost

    return run_cost(args, console)


def cmd_whatif(args: argparse.Namespace) -> int:
    from .cost_cmd import run_whatif

    return run_whatif(args, console)


def cmd_factories(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .load import builtin_factories

    t = Table(title="model factories shipped with gradshard (gradshard.examples.factories)")
    t.add_column("NAME")
    t.add_column("model", overflow="fold")
    for name, fn in builtin_factories().items():
        t.add_row(name, (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "")
    console.print(t)
    console.print("use one as a target: `gradshard show NAME --plan adjoint`; size overrides: --seq-len, --batch; "
                  "your own model: MODULE:FACTORY or FILE.py:FACTORY")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench_cmd import run_bench

    return run_bench(args, console)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .load import parse_options

    return run_demo(console, plan=args.plan, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                    options=parse_options(args.option))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GradshardError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``gradshard cost`` and ``gradshard whatif``: thin layers over :mod:`gradshard.cost`."""

from __future__ import annotations

import argparse

from rich.console import Console

__all__ = ["run_cost", "run_whatif"]


def _reports(args: argparse.Namespace, console: Console):
    from gradshard.cost import cost_reports

    from .load import call_factory, load_factory, parse_options

    target, inputs = call_factory(load_factory(args.target), seq_len=args.seq_len, batch=args.batch)
    with console.status("pricing plans...") as status:
        return cost_reports(target, args.plan, example_inputs=inputs, device=args.device,
                            common_options=parse_options(args.option),
                            progress=lambda msg: status.update(msg))


def run_cost(args: argparse.Namespace, console: Console) -> int:
    from gradshard.cost import cost_table, parse_counts, plot_memory_vs_seq_len

    reports = _reports(args, console)
    table = cost_table(reports, parse_counts(args.seq_lens), device=args.device)
    console.print(table)
    if args.expressions:
        for rep in reports:
            console.rule(rep.short_name())
            for name in ("activation_bytes", "peak_bytes", "flops", "comm_bytes"):
                console.print(f"{name} = {rep.formula(name)}")
    if args.plot:
        plot_memory_vs_seq_len(reports, args.plot, device=args.device)
        console.print(f"wrote {args.plot}")
    return 0


def _choose(args: argparse.Namespace, console: Console) -> int:
    """``whatif --choose-plan``: what ``plan="auto"`` would compile for the factory's example."""
    from gradshard.autoplan import choose_plan

    from .load import call_factory, load_factory

    target, inputs = call_factory(load_factory(args.target), seq_len=args.seq_len, batch=args.batch)
    memory = args.memory or (None if args.device else "80GB")
    if memory is None:
        from gradshard.cost import get_device

        memory = get_device(args.device).memory_bytes
    with console.status("pricing candidate plans...") as status:
        choice = choose_plan(target, inputs, memory_budget=memory, device=args.device,
                             allow_approximate=args.allow_approximate, progress=lambda msg: status.update(msg))
    console.print(choice.describe(), soft_wrap=True, markup=False)
    return 0


def run_whatif(args: argparse.Namespace, console: Console) -> int:
    from gradshard.cost import max_seq_len_table, plot_memory_vs_seq_len

    if args.choose_plan:
        return _choose(args, console)
    if not args.max_seq_len and not args.plot:
        console.print("[yellow]nothing asked: pass --max-seq-len (and --memory), --choose-plan or --plot[/]")
        return 1
    reports = _reports(args, console)
    if args.max_seq_len:
        memory = args.memory or (None if args.device else "80GB")
        console.print(max_seq_len_table(reports, memory, device=args.device))
    if args.plot:
        plot_memory_vs_seq_len(reports, args.plot, device=args.device)
        console.print(f"wrote {args.plot}")
    return 0

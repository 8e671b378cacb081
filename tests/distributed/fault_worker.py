"""One rank of a real multi-process gloo group, for the fault tests in ``test_faults.py``.

Run as a script (a separate OS process per rank)::

    python fault_worker.py SCENARIO RANK WORLD PORT OUTDIR [key=value ...]

It joins ``torch.distributed`` (gloo, TCP store on 127.0.0.1:PORT), runs SCENARIO and
reports with marker lines (stdout and ``OUTDIR/rank{R}.log``) that the test parses::

    FAULT rank=R event=ready t=T                  process group is up (T: time.monotonic())
    FAULT rank=R event=pause t=T at=WHERE         stopped at WHERE, alive, until the test SIGKILLs it
    FAULT rank=R event=sleeping t=T seconds=S     about to sleep S s before a collective
    FAULT rank=R event=step|collective|synced|saved|loaded t=T ...   progress
    FAULT rank=R event=error t=T error=CLS mro=A,B,.. cause=CLS elapsed=S   (then the exception propagates)
    FAULT rank=R event=done t=T

``elapsed`` is measured from the start of the step (or collective) in which the fault happens
(for a rank that slept: from when it woke up).
Scenarios:

- ``lasp``: a 2-layer linear-attention LM compiled with ``plan="lasp"`` (option
  ``timeout_s=timeout``) on the default world group; one clean step, then in the second step rank
  ``victim`` pauses ``at=forward`` (inside layer 1's LASP stage) or ``at=backward`` (when the
  gradient of layer 1's LASP output arrives) until the test kills it, or (``at=sleep``) sleeps
  ``sleep`` s inside layer 1's LASP stage and then goes on.
- ``diloco``: DiLoCo on a small MLP; ``fault=kill``: rank ``victim`` pauses on entering its
  second outer sync; ``fault=sleep``: rank ``victim`` sleeps ``sleep`` s before its second
  outer sync (then takes part).
- ``train``: DiLoCo with dropout and two streaming fragments for ``steps`` inner steps;
  ``mode=reference`` dumps the final state (``OUTDIR/reference-{R}.pt``); ``mode=interrupt``
  saves a checkpoint (``ckpt_dir/ckpt-{R}.pt``) after step ``ckpt``, trains two more steps and
  pauses; ``mode=resume`` loads that checkpoint, trains to ``steps`` and dumps the final state
  (``OUTDIR/resume-{R}.pt``).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

_T0: list[float] = [time.monotonic()]  # start of the step in which the fault happens
_RANK: list[int] = [-1]
_LOG: list[Any] = [None]  # this rank's marker file (line-buffered), when run by the tests


def report(event: str, **fields: Any) -> None:
    """Write one marker line (with this process's monotonic clock) to stdout and the log file."""
    extra = "".join(f" {k}={v}" for k, v in fields.items())
    line = f"FAULT rank={_RANK[0]} event={event} t={time.monotonic():.3f}{extra}"
    print(line, flush=True)
    if _LOG[0] is not None:
        _LOG[0].write(line + "\n")
        _LOG[0].flush()


def mark_fault_clock() -> None:
    """Start the clock that ``elapsed`` in the error marker is measured from."""
    _T0[0] = time.monotonic()


def pause(where: str) -> None:
    """Stop here, alive, until the test SIGKILLs this process."""
    report("pause", at=where)
    time.sleep(600)
    raise SystemExit(f"rank {_RANK[0]} paused at {where} and was not killed within 600 s")


# --------------------------------------------------------------------------- lasp


def run_lasp(rank: int, opts: dict[str, str]) -> None:
    import gradshard as gs
    from gradshard.plans.lasp.runtime import local_slice

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lasp"))
    from lasp_models import tiny_lm

    victim, at = int(opts["victim"]), opts["at"]
    world = dist.get_world_size()
    model, ids = tiny_lm("naive", "const", seq_len=17, batch=1)
    cm = gs.compile(model, plan="lasp", timeout_s=float(opts["timeout"]))  # default world group
    x = local_slice(ids, rank, world)
    cm(x).sum().backward()  # one clean step: compiles on every rank
    report("step", n=1)
    if rank == victim:
        stage = cm.graph.lasp_1
        original = stage.forward

        def forward(*args: Any) -> Any:
            if at == "forward":
                pause("forward")
            if at == "sleep":
                report("sleeping", seconds=opts["sleep"])
                time.sleep(float(opts["sleep"]))
                mark_fault_clock()
                return original(*args)
            out = original(*args)
            first = out[0] if isinstance(out, tuple) else out
            first.register_hook(lambda grad: pause("backward"))
            return out

        stage.forward = forward
    mark_fault_clock()
    cm(x).sum().backward()
    report("step", n=2)


# --------------------------------------------------------------------------- diloco


def make_mlp(dropout: float = 0.0) -> nn.Module:
    """Identical on every rank (private generator): two layers, so two streaming fragments."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 9), nn.Dropout(dropout), nn.Tanh(), nn.Linear(9, 3)).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return net


def inner_step(net: nn.Module, rank: int, step: int) -> None:
    """Forward + backward of a batch that depends only on (rank, step)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    (net(x) - y).square().mean().backward()


def run_diloco(rank: int, opts: dict[str, str]) -> None:
    from gradshard.distributed.diloco import DiLoCo

    fault, victim, timeout = opts["fault"], int(opts["victim"]), float(opts["timeout"])
    net = make_mlp()
    outer = DiLoCo(net, torch.optim.AdamW(net.parameters(), lr=0.05), sync_every=2, timeout_s=timeout)
    original = outer.sync

    def sync(fragment: int = 0) -> None:
        if outer.fragment_syncs[0] == 1:  # the second outer sync
            mark_fault_clock()
            if rank == victim and fault == "kill":
                pause("sync")
            if rank == victim and fault == "sleep":
                report("sleeping", seconds=opts["sleep"])
                time.sleep(float(opts["sleep"]))
                mark_fault_clock()
        report("collective", sync=outer.fragment_syncs[0] + 1)
        original(fragment)

    outer.sync = sync  # type: ignore[method-assign]
    for step in range(1, 7):
        inner_step(net, rank, step)
        if outer.step() is not None:
            report("synced", step=step)


def run_train(rank: int, out: Path, opts: dict[str, str]) -> None:
    from gradshard.distributed.diloco import DiLoCo

    mode, steps, ckpt = opts["mode"], int(opts["steps"]), int(opts["ckpt"])
    net = make_mlp(dropout=0.25)
    outer = DiLoCo(net, torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1), sync_every=4,
                   fragments=2, outer_lr=0.7, outer_momentum=0.9, timeout_s=float(opts["timeout"]))
    torch.manual_seed(100 + rank)  # dropout masks differ per rank and come from the global RNG
    path = Path(opts["ckpt_dir"]) / "ckpt-{rank}.pt"
    first = 1
    if mode == "resume":
        outer.load(path)
        first = outer.inner_steps + 1
        report("loaded", step=outer.inner_steps)
    last = ckpt + 2 if mode == "interrupt" else steps
    for step in range(first, last + 1):
        inner_step(net, rank, step)
        outer.step()
        if mode == "interrupt" and step == ckpt:
            outer.save(path)
            report("saved", step=step)
    if mode == "interrupt":
        pause(f"step{last}")
    torch.save(outer.state_dict(), out / f"{mode}-{rank}.pt")


# --------------------------------------------------------------------------- main


def run_rank(scenario: str, rank: int, world: int, port: int, out: str, opts: dict[str, str]) -> None:
    """Entry point of one rank (a ``multiprocessing`` target, or called by :func:`main`).

    Markers also go to ``OUT/rank{R}.log``. An exception is reported and then propagates, so
    the process exits with status 1 like any Python program that raised.
    """
    _RANK[0] = rank
    _LOG[0] = open(Path(out) / f"rank{rank}.log", "a", buffering=1)
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=float(opts.get("pg_timeout", "60"))),
    )
    report("ready")
    runners: dict[str, Callable[[], None]] = {
        "lasp": lambda: run_lasp(rank, opts),
        "diloco": lambda: run_diloco(rank, opts),
        "train": lambda: run_train(rank, Path(out), opts),
    }
    try:
        runners[scenario]()
    except Exception as exc:
        cause = exc.__cause__
        report("error", error=type(exc).__name__, mro=",".join(c.__name__ for c in type(exc).__mro__),
               cause=type(cause).__name__ if cause is not None else "None",
               elapsed=f"{time.monotonic() - _T0[0]:.3f}")
        _LOG[0].write("".join(traceback.format_exception(exc)))
        _LOG[0].flush()
        raise
    report("done")
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """``python fault_worker.py SCENARIO RANK WORLD PORT OUTDIR [key=value ...]``"""
    scenario, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    run_rank(scenario, rank, world, port, out, dict(a.split("=", 1) for a in argv[5:]))


if __name__ == "__main__":
    main(sys.argv[1:])

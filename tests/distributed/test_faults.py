"""Fault tests with real OS processes: dead and stuck peers, and kill-and-resume.

Every rank is a separate process (``multiprocessing`` with the ``forkserver`` start method:
a clean single-threaded server that has imported torch and gradshard once forks each rank,
so a rank starts in milliseconds instead of the 5-20 s a fresh interpreter needs on this
machine). The ranks form a gloo group over loopback (TCP store on a free port) and run
:mod:`tests.distributed.fault_worker`, which writes marker lines (event, process monotonic
clock, exception class) to ``rank{R}.log``. A rank told to fail stops at a precise point and
the test SIGKILLs it; a survivor must raise the documented error type within the
communication timeout plus a margin, and exit. Every wait here has a deadline and every
process is killed at the end, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from . import fault_worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

TIMEOUT = 5.0  # gradshard's communication timeout in every scenario (s)
MARGIN = 4.0  # scheduling slack on a loaded 2-core machine (s)
PG_TIMEOUT = 60.0  # gloo's own group timeout: longer, so gradshard's timeout is the one that acts
START = 120.0  # deadline for a group to get to its fault point (forkserver start, compile)

_PRELOAD = [
    "torch", "torch.distributed", "gradshard", "gradshard.distributed.diloco",
    "gradshard.passes.plan_adjoint", "gradshard.passes.plan_chunked", "gradshard.passes.plan_lasp",
    "gradshard.passes.plan_partial", fault_worker.__name__,
]


@pytest.fixture(scope="module")
def ctx() -> Any:
    """The forkserver context (preloads only if no other test started the server first)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """A group of rank processes running one scenario, and what they reported."""

    def __init__(self, ctx: Any, out: Path, scenario: str, world: int = 2, **opts: Any) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        opts.setdefault("pg_timeout", PG_TIMEOUT)
        port = free_port()
        self.procs = [
            ctx.Process(target=fault_worker.run_rank, daemon=True,
                        args=(scenario, r, world, port, str(out), {k: str(v) for k, v in opts.items()}))
            for r in range(world)
        ]
        self.exit_time: dict[int, float] = {}
        for p in self.procs:
            p.start()

    def log(self, rank: int) -> str:
        path = self.out / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.exitcode}):\n{self.log(r)}" for r, p in enumerate(self.procs))

    def events(self, rank: int, event: str) -> list[dict[str, str]]:
        found = []
        for line in self.log(rank).splitlines():
            if line.startswith("FAULT ") and f" event={event} " in line + " ":
                found.append(dict(f.split("=", 1) for f in line.split()[1:]))
        return found

    def wait_event(self, rank: int, event: str, deadline: float) -> dict[str, str]:
        """The first ``event`` of ``rank``; fails if the rank exits or ``deadline`` passes first."""
        while True:
            found = self.events(rank, event)
            if found:
                return found[0]
            if not self.procs[rank].is_alive() and not self.events(rank, event):
                pytest.fail(f"rank {rank} exited before reporting {event}:\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"rank {rank} did not report {event} in time:\n{self.logs()}")
            time.sleep(0.02)

    def kill(self, rank: int) -> float:
        """SIGKILL one rank; returns the (monotonic) time of the kill."""
        t = time.monotonic()
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.wait_exit([rank], t + 10.0)
        return t

    def wait_exit(self, ranks: list[int], deadline: float) -> None:
        """Record when each of ``ranks`` exits; those still alive at ``deadline`` stay unrecorded."""
        pending = {self.procs[r].sentinel: r for r in ranks if r not in self.exit_time}
        while pending and time.monotonic() < deadline:
            for s in wait_for_exit(list(pending), timeout=max(0.0, deadline - time.monotonic())):
                self.exit_time[pending.pop(s)] = time.monotonic()
        for r in ranks:
            self.procs[r].join(0)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)


@contextmanager
def launch(ctx: Any, out: Path, scenario: str, **opts: Any) -> Iterator[Ranks]:
    ranks = Ranks(ctx, out, scenario, **opts)
    try:
        yield ranks
    finally:
        ranks.close()


def _error(ranks: Ranks, rank: int, deadline: float) -> dict[str, str]:
    return ranks.wait_event(rank, "error", deadline)


# --------------------------------------------------------------------------- 1. LASP


@pytest.mark.parametrize("at", ["forward", "backward"])
def test_lasp_rank_killed_mid_step_makes_the_survivor_raise_comm_timeout(ctx: Any, tmp_path: Path, at: str) -> None:
    """Rank 1 is SIGKILLed inside layer 1 of the second step (forward, or backward when layer
    1's output gradient arrives); rank 0 raises CommTimeoutError (naming what it waited for)
    within the timeout + margin of the kill, and exits with status 1."""
    with launch(ctx, tmp_path, "lasp", victim=1, at=at, timeout=TIMEOUT) as ranks:
        ranks.wait_event(1, "pause", time.monotonic() + START)
        assert ranks.events(1, "pause")[0]["at"] == at
        killed = ranks.kill(1)
        err = _error(ranks, 0, killed + TIMEOUT + MARGIN)
        ranks.wait_exit([0], killed + TIMEOUT + MARGIN)
        assert err["error"] == "CommTimeoutError", ranks.logs()
        assert float(err["t"]) - killed < TIMEOUT + MARGIN
        assert "rank 0 waited" in ranks.log(0) and "from rank 1" in ranks.log(0) or "rank 0 could not" in ranks.log(0)
        assert ranks.procs[1].exitcode == -signal.SIGKILL
        assert 0 in ranks.exit_time, f"rank 0 did not exit within {TIMEOUT + MARGIN} s of the kill:\n{ranks.logs()}"
        assert ranks.procs[0].exitcode == 1
        assert not ranks.events(0, "step") or ranks.events(0, "step")[-1]["n"] == "1"


# --------------------------------------------------------------------------- 2. DiLoCo


def test_diloco_rank_killed_during_outer_step_makes_the_survivor_raise(ctx: Any, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while rank 0 waits in the second outer all-reduce: rank 0 raises
    DiLoCoError (from CommTimeoutError) within the timeout + margin, and exits with status 1."""
    with launch(ctx, tmp_path, "diloco", fault="kill", victim=1, timeout=TIMEOUT) as ranks:
        ranks.wait_event(1, "pause", time.monotonic() + START)
        ranks.wait_event(0, "collective", time.monotonic() + START)
        time.sleep(0.5)  # rank 0 is now blocked in the all-reduce
        killed = ranks.kill(1)
        err = _error(ranks, 0, killed + TIMEOUT + MARGIN)
        ranks.wait_exit([0], killed + TIMEOUT + MARGIN)
        assert err["error"] == "DiLoCoError" and err["cause"] == "CommTimeoutError", ranks.logs()
        assert "GradshardError" in err["mro"].split(",")
        assert float(err["t"]) - killed < TIMEOUT + MARGIN
        assert "diloco.fragment0" in ranks.log(0)
        assert ranks.procs[1].exitcode == -signal.SIGKILL
        assert 0 in ranks.exit_time, f"rank 0 did not exit within {TIMEOUT + MARGIN} s of the kill:\n{ranks.logs()}"
        assert ranks.procs[0].exitcode == 1

"""Run a program compiled at one sequence length at another, without capturing again.

``CompiledModule`` captures once per input signature. For a loop-written model, capturing
at a new length unrolls the loop again (make_fx records ~3 ms per node: a 2-layer loop
model at T=1000 takes about a minute). The adjoint rewrite leaves a program whose only
length-dependent parts are integer arguments (views, slices) outside the regions -- the
regions and rolled loop bodies are length-generic. So a new length is served by
re-specialising the compiled graph (:func:`gradshard.plans.adjoint.respecialize.respecialize`).

Safety: the first time, the re-specialisation is cross-checked against a real capture at
a probe length ``T + 1`` (cheap) on the same inputs (sliced); a program that fails the
check, or whose re-specialisation is refused, falls back to the normal capture.

``install_length_generic(gm, facts, tl)`` stores the facts on the rewritten graph and a
``gs_attach`` hook; ``CompiledModule`` calls the hook once, which routes cache misses that
differ only in the time length through :func:`serve_new_length` (registered with
``CompiledModule.register_specializer``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.ir import PassRecord
from gradshard.passes.respecialize import call_length, cut_call
from gradshard.plans.adjoint.respecialize import RespecializeError, expected_shape, respecialize
from gradshard.runtime.compiled import forgetting_new_lengths

__all__ = ["install_length_generic", "serve_new_length"]

log = logging.getLogger("gradshard")


def install_length_generic(gm: fx.GraphModule, facts: dict, tl: Any) -> None:
    """Record what :func:`serve_new_length` needs on ``gm`` and install the attach hook."""
    gm.gs_time_facts = dict(facts)
    gm.gs_seq_len = int(tl.seq_len)
    gm.gs_time_inputs = dict(tl.time_inputs)
    gm.gs_attach = functools.partial(_attach, gm)


def _attach(gm: fx.GraphModule, cm: Any) -> None:
    cm.register_specializer(_serve)


def _serve(cm: Any, args: tuple, kwargs: dict) -> Any:
    """Specialiser: serve inputs that differ from a compiled entry only in time length."""
    return serve_new_length(cm, args, kwargs)


def _new_length(entry: Any, args: tuple, kwargs: dict) -> Optional[int]:
    """The new sequence length if ``args`` differ from ``entry``'s inputs only along time."""
    cap = entry.captured
    gm = entry.gm
    if cap is None or not hasattr(gm, "gs_time_facts"):
        return None
    T_new = call_length(cap, gm.graph, gm.gs_time_inputs, args, kwargs)
    if T_new is None or T_new == gm.gs_seq_len or T_new < 1:
        return None
    return T_new


def _region_outputs(gm: fx.GraphModule, T_new: int):
    facts = gm.gs_time_facts

    def outputs(node: fx.Node, args: list) -> tuple:
        outs = []
        getters = sorted((u for u in node.users), key=lambda u: u.args[1])
        n_out = max((u.args[1] for u in getters), default=-1) + 1
        by_index = {u.args[1]: u for u in getters}
        for j in range(n_out):
            g = by_index.get(j)
            if g is None:
                outs.append(None)
                continue
            old = g.meta["val"]
            outs.append(torch.empty(expected_shape(old.shape, facts.get(g.name, ()), T_new), dtype=old.dtype,
                                    device=old.device))
        return tuple(outs)

    return outputs


def _respecialize_entry(entry: Any, T_new: int) -> Any:
    """A copy of the compiled entry ``entry`` (a ``CompiledGraph``) re-specialised to ``T_new``."""
    gm = entry.gm
    new_gm = respecialize(gm, gm.gs_time_facts, gm.gs_seq_len, T_new, strict_scalars=True,
                          module_outputs=_region_outputs(gm, T_new))
    new_gm.gs_time_facts = gm.gs_time_facts
    new_gm.gs_seq_len = gm.gs_seq_len
    new_gm.gs_time_inputs = gm.gs_time_inputs
    record = PassRecord(
        name="respecialize_length", doc=f"re-specialise the program compiled at T={gm.gs_seq_len} to T={T_new} "
        "(length-dependent integers outside the regions rewritten; no new capture)",
        changed=True, before=gm.code, after=new_gm.code, created=(), erased=(),
        notes=(f"T: {gm.gs_seq_len} -> {T_new}",), regions=(), seconds=0.0)
    return dataclasses.replace(entry, gm=new_gm, records=(*entry.records, record),
                               extras={"respecialized_from": gm.gs_seq_len, "seq_len": T_new})


def _slice_time(args: tuple, kwargs: dict, entry: Any, length: int) -> tuple[tuple, dict]:
    return cut_call(entry.captured, entry.gm.graph, entry.gm.gs_time_inputs, args, kwargs, length)


def _probe_ok(cm: Any, entry: Any, args: tuple, kwargs: dict, T_new: int) -> bool:
    """Cross-check the re-specialisation against a real capture at a probe length."""
    gm = entry.gm
    T0 = gm.gs_seq_len
    probe = T0 + 1 if T_new > T0 else T0 - 1
    if probe < 2 or probe > T_new and T_new < T0 and probe != T_new:
        probe = T_new
    p_args, p_kwargs = _slice_time(args, kwargs, entry, min(probe, T_new)) if probe <= T_new else (None, None)
    if p_args is None:
        return False
    probe = min(probe, T_new)
    try:
        real = cm.compile_at(p_args, p_kwargs, plain_when_short=False)
        cap = real.captured
        mine = _respecialize_entry(entry, probe)
    except Exception as exc:  # noqa: BLE001 - any failure means: capture normally
        log.info("gradshard: length-generic probe failed (%s); capturing again", exc)
        return False
    with torch.no_grad():
        flat = [*cap.state(), *cap.flat_inputs(p_args, p_kwargs)]
        want = real.gm(*flat)
        with forgetting_new_lengths(mine.gm):  # its regions are the kept program's
            got = mine.gm(*flat)
    for a, b in zip(want, got):
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape:
                return False
            tol = 1e-9 if a.dtype == torch.float64 else 1e-4
            if not torch.allclose(a, b, rtol=tol, atol=tol):
                return False
    return True


def serve_new_length(cm: Any, args: tuple, kwargs: dict) -> Optional[Any]:
    """A compiled entry for ``args`` re-specialised from a cached one, or ``None``."""
    # oldest first (the entry the verdict was checked on), among those compiled in this state
    same_state = {id(e) for e in cm.specializations_like(args, kwargs)}
    for entry in (e for e in cm.specializations if id(e) in same_state):
        T_new = _new_length(entry, args, kwargs)
        if T_new is None:
            continue
        gm = entry.gm
        verdict = getattr(gm, "gs_generic_ok", None)
        if verdict is None:
            verdict = _probe_ok(cm, entry, args, kwargs, T_new)
            gm.gs_generic_ok = verdict
        if not verdict:
            return None
        try:
            new = _respecialize_entry(entry, T_new)
        except RespecializeError as exc:
            log.info("gradshard: cannot re-specialise to T=%d (%s); capturing again", T_new, exc)
            return None
        log.info("gradshard: serving T=%d from the program captured at T=%d (no new capture)", T_new, gm.gs_seq_len)
        return new
    return None

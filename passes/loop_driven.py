"""Loops that carry linear states beside a *driver*: which carried value is which.

A max-stabilised (log-sum-exp) recurrence carries a running maximum next to its states.
RWKV's WKV (``transformers`` ``rwkv_linear_attention_cpu``) and xLSTM's mLSTM step are::

    m_t   = max(m_{t-1} + w, k_t)                                  # the driver
    num_t = exp(m_{t-1} + w - m_t) * num_{t-1} + exp(k_t - m_t) * v_t
    den_t = exp(m_{t-1} + w - m_t) * den_{t-1} + exp(k_t - m_t)    # linear in themselves

    m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)                      # the driver
    C_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) * C_{t-1} + exp(i_t - m_t) * k_t v_t^T
    n_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) * n_{t-1} + exp(i_t - m_t) * k_t

The maximum's update reads no other carried value, and every other carried value's update is
``A_t * h_{t-1} + U_t`` with ``A_t``, ``U_t`` computed from the step's inputs and the driver
alone. So, exactly (the same operations, regrouped): the driver runs first as a loop of its own
(any update), and given the driver's sequence each state is a diagonal linear scan whose
``a_t``, ``u_t`` are per-step functions of ``(x_t, m_{t-1}, m_t)`` (one scan holds them all,
:mod:`.loop_driven_emit`). The stabilisation is kept as written: the scan computes the same
max-shifted states the model carries, from the same coefficients (``exp`` of differences to
the maximum), so it overflows only where the model does -- no plain ``exp``-space scan.

:func:`analyse_driven_loop` proves that split on the graph of one unrolled loop (structure
only: graph reachability and the linear form of each update) and returns a
:class:`DrivenLoop`; ``None`` when the loop is not of this form (left to ``roll_loops``).
Rules, all checked on the template step:

* the steps repeat the same operations and the loop's outputs are stacked per step
  (:func:`~gradshard.passes.loop_generic.plan_carried_loop`);
* a *linear state* ``h`` has an update ``cast(A * h_prev + U)`` (``add``/``sub``/``addcmul``;
  ``A`` a tensor that broadcasts to ``h`` without growing it, a number, or 1; ``U`` a tensor
  that broadcasts to ``h``; ``cast`` copies and dtype conversions that keep the shape), where
  ``A`` and ``U`` read no linear state;
* a *driver* is every other carried value; no driver reads a linear state (so the driver
  loop can run first). Values that break a rule move from the linear states to the drivers
  until both rules hold; at least one linear state must remain.

Which value of a linear state the per-step readout needs decides the scan: the updated value
(``xLSTM``: ``h_t = q_t C_t / ...``) reads the scan of ``h``; a readout that reads the value
carried *into* the step (``RWKV``: ``out_t = (e1 num_{t-1} + e2 v_t) / (...)``) reads a scan
shifted by one step (``a_0 = 1, u_0 = 0`` from ``h0``, then ``a_{t-1}``, ``u_{t-1}``), so the
readout stays per step. A loop that carries a running maximum and does not split is refused
(:class:`Refusal`) naming the value that is not linear and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.errors import UnsupportedGraphError

from gradshard.passes.loop_chains import LoopChain
from gradshard.passes.loop_generic import CarriedPlan, plan_carried_loop

aten = torch.ops.aten

__all__ = ["LinearState", "DrivenLoop", "Refusal", "analyse_driven_loop", "COPIES"]

#: Ops that copy a value, possibly to another dtype, keeping its shape.
COPIES = (aten.clone.default, aten.alias.default, aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout,
          aten.contiguous.default)


@dataclass(frozen=True)
class LinearState:
    """One carried value proven ``h_new = cast(core)``, ``core = A * h_prev + sign * U``."""

    index: int  # position among the loop's carried values (CarriedPlan.h_new)
    h_prev: fx.Node  # the value carried into the template step (a node of step 0)
    core: fx.Node  # the template node computing A * h_prev + sign * U
    A: Any  # template node, invariant node, a number, or None (A = 1)
    U: fx.Node  # template node or invariant node
    negate_u: bool  # core = A * h_prev - U


@dataclass(frozen=True)
class DrivenLoop:
    """A loop split into drivers (run as a carried loop) and linear states (scanned together)."""

    plan: CarriedPlan
    drivers: tuple[int, ...]  # positions among the carried values
    states: tuple[LinearState, ...]
    #: linear states whose readout reads the value carried into the step; when any does, the
    #: one packed scan holds every state as carried into each step (the readout recomputes the
    #: updated values it needs from those)
    shifted: frozenset[int]

    @property
    def readout_roots(self) -> list[fx.Node]:
        return [src for _, src, _ in self.plan.outputs]


@dataclass(frozen=True)
class Refusal:
    """Why a loop that carries a running maximum does not split (every plan that rolls one
    carried linear state would refuse it too): the node to name and the reason."""

    node: fx.Node
    why: str


_RUNNING_MAX = (aten.maximum.default, aten.max.other, aten.fmax.default)


def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_copy(n: Any, members: set[fx.Node]) -> bool:
    """A shape-keeping copy or dtype conversion inside the step."""
    if not isinstance(n, fx.Node) or n not in members or n.op != "call_function" or n.target not in COPIES:
        return False
    src = n.args[0] if n.args else None
    if not isinstance(src, fx.Node) or _val(n) is None or _val(src) is None or _val(n).shape != _val(src).shape:
        return False
    if n.target is aten._to_copy.default and set(n.kwargs) - {"dtype"}:
        return False
    return n.target is not aten.to.dtype_layout or set(n.kwargs) <= {"dtype"}


def _strip(n: Any, members: set[fx.Node]) -> Any:
    while _is_copy(n, members):
        n = n.args[0]
    return n


def _broadcasts_into(x: Any, shape: torch.Size) -> bool:
    """``x`` (a tensor node or a number) broadcasts to ``shape`` without growing it."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    v = _val(x)
    if v is None or v.dim() > len(shape) or not v.is_floating_point():
        return False
    try:
        return tuple(torch.broadcast_shapes(tuple(v.shape), tuple(shape))) == tuple(shape)
    except RuntimeError:
        return False


class _Taint:
    """Which template nodes depend on which carried value (as step 1 reads it)."""

    def __init__(self, template: list[fx.Node], h_prev: list[fx.Node]) -> None:
        self.of: dict[fx.Node, set[int]] = {h: {i} for i, h in enumerate(h_prev)}
        for n in template:
            found: set[int] = set(self.of.get(n, ()))
            for a in n.all_input_nodes:
                found |= self.of.get(a, set())
            self.of[n] = found

    def reads(self, x: Any) -> set[int]:
        return set(self.of.get(x, ())) if isinstance(x, fx.Node) else set()


def _linear_form(index: int, h_prev: fx.Node, h_new: fx.Node, members: set[fx.Node],
                 taint: _Taint) -> Optional[LinearState]:
    """``h_new = cast(A * h_prev + sign * U)`` with ``A``, ``U`` not reading ``h_prev``, or None."""
    core = _strip(h_new, members)
    if not isinstance(core, fx.Node) or core not in members or core.op != "call_function":
        return None
    shape = _val(h_prev).shape if _val(h_prev) is not None else None
    cv = _val(core)
    if shape is None or cv is None or cv.shape != shape or len(shape) < 1 or not cv.is_floating_point():
        return None

    def free(x: Any) -> bool:
        return index not in taint.reads(x)

    def factor(m: Any) -> tuple[bool, Any]:
        """``(True, A)`` when ``m = A * h_prev`` (``A = None``: ``m`` is ``h_prev``)."""
        if _strip(m, members) is h_prev:
            return True, None
        if not isinstance(m, fx.Node) or m not in members or m.target not in (aten.mul.Tensor, aten.mul.Scalar):
            return False, None
        p, q = m.args[:2]
        for s, other in ((p, q), (q, p)):
            if _strip(s, members) is h_prev and free(other) and _broadcasts_into(other, shape):
                return True, other
        return False, None

    t = core.target
    if t is aten.addcmul.default and core.kwargs.get("value", 1) == 1:
        U, x, y = core.args[:3]
        for s, other in ((x, y), (y, x)):
            if _strip(s, members) is h_prev and isinstance(U, fx.Node) and free(other) and free(U) \
                    and _broadcasts_into(other, shape) and _broadcasts_into(U, shape):
                return LinearState(index, h_prev, core, other, U, False)
        return None
    if t not in (aten.add.Tensor, aten.sub.Tensor) or core.kwargs.get("alpha", 1) != 1 or len(core.args) != 2:
        return None
    x, y = core.args
    orders = [(x, y)] if t is aten.sub.Tensor else [(x, y), (y, x)]
    for m, U in orders:
        ok, A = factor(m)
        if ok and isinstance(U, fx.Node) and free(U) and _broadcasts_into(U, shape):
            return LinearState(index, h_prev, core, A, U, t is aten.sub.Tensor)
    return None


def _readout_reads_prev(loop_plan: CarriedPlan, state: LinearState, fed: set[fx.Node]) -> bool:
    """Whether the readout needs ``h_prev`` of ``state`` other than through its scanned core."""
    members = set(loop_plan.template)
    stack = [src for _, src, _ in loop_plan.outputs]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen or n in fed:
            continue
        seen.add(n)
        if n is state.h_prev:
            return True
        if n in members:
            stack.extend(n.all_input_nodes)
    return False


def _running_max(plan: CarriedPlan) -> Optional[int]:
    """The position of a carried value computed by an elementwise maximum (under copies), or None."""
    members = set(plan.template)
    for i, h in enumerate(plan.h_new):
        core = _strip(h, members)
        if isinstance(core, fx.Node) and core.target in _RUNNING_MAX:
            return i
    return None


def _split(plan: CarriedPlan, forms: dict[int, LinearState], taint: _Taint) -> tuple[set[int], dict[int, str]]:
    """The linear states that remain once every rule holds, and why each other candidate left."""
    linear = set(forms)
    left: dict[int, str] = {}
    changed = True
    while changed and linear:
        changed = False
        for i in sorted(linear):
            reads = (taint.reads(forms[i].A) | taint.reads(forms[i].U)) & (linear - {i})
            if reads:
                linear.discard(i)
                left[i] = f"its coefficients (A_t, U_t) read `{plan.h_prev[min(reads)].name}`, another carried value"
                changed = True
        for d in range(len(plan.h_new)):
            if d in linear:
                continue
            for i in sorted(taint.reads(plan.h_new[d]) & linear):
                linear.discard(i)
                left[i] = f"`{plan.h_new[d].name}`, a value that is not linear in itself, reads it"
                changed = True
    return linear, left


def analyse_driven_loop(chain: LoopChain) -> DrivenLoop | Refusal | None:
    """The drivers and linear states of ``chain`` (see the module doc). A loop that carries a
    running maximum but does not split gives a :class:`Refusal`; None when the loop carries
    fewer than two values or no maximum (``roll_loops`` rolls or refuses it), or when it is not
    a carried loop at all. ``chain``'s last step must be complete."""
    try:
        plan = plan_carried_loop(chain)
    except UnsupportedGraphError:
        return None
    k = len(plan.h_new)
    if k < 2:
        return None
    members = set(plan.template)
    taint = _Taint(plan.template, plan.h_prev)
    forms = {i: f for i in range(k)
             if (f := _linear_form(i, plan.h_prev[i], plan.h_new[i], members, taint)) is not None}
    linear, left = _split(plan, forms, taint)
    if not linear:
        m = _running_max(plan)
        if m is None:
            return None
        names = ", ".join(f"`{h.name}`" for h in plan.h_new)
        other = next(i for i in range(k) if i != m)
        node = _strip(plan.h_new[other], members)
        reason = left.get(other) or (f"its update (`{node.name}`: {getattr(node.target, '__name__', node.target)}) is "
                                     "not A_t * h_{t-1} + U_t with A_t, U_t free of the loop's linear states")
        return Refusal(node, f"the loop carries {k} values from step to step ({names}), one of them the running "
                       f"maximum `{plan.h_new[m].name}` of a max-stabilised recurrence; the adjoint plans split "
                       "such a loop into the maximum (run step by step) and linear scans of the other values, but "
                       f"`{plan.h_new[other].name}` is not linear: {reason}")
    states = tuple(forms[i] for i in sorted(linear))
    drivers = tuple(d for d in range(k) if d not in linear)
    fed = {*plan.sel_nodes, *(plan.h_prev[d] for d in drivers), *(plan.h_new[d] for d in drivers),
           *(s.core for s in states)}
    shifted = frozenset(s.index for s in states if _readout_reads_prev(plan, s, fed))
    return DrivenLoop(plan, drivers, states, shifted)

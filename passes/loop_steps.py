"""Checking an unrolled loop: its steps are isomorphic and its state update is linear.

:func:`check_isomorphic` compares the ops of every step (arguments as references to this
step, the previous one, or outside values) and matches step 0 against them, which finds
the loop's initial state. :func:`analyse_update` proves the state update is one of the
linear forms the scans run (``A * h + U``, ``addcmul(U, A, h)``, ``h + U``, ``A @ h + U``)
and returns ``A`` and ``U``; anything else is an error naming the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.errors import node_error
from gradshard.pipeline import ancestors

from gradshard.passes.loop_chains import LoopChain

aten = torch.ops.aten

__all__ = ["UNROLLABLE_HINT", "CARRY_HINT", "NONLINEAR_HINT", "Update", "check_isomorphic", "analyse_update"]

#: Advice for a loop no plan can roll (its steps differ, or its values leave it other than
#: stacked per step or after the last step): roll_loops runs in the adjoint and the chunked
#: (seco/spaco) pipelines alike, so only plans that leave loops alone may be recommended.
UNROLLABLE_HINT = ("use plan='none' (plain autograd) or plan='partial_update', and wrap the layer in "
                   "torch.utils.checkpoint to save memory: the adjoint and chunked plans (seco, spaco) "
                   "need every per-step loop rolled first (steps that repeat the same operations, outputs "
                   "stacked per step)")
#: Advice for a loop the chunked plans roll but the adjoint plans cannot (its update is not
#: linear in one state): :func:`gradshard.passes.roll_loops.roll_loops` swaps it in for
#: :data:`UNROLLABLE_HINT` once it has proven the loop rolls as a carried loop.
CARRY_HINT = ("use plan='seco' or plan='spaco' (exact for any state update: they run the loop step by step "
              "within each chunk and carry its values across chunks), or plan='none' / plan='partial_update'")
NONLINEAR_HINT = (
    "the adjoint plans need a state update linear in the state (h_t = a_t * h_{t-1} + u_t or "
    "A_t @ h_{t-1} + u_t with a_t, u_t independent of h); " + UNROLLABLE_HINT
)


def _not_linear(node: fx.Node) -> Exception:
    """The error for an op that applies a non-linear function to a value depending on the state."""
    return node_error(node, "the state update is not linear in the state: this op applies a non-linear or "
                      f"unsupported function ({getattr(node.target, '__name__', node.target)}) to a value that "
                      "depends on the previous state", NONLINEAR_HINT)


# --------------------------------------------------------------------------- step signatures


def _plain(a: Any) -> Any:
    if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return a
    return repr(a)


def _step_signature(chain: LoopChain, t: int, skip: int = 0) -> tuple:
    """Ops of step ``t`` with arguments as references: this step, the previous one (counted
    from its end), outside. ``skip``: leading nodes of the step treated as outside values."""
    nodes = chain.steps[t][skip:]
    outside = set(chain.steps[t][:skip])
    local_t = {m: i for i, m in enumerate(nodes)}
    prev_nodes = chain.steps[t - 1] if t > 0 else []
    prev = {m: i - len(prev_nodes) for i, m in enumerate(prev_nodes)}

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in outside:
                return ("I", a.name)
            s = chain.step_of.get(a)
            if s == t:
                return ("L", local_t[a])
            if s == t - 1:
                return ("P", prev[a])
            if s is not None:
                return ("X", t - s)
            return ("I", a.name)
        return _plain(a)

    sig = []
    for n in nodes:
        if n in chain.sources:
            src, d = chain.sources[n]
            sig.append(("SEL", src.name, d))
            continue
        sig.append((n.op, str(n.target), fx.node.map_aggregate(n.args, ref), fx.node.map_aggregate(dict(n.kwargs), ref)))
    return tuple(sig)


_LINEAR_OPS = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.add.Scalar, aten.addcmul.default,
               aten.matmul.default, aten.bmm.default, aten.mm.default, aten.einsum.default, aten.linear.default,
               aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
               aten.clone.default, aten.neg.default, aten.permute.default, aten.transpose.int}


def _precheck_nonlinear(chain: LoopChain) -> None:
    """Name the first non-linear op on the state chain (a clearer error than non-isomorphism)."""
    if len(chain.steps) < 3:
        return
    prev, cur, nxt = chain.steps[0], set(chain.steps[1]), set(chain.steps[2])
    dep = {a for n in chain.steps[1] for a in n.all_input_nodes if a in set(prev)}
    carried = {n for n in chain.steps[1] if any(u in nxt for u in n.users)}
    anc = ancestors(carried, cur.__contains__)
    for n in chain.steps[1]:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
            if n in anc and n.op == "call_function" and n.target not in _LINEAR_OPS and n not in chain.sources:
                raise _not_linear(n)


def check_isomorphic(chain: LoopChain, *, precheck: bool = True,
                     last_aligned: bool = False) -> tuple[tuple, dict[int, fx.Node], list[fx.Node]]:
    """Signature of steps 1..T-1 (must be equal), the initial values of the carried refs and
    the leading nodes of step 0 that only build the initial state (``zeros_like(x[:, 0])``).

    ``precheck``: first name a non-linear op on the state (the linear roll's clearer error);
    ``last_aligned``: the last step was aligned with the template already (``loop_tail``)."""
    if precheck:
        _precheck_nonlinear(chain)
    ref = _step_signature(chain, 1)
    for t in range(2, len(chain.steps) - (1 if last_aligned else 0)):
        if _step_signature(chain, t) != ref:
            first = chain.steps[t][0]
            raise node_error(first, f"the unrolled loop's step {t} is not isomorphic to step 1 (the loop body "
                             "changes from step to step, or two loops interleave)",
                             "write the loop so every step runs the same operations, or " + UNROLLABLE_HINT)
    nodes0 = chain.steps[0]
    skip = len(nodes0) - len(ref)
    init: dict[int, fx.Node] = {}
    by_name = {n.name: n for n in nodes0[0].graph.nodes}
    if skip < 0:
        raise node_error(nodes0[0], "the first step of the unrolled loop differs from the others",
                         "start the loop from an explicit initial state (e.g. h = zeros) so every step is the same")
    sig0 = _step_signature(chain, 0, skip)
    nodes0 = nodes0[skip:]

    def match(a: Any, b: Any) -> bool:
        if isinstance(b, tuple) and len(b) == 2 and b[0] == "P":
            if isinstance(a, tuple) and len(a) == 2 and a[0] == "I":
                prev = init.get(b[1])
                node = by_name[a[1]]
                if prev is not None and prev is not node:
                    return False
                init[b[1]] = node
                return True
            return False
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(match(x, y) for x, y in zip(a, b))
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(match(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(match(a[k], b[k]) for k in a)
        return a == b

    for i, (s0, s1) in enumerate(zip(sig0, ref)):
        if not match(s0, s1):
            raise node_error(nodes0[i], "the first step of the unrolled loop differs from the others",
                             "start the loop from an explicit initial state (e.g. h = zeros) so every step is the same")
    return ref, init, chain.steps[0][:skip]


# --------------------------------------------------------------------------- linear analysis


@dataclass
class Update:
    """A proven linear update ``h_new = A * h_prev + U`` (``"diagonal"``) or ``A @ h_prev + U``
    (``"dense"``); ``path``: the template nodes that form it."""

    kind: str  # "diagonal" | "dense"
    A: Any  # template node, a number, or None (A = 1)
    U: fx.Node
    path: set[fx.Node]
    transpose_A: bool = False
    vector_state: bool = False


def _einsum_as_matmul(eq: str) -> Optional[tuple[bool, bool]]:
    """``(transpose_A, vector_state)`` if ``einsum(eq, A, h)`` is ``A @ h`` (or ``A^T @ h``)."""
    lhs, _, rhs = eq.replace(" ", "").partition("->")
    parts = lhs.split(",")
    if len(parts) != 2 or not rhs or "..." in eq:
        return None
    sa, sh = parts
    if len(sa) < 2 or len(sh) < 1:
        return None
    for vec in (False, True):
        if vec:
            batch_h, (j,) = sh[:-1], sh[-1:]
            batch_o, (i,) = rhs[:-1], rhs[-1:]
            k = ""
        else:
            if len(sh) < 2 or len(rhs) < 2:
                continue
            batch_h, (j, k) = sh[:-2], sh[-2:]
            batch_o, (i, k2) = rhs[:-2], rhs[-2:]
            if k != k2:
                continue
        batch_a = sa[:-2]
        if batch_a != batch_h or batch_h != batch_o:
            continue
        if sa[-2:] == i + j:
            return False, vec
        if sa[-2:] == j + i:
            return True, vec
    return None


def analyse_update(template: list[fx.Node], h_prev: fx.Node, h_new: fx.Node) -> Update:
    """Prove ``h_new`` is linear in ``h_prev``; return ``A``, ``U`` (see the module doc)."""
    dep: set[fx.Node] = {h_prev}
    for n in template:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    if h_new not in dep:
        raise node_error(h_new, "the loop's carried value does not depend on its previous value", NONLINEAR_HINT)

    def indep(x: Any) -> bool:
        return not isinstance(x, fx.Node) or x not in dep

    n = h_new
    if n.op != "call_function":
        raise _not_linear(n)
    if n.target is aten.addcmul.default and n.kwargs.get("value", 1) == 1:
        U, x, y = n.args[:3]
        if indep(U) and ((x is h_prev and indep(y)) or (y is h_prev and indep(x))):
            return Update("diagonal", y if x is h_prev else x, U, {n})
        raise _not_linear(n)
    if n.target not in (aten.add.Tensor, aten.add.Scalar) or n.kwargs.get("alpha", 1) != 1:
        raise _not_linear(n)
    x, y = n.args[:2]
    M, U = (x, y) if not indep(x) else (y, x)
    if not indep(U) or not isinstance(U, fx.Node):
        raise _not_linear(n)
    if M is h_prev:
        return Update("diagonal", None, U, {n})
    if not isinstance(M, fx.Node) or M.op != "call_function":
        raise _not_linear(n)
    if M.target in (aten.mul.Tensor, aten.mul.Scalar):
        p, q = M.args[:2]
        if p is h_prev and indep(q):
            return Update("diagonal", q, U, {n, M})
        if q is h_prev and indep(p):
            return Update("diagonal", p, U, {n, M})
        raise _not_linear(M)
    if M.target in (aten.matmul.default, aten.bmm.default, aten.mm.default):
        p, q = M.args[:2]
        if q is h_prev and indep(p):
            vec = len(h_prev.meta["val"].shape) < 2 or (len(p.meta["val"].shape) == len(h_prev.meta["val"].shape) + 1)
            return Update("dense", p, U, {n, M}, vector_state=vec)
        raise _not_linear(M)
    if M.target is aten.einsum.default:
        eq, ops = M.args[0], M.args[1]
        if len(ops) == 2 and ops[1] is h_prev and indep(ops[0]):
            form = _einsum_as_matmul(eq)
            if form is not None:
                return Update("dense", ops[0], U, {n, M}, transpose_A=form[0], vector_state=form[1])
        raise _not_linear(M)
    raise _not_linear(M)


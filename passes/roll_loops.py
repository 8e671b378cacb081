"""roll_loops: roll unrolled per-timestep loops back into one scan per loop.

A Python loop ``for t in range(T): h = a[:, t] * h + u[:, t]; ys.append(c[:, t] @ h)``
is captured unrolled: ``T`` isomorphic copies of the step body, chained through ``h``, and a
``stack`` of the per-step outputs. This pass finds each chain, checks the copies are
isomorphic, extracts the body of one step as a small fx graph of
``(x_t..., h_{t-1}, invariants) -> (h_t, y_t...)``, proves the state update is linear in
the state, and rewrites the graph::

    before:  select(a,1,0) -> mul(., h0) -> add(., select(u,1,0)) -> h_1 -> einsum -> y_0 ...
             ... (T copies) ... stack([y_0, ..., y_{T-1}], 1)
    after:   run_rolled_body(producers, a, u, c)         -> (a_seq, u_seq, r_seq)   (vmap over t)
             linear_scan(a_seq, u_seq, h0)             -> h_seq                   (one scan)
             run_rolled_body(readout, h_seq, r_seq)    -> y_seq                   (vmap over t)

A stacked state itself (``hs.append(h)``, readout after the loop) is ``h_seq`` (moved to the
stack dim), with no readout body: the scan's dims reach the readout after the loop.

The linear forms accepted for the state update (``A``, ``U`` not depending on ``h``):
``A * h + U`` (either operand order, ``A`` a tensor or a number), ``addcmul(U, A, h)``,
``h + U`` (``A = 1``), ``A @ h + U`` / ``matmul``/``bmm``/matmul-shaped ``einsum`` (dense).
Anything else that feeds the next state (``tanh(W h + x)``) is an error naming the node,
with ``seco`` or checkpointing suggested. One carried state per loop; the first step must
be isomorphic to the others (its previous state is the loop's initial state).

The rolled bodies hold no sequence length: the rolled program runs at any length. The pass
is linear in the number of graph nodes (T=1000 loops roll in well under a second).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.locality import analyze_time_locality
from gradshard.errors import node_error
from gradshard.pipeline import PassContext, PassResult, graph_pass
from gradshard.ops.rolled_body import RolledBody, run_rolled_body

from gradshard.passes.recurrence_graph import fake_run

aten = torch.ops.aten

__all__ = ["roll_loops", "find_loops", "LoopChain"]

_NONLINEAR_HINT = (
    "gradshard's adjoint plans need a state update linear in the state (h_t = a_t * h_{t-1} + u_t "
    "or A_t @ h_{t-1} + u_t with a_t, u_t independent of h); use plan='seco' (chunked "
    "recomputation works for any recurrence) or wrap the layer in torch.utils.checkpoint"
)


@dataclass
class LoopChain:
    """One unrolled loop: its steps (node lists in graph order) and its outside uses."""

    steps: list[list[fx.Node]]
    step_of: dict[fx.Node, int]
    sources: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)  # select node -> (seq, dim)


# --------------------------------------------------------------------------- finding loops


def _loop_select(node: fx.Node, tl: Any) -> Optional[tuple[fx.Node, int, int]]:
    """``(sequence, time dim, step)`` if ``node`` reads one step of a time-carrying tensor."""
    if node.op != "call_function":
        return None
    if node.target is aten.select.int:
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.name not in tl.info:
            return None
        td = tl.time_dim(src)
        shp = src.meta.get("val").shape if isinstance(src.meta.get("val"), torch.Tensor) else None
        if td is None or shp is None:
            return None
        d = node.args[1] % len(shp)
        if d != td:
            return None
        i = int(node.args[2])
        return src, d, i if i >= 0 else i + int(shp[d])
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.unbind.int:
        ub = node.args[0]
        src = ub.args[0]
        td = tl.time_dim(src) if isinstance(src, fx.Node) and src.name in tl.info else None
        shp = src.meta.get("val").shape
        d = (ub.args[1] if len(ub.args) > 1 else 0) % len(shp)
        if td is None or d != td:
            return None
        return src, d, int(node.args[1])
    return None


def _assign_state_ops_to_their_step(gm: fx.GraphModule, step_of: dict[fx.Node, int],
                                    sources: dict[fx.Node, tuple[fx.Node, int]]) -> None:
    """Move ops on the previous state into the step that uses them (in place on ``step_of``).

    A first guess puts every node in the latest step it reads from, so ``dA * h`` in
    ``h = dA * h + B * x[:, t]`` -- evaluated before ``x[:, t]`` is read -- lands in step
    ``t-1``. A node whose users all sit in the next step (so nothing outside the body reads it)
    moves there. Whatever this decides is still checked by the step isomorphism test, so a
    wrong guess is an error, never a wrong scan.
    """
    for node in reversed(gm.graph.nodes):
        s = step_of.get(node)
        if s is None or node in sources or not node.users:
            continue
        if all(step_of.get(u) == s + 1 for u in node.users):
            step_of[node] = s + 1


def _absorb_initial_state_ops(steps: list[list[fx.Node]], step_of: dict[fx.Node, int], tl: Any) -> None:
    """Pull ops on the initial state into step 0 while step 0 is shorter than step 1.

    In ``h = dA * h + B * x[:, t]`` the first ``dA * h0`` reads no step of the sequence, so it
    is outside the body; it belongs to step 0 when only step 0 uses it. Walks back from step
    0's inputs (nodes without a time dim that step 0 alone uses); ``steps[0]`` keeps graph order.
    """
    first, want = steps[0], len(steps[1])
    changed = True
    while changed and len(first) < want:
        changed = False
        for node in [a for n in first for a in n.all_input_nodes]:
            info = tl.info.get(node.name)
            if (node.op != "call_function" or node in step_of or info is None or info.time_dims
                    or any(step_of.get(u) != 0 for u in node.users) or len(first) >= want):
                continue
            step_of[node] = 0
            first.append(node)
            changed = True
    order = {n: i for i, n in enumerate(first[0].graph.nodes)} if first else {}
    first.sort(key=order.__getitem__)


def find_loops(gm: fx.GraphModule, tl: Any) -> list[LoopChain]:
    """Group the unrolled-loop nodes of ``gm`` into chains (one per loop), steps in order."""
    step_of: dict[fx.Node, int] = {}
    sources: dict[fx.Node, tuple[fx.Node, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        sel = _loop_select(node, tl)
        if sel is not None:
            step_of[node] = sel[2]
            sources[node] = (sel[0], sel[1])
            continue
        if node.target is aten.unbind.int:
            continue
        info = tl.info.get(node.name)
        if info is None or info.time_dims:
            continue
        ins = [step_of[a] for a in node.all_input_nodes if a in step_of]
        if ins:
            step_of[node] = max(ins)
    _assign_state_ops_to_their_step(gm, step_of, sources)
    # connected components of body nodes (edges between body nodes)
    parent: dict[fx.Node, fx.Node] = {n: n for n in step_of}

    def find(x: fx.Node) -> fx.Node:
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in step_of:
        for a in n.all_input_nodes:
            if a in step_of:
                ra, rb = find(a), find(n)
                if ra is not rb:
                    parent[ra] = rb
    comps: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n in step_of:
            comps[find(n)].append(n)
    chains = []
    for nodes in comps.values():
        n_steps = max(step_of[n] for n in nodes) + 1
        if n_steps < 2:
            continue
        steps: list[list[fx.Node]] = [[] for _ in range(n_steps)]
        for n in nodes:
            steps[step_of[n]].append(n)
        if any(not s for s in steps):
            continue
        _absorb_initial_state_ops(steps, step_of, tl)
        # a chain carries a value from step to step; plain per-step maps are not loops over a state
        carried = any(step_of.get(a) == step_of[n] - 1 for n in steps[1] for a in n.all_input_nodes)
        if not carried:
            continue
        chains.append(LoopChain(steps, {n: t for t, ns in enumerate(steps) for n in ns}, {n: sources[n] for n in nodes if n in sources}))
    return chains


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
    anc: set[fx.Node] = set()
    stack = list(carried)
    while stack:
        n = stack.pop()
        if n in anc:
            continue
        anc.add(n)
        stack.extend(a for a in n.all_input_nodes if a in cur)
    for n in chain.steps[1]:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
            if n in anc and n.op == "call_function" and n.target not in _LINEAR_OPS and n not in chain.sources:
                raise node_error(n, "the state update is not linear in the state: this op applies a non-linear or "
                                 f"unsupported function ({getattr(n.target, '__name__', n.target)}) to a value that "
                                 "depends on the previous state", _NONLINEAR_HINT)


def _check_isomorphic(chain: LoopChain) -> tuple[tuple, dict[int, fx.Node], list[fx.Node]]:
    """Signature of steps 1..T-1 (must be equal), the initial values of the carried refs and
    the leading nodes of step 0 that only build the initial state (``zeros_like(x[:, 0])``)."""
    _precheck_nonlinear(chain)
    ref = _step_signature(chain, 1)
    for t in range(2, len(chain.steps)):
        if _step_signature(chain, t) != ref:
            first = chain.steps[t][0]
            raise node_error(first, f"the unrolled loop's step {t} is not isomorphic to step 1 (the loop body "
                             "changes from step to step, or two loops interleave)",
                             "write the loop so every step runs the same operations, or use plan='seco'")
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
class _Update:
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


def _analyse_update(template: list[fx.Node], h_prev: fx.Node, h_new: fx.Node) -> _Update:
    """Prove ``h_new`` is linear in ``h_prev``; return ``A``, ``U`` (see the module doc)."""
    dep: set[fx.Node] = {h_prev}
    for n in template:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    if h_new not in dep:
        raise node_error(h_new, "the loop's carried value does not depend on its previous value", _NONLINEAR_HINT)

    def indep(x: Any) -> bool:
        return not isinstance(x, fx.Node) or x not in dep

    def fail(node: fx.Node) -> Exception:
        return node_error(node, "the state update is not linear in the state: this op applies a "
                          f"non-linear or unsupported function ({getattr(node.target, '__name__', node.target)}) "
                          "to a value that depends on the previous state", _NONLINEAR_HINT)

    n = h_new
    if n.op != "call_function":
        raise fail(n)
    if n.target is aten.addcmul.default and n.kwargs.get("value", 1) == 1:
        U, x, y = n.args[:3]
        if indep(U) and ((x is h_prev and indep(y)) or (y is h_prev and indep(x))):
            return _Update("diagonal", y if x is h_prev else x, U, {n})
        raise fail(n)
    if n.target not in (aten.add.Tensor, aten.add.Scalar) or n.kwargs.get("alpha", 1) != 1:
        raise fail(n)
    x, y = n.args[:2]
    M, U = (x, y) if not indep(x) else (y, x)
    if not indep(U) or not isinstance(U, fx.Node):
        raise fail(n)
    if M is h_prev:
        return _Update("diagonal", None, U, {n})
    if not isinstance(M, fx.Node) or M.op != "call_function":
        raise fail(n)
    if M.target in (aten.mul.Tensor, aten.mul.Scalar):
        p, q = M.args[:2]
        if p is h_prev and indep(q):
            return _Update("diagonal", q, U, {n, M})
        if q is h_prev and indep(p):
            return _Update("diagonal", p, U, {n, M})
        raise fail(M)
    if M.target in (aten.matmul.default, aten.bmm.default, aten.mm.default):
        p, q = M.args[:2]
        if q is h_prev and indep(p):
            vec = len(h_prev.meta["val"].shape) < 2 or (len(p.meta["val"].shape) == len(h_prev.meta["val"].shape) + 1)
            return _Update("dense", p, U, {n, M}, vector_state=vec)
        raise fail(M)
    if M.target is aten.einsum.default:
        eq, ops = M.args[0], M.args[1]
        if len(ops) == 2 and ops[1] is h_prev and indep(ops[0]):
            form = _einsum_as_matmul(eq)
            if form is not None:
                return _Update("dense", ops[0], U, {n, M}, transpose_A=form[0], vector_state=form[1])
        raise fail(M)
    raise fail(M)


# --------------------------------------------------------------------------- body extraction

_LIKE = {aten.zeros_like.default: aten.new_zeros.default, aten.ones_like.default: aten.new_ones.default,
         aten.empty_like.default: aten.new_empty.default}


def _rebuild_initial_state(gm: fx.GraphModule, chain: LoopChain, prefix: list[fx.Node], h_init: fx.Node) -> fx.Node:
    """``zeros_like(x[:, 0])`` built in step 0 -> ``new_zeros(x, shape)`` outside the loop."""
    if h_init not in prefix:
        return h_init
    if h_init.target not in _LIKE and h_init.target not in (aten.new_zeros.default, aten.new_ones.default,
                                                             aten.new_empty.default):
        raise node_error(h_init, "the loop's initial state is computed from the first step's inputs",
                         "start from an explicit initial state (zeros, or a parameter) so every step is the same")
    src = h_init.args[0]
    while isinstance(src, fx.Node) and src in chain.step_of:
        if src in chain.sources:
            src = chain.sources[src][0]
            break
        src = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else None
    if not isinstance(src, fx.Node):
        raise node_error(h_init, "cannot rebuild the loop's initial state outside the loop", "use h = zeros(...)")
    shape = list(h_init.meta["val"].shape)
    target = _LIKE.get(h_init.target, h_init.target)
    with gm.graph.inserting_after(src):
        new = gm.graph.call_function(target, (src, shape))
        new.meta["val"] = fake_run(target, (src, shape))
        new.meta["stack_trace"] = h_init.meta.get("stack_trace")
    return new



def _body_graph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[Any],
                extra: Optional[list] = None) -> fx.GraphModule:
    """A graph of ``nodes`` with ``inputs`` as placeholders returning ``outputs``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        ph = g.placeholder(f"in{i}_{n.name}")
        ph.meta = dict(n.meta)
        env[n] = ph
    for n in nodes:
        if n in env:
            continue
        new = g.node_copy(n, lambda a: env[a])
        env[n] = new
    outs = []
    for o in outputs:
        outs.append(env[o] if isinstance(o, fx.Node) else o)
    for fn in extra or []:
        outs = fn(g, outs)
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g, "LoopBody")


def _ancestors(targets: list[fx.Node], members: set[fx.Node]) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [t for t in targets if t in members]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a in members)
    return [n for n in seen]


def _roll_one(gm: fx.GraphModule, chain: LoopChain, index: int) -> str:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    _, init, prefix = _check_isomorphic(chain)
    template = chain.steps[1]
    prev = chain.steps[0]
    carried = sorted({prev.index(a) - len(prev) for n in template for a in n.all_input_nodes if chain.step_of.get(a) == 0})
    if len(carried) != 1:
        raise node_error(template[0], f"the loop carries {len(carried)} values from step to step; gradshard "
                         "rolls loops that carry one linear state", _NONLINEAR_HINT)
    k = carried[0]
    h_prev_t = prev[k]
    h_new_t = template[k]
    h_init = init[k]
    T = len(chain.steps)
    if prefix:
        h_init = _rebuild_initial_state(gm, chain, prefix, h_init)
    upd = _analyse_update(template, h_prev_t, h_new_t)
    members = set(template)
    dep = {h_prev_t}
    for n in template:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    readout = [n for n in template if n in dep and n not in upd.path]
    for n in readout:
        bad = [a for a in n.all_input_nodes if a in dep and a is not h_new_t and a not in readout]
        if bad:
            raise node_error(n, "the loop's per-step output reads the previous state (h_{t-1}) or the update's "
                             "intermediate values; gradshard needs outputs that read the new state h_t",
                             "compute the outputs from the updated state, or use plan='seco'")
    # ---- uses outside the loop
    stack_outs: dict[int, list[tuple[fx.Node, int, str]]] = defaultdict(list)  # local idx -> (consumer, dim, mode)
    final_uses: dict[int, list[fx.Node]] = defaultdict(list)
    all_body = set(chain.step_of)
    consumers: list[fx.Node] = []
    stack_ok: dict[fx.Node, bool] = {}
    pos_end = {n: i - len(nodes) for nodes in chain.steps for i, n in enumerate(nodes)}
    for t, nodes in enumerate(chain.steps):
        for j0, n in enumerate(nodes):
            j = j0 - len(nodes)  # counted from the end: step 0 may start with extra nodes
            for user in n.users:
                if user in all_body:
                    continue
                if j < -len(template):
                    raise node_error(user, "a value built while setting up the loop's first step is used outside "
                                     "the loop", "build it outside the loop")
                if user.target in (aten.stack.default, aten.cat.default):
                    if user not in stack_ok:  # checked once per stack: linear in T
                        pieces = user.args[0]
                        stack_ok[user] = len(pieces) == T and all(
                            isinstance(p, fx.Node) and chain.step_of.get(p) == s and pos_end.get(p) == j
                            for s, p in enumerate(pieces))
                        if stack_ok[user]:
                            dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
                            stack_outs[j].append((user, dim, "stack" if user.target is aten.stack.default else "cat"))
                            consumers.append(user)
                    if stack_ok[user]:
                        continue
                if t == T - 1:
                    if user not in final_uses[j]:
                        final_uses[j].append(user)
                        consumers.append(user)
                    continue
                raise node_error(user, f"a value of step {t} of an unrolled loop is used outside the loop; "
                                 "gradshard rolls loops whose outputs are stacked per step or taken after the last step",
                                 "collect per-step outputs in a list and torch.stack them, or use plan='seco'")
    if not consumers:
        raise node_error(template[0], "the unrolled loop has no output", "return or stack the loop's outputs")
    # ---- producer body: state-independent values the update and the readout need
    sel_nodes = [n for n in template if n in chain.sources]
    seqs: list[tuple[fx.Node, int]] = []
    for n in sel_nodes:
        key = chain.sources[n]
        if key not in seqs:
            seqs.append(key)
    sel_of_seq = {chain.sources[n]: n for n in sel_nodes}
    invariants: list[fx.Node] = []
    for n in template:
        if n in chain.sources:
            continue  # a step read: becomes a placeholder of the body
        for a in n.all_input_nodes:
            if a not in members and chain.step_of.get(a) is None and a not in invariants and a is not h_prev_t:
                invariants.append(a)
    readout_inputs: list[fx.Node] = []  # non-state template values the readout reads
    for n in readout:
        for a in n.all_input_nodes:
            if a in members and a not in dep and a not in readout_inputs:
                readout_inputs.append(a)
    readout_invariants = [a for n in readout for a in n.all_input_nodes if a not in members and a is not h_prev_t]
    readout_invariants = list(dict.fromkeys(readout_invariants))
    u_val = upd.U.meta["val"]
    h_val = h_new_t.meta["val"]
    prod_targets = [x for x in (upd.A, upd.U) if isinstance(x, fx.Node)] + readout_inputs
    prod_nodes = [n for n in template if n in set(_ancestors(prod_targets, members))]
    prod_inputs = [sel_of_seq[s] for s in seqs] + invariants
    A_node = upd.A

    def shape_fix(g: fx.Graph, outs: list) -> list:
        """Make ``A`` a tensor of U's rank and ``U`` h-shaped (the scan's layout)."""
        A, U = outs[0], outs[1]
        nd = h_val.dim()
        if not isinstance(U, fx.Node):
            raise node_error(h_new_t, "the additive term of the state update is not a tensor", _NONLINEAR_HINT)
        if tuple(u_val.shape) != tuple(h_val.shape):
            U = g.call_function(aten.expand.default, (U, list(h_val.shape)))
        if upd.kind == "diagonal":
            if A is None:
                A = g.call_function(aten.new_ones.default, (U, [1] * nd))
            elif not isinstance(A, fx.Node):
                A = g.call_function(aten.new_full.default, (U, [1] * nd, float(A)))
            want = nd
        else:
            if upd.transpose_A:
                A = g.call_function(aten.transpose.int, (A, -1, -2))
            if upd.vector_state:
                U = g.call_function(aten.unsqueeze.default, (U, -1))
            want = nd + (1 if upd.vector_state else 0)
        if isinstance(A_node, fx.Node):
            shape_a = list(A_node.meta["val"].shape)
            if upd.transpose_A:
                shape_a[-1], shape_a[-2] = shape_a[-2], shape_a[-1]
            if len(shape_a) < want:
                A = g.call_function(aten.reshape.default, (A, [1] * (want - len(shape_a)) + shape_a))
            elif len(shape_a) > want:
                raise node_error(A_node, "the transition broadcasts the state to a larger shape", _NONLINEAR_HINT)
        return [A, U, *outs[2:]]

    prod_gm = _body_graph(prod_nodes, prod_inputs, [A_node if isinstance(A_node, fx.Node) else A_node, upd.U, *readout_inputs],
                          extra=[shape_fix])
    in_dims = [d for _, d in seqs] + [None] * len(invariants)
    n_prod_out = 2 + len(readout_inputs)
    prod_mod = RolledBody(prod_gm, in_dims, [1] * n_prod_out, f"loop {index}: per-step a_t, u_t and readout inputs")
    # ---- readout body: (h_t, readout inputs, invariants) -> per-step outputs
    out_locals = sorted(set(stack_outs) | set(final_uses))
    for j in out_locals:
        node = template[j]
        if node not in readout and node is not h_new_t:
            raise node_error(node, "a state-independent value computed inside the loop is used outside it",
                             "compute it outside the loop")
    ro_outputs: list[tuple[int, fx.Node, int]] = []  # (local idx, template node, out dim)
    for j in out_locals:
        node = template[j]
        for _, dim, mode in stack_outs.get(j, []):
            src = node
            od = dim
            if mode == "cat":
                if node.target is not aten.unsqueeze.default:
                    raise node_error(node, "per-step outputs concatenated along time must be unsqueezed steps",
                                     "use torch.stack(ys, dim)")
                src = node.args[0]
            ro_outputs.append((j, src, od))
        if j in final_uses and node is not h_new_t:
            ro_outputs.append((j, node, 0))
    # normalise negative stack dims to the stacked rank
    norm_outputs = []
    for j, src, od in ro_outputs:
        rank = src.meta["val"].dim() + 1
        norm_outputs.append((j, src, od % rank))
    # a stacked state (``hs.append(h)``) is the scan's output itself: no readout body for it, so
    # the analyses see the scan's dims (state dims, time) on it and a readout after the loop
    # (``einsum(c, stack(hs))``) joins the recurrence region like an in-loop readout does
    body_outputs = [(j, src, od) for j, src, od in norm_outputs if src is not h_new_t]
    ro_nodes = [n for n in template if n in readout]
    ro_mod: Optional[RolledBody] = None
    if body_outputs:
        ro_in = [h_new_t] + readout_inputs + readout_invariants
        ro_gm = _body_graph(ro_nodes, ro_in, [src for _, src, _ in body_outputs])
        ro_mod = RolledBody(ro_gm, [1] + [1] * len(readout_inputs) + [None] * len(readout_invariants),
                            [od for _, _, od in body_outputs], f"loop {index}: per-step readout")
    # ---- emit
    first_consumer = min(consumers, key=lambda c: order[c])
    prefix = f"loop{index}"
    gm.add_submodule(f"{prefix}_producers", prod_mod)
    if ro_mod is not None:
        gm.add_submodule(f"{prefix}_readout", ro_mod)
    trace = h_new_t.meta.get("stack_trace")
    with graph.inserting_before(first_consumer):
        p_attr = graph.get_attr(f"{prefix}_producers")
        p_args = (p_attr, *[s for s, _ in seqs], *invariants)
        p_node = graph.call_function(run_rolled_body, p_args)
        p_node.meta["val"] = fake_run(lambda *a: prod_mod(*a), p_args[1:])
        p_node.meta["stack_trace"] = trace
        getters = []
        for i in range(n_prod_out):
            gi = graph.call_function(operator.getitem, (p_node, i))
            gi.meta["val"] = p_node.meta["val"][i]
            getters.append(gi)
        a_seq, u_seq, r_seqs = getters[0], getters[1], getters[2:]
        h0 = h_init
        if tuple(h_init.meta["val"].shape) != tuple(h_val.shape):
            h0 = graph.call_function(aten.expand.default, (h_init, list(h_val.shape)))
            h0.meta["val"] = fake_run(aten.expand.default, (h_init, list(h_val.shape)))
        if upd.kind == "diagonal":
            scan = graph.call_function(torch.ops.gradshard.linear_scan.default, (a_seq, u_seq, h0, False, None))
        else:
            if upd.vector_state:
                h0 = graph.call_function(aten.unsqueeze.default, (h0, -1))
                h0.meta["val"] = fake_run(aten.unsqueeze.default, (h0.args[0], -1))
            scan = graph.call_function(torch.ops.gradshard.dense_linear_scan.default, (a_seq, u_seq, h0))
        scan.meta["val"] = fake_run(scan.target, scan.args)
        scan.meta["stack_trace"] = trace
        scan.meta["gs_rolled_loop"] = {"steps": T, "form": upd.kind}
        h_seq = scan
        if upd.kind == "dense" and upd.vector_state:
            h_seq = graph.call_function(aten.squeeze.dim, (scan, -1))
            h_seq.meta["val"] = fake_run(aten.squeeze.dim, (scan, -1))
        body_outs: list[fx.Node] = []
        if ro_mod is not None:
            r_attr = graph.get_attr(f"{prefix}_readout")
            r_args = (r_attr, h_seq, *r_seqs, *readout_invariants)
            r_node = graph.call_function(run_rolled_body, r_args)
            r_node.meta["val"] = fake_run(lambda *a: ro_mod(*a), r_args[1:])
            r_node.meta["stack_trace"] = next((n.meta.get("stack_trace") for n in ro_nodes if n.meta.get("stack_trace")),
                                              trace)
            for i in range(len(body_outputs)):
                gi = graph.call_function(operator.getitem, (r_node, i))
                gi.meta["val"] = r_node.meta["val"][i]
                body_outs.append(gi)
        outs = []  # one per entry of norm_outputs
        next_body = iter(body_outs)
        for _, src, od in norm_outputs:
            if src is not h_new_t:
                outs.append(next(next_body))
            elif od == 1:  # the scan's layout: time at dim 1
                outs.append(h_seq)
            else:
                moved = graph.call_function(aten.movedim.int, (h_seq, 1, od))
                moved.meta["val"] = fake_run(aten.movedim.int, (h_seq, 1, od))
                moved.meta["stack_trace"] = trace
                outs.append(moved)
    # ---- rewire consumers
    pos = 0
    for j in out_locals:
        for consumer, dim, mode in stack_outs.get(j, []):
            consumer.replace_all_uses_with(outs[pos])
            graph.erase_node(consumer)
            pos += 1
        if j in final_uses:
            node_last = chain.steps[-1][j]
            seq, dim = (h_seq, 1) if template[j] is h_new_t else (outs[pos], 0)
            with graph.inserting_before(first_consumer):
                last = graph.call_function(aten.select.int, (seq, dim, -1))
                last.meta["val"] = fake_run(aten.select.int, (seq, dim, -1))
            for user in list(final_uses[j]):
                user.replace_input_with(node_last, last)
            if template[j] is not h_new_t:
                pos += 1
    # ---- erase the unrolled steps (users first)
    for n in sorted(chain.step_of, key=lambda x: -order[x]):
        if n.users:
            raise node_error(n, "internal: an unrolled loop node is still used after rolling", "report this")
        graph.erase_node(n)
    # drop unbind nodes left without users
    for n in list(graph.nodes):
        if n.target is aten.unbind.int and not n.users:
            graph.erase_node(n)
    tail = f" -> {prefix}_readout" if ro_mod is not None else ""
    folded = " (the stacked states are the scan's output)" if len(body_outputs) < len(norm_outputs) else ""
    return (f"rolled loop {index}: {T} steps of a {upd.kind} recurrence "
            f"({len(template)} nodes per step) into {prefix}_producers -> {scan.name}{tail}{folded}")


@graph_pass
def roll_loops(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Roll unrolled per-timestep loops into one vectorised scan each (see module doc).

    Needs ``ctx.analyses["time"]``; recomputes it on the rolled graph. Rewrites ``gm`` in place.
    """
    tl = ctx.analyses.get("time")
    if tl is None:
        return PassResult(gm, notes=("no time axis: nothing to roll",))
    chains = find_loops(gm, tl)
    if not chains:
        return PassResult(gm, notes=("no unrolled loops",))
    # Rolled in place: copying and recompiling a graph of T unrolled steps costs more than the
    # rolling itself, and the pass manager already recorded the code before this pass.
    new = gm
    new.graph.owning_module = new  # a shared graph may name another module its owner
    notes = []
    for i, chain in enumerate(chains):
        notes.append(_roll_one(new, chain, i))
    new.graph.lint()
    ctx.invalidate("time")
    ctx.analyses["time"] = analyze_time_locality(new, time_axis=ctx.time_axis)
    return PassResult(new, changed=True, notes=tuple(notes))

"""detect_linear_attention: find causal linear attention, ``o_t = q_t kv_t``,
``kv_t = λ_t kv_{t-1} + k_t^T v_t``, in a captured aten graph (a pure analysis).

Forms recognised (one region per layer):

- ``kernel``: the op ``gradshard::lightning_attention`` (q, k, v, decay are its arguments);
- ``masked``: ``((q @ k^T) ⊙ M) @ v`` with ``M`` causal: a 0/1 ``tril`` (no decay), a constant
  ``λ_h^{i-j}`` mask, or ``exp(c_i - c_j)`` masked with ``c = cumsum(log λ)`` (constant or
  data-dependent gates);
- ``blockwise``: the unrolled "lightning" loop (per block: slices, intra-block masked product,
  inter-block state);
- ``recurrent``: the unrolled per-step loop ``kv = λ kv + k_t^T v_t; o_t = q_t kv`` + ``stack``;
- ``cumsum``: a prefix sum along time (``cumsum(k^T v)`` states of the recurrent form, or a
  normaliser ``cumsum(k)``): linear attention with q = k = 1.

How: :func:`~gradshard.passes.linear_attention_graph.find_components` groups the nodes that
mix time steps into components; a component is a linear-attention region if its output
equals the reference kernel's on random inputs (float64) for some assignment of its
time-carrying inputs to q, k, v (and gates), with the decay read from one of the constant
tensors it depends on (a per-head rate, a log-rate, a mask) or from the gates. This
*certifies* the semantics instead of pattern-matching one implementation: a softmax, a
non-causal mask or a missing decay makes the outputs differ and the component is not
claimed (softmax attention is the ``attention`` detector's). Output normalisation after the
region (TransNormerLLM's ``Norm(o)``) is reported in the region options; it is position-wise.

Results are cached in ``ctx.analyses["linear_attention"]`` (a :class:`LinearAttentionAnalysis`)
for the ``lasp`` rewrite, which also uses the rejected components to explain failures.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from gradshard.analysis.dims import shape_of
from gradshard.analysis.locality import DATA_INDEPENDENT, TimeLocality
from gradshard.ir import Region, source_of
from gradshard.pipeline import PassContext

from gradshard.passes.linear_attention_graph import (
    Component,
    ConstValues,
    classify_nodes,
    evaluate_members,
    find_components,
)
from gradshard.passes.linear_attention_spec import DecaySpec, LaspSpec, decay_spec_for, layout_for, reference_attention

aten = torch.ops.aten

__all__ = ["detect_linear_attention", "analyze_linear_attention", "LinearAttentionAnalysis", "Finding",
           "Rejection", "KIND"]

KIND = "linear_attention"
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
            aten.scaled_dot_product_attention.default}
_LIGHTNING = "gradshard::lightning_attention"
_SCREEN_STEPS = 8
_MAX_DECAY_CANDIDATES = 12
_DETECT_BUDGET = 50_000_000  # elements evaluated per component under plans other than "lasp"


@dataclass(frozen=True)
class Finding:
    """A certified linear-attention region: its component, spec, module inputs and output."""

    component: Component
    spec: LaspSpec
    inputs: tuple[str, ...]  # module inputs in LaspSpec order
    output: str
    region: Region
    decay_value: Optional[torch.Tensor] = field(default=None, compare=False)  # baked canonical decay


@dataclass(frozen=True)
class Rejection:
    """A mixing component that is not linear attention, and why (``node``: where to point)."""

    component: Component
    node: str
    why: str
    kind: str = "unknown"  # softmax_attention | window | reduction | unknown


@dataclass
class LinearAttentionAnalysis:
    gm: fx.GraphModule
    classes: dict[str, str]
    findings: list[Finding] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    dead: list[Component] = field(default_factory=list)


def detect_linear_attention(gm: fx.GraphModule, ctx: PassContext) -> list[Region]:
    """Linear-attention regions of ``gm`` (cumsum-only prefix sums are reported by the rewrite)."""
    analysis = analyze_linear_attention(gm, ctx)
    if analysis is None:
        return []
    return [f.region for f in analysis.findings if f.region.kind == KIND]


def analyze_linear_attention(gm: fx.GraphModule, ctx: PassContext) -> Optional[LinearAttentionAnalysis]:
    """Run (or fetch the cached) analysis of ``gm``; ``None`` without a time axis."""
    cached = ctx.analyses.get(KIND)
    if isinstance(cached, LinearAttentionAnalysis) and cached.gm is gm:
        return cached
    tl: TimeLocality | None = ctx.analyses.get("time")
    if tl is None:
        return None
    classes = classify_nodes(gm, tl)
    analysis = LinearAttentionAnalysis(gm, classes)
    consts = ConstValues(gm, ctx.example_inputs, classes)
    by_name = {n.name: n for n in gm.graph.nodes}
    for comp in find_components(gm, tl, classes):
        if not comp.outputs:
            analysis.dead.append(comp)
            continue
        try:
            result = _classify_component(comp, by_name, tl, consts, strict=ctx.plan == "lasp",
                                         index=len(analysis.findings))
        except Exception as exc:  # noqa: BLE001 - a component we cannot evaluate is not claimed
            result = Rejection(comp, comp.outputs[0], f"could not analyse it ({type(exc).__name__}: {exc})")
        (analysis.findings if isinstance(result, Finding) else analysis.rejections).append(result)
    ctx.analyses[KIND] = analysis
    return analysis


# --------------------------------------------------------------------------- classification


def _classify_component(comp: Component, by_name: dict[str, fx.Node], tl: TimeLocality, consts: ConstValues,
                        *, strict: bool, index: int) -> Finding | Rejection:
    members = [by_name[m] for m in comp.nodes]
    soft = next((n for n in members if n.target in _SOFTMAX), None)
    if soft is not None:
        return Rejection(comp, soft.name, "softmax attention (softmax over the scores): not linear attention",
                         "softmax_attention")
    kernel = next((n for n in members if _qualname(n) == _LIGHTNING), None)
    if kernel is not None:
        return _kernel_finding(comp, kernel, by_name, tl, index)
    if len(comp.outputs) != 1:
        return Rejection(comp, comp.outputs[0], f"it has {len(comp.outputs)} outputs read elsewhere "
                         f"({', '.join(comp.outputs)}); a linear-attention layer has one")
    out = by_name[comp.outputs[0]]
    out_td = tl[out].time_dims
    if len(out_td) != 1:
        return _reject_shape(comp, members, tl)
    if all(n.target is aten.cumsum.default or n.target is operator.getitem for n in members):
        return _cumsum_finding(comp, members, out, by_name, tl, index)
    if not strict and sum(_numel(n) for n in members) > _DETECT_BUDGET:
        return Rejection(comp, out.name, "too large to certify outside plan='lasp' (analysis budget)")
    return _certify(comp, members, out, by_name, tl, consts, index)


def _reject_shape(comp: Component, members: list[fx.Node], tl: TimeLocality) -> Rejection:
    """Explain a component whose output has no (single) time axis or that shifts time."""
    out_name = comp.outputs[0]
    for n in members:
        info = tl[n]
        why = info.why
        if "reduces" in why or "normalises" in why:
            return Rejection(comp, n.name, f"it reduces over the time axis ({why})", "reduction")
    first = members[0]
    return Rejection(comp, first.name, f"its output `{out_name}` does not carry the time axis", "unknown")


def _qualname(node: fx.Node) -> Optional[str]:
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None)


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (tuple, list)):
        return sum(v.numel() for v in val if isinstance(v, torch.Tensor))
    return 0


def _val(node: fx.Node) -> Optional[torch.Tensor]:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


# --------------------------------------------------------------------------- kernel form


def _kernel_finding(comp: Component, op: fx.Node, by_name: dict[str, fx.Node], tl: TimeLocality,
                    index: int) -> Finding | Rejection:
    args = list(op.args) + [None] * (7 - len(op.args))
    q, k, v, decay, s0 = args[:5]
    decay = op.kwargs.get("decay", decay)
    s0 = op.kwargs.get("initial_state", s0)
    outs = {u.args[1]: u for u in op.users if u.target is operator.getitem}
    o = outs.get(0)
    final = outs.get(1)
    if final is not None and final.users:
        user = next(iter(final.users))
        return Rejection(comp, final.name, f"the kernel's final state is used (by `{user.name}`): under "
                         "sequence parallelism a rank only has the state after its own slice", "kernel_state")
    if o is None:
        return Rejection(comp, op.name, "the kernel's output is unused")
    qv, vv, ov = _val(q), _val(v), _val(o)
    b, h, t, dk = qv.shape
    dv = vv.shape[-1]
    ident = layout_for(tuple(qv.shape), 2)
    dspec = DecaySpec()
    inputs = [q.name, k.name, v.name]
    if isinstance(decay, fx.Node):
        dval = _val(decay)
        dspec = decay_spec_for(tuple(dval.shape), tuple(qv.shape), ident,
                               "head" if dval.dim() == 1 else "step", "identity")
        inputs.append(decay.name)
    if isinstance(s0, fx.Node):
        inputs.append(s0.name)
    spec = LaspSpec("kernel", ident, ident, ident, ident, dspec, ov.dtype, h, dk, dv, b,
                    has_initial_state=isinstance(s0, fx.Node))
    return _finding(comp, spec, inputs, o, op, by_name, index)


# --------------------------------------------------------------------------- cumsum form


def _cumsum_finding(comp: Component, members: list[fx.Node], out: fx.Node, by_name: dict[str, fx.Node],
                    tl: TimeLocality, index: int) -> Finding | Rejection:
    scans = [n for n in members if n.target is aten.cumsum.default]
    if len(scans) != 1 or len(comp.inputs) != 1 or scans[0].args[0].name != comp.inputs[0]:
        return Rejection(comp, scans[0].name, "chained prefix sums are not supported")
    scan = scans[0]
    u = by_name[comp.inputs[0]]
    td = tl.time_dim(u)
    uv, ov = _val(u), _val(out)
    if td is None or uv is None or ov is None:
        return Rejection(comp, scan.name, "the summand has no single time axis")
    n = uv.numel() // max(uv.shape[td], 1)
    spec = LaspSpec("cumsum", None, None, None, None, DecaySpec(), ov.dtype, 1, 1, n, 1,
                    scan_dim=td, scan_shape=tuple(uv.shape))
    outer = _outer_product_factors(u)
    kind = KIND if outer is not None else "prefix_sum"
    return _finding(comp, spec, [u.name], out, scan, by_name, index, kind=kind,
                    extra={"k": outer[0], "v": outer[1]} if outer else {})


def _outer_product_factors(u: fx.Node) -> Optional[tuple[str, str]]:
    """``k[..., :, None] * v[..., None, :]`` (or a matmul with a size-1 contraction)."""
    if u.op != "call_function":
        return None
    if u.target is aten.mul.Tensor and all(isinstance(a, fx.Node) for a in u.args[:2]):
        a, b = u.args[:2]
        if (a.target is aten.unsqueeze.default and b.target is aten.unsqueeze.default
                and shape_of(a)[-1] == 1 and shape_of(b)[-2] == 1):
            return a.args[0].name, b.args[0].name
    if u.target in (aten.matmul.default, aten.bmm.default):
        a, b = u.args[:2]
        sa = shape_of(a)
        if sa is not None and sa[-1] == 1:
            return a.name, b.name
    return None


# --------------------------------------------------------------------------- certification


def _certify(comp: Component, members: list[fx.Node], out: fx.Node, by_name: dict[str, fx.Node],
             tl: TimeLocality, consts: ConstValues, index: int) -> Finding | Rejection:
    """Find q, k, v (gates) and a decay for which the component equals the reference kernel."""
    inputs = [by_name[n] for n in comp.inputs]
    ov = _val(out)
    out_layout = layout_for(tuple(ov.shape), tl.time_dim(out)) if ov is not None else None
    if out_layout is None:
        return Rejection(comp, out.name, f"its output has shape {tuple(ov.shape) if ov is not None else '?'}; "
                         "expected (B, H, T, dv), (B, T, H, dv) or (B, T, dv)")
    if len(inputs) not in (3, 4):
        names = ", ".join(f"`{n.name}`" for n in inputs)
        return Rejection(comp, out.name, f"it reads {len(inputs)} time-carrying tensors ({names}); "
                         "linear attention reads q, k, v and optionally per-step gates",
                         "window" if len(inputs) < 3 else "unknown")
    o_canon = _canonical_shape(tuple(ov.shape), out_layout)
    gen = torch.Generator().manual_seed(20240611 + index)
    tried = 0
    for gate in ([None] if len(inputs) == 3 else inputs):
        rest = [n for n in inputs if n is not gate]
        for transform in ((None,) if gate is None else ("exp", "identity")):
            # One evaluation per gate range: the roles below only change the reference.
            env = {x.name: torch.randn(tuple(_val(x).shape), generator=gen, dtype=torch.float64)
                   / math.sqrt(max(_val(x).shape[-1], 1)) for x in rest}
            if gate is not None:
                lo, hi = (-0.7, -0.01) if transform == "exp" else (0.5, 0.99)
                env[gate.name] = lo + (hi - lo) * torch.rand(tuple(_val(gate).shape), generator=gen,
                                                             dtype=torch.float64)
            got = evaluate_members(members, env, consts)[out.name]
            if not isinstance(got, torch.Tensor) or not got.is_floating_point():
                continue
            got = out_layout.to_canonical(got.to(torch.float64))
            for q, k, v in itertools.permutations(rest, 3):
                lay = _layouts(q, k, v, tl)
                if lay is None:
                    continue
                ql, kl, vl = lay
                qc, kc, vc = (_canonical_shape(tuple(_val(x).shape), l) for x, l in zip((q, k, v), lay))
                if qc != kc or qc[:3] != vc[:3] or o_canon != vc:
                    continue
                batch, heads, dk, dv = qc[0], qc[1], qc[3], vc[3]
                q_shape = tuple(_val(q).shape)
                if gate is not None:
                    gspec = decay_spec_for(tuple(_val(gate).shape), q_shape, ql, "step", transform,
                                           src_time_dim=tl.time_dim(gate))
                    options = [(gspec, gate)] if gspec is not None else []
                else:
                    options = _decay_candidates(comp, by_name, consts, q_shape, ql, tl)
                qv, kv_, vv = (l.to_canonical(env[x.name]) for x, l in zip((q, k, v), lay))
                for dspec, src in options:
                    tried += 1
                    src_val = None
                    if src is not None:
                        src_val = env[src.name] if src.name in env else consts.get(src)
                    try:
                        decay = dspec.values(src_val) if dspec.kind != "none" else None
                    except Exception:  # noqa: BLE001 - a candidate whose shape does not fit
                        continue
                    if decay is not None and dspec.kind != "step" and tuple(decay.shape) != (heads,):
                        continue
                    if not _matches(got, qv, kv_, vv, decay):
                        continue
                    baked = None
                    if src is not None and src.name not in env and not _reads_inputs(src):
                        # a decay fixed in the code (a tril mask, a float λ): store it, keep no node
                        if bool((decay == 1).all()):
                            dspec = DecaySpec()
                        else:
                            dspec = DecaySpec(dspec.kind if dspec.kind == "step" else "head", "identity",
                                              heads=heads, canon_shape=tuple(decay.shape), baked=True)
                            baked = decay
                    spec = LaspSpec(_numeric_form(members, tl), ql, kl, vl, out_layout, dspec, ov.dtype,
                                    heads, dk, dv, batch)
                    uses_src = dspec.kind != "none" and not dspec.baked
                    names = [q.name, k.name, v.name] + ([src.name] if uses_src else [])
                    anchor = next((n for n in members if len(tl[n].time_dims) == 2), members[-1])
                    return _finding(comp, spec, names, out, anchor, by_name, index, decay_value=baked)
    why = ("no assignment of its inputs to q, k, v (and gates) with a causal decay reproduces linear "
           f"attention ({tried} tried on random inputs)")
    return Rejection(comp, out.name, why)


def _reads_inputs(node: fx.Node) -> bool:
    """Does ``node`` depend on a graph input (parameter, buffer, data)? Shapes do not count."""
    seen: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "placeholder":
            return True
        if getattr(n.target, "_overloadpacket", None) in DATA_INDEPENDENT:
            continue
        stack.extend(n.all_input_nodes)
    return False


def _layouts(q: fx.Node, k: fx.Node, v: fx.Node, tl: TimeLocality):
    lays = []
    for x in (q, k, v):
        val, td = _val(x), tl.time_dim(x)
        if val is None or td is None or not val.is_floating_point():
            return None
        lay = layout_for(tuple(val.shape), td)
        if lay is None:
            return None
        lays.append(lay)
    return tuple(lays)


def _canonical_shape(shape: tuple[int, ...], layout) -> tuple[int, ...]:
    s = tuple(shape[p] for p in layout.perm)
    return (s[0], 1, *s[1:]) if layout.rank == 3 else s


def _matches(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             decay: Optional[torch.Tensor]) -> bool:
    """Reference equality, screened on the first steps first (causality makes that valid)."""
    if got.shape != v.shape or not torch.isfinite(got).all():
        return False
    s = min(_SCREEN_STEPS, q.shape[2])
    d_small = decay if decay is None or decay.dim() == 1 else decay[..., :s]
    if not _close(got[:, :, :s], reference_attention(q[:, :, :s], k[:, :, :s], v[:, :, :s], d_small)):
        return False
    return s == q.shape[2] or _close(got, reference_attention(q, k, v, decay))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-7, atol=1e-9 * (1.0 + scale)))


def _decay_candidates(comp: Component, by_name: dict[str, fx.Node], consts: ConstValues,
                      q_shape: tuple[int, ...], q_layout, tl: TimeLocality) -> list[tuple[DecaySpec, Any]]:
    """Constant tensors the component depends on that could hold the decay, nearest first.

    Vector-like sources (per head or per step, λ or log λ) come before masks (``M[..., 1, 0]``);
    "no decay" comes last, so a decay that currently equals 1 keeps its dependency.
    """
    seq = q_shape[q_layout.time_dim]
    seen: set[str] = set()
    frontier = [by_name[c] for c in comp.consts]
    ordered: list[fx.Node] = []
    depth = 0
    while frontier and depth < 12 and len(ordered) < 4096:
        nxt = []
        for n in frontier:
            if n.name in seen:
                continue
            seen.add(n.name)
            ordered.append(n)
            nxt.extend(a for a in n.all_input_nodes if a.name not in seen)
        frontier, depth = nxt, depth + 1
    vectors: list[tuple[DecaySpec, Any]] = []
    masks: list[tuple[DecaySpec, Any]] = []
    seen_values: list[torch.Tensor] = []  # equal decays reached by several nodes: keep the nearest
    for n in ordered:
        val = _val(n)
        if val is None or not val.is_floating_point():
            continue
        shape = tuple(val.shape)
        for transform in ("identity", "exp"):
            if len(shape) >= 2 and shape[-1] == seq and shape[-2] == seq and seq >= 2:
                ds = decay_spec_for(shape, q_shape, q_layout, "mask", transform)
                if ds is not None and len(masks) < _MAX_DECAY_CANDIDATES:
                    masks.append((ds, n))
                continue
            step = decay_spec_for(shape, q_shape, q_layout, "step", transform)
            if step is None:
                continue
            value = consts.get(n)
            if value is None:
                continue
            try:
                per_step = step.values(value)
            except Exception:  # noqa: BLE001
                continue
            if not torch.isfinite(per_step).all() or any(
                    v.shape == per_step.shape and torch.equal(v, per_step) for v in seen_values):
                continue
            seen_values.append(per_step)
            if _constant_over_batch_and_time(per_step):
                vectors.append((decay_spec_for(shape, q_shape, q_layout, "head", transform), n))
            else:
                vectors.append((step, n))
    out = vectors[:_MAX_DECAY_CANDIDATES] + masks[:4]
    out.append((DecaySpec(), None))
    return out


def _constant_over_batch_and_time(x: torch.Tensor) -> bool:
    return bool((x == x[:1, :, :1]).all())


def _numeric_form(members: list[fx.Node], tl: TimeLocality) -> str:
    whys = [tl[n].why for n in members]
    if any(w.startswith("loop step") for w in whys):
        return "recurrent"
    if any(w.startswith("concatenates blocks") for w in whys) or sum(
            n.target is aten.slice.Tensor for n in members) >= 3:
        return "blockwise"
    return "masked"


# --------------------------------------------------------------------------- findings


def _finding(comp: Component, spec: LaspSpec, inputs: list[str], out: fx.Node, anchor: fx.Node,
             by_name: dict[str, fx.Node], index: int, *, kind: str = KIND,
             extra: dict[str, Any] | None = None, decay_value: Optional[torch.Tensor] = None) -> Finding:
    elem = 4 if spec.out_dtype.itemsize < 4 else spec.out_dtype.itemsize
    options: dict[str, Any] = {"form": spec.form}
    if spec.form != "cumsum":
        options.update(q=inputs[0], k=inputs[1], v=inputs[2],
                       layout=spec.q.describe(), heads=spec.heads, dk=spec.dk, dv=spec.dv,
                       decay=spec.decay.describe())
        if spec.decay.baked:
            options["decay_source"] = "constant in the code"
        elif spec.decay.kind != "none":
            options["decay_source"] = inputs[3]
    else:
        options.update(summand=inputs[0], **(extra or {}))
    options["state_bytes"] = spec.state_elements() * elem
    norm = _output_norm(out)
    if norm:
        options["output_norm"] = norm
    region = Region(kind=kind, name=f"{kind}_{index}", nodes=comp.nodes, inputs=tuple(inputs),
                    outputs=(out.name,), time_axis=(spec.out.time_dim if spec.out else spec.scan_dim),
                    source=source_of(anchor) or source_of(out), options=options)
    return Finding(comp, spec, tuple(inputs), out.name, region, decay_value)


_VIEWS = {aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default, aten.clone.default, aten.flatten.using_ints}


def _output_norm(out: fx.Node) -> Optional[str]:
    """A normalisation applied (position-wise) to the region output, e.g. TransNormer's Norm(o)."""
    node = out
    for _ in range(6):
        users = [u for u in node.users if u.op == "call_function"]
        if len(users) == 1 and users[0].target in _VIEWS:
            node = users[0]
            continue
        for user in users:
            if user.target in (aten.rms_norm.default, aten.layer_norm.default, aten.group_norm.default):
                return user.target._overloadpacket.__name__
            if user.target is aten.pow.Tensor_Scalar and user.args[1] == 2:
                if any(u.target is aten.mean.dim for u in user.users):
                    return "rms (x * rsqrt(mean(x^2) + eps))"
        return None
    return None

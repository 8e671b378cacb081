"""detect_attention: find softmax attention in a captured aten graph (a pure analysis).

Two forms are recognised, both with grouped-query heads and rotary embeddings upstream:

- ``aten.scaled_dot_product_attention(q, k, v, attn_mask?, is_causal?, scale?, enable_gqa?)``;
- explicit ``softmax(q @ k^T * scale + mask) @ v`` (any chain of scaling, additive mask,
  ``masked_fill`` or ``where`` between the score matmul and the softmax).

For each one the region records where its keys and values come from *before* a GQA head
repeat (``repeat_kv``'s ``unsqueeze -> expand -> reshape`` or ``repeat_interleave(n, 1)``),
which is what a chunked plan keeps as the KV cache, whether the score matrix is causal
(from the time analysis: ``is_causal``, or a constant mask that masks every future step),
and whether RoPE (``cos``/``sin`` of positions) feeds the keys::

    Region(kind="attention", options={"form": "sdpa", "causal": True, "mask": "is_causal",
           "k_cache": "add_2", "v_cache": "transpose_2", "n_rep": 2, "kv_repeat": "interleave",
           "rope": True, "heads": 4, "kv_heads": 2})

Non-causal attention is reported with ``causal=False``: a plan that needs causality raises
(this detector never does; plans that do not care keep working).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from gradshard.ir import Region, source_of
from gradshard.pipeline import PassContext

aten = torch.ops.aten

__all__ = ["detect_attention", "kv_source", "attention_regions"]

_PASS_THROUGH = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten._to_copy.default,
                 aten.to.dtype, aten.to.dtype_layout, aten.detach.default}
_SCORE_CHAIN = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
                aten.div.Scalar, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
                aten.where.ScalarOther, aten.add.Scalar, *_PASS_THROUGH}
_PROB_CHAIN = {aten.dropout.default, aten.type_as.default, *_PASS_THROUGH}
_MATMULS = {aten.matmul.default, aten.bmm.default, aten.einsum.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_TRANSPOSES = {aten.transpose.int, aten.permute.default, aten.t.default}


def _shape(node: Any) -> tuple[int, ...]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _skip(node: fx.Node, ops: set) -> fx.Node:
    while node.op == "call_function" and node.target in ops and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def kv_source(k: fx.Node) -> tuple[fx.Node, int, str, tuple[str, ...]]:
    """``(source, n_rep, style, chain)``: where keys come from before a GQA head repeat.

    ``style``: ``interleave`` (key head h is source head h // n_rep: ``repeat_kv`` and
    ``repeat_interleave(n, dim=1)``), ``tile`` (``repeat(1, n, 1, 1)``: h % kv_heads) or
    ``none``.
    """
    chain: list[str] = []
    node = k
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        chain.append(node.name)
        node = node.args[0]
    t = node.target if node.op == "call_function" else None
    if t in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        exp = _skip(node.args[0], _PASS_THROUGH)
        if exp.op == "call_function" and exp.target is aten.expand.default:
            uns = _skip(exp.args[0], _PASS_THROUGH)
            if uns.op == "call_function" and uns.target is aten.unsqueeze.default and uns.args[1] in (2, -3):
                src = uns.args[0]
                es, ss = _shape(exp), _shape(src)
                if len(ss) == 4 and len(es) == 5 and es[2] > 1:
                    return src, es[2], "interleave", (*chain, node.name, exp.name, uns.name)
    if t is aten.repeat_interleave.self_int:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim in (1, -3) and len(_shape(node)) == 4:
            return node.args[0], int(node.args[1]), "interleave", (*chain, node.name)
    if t is aten.repeat.default and list(node.args[1])[0] == 1 and list(node.args[1])[2:] == [1, 1]:
        return node.args[0], int(node.args[1][1]), "tile", (*chain, node.name)
    return k, 1, "none", ()


def _rotate_half_pattern(node: fx.Node) -> bool:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half = cat(-x2, x1)`` (cached cos/sin)."""
    if node.op != "call_function" or node.target is not aten.add.Tensor:
        return False
    for m in node.args:
        if isinstance(m, fx.Node) and m.op == "call_function" and m.target is aten.mul.Tensor:
            for c in m.args:
                if isinstance(c, fx.Node) and c.op == "call_function" and c.target is aten.cat.default \
                        and any(p.op == "call_function" and p.target is aten.neg.default for p in c.args[0]):
                    return True
    return False


def _has_rope(node: fx.Node, depth: int = 10) -> bool:
    """Rotary embedding on ``node``: the rotate-half pattern, or cos/sin within ``depth`` ops."""
    if _rotate_half_pattern(node):
        return True
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen:
                    continue
                seen.add(a)
                if a.op == "call_function" and a.target in (aten.cos.default, aten.sin.default):
                    return True
                nxt.append(a)
        frontier = nxt
    return False


def _is_causal(tl: Any, node: fx.Node) -> bool:
    info = tl.info.get(node.name)
    return bool(info is not None and info.local is not None and info.local.lo == -math.inf
                and info.local.hi <= 0)


def _kv_options(k: fx.Node, v: fx.Node) -> dict[str, Any]:
    ks, n_rep, style, kchain = kv_source(k)
    vs, n_rep_v, style_v, vchain = kv_source(v)
    if (n_rep, style) != (n_rep_v, style_v):
        ks, vs, n_rep, style, kchain, vchain = k, v, 1, "none", (), ()
    return {"k_cache": ks.name, "v_cache": vs.name, "n_rep": n_rep, "kv_repeat": style,
            "rope": _has_rope(ks), "_chain": (*kchain, *vchain), "_k": ks}


def _heads(node: fx.Node) -> int:
    shp = _shape(node)
    return shp[-3] if len(shp) >= 3 else 1


def _sdpa_region(node: fx.Node, tl: Any, i: int) -> Region:
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    is_causal = bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))
    opts = _kv_options(k, v)
    heads, kv_heads = _heads(q), _heads(opts.pop("_k"))
    if node.kwargs.get("enable_gqa") and heads != kv_heads:
        opts.update(n_rep=heads // kv_heads, kv_repeat="interleave")
    chain = opts.pop("_chain")
    mask_kind = "tensor" if isinstance(mask, fx.Node) else ("is_causal" if is_causal else "none")
    t_axis = tl.time_dim(node) if node.name in tl.info else None
    return Region(
        kind="attention", name=f"attention_{i}", nodes=(node.name, *chain),
        inputs=tuple(a.name for a in (q, k, v, mask) if isinstance(a, fx.Node)), outputs=(node.name,),
        time_axis=t_axis, source=source_of(node),
        options={"form": "sdpa", "causal": _is_causal(tl, node), "mask": mask_kind, **opts,
                 "heads": heads, "kv_heads": kv_heads})


def _explicit_region(sm: fx.Node, tl: Any, i: int) -> Region | None:
    chain: list[str] = [sm.name]
    node = sm.args[0]
    masks: list[str] = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SCORE_CHAIN:
        chain.append(node.name)
        timed = [a for a in node.all_input_nodes if tl.info.get(a.name) is not None and len(tl[a].time_dims) == 2
                 and tl[a].reach is not None]
        masks += [a.name for a in node.all_input_nodes if a not in timed and len(_shape(a)) >= 2]
        if not timed:
            return None
        node = timed[0]
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _MATMULS - {aten.einsum.default}):
        return None
    scores = node
    chain.append(scores.name)
    q, kt = scores.args[0], scores.args[1]
    k = kt.args[0] if kt.op == "call_function" and kt.target in _TRANSPOSES else None
    if k is None:
        return None
    chain.append(kt.name)
    # follow the probabilities to the matmul with v
    users = list(sm.users)
    probs = sm
    while len(users) == 1 and users[0].op == "call_function" and users[0].target in _PROB_CHAIN:
        probs = users[0]
        chain.append(probs.name)
        users = list(probs.users)
    outs = [u for u in users if u.op == "call_function" and u.target in _MATMULS and u.args[0] is probs]
    if len(outs) != 1:
        return None
    out = outs[0]
    v = out.args[1]
    opts = _kv_options(k, v)
    chain += opts.pop("_chain")
    ks = opts.pop("_k")
    return Region(
        kind="attention", name=f"attention_{i}", nodes=(out.name, *chain),
        inputs=tuple(a.name for a in (q, k, v) if isinstance(a, fx.Node)) + tuple(masks), outputs=(out.name,),
        time_axis=tl.time_dim(out) if out.name in tl.info else None, source=source_of(sm),
        options={"form": "explicit", "causal": _is_causal(tl, out) and bool(tl[scores].causal_mask or
                                                                            tl[sm.args[0]].causal_mask),
                 "mask": "tensor" if masks else "none", **opts,
                 "heads": _heads(q), "kv_heads": _heads(ks)})


def attention_regions(gm: fx.GraphModule, tl: Any) -> list[Region]:
    """Every attention in ``gm`` (see module doc); ``tl`` is the time analysis."""
    found: list[Region] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            found.append(_sdpa_region(node, tl, len(found)))
        elif node.target in _SOFTMAX and isinstance(node.args[0], fx.Node) \
                and node.args[0].name in tl.info and len(tl[node.args[0]].time_dims) == 2:
            r = _explicit_region(node, tl, len(found))
            if r is not None:
                found.append(r)
    return found


def detect_attention(gm: fx.GraphModule, ctx: PassContext) -> list[Region]:
    """Attention regions (SDPA and explicit softmax), with their KV sources and causality."""
    tl = ctx.analyses.get("time")
    if tl is None:
        return []
    return attention_regions(gm, tl)

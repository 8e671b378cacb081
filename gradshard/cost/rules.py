"""Per-plan cost rules: one small registry entry per plan.

The probed expressions (fitted to fake-tensor runs of the compiled plan, see
:mod:`gradshard.cost.probe`) already follow each plan's schedule: what it saves, recomputes
and frees. A :class:`PlanRule` adds what one process cannot observe or what a probe size
must respect:

- ``granularity(options)``: probe sequence lengths are multiples of it (a chunk, a shard);
- ``probe_above(options)``: the steady step's probes run above this length (the truncated
  adjoint runs calls its window covers as the exact adjoint: it is priced as longer calls);
- ``symbols``/``defaults``: extra symbols of the plan (LASP's world size ``R``);
- ``per_rank_seq_len``: the length one rank runs (a sequence-parallel rank holds ``T/R``
  tokens): the probes are fitted in ``T`` and then ``T`` is replaced by it;
- ``probe_context(options, seq_len)``: a context manager around each probe's step (SpaCO
  probes keep every chunk: the worst case memory and the full backward);
- ``adjust(ctx)``: rewrite the probed expressions (communication per step, expected values
  of randomised plans);
- ``compile_breaks(options)``: sequence lengths at which the plan's compile (what the first
  call adds to a steady step) changes form; the compile is fitted piece by piece between them.
  SeCO/SpaCO's chunk planner dry-runs ``min(k, 6)`` of the ``k`` chunks
  (:func:`gradshard.plans.chunked.plan.dry_run`), so its cost bends after ``k = 6``; a plan with a
  ``probe_length`` compiles at the probe and serves longer calls from it (gs.cost adds that
  break, ``2 * probe_length``, itself).

Rules come from the plans' semantics in docs/DESIGN.md:

==================  ====================================================================
none                plain autograd: everything saved, as probed
adjoint             layer inputs + state checkpoints at shard boundaries + one shard's
                    working set, as probed (shards of ``shard_size``)
truncated_adjoint   adjoint + the window buffer, as probed above the window
seco                KV cache / state checkpoints + one chunk's graph, as probed
spaco               seco's memory; backward FLOPs of the kept chunks, ``budget/k`` of them in
                    expectation (``k = ceil(T / chunk_size)``)
lasp                per rank: the plan on its ``T/R`` tokens (probed on a single-rank group,
                    where nothing is sent) plus, per middle rank and step, one ``B·H·dk·dv``
                    state per linear-attention layer sent forward and one sent backward,
                    plus the gradient all-reduce (ring: ``2·(R-1)/R·grad_bytes``) when
                    ``reduce_grads``
partial_update      gradients and optimizer state of the trainable slice only; weight-gradient
                    FLOPs of the frozen slices skipped, as probed
==================  ====================================================================

``register_rule`` adds or replaces an entry; plans without one use the ``none`` rule with
the plan's own probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import sympy

from gradshard.cost.fit import T

__all__ = ["PlanRule", "RuleContext", "RULES", "register_rule", "get_rule", "R", "OPTIMIZER_STATES",
           "optimizer_states"]

R = sympy.Symbol("R", positive=True, integer=True)  # world size (ranks of a sequence-parallel group)

# Optimizer state per trainable parameter, in parameter-sized tensors.
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "momentum": 1, "sgd_momentum": 1,
                                    "adagrad": 1, "rmsprop": 1, "lion": 1, "none": 0}


def optimizer_states(optimizer: str | int | float) -> float:
    """State tensors per parameter for ``optimizer`` (a name from :data:`OPTIMIZER_STATES` or a number)."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        return float(optimizer)
    key = str(optimizer).lower()
    if key not in OPTIMIZER_STATES:
        raise KeyError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)} (or pass a number of "
                       "parameter-sized state tensors)")
    return float(OPTIMIZER_STATES[key])


@dataclass(frozen=True)
class RuleContext:
    """What a rule's ``adjust`` sees: options, probed expressions and graph facts."""

    plan: str
    options: Any
    expressions: Mapping[str, sympy.Expr]
    facts: Mapping[str, Any]


def _one(options: Any) -> int:
    return 1


@dataclass(frozen=True)
class PlanRule:
    """How to price one plan (see the module doc)."""

    plan: str
    doc: str
    granularity: Callable[[Any], int] = _one
    symbols: Mapping[str, sympy.Symbol] = field(default_factory=dict)
    defaults: Callable[[Any], dict[str, int]] = lambda options: {}
    per_rank_seq_len: sympy.Expr | None = None
    adjust: Callable[[RuleContext], dict[str, sympy.Expr]] | None = None
    needs: tuple[str, ...] = ()  # graph facts adjust() reads (see gradshard.cost.facts)
    # a context manager factory entered around each probe's step: (options, seq_len) -> cm
    probe_context: Callable[[Any, int], Any] | None = None
    # lengths at which the compile (what a first call adds) changes form: its cost is fitted
    # piece by piece between them (a plan's probe-first length is added by gs.cost itself)
    compile_breaks: Callable[[Any], tuple[int, ...]] = lambda options: ()
    # the steady step's probes run at lengths above this: a plan whose step takes another form on
    # calls up to it is priced in the form of the longer calls there (an overestimate)
    probe_above: Callable[[Any], int] = lambda options: 0


RULES: dict[str, PlanRule] = {}


def register_rule(rule: PlanRule) -> PlanRule:
    RULES[rule.plan] = rule
    return rule


def get_rule(plan: str) -> PlanRule:
    """The rule of ``plan`` (plans without one are priced like ``none``: as probed)."""
    return RULES.get(plan) or PlanRule(plan=plan, doc="as probed (no plan-specific rule)")


def _opt(options: Any, name: str, default: Any = None) -> Any:
    return getattr(options, name, default)


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        if x:
            out = out * int(x) // math.gcd(out, int(x))
    return out


register_rule(PlanRule("none", "plain autograd: every saved activation, as probed"))
register_rule(PlanRule(
    "adjoint", "layer inputs + state checkpoints at shard boundaries + one shard's working set, as probed",
    granularity=lambda o: _opt(o, "shard_size", 1)))
register_rule(PlanRule(
    "truncated_adjoint", "adjoint + the window buffer, as probed (calls longer than the window; a call the "
    "window covers runs the exact adjoint, without the window's buffers or correction: priced as a longer one)",
    granularity=lambda o: _lcm(_opt(o, "shard_size", 1), min(_opt(o, "window", 1), _opt(o, "shard_size", 1))),
    probe_above=lambda o: _opt(o, "window", 0)))
#: The chunk planner's dry run evaluates at most this many chunks (first three, middle, last two).
CHUNK_DRY_RUN_SAMPLES = 6


def _chunk_compile_breaks(options: Any) -> tuple[int, ...]:
    """Up to ``SAMPLES * chunk`` steps the dry run evaluates every chunk; beyond, six of them."""
    return (CHUNK_DRY_RUN_SAMPLES * _opt(options, "chunk_size", 1),)


register_rule(PlanRule(
    "seco", "KV cache / state checkpoints + one chunk's graph, as probed",
    granularity=lambda o: _opt(o, "chunk_size", 1), compile_breaks=_chunk_compile_breaks))
register_rule(PlanRule(
    "partial_update", "gradients and optimizer state of the trainable slice only, as probed"))


def _spaco_all_chunks(options: Any, seq_len: int) -> Any:
    from gradshard.plans.chunked.runtime import force_selection

    return force_selection(range(-(-seq_len // options.chunk_size)))


def _spaco_adjust(ctx: RuleContext) -> dict[str, sympy.Expr]:
    """Expected backward FLOPs: each of the ``k`` chunks runs its backward with probability ``q``.

    Bernoulli sampling keeps a chunk with ``q = min(1, budget/k)``; fixed sampling keeps
    ``budget`` of ``k`` uniformly, each chunk again with probability ``budget/k``. The
    probes kept every chunk, so the expectation is ``q`` times the probed backward; memory
    stays the worst case (every chunk kept), which is what must fit.
    """
    o = ctx.options
    k = sympy.ceiling(T / o.chunk_size)
    q = sympy.Min(1, sympy.Integer(o.budget) / k)
    return {"flops_bwd": q * ctx.expressions["flops_bwd"]}


register_rule(PlanRule(
    "spaco", "seco's memory (every chunk kept: the worst case); backward FLOPs of budget/k of the chunks "
    "in expectation", granularity=lambda o: _opt(o, "chunk_size", 1), probe_context=_spaco_all_chunks,
    adjust=_spaco_adjust, compile_breaks=_chunk_compile_breaks))


def _lasp_adjust(ctx: RuleContext) -> dict[str, sympy.Expr]:
    """Per-rank costs at ``T/R`` plus the KV-state relay and the gradient all-reduce.

    The probes ran on a single-rank group, where nothing is received and the gradient
    all-reduce is skipped. On ``R > 1`` ranks a middle rank also combines the received
    state into its outputs and gradients (FLOPs below), and the all-reduce flattens every
    gradient into buckets that become the ``.grad`` tensors while the engine still holds the
    gradients it produced: ``2·grad_bytes`` live at the end of the backward.
    """
    state = ctx.facts["linear_attention_state_bytes"]  # sum over layers of B*H*dk*dv*bytes
    relay = 2 * state  # forward KV to rank+1, backward dKV to rank-1
    # A middle rank combines the states it receives with its local results, one
    # (T/R x dk) @ (dk x dv) product per head each (2·(T/R)·B·H·dk·dv FLOPs), as
    # gradshard.plans.lasp.runtime runs them: forward q S; backward do S^T, v D^T and k D.
    # (Per-step decay gradients add up to two more products; they are not counted.)
    one = sympy.Piecewise((2 * (T / R) * ctx.facts["linear_attention_state_elements"], R > 1), (0, True))
    out: dict[str, sympy.Expr] = {"flops_fwd": ctx.expressions["flops_fwd"] + one,
                                  "flops_bwd": ctx.expressions["flops_bwd"] + 3 * one}
    if _opt(ctx.options, "reduce_grads", True):
        grads = ctx.expressions["grad_bytes"]
        out["comm_bytes"] = relay + 2 * (R - 1) / R * grads
        out["peak_bytes"] = sympy.Max(ctx.expressions["peak_bytes"],
                                      sympy.Piecewise((2 * grads, R > 1), (0, True)))
    else:
        out["comm_bytes"] = relay
    return out


register_rule(PlanRule(
    "lasp", "per rank: the plan on T/R tokens (probed on one rank) + one B*H*dk*dv state per layer and "
    "direction + grad all-reduce", symbols={"world_size": R}, defaults=lambda o: {"world_size": 2},
    per_rank_seq_len=T / R, adjust=_lasp_adjust,
    needs=("linear_attention_state_bytes", "linear_attention_state_elements")))

"""plan="lasp": sequence parallelism for linear attention (Sun et al., "Linear Attention
Sequence Parallelism"), exact gradients.

User contract (works unchanged under ``torchrun``):

* every rank of the sequence-parallel ``group`` builds the same model and calls the compiled
  module with its **local, contiguous slice** of the sequence — ``input_ids[:, start:stop]``
  with the ranks in sequence order (:func:`gradshard.plans.lasp.runtime.local_slice` gives the
  standard split; slices may differ in length). Inputs are batch-first: the time axis is
  dim 1 of the first tensor input unless ``time_axis=(input_index, dim)`` says otherwise;
* gradshard offsets positions built with ``torch.arange`` over the sequence by the rank's
  first step (learned/rotary position ids come out global); position ids passed as inputs
  must be sliced like the tokens; labels too (shift them on the full sequence first);
* the module returns this rank's slice of every per-token output; a loss computed *inside*
  the compiled function (a sum or a mean over tokens) is returned as this rank's **share**:
  the full-sequence loss is the SUM of the per-rank values (a mean is divided by the global
  token count). For a loss computed outside, use the same convention:
  ``loss = gradshard.runtime.reduce.global_mean(token_losses.sum(), n_local, group)``;
* after ``backward`` every rank's ``.grad`` equals the full-sequence gradient: the
  parameters enter the graph through an identity whose backward SUM-all-reduces their
  gradients once per backward (``reduce_grads=True``). With ``reduce_grads=False`` each rank
  keeps its partial gradient (for DDP/FSDP over a data-parallel group: the data-sequence
  hybrid, sequence-parallel size dividing the world size).

``group=None`` uses the default world group when ``torch.distributed`` is initialised and
otherwise a single-rank group (``gradshard show`` outside ``torchrun``: the send/recv stages
are listed with "no peer"). All communication has timeouts (``timeout_s``, default
``GRADSHARD_COMM_TIMEOUT_S`` or 60 s): a dead or failing peer raises ``CommTimeoutError``.
Message tags: layer ``i`` uses ``2i`` (KV) and ``2i + 1`` (dKV) on the group; do not run two
LASP-compiled modules on the same group in one step. Compiling is collective: the first
call with a new input signature captures and compiles on every rank, and the ranks exchange
their local lengths (and check they compiled the same program), so all ranks must make that
call together. After compile, ``cm.lasp`` holds this rank's place (``start``, ``stop``,
``seq_len``, ``lengths``) and the layers.

Time-locality outside the regions: position-wise layers need nothing; short causal windows
(token shift, causal ``conv1d``) get a halo exchange of their last ``w-1`` steps; other
time mixing (softmax attention, non-causal products, other recurrences, position-dependent
constants) is an error naming the node. Limitation: Python arithmetic on the sequence
length (``x / x.shape[1]``) is baked in at the local length; reduce with ``sum``/``mean``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from gradshard.passes.annotate_time import annotate_time_locality
from gradshard.passes.check_mutations import refuse_unordered_mutations
from gradshard.passes.detect_regions import detect_regions
from gradshard.errors import GradshardError
from gradshard.ir import is_call_input
from gradshard.pipeline import PassContext
from gradshard.plans.lasp.group import exchange_lengths, resolve_group
from gradshard.plans.lasp.rewrite import rewrite_lasp
from gradshard.plans.registry import register_plan


def join_lasp_group(gm: fx.GraphModule, ctx: PassContext) -> tuple[str, ...]:
    """Fix the time axis and learn every rank's place in the sequence (collective).

    The time axis defaults to dim 1 of the first tensor input (LASP inputs are batch-first):
    inferring it from the graph can pick another axis when sizes coincide (a local length
    equal to the head dim); ``time_axis=`` overrides. The ranks then exchange their local
    lengths (:func:`~gradshard.plans.lasp.group.exchange_lengths`); the group, with this
    rank's slice, is left in ``ctx.plan_state["lasp_group"]`` for ``rewrite_lasp``.
    """
    notes: list[str] = []
    phs = list(gm.graph.find_nodes(op="placeholder"))
    users = [p for p in phs if is_call_input(p, untagged=False)]
    if ctx.time_axis is None and users and getattr(users[0].meta.get("val"), "ndim", 0) >= 2:
        ctx.time_axis = (0, 1)
        notes.append("time axis: dim 1 of the first input (LASP default)")
    index, dim = ctx.time_axis if ctx.time_axis is not None else (0, 1)
    val = users[index].meta.get("val") if index < len(users) else None
    if val is None or not hasattr(val, "shape") or val.ndim <= dim:
        raise GradshardError(
            f"plan 'lasp' needs the sequence axis of a tensor input: input {index} has no dim {dim}. "
            "Pass the tokens batch-first (batch, time, ...) as the first tensor input, or "
            "time_axis=(input_index, dim)")
    opts = ctx.options
    group = exchange_lengths(resolve_group(opts.group, opts.timeout_s), int(val.shape[dim]))
    ctx.plan_state["lasp_group"] = group
    notes.append(group.describe())
    return tuple(notes)


PASSES = (
    # (join_lasp_group, the plan's prepare step, has fixed the time-axis hint that the
    # analysis reads and this rank's slice of the sequence before these passes run.)
    # First: the rewrite cuts the graph along its data flow (see the chunked plans' list).
    refuse_unordered_mutations,
    annotate_time_locality,
    # Detection needs ctx.analyses["time"]; it caches the linear-attention analysis
    # (components, certified specs, rejections) that the rewrite consumes.
    detect_regions,
    # Last: replaces regions, offsets positions, turns reductions into shares, inserts
    # the gradient all-reduce. The ranks' compile-time handshake runs after the pipeline
    # (`gs_attach`), not inside a pass.
    rewrite_lasp,
)


@register_plan("lasp", passes=PASSES, prepare=join_lasp_group,
               gradient="exact (full-sequence gradient on every rank)",
               doc="Sequence parallelism for linear attention: KV states passed rank to rank (LASP).")
@dataclass(frozen=True)
class LaspOptions:
    group: Any = field(default=None, compare=False)
    chunk_size: int = 64
    reduce_grads: bool = True
    timeout_s: float | None = None  # per wait; None: GRADSHARD_COMM_TIMEOUT_S (default 60 s)

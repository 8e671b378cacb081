"""plan="lasp": sequence parallelism for linear attention (Sun et al., "Linear Attention
Sequence Parallelism"), exact gradients.

User contract (works unchanged under ``torchrun``):

* every rank of the sequence-parallel ``group`` builds the same model and calls the compiled
  module with its **local, contiguous slice** of the sequence — ``input_ids[:, start:stop]``
  with the ranks in sequence order (:func:`gradshard.runtime.lasp.local_slice` gives the
  standard split; slices may differ in length). Inputs are batch-first: the time axis is
  dim 1 of the first tensor input unless ``time_axis=(input_index, dim)`` says otherwise;
* gradshard offsets positions built with ``torch.arange`` over the sequence by the rank's
  first step (learned/rotary position ids come out global); position ids passed as inputs
  must be sliced like the tokens; labels too (shift them on the full sequence first);
* the module returns this rank's slice of every per-token output; a loss computed *inside*
  the compiled function (a sum or a mean over tokens) is returned as this rank's **share**:
  the full-sequence loss is the SUM of the per-rank values (a mean is divided by the global
  token count). For a loss computed outside, use the same convention:
  ``loss = gradshard.distributed.reduce.global_mean(token_losses.sum(), n_local, group)``;
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

import torch.fx as fx

from gradshard.pipeline import PassContext, PassResult, graph_pass
from gradshard.plans import LaspOptions, PlanSpec, register_plan


@graph_pass
def set_lasp_time_axis(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Default the time axis to dim 1 of the first tensor input (LASP inputs are batch-first).

    Inferring it from the graph can pick another axis when sizes coincide (a local length
    equal to the head dim); the LASP contract fixes it instead. ``time_axis=`` overrides.
    """
    if ctx.time_axis is not None:
        return PassResult(gm)
    names = [p.meta.get("gs_input_name", "") for p in gm.graph.find_nodes(op="placeholder")]
    users = [p for p, n in zip(gm.graph.find_nodes(op="placeholder"), names) if str(n).startswith("input")]
    if users:
        val = users[0].meta.get("val")
        if val is not None and val.dim() >= 2:
            ctx.time_axis = (0, 1)
            return PassResult(gm, notes=("time axis: dim 1 of the first input (LASP default)",))
    return PassResult(gm)


register_plan(PlanSpec(
    name="lasp",
    options=LaspOptions,
    passes=(
        # Must run before annotate_time: it only sets the time-axis hint that analysis reads.
        "plan_lasp:set_lasp_time_axis",
        "annotate_time:annotate_time_locality",
        # Detection needs ctx.analyses["time"]; it caches the linear-attention analysis
        # (components, certified specs, rejections) that the rewrite consumes.
        "detect_regions:detect_regions",
        # Last: replaces regions, offsets positions, turns reductions into shares, inserts
        # the gradient all-reduce, and runs the compile-time handshake with the other ranks.
        "rewrite_lasp:rewrite_lasp",
    ),
    gradient="exact (full-sequence gradient on every rank)",
    doc="Sequence parallelism for linear attention: KV states passed rank to rank (LASP).",
))

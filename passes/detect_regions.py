"""detect_regions: run every registered region detector, then cover what none claimed.

Detectors are plain functions ``(gm, ctx) -> list[Region]``, one per module that knows one
kind of region; :data:`DETECTORS` lists them in the order they run (recurrences, attention,
linear attention), and :func:`register_detector` adds one more (a plugin's detector runs
after the built-in ones). Nodes that read unboundedly far along
time but that no detector claimed become ``time_mixer`` regions, so nothing that grows
with sequence length goes unreported.
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from gradshard.errors import GradshardError, first_line, summary
from gradshard.ir import Region, source_of
from gradshard.passes.detect_attention import detect_attention
from gradshard.passes.detect_linear_attention import KIND as LINEAR_ATTENTION
from gradshard.passes.detect_linear_attention import detect_linear_attention
from gradshard.passes.detect_recurrence import detect_linear_recurrences
from gradshard.pipeline import PassContext, PassResult, graph_pass

Detector = Callable[[fx.GraphModule, PassContext], list[Region]]
DETECTORS: dict[str, Detector] = {
    "linear_recurrence": detect_linear_recurrences,
    "attention": detect_attention,
    LINEAR_ATTENTION: detect_linear_attention,
}

__all__ = ["register_detector", "detect_regions", "DETECTORS"]


def register_detector(name: str) -> Callable[[Detector], Detector]:
    """Register a region detector under ``name`` (detectors run in registration order)."""

    def deco(fn: Detector) -> Detector:
        if name in DETECTORS:
            raise GradshardError(f"a region detector named {name!r} is already registered")
        DETECTORS[name] = fn
        return fn

    return deco


@graph_pass
def detect_regions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Find the regions whose memory grows with sequence length (analysis only)."""
    tl = ctx.analyses.get("time")
    found: list[Region] = []
    notes: list[str] = []
    for name, detector in DETECTORS.items():
        try:
            found.extend(detector(gm, ctx))
        except GradshardError as exc:
            # A refusal: it matters to the plans that rewrite regions; the others (`none`,
            # `partial_update`) run without them and say why in their notes.
            if ctx.strict:
                raise
            notes.append(f"detector {name} refused: {first_line(exc)}")
        except Exception as exc:
            raise GradshardError(
                f"internal error in region detector {name!r}: {summary(exc)}\n"
                "  instead: please report this graph (`gradshard show` prints it); no plan can run "
                "until the detector is fixed") from exc
    if tl is not None:
        claimed = {n for r in found for n in r.nodes}
        nodes = {n.name: n for n in gm.graph.nodes}
        for i, name in enumerate(n for n in tl.non_local_nodes() if n not in claimed and tl[n].time_dims):
            node = nodes[name]
            info = tl[name]
            found.append(Region(
                kind="time_mixer", name=f"time_mixer_{i}", nodes=(name,),
                inputs=tuple(a.name for a in node.all_input_nodes), outputs=(name,),
                time_axis=info.time_dims[0] if info.time_dims else None, source=source_of(node),
                options={"reach": str(info.reach), "why": info.why},
            ))
    return PassResult(gm, regions=tuple(found), notes=tuple(notes))

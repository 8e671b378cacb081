"""Capture: turn a model or function into one aten-level fx graph, traced on fake tensors.

``trace`` holds the front doors (Python tracing, torch.fx, Dynamo) and the guards;
``canonical`` removes capture artefacts (empty cat pieces, no-op casts) and turns a fresh
tensor filled step by step (``out[:, t] = y_t``) into a stack (``step_writes``); ``mutations``
turns in-place buffer updates into graph outputs; ``substitutions`` swaps fused
third-party kernels for traceable twins (``twins_mamba``) while tracing.
"""

from __future__ import annotations

from gradshard.capture.trace import (
    FRONTENDS,
    Captured,
    GradshardTracer,
    capture,
    capture_graph_module,
    flatten_output,
    guard_key,
    register_leaf_module,
    state_key,
)

__all__ = ["Captured", "capture", "capture_graph_module", "flatten_output", "GradshardTracer", "FRONTENDS", "guard_key",
           "state_key", "register_leaf_module"]

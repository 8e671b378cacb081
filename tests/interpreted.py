"""Run a test file again in a child pytest process under the Triton interpreter.

Triton chooses between the interpreter and the compiler when a ``@triton.jit`` function is
defined (at import), so tests of the Triton kernels on CPU run in a fresh process started with
``TRITON_INTERPRET=1``; the parent test only launches it and reports its output.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def run_under_interpreter(path: str, timeout_s: float = 280.0, markexpr: str = "") -> None:
    """Run the tests in ``path`` with TRITON_INTERPRET=1 (those ``markexpr`` selects, as the parent's
    ``-m``); fail with their output if any fails."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", path, "-x", "-q", "-p", "no:cacheprovider", *(["-m", markexpr] if markexpr else [])]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]

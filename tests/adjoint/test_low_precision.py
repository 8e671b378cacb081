"""Every plan trains in bfloat16 and float16 (issue 20): at T = 4096, on a recurrent and an
attention model, its gradient error against float64 is no worse than eager autograd's in the
same dtype (up to rounding-order noise). The numbers are in bench/RESULTS.md ("Low precision").

The default suite runs two cells (adjoint on the SSM in bf16, seco on Llama in fp16);
``-m slow`` runs the whole plan x dtype x model matrix of ``bench/bench_low_precision.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.bench_modules import load_bench

bench = load_bench("bench_low_precision")

T = 4096
#: Rounding happens in a different order than eager's (scans accumulate in float32, chunks
#: recompute): a plan may land on either side of eager. Measured worst ratio 1.26 (fp16 SSM).
SLACK = 1.5
DTYPES = [torch.bfloat16, torch.float16]


def _check(rows: list[dict]) -> None:
    eager = rows[0]["error"]
    # eager's own bf16 error at T=4096 is large (0.51 on the SSM, 0.78 on Llama: long sums in
    # bfloat16); the contract is "no worse than that", and finite.
    assert rows[0]["run"] == "eager" and eager < float("inf"), rows[0]
    for row in rows[1:]:
        err = row["error"]
        assert not isinstance(err, str), row
        assert err <= SLACK * eager + 1e-4, (row, eager)


@pytest.mark.parametrize("model, plan, dtype", [("ssm", "adjoint", torch.bfloat16), ("llama", "seco", torch.float16)],
                         ids=["ssm-adjoint-bf16", "llama-seco-fp16"])
def test_plan_gradients_in_low_precision_are_as_good_as_eager(model: str, plan: str, dtype: torch.dtype) -> None:
    _check(bench.measure(model, dtype, T, [plan], d_model=32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("model", ["ssm", "llama"])
def test_every_plan_in_low_precision_is_as_good_as_eager(model: str, dtype: torch.dtype) -> None:
    plans = [p for p in bench.PLAN_OPTIONS if p != "partial_update" or model == "llama"]
    _check(bench.measure(model, dtype, T, plans))

#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA device and torch + triton installed
# (no network needed): the Triton kernels and every plan tested on the device, the kernel
# roofline table, and the Inductor composition table. Each part has its own time limit, so a
# slow part cannot starve the next; logs and the updated RESULTS.md land in OUTDIR.
#
#   bash bench/run_gpu.sh OUTDIR
set -u
OUT=${1:?usage: bash bench/run_gpu.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi -L
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

echo "== tests on the device"
timeout 150 $PY -m pytest -q -p no:cacheprovider -rs -s tests/kernels/test_kernel_triton_interp.py \
  tests/kernels/test_cuda_plans.py 2>&1 | tee "$OUT/tests.log" | grep -Ev "^DEBUG" | tail -40

echo "== kernels"
timeout 110 $PY bench/bench_kernels.py --results --reps 10 --no-peers 2>&1 | tee "$OUT/kernels.log" | tail -45

echo "== compose"
timeout 230 $PY bench/bench_compose.py --device cuda --models ssm,mingru,hf_llama --seq-lens 4k,16k \
  --methods eager,compile,compile_budget,gs_adjoint,gs_adjoint_eager,gs_seco,gs_seco_eager --repeat 5 \
  2>&1 | tee "$OUT/compose.log" | grep -E "^(ssm|mingru|hf_llama) |Error|error" | tail -40

cp bench/RESULTS.md "$OUT/RESULTS.md"
cp bench/out/*.json "$OUT/" 2>/dev/null
exit 0

#!/usr/bin/env bash
# The GPU checks, in one call: the kernel tests compiled on CUDA, the decode-kernel bandwidth
# against a device-to-device copy, greedy parity with HF with the engine on CUDA, then end-to-end
# throughput.
# Usage (from the repo root): benchmarks/gpu_check.sh [SMOLLM2_FILES]
#   PY=... picks the interpreter (default: the repo's .venv if present, else python3).
#   SMOLLM2_FILES: a folder with the default model's config.json and tokenizer files. Where given
#   (a GPU machine that cannot receive the 98 MB GGUF), a random-weight model of that shape stands
#   in for the default model in the parity tests and the throughput run.
# Exits 0 with a message where CUDA is unavailable; else non-zero if any step failed (every step
# still runs).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: CUDA is not available to $PY; nothing to check here (the kernel tests run on the CPU under pytest)."
    exit 0
fi
# A fresh GPU machine has torch and triton but not this project: install it in place, without deps.
if ! "$PY" -c 'import localpaged.kernels' 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: could not install the project"; exit 1; }
fi
"$PY" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")'

model_args=()
if [ -n "${1:-}" ]; then
    export LOCALPAGED_TEST_MODEL_FOLDER=/tmp/smollm2-random
    "$PY" benchmarks/random_model.py "$1" "$LOCALPAGED_TEST_MODEL_FOLDER" || exit 1
    model_args=(--model "$LOCALPAGED_TEST_MODEL_FOLDER")
fi

status=0
step() { echo; echo "== $*"; "$@" || { echo "gpu_check: FAILED: $*"; status=1; }; }
step "$PY" -m pytest tests/kernels -q -p no:cacheprovider
step "$PY" benchmarks/kernel_bench.py
# Greedy parity with HF (fp32) with the engine on CUDA: Triton kernels and CUDA graphs end to end.
step env LOCALPAGED_TEST_DEVICE=cuda "$PY" -m pytest tests/engine/test_parity.py tests/engine/test_requests.py \
    tests/engine/test_prefix_cache.py tests/engine/test_cuda_graphs.py -q -p no:cacheprovider
step "$PY" benchmarks/throughput.py --device cuda --sessions 64 --skip-hf-sequential "${model_args[@]}"
exit $status

#!/usr/bin/env bash
# The GPU test plan, for a machine with a GPU (one is enough: the ranks share it). Run after the
# README's install, with its virtual environment active. Stops at the first failing stage; prints
# every test's duration.
#   Stage 1, smoke (about a minute): the native CUDA test built by nvcc (kernels, p2p ring with
#     ranks as streams, failure paths), then world 2 on p2p and nccl and the transport choice.
#   Stage 2, the rest of tests/test_cuda.py (sized for one GPU: about 10 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

echo "== stage 1: smoke"
start=$(date +%s)
cmake -S . -B cbuild-gpu -DCMAKE_BUILD_TYPE=Release > cbuild-gpu.log 2>&1 || { cat cbuild-gpu.log; exit 1; }
cmake --build cbuild-gpu -j"$(nproc)" --target test_cuda_kernels >> cbuild-gpu.log 2>&1 || { tail -50 cbuild-gpu.log; exit 1; }
./cbuild-gpu/test_cuda_kernels
python -m pytest -q -m "gpu and smoke" tests/test_cuda.py --durations=0 -x
echo "== stage 1 took $(( $(date +%s) - start )) s"

echo "== stage 2: the rest"
start=$(date +%s)
python -m pytest -q -m "gpu and not smoke" tests/test_cuda.py --durations=0
echo "== stage 2 took $(( $(date +%s) - start )) s"

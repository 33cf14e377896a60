#!/usr/bin/env bash
# The CUDA grid on a lent GPU, from the project root: the tasks of benchmarks/cuda_interpret_grid.py with the real
# kernels (--gpu), and the tests that need a CUDA device (-k on_cuda). Results go to $OUT/gpu_grid.log; a partial log
# from an earlier call, given as GRID_LOG, is resumed.
#   OUT=gpu-out COMMIT=$(git rev-parse HEAD) GRID_LOG=earlier/gpu_grid.log bash benchmarks/run_grid_on_gpu.sh
set -u
OUT=${OUT:-gpu-out}
. benchmarks/gpu_setup.sh
if [ -n "${GRID_LOG:-}" ]; then cp "$GRID_LOG" "$OUT/gpu_grid.log"; fi
# each grid process compiles its own kernels: one inductor compile thread each, not one per core
export TORCHINDUCTOR_COMPILE_THREADS=1
if [ "${TEST_SECONDS:-240}" -gt 0 ]; then
    timeout -k 10 -s INT "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider -n 4 -k on_cuda -rfEs \
        --tb=short "${CUDA_TEST_FILES[@]}" >"$OUT/cuda_tests.log" 2>&1 &
fi
python3 benchmarks/cuda_interpret_grid.py "$OUT/gpu_grid.log" --gpu --catalogue-first --jobs "${GRID_JOBS:-12}" \
    --time-budget "${GRID_SECONDS:-400}" >"$OUT/gpu_grid_driver.log" 2>&1
wait
tail -n 40 "$OUT/cuda_tests.log" 2>/dev/null
tail -n 1 "$OUT/gpu_grid_driver.log"
python3 benchmarks/cuda_interpret_grid.py "$OUT/gpu_grid.log" --summary

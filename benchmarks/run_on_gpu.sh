#!/usr/bin/env bash
# One lent-GPU session, from the project root: versions, the CUDA tests, and bench_gpu.py's table at 8 x 2048 (both
# families, every scheme and normalizer on its default backend, stock and x-transformers) and at 1 x 8192 (the rows
# with a memory goal). Kernels are compiled first in parallel processes; each row is then timed alone. Logs and
# tables go to $OUT. Wheels the machine lacks (x-transformers and its needs) are read from .whl/ when present.
#   OUT=gpu-out COMMIT=$(git rev-parse HEAD) bash benchmarks/run_on_gpu.sh
set -u
OUT=${OUT:-gpu-out}
COMPILE_SECONDS=${COMPILE_SECONDS:-150}
TIME_SECONDS=${TIME_SECONDS:-260}
LONG_SECONDS=${LONG_SECONDS:-80}
. benchmarks/gpu_setup.sh

read -r -a SHORT <<<"${SHORT_ARGS:---shapes 8x2048 --backends}"
read -r -a LONG <<<"${LONG_ARGS:---shapes 1x8192 --backends --normalizers softmax l2 exp relu2 swish_l2 \
--schemes none alibi t5 kerple fire tupe shaw xlnet deberta cope}"
# SIGINT at the limit: pytest still prints its summary, with each failure's short traceback
timeout -k 10 -s INT "${TEST_SECONDS:-$COMPILE_SECONDS}" python3 -m pytest -q -p no:cacheprovider -n 4 -k on_cuda -rfEs \
    --tb=short "${CUDA_TEST_FILES[@]}" >"$OUT/cuda_tests.log" 2>&1 &
python3 benchmarks/bench_gpu.py "${SHORT[@]}" --compile-only --compile-jobs "${SHORT_JOBS:-6}" --time-budget "$COMPILE_SECONDS" \
    >"$OUT/compile_short.log" 2>&1 &
python3 benchmarks/bench_gpu.py "${LONG[@]}" --compile-only --compile-jobs "${LONG_JOBS:-3}" --time-budget "$COMPILE_SECONDS" \
    >"$OUT/compile_long.log" 2>&1 &
wait
tail -n 3 "$OUT/compile_short.log" "$OUT/compile_long.log"
grep -E "passed|failed|error" "$OUT/cuda_tests.log" | tail -5
python3 benchmarks/bench_gpu.py "${SHORT[@]}" --warmup 1 --repeats 5 --time-budget "$TIME_SECONDS" \
    --output "$OUT/bench_8x2048.md" >"$OUT/bench_8x2048.log" 2>&1
python3 benchmarks/bench_gpu.py "${LONG[@]}" --warmup 1 --repeats 3 --time-budget "$LONG_SECONDS" \
    --output "$OUT/bench_1x8192.md" >"$OUT/bench_1x8192.log" 2>&1
cat "$OUT/bench_8x2048.md" "$OUT/bench_1x8192.md"

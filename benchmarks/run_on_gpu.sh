#!/usr/bin/env bash
# One lent-GPU session (10 minutes of an H100, compile included), from the project root: every row of the GPU-speed
# table (both families, 8 x 2048 and 1 x 8192) on the library's default routing and, for the rows the routing table
# or the per-pass kernel options changed, on the old routing beside it (bench_gpu.py --routings old), plus the sweep
# of FlexAttention's kernel options (flex_kernel_options.py). Kernels are compiled first, in parallel processes
# (their caches on disk); each row is then timed alone. Each step's log lands in $OUT as the step ends; every table
# goes into one results file, $OUT/results.md. Wheels the machine lacks are read from .whl/ when present.
#   OUT=gpu-out COMMIT=$(git rev-parse HEAD) bash benchmarks/run_on_gpu.sh
#   DRY_RUN=1 bash benchmarks/run_on_gpu.sh      # print the commands and the rows, run nothing
# Phases (seconds, each capped by its budget; rows past a budget are listed as not run): compile 180 (all rows and
# the sweep's sets at once, ~16 processes); 8 x 2048 timing 200; 1 x 8192 timing 120; the sweep's timing 60.
# Estimates from the fake-H100 compile (cuda_proxy.py, which runs inductor's lowering and codegen for sm_90 but not
# Triton's PTX compile): a flex training step of one tiny model lowers in ~20-60 s on a loaded 2-core CPU, SDPA rows
# in seconds; on 16 cores at ~3x that speed plus Triton's own compile, ~8-15 s a flex row, so the ~140 rows compile in
# ~120-180 s over 12 processes. Timing: ~3-6 s a row (process-local tracing from the warm caches, warm-up, 3 steps),
# more for the old routing's slow rows (relative_key ~5 s a step); the budgets keep the total under 10 minutes.
set -u
OUT=${OUT:-gpu-out}
COMPILE_SECONDS=${COMPILE_SECONDS:-180}
SHORT_SECONDS=${SHORT_SECONDS:-200}
LONG_SECONDS=${LONG_SECONDS:-120}
SWEEP_SECONDS=${SWEEP_SECONDS:-60}
# The rows of the table: every scheme named there with softmax, every normalizer named there with learned (and stock,
# none as references); the old routing for the rows whose route or kernel options changed.
ROWS="--schemes none learned shaw xlnet deberta relative_key cope path recurrent floater floater:method=rk4 t5 kerple
tupe fire alibi fox
--normalizers softmax stick_breaking swish_l2 softpick sigmoid l2 --backends --no-x-transformers"
CHANGED="--schemes shaw xlnet deberta relative_key fox alibi fire t5 kerple tupe --normalizers softmax --backends
--no-x-transformers"
read -r -a NEW_ROWS <<<"$(echo "${NEW_ARGS:-$ROWS --routings new}" | tr '\n' ' ')"
read -r -a OLD_ROWS <<<"$(echo "${OLD_ARGS:-$CHANGED --routings old}" | tr '\n' ' ')"
BENCH=(python3 benchmarks/bench_gpu.py)
SWEEP=(python3 benchmarks/flex_kernel_options.py --shape 8x2048)

if [ -n "${DRY_RUN:-}" ]; then
    for shape in 8x2048 1x8192; do
        for rows in NEW_ROWS OLD_ROWS; do
            declare -n args=$rows
            echo "${BENCH[*]} ${args[*]} --shapes $shape"
            "${BENCH[@]}" "${args[@]}" --shapes "$shape" --list-rows || exit 1
        done
    done
    echo "${SWEEP[*]} --compile-jobs 8"
    exec "${SWEEP[@]}" --list
fi

. benchmarks/gpu_setup.sh
started=$SECONDS
phase() { echo "$1: $((SECONDS - started)) s" | tee -a "$OUT/phases.log"; }

# 1. compile everything at once, in parallel processes: the timed runs read the kernels from inductor's caches
for shape in 8x2048 1x8192; do
    "${BENCH[@]}" "${NEW_ROWS[@]}" --shapes "$shape" --compile-only --compile-jobs "${NEW_JOBS:-4}" \
        --time-budget "$COMPILE_SECONDS" >"$OUT/compile_new_$shape.log" 2>&1 &
    "${BENCH[@]}" "${OLD_ROWS[@]}" --shapes "$shape" --compile-only --compile-jobs "${OLD_JOBS:-2}" \
        --time-budget "$COMPILE_SECONDS" >"$OUT/compile_old_$shape.log" 2>&1 &
done
timeout -k 10 "$COMPILE_SECONDS" "${SWEEP[@]}" --compile-jobs 8 --compile-only >"$OUT/compile_sweep.log" 2>&1 &
wait
phase compile
# 2. time each row alone: 8 x 2048, then 1 x 8192 (new and old routing share each budget, the new rows first)
"${BENCH[@]}" "${NEW_ROWS[@]}" --shapes 8x2048 --warmup 1 --repeats 3 --time-budget "$((SHORT_SECONDS * 2 / 3))" \
    --output "$OUT/bench_new_8x2048.md" >"$OUT/bench_new_8x2048.log" 2>&1
"${BENCH[@]}" "${OLD_ROWS[@]}" --shapes 8x2048 --warmup 1 --repeats 2 --time-budget "$((SHORT_SECONDS / 3))" \
    --output "$OUT/bench_old_8x2048.md" >"$OUT/bench_old_8x2048.log" 2>&1
phase "timing 8x2048"
"${BENCH[@]}" "${NEW_ROWS[@]}" --shapes 1x8192 --warmup 1 --repeats 2 --time-budget "$((LONG_SECONDS * 2 / 3))" \
    --output "$OUT/bench_new_1x8192.md" >"$OUT/bench_new_1x8192.log" 2>&1
"${BENCH[@]}" "${OLD_ROWS[@]}" --shapes 1x8192 --warmup 1 --repeats 1 --time-budget "$((LONG_SECONDS / 3))" \
    --output "$OUT/bench_old_1x8192.md" >"$OUT/bench_old_1x8192.log" 2>&1
phase "timing 1x8192"
# 3. the kernel-option sweep: one layer, a per-distance table with gradients, forward + backward
timeout -k 10 "$SWEEP_SECONDS" "${SWEEP[@]}" --repeats 10 --output "$OUT/sweep.md" >"$OUT/sweep.log" 2>&1
phase sweep
{
    cat "$OUT/versions.txt"
    echo
    cat "$OUT/phases.log"
    for table in bench_new_8x2048 bench_old_8x2048 bench_new_1x8192 bench_old_1x8192 sweep; do
        echo
        echo "## $table"
        cat "$OUT/$table.md" 2>/dev/null || echo "(no table: see $table.log)"
    done
} >"$OUT/results.md"
cat "$OUT/results.md"

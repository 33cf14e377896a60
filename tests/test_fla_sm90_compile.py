"""fla's Triton kernels, as the routing launches them, compiled for an H100 (sm_90) without a GPU: Triton -> TTIR ->
TTGIR -> LLVM IR -> PTX -> cubin with Triton's bundled ptxas (``tests/fla_sm90_compile.py``, in a Python of its own:
its fake H100 must be in place before fla is imported).

The regular suite compiles a representative pair (under a minute on a busy CPU): the gated delta rule's chunked
kernel, forward and backward, from a state, bf16, the tests' heads (keys of 8, values of 6), and its fused recurrent
step. ``HF_POSENC_FLA_SM90=1`` compiles every case of :data:`CASES` (about 6 minutes): the chunked kernel in a
training step, a prefill and from a state, the recurrent step, Wall's kernel with and without its scalar gate,
float32 and bf16, small and Qwen3-Next-sized heads; ``HF_POSENC_FLA_SM90=all-configs`` also every autotune config of
each kernel (the first after fla's pruning otherwise). ``HF_POSENC_FLA_SM90_REPORT=<file>`` appends each case's
kernels (stages, shared memory, ptxas's registers and stack, seconds) to ``<file>`` as JSON lines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
HELPER = Path(__file__).with_name("fla_sm90_compile.py")
MODE = os.environ.get("HF_POSENC_FLA_SM90", "")

DELTA_RULE_FORWARD = {
    "l2norm_fwd_kernel",
    "chunk_local_cumsum_scalar_kernel",
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
    "recompute_w_u_fwd_kernel",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    "chunk_fwd_kernel_o",
}
DELTA_RULE_BACKWARD = {
    "recompute_w_u_fwd_kernel",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    "chunk_bwd_kernel_dv_local",
    "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
    "chunk_bwd_kernel_dqkwg",
    "prepare_wy_repr_bwd_kernel",
    "chunk_local_cumsum_scalar_kernel",
    "l2norm_bwd_kernel",
}
WALL = {
    "chunk_global_cumsum_vector_kernel",
    "parallel_wall_attn_fwd_kernel",
    "parallel_wall_attn_bwd_kernel_preprocess",
    "parallel_wall_attn_bwd_kernel_dq",
    "parallel_wall_attn_bwd_kernel_dkv",
}
KERNELS = {
    "train": DELTA_RULE_FORWARD | DELTA_RULE_BACKWARD,
    "prefill": DELTA_RULE_FORWARD,
    "state": DELTA_RULE_FORWARD | DELTA_RULE_BACKWARD,
    "recurrent": {"fused_recurrent_gated_delta_rule_fwd_kernel"},
    "wall": WALL,
    "wall_fox": WALL | {"chunk_global_cumsum_scalar_kernel"},  # the scalar gate's cumulative sum
}
"""The Triton kernels each case launches (``fla_sm90_compile.FORMS``), by name."""

H100_TO_FLA = {
    "device": "cuda",
    "device_platform": "cuda",
    "IS_NVIDIA": True,
    "IS_NVIDIA_HOPPER": True,
    "IS_TF32_SUPPORTED": True,
    "IS_TMA_SUPPORTED": False,  # (only with FLA_USE_TMA=1)
    "check_shared_mem('hopper', None)": True,
    "check_shared_mem('hopper', 0)": True,
    "multiprocessor_count": 132,
}
"""fla's hardware answers under the fake H100, as on one (its kernels' tiles and autotune lists follow them)."""

REGULAR = [("state", "bfloat16", 8, 6), ("recurrent", "bfloat16", 8, 6)]
CASES = (
    REGULAR
    + [
        (form, dtype, k_dim, v_dim)
        for form in ("train", "prefill", "state", "recurrent")
        for dtype in ("float32", "bfloat16")
        for k_dim, v_dim in ((8, 6), (128, 128))
        if (form, dtype, k_dim, v_dim) not in REGULAR
    ]
    + [
        (form, dtype, head, head)
        for form in ("wall", "wall_fox")
        for dtype in ("float32", "bfloat16")
        for head in (16, 64)
    ]
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``compiled(form, dtype, k_dim, v_dim)``: the kernels the helper compiled for a case (one process serves every
    case of the module: importing fla under the fake H100 takes ~10 s)."""
    log = tmp_path_factory.mktemp("fla_sm90") / "stderr.txt"
    command = [sys.executable, str(HELPER)] + (["--all-configs"] if MODE == "all-configs" else [])
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
        )

    def compile_case(*case) -> dict:
        process.stdin.write(json.dumps(case) + "\n")
        process.stdin.flush()
        watchdog = threading.Timer(1800, process.kill)  # a case that hangs ends the process, and fails
        watchdog.start()
        try:
            for line in iter(process.stdout.readline, ""):
                if line.startswith("result: "):
                    result = json.loads(line.removeprefix("result: "))
                    assert "error" not in result, result["error"][-3000:]
                    return result
        finally:
            watchdog.cancel()
        pytest.fail(f"the compiling process stopped: {log.read_text()[-3000:]}")

    yield compile_case
    process.stdin.close()
    process.wait(timeout=60)


@pytest.mark.skipif(
    importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
    reason="needs fla-core and triton (pip install fla-core==0.6.0 --no-deps einops; torch pins triton)",
)
@pytest.mark.parametrize(("form", "dtype", "k_dim", "v_dim"), CASES)
def test_flas_kernels_compile_to_cubins_for_an_h100(form, dtype, k_dim, v_dim, compiled):
    """Each Triton kernel fla launches for the case (:data:`KERNELS`: the gated delta rule's chunked forward and
    backward and fused recurrent step through ``linear_attention.gated_delta_rule`` -> ``fla_gated_delta_rule``;
    ``parallel_wall_attn`` forward and backward called as ``fla_attention`` calls it), with the specialization of its
    arguments, compiles for sm_90 through every stage to a cubin (Triton's bundled ptxas) and would load on an H100
    (``fla_sm90_compile.load_refusal``: the shared memory Triton checks against the block's opt-in limit, ptxas's
    registers for all its warps within an SM's). An autotuned kernel passes where one of its configs does (the first
    that does; with ``all-configs`` every one is compiled): on a GPU Triton's autotuner times a config that fails to
    compile or load as infinite and keeps another. fla answers its hardware questions as on an H100
    (:data:`H100_TO_FLA`), so the tiles and autotune lists compiled are the ones an H100 takes."""
    if (form, dtype, k_dim, v_dim) not in REGULAR and not MODE:
        pytest.skip("the full grid (about 6 minutes of compiling) runs with HF_POSENC_FLA_SM90=1 (or =all-configs)")
    result = compiled(form, dtype, k_dim, v_dim)
    if os.environ.get("HF_POSENC_FLA_SM90_REPORT"):
        with open(os.environ["HF_POSENC_FLA_SM90_REPORT"], "a") as report:
            report.write(json.dumps({"case": [form, dtype, k_dim, v_dim], **result}) + "\n")
    assert result["fla"] == H100_TO_FLA
    kernels = result["compiled"]
    assert {kernel["kernel"] for kernel in kernels} == KERNELS[form]
    launches = {}
    for kernel in kernels:
        launches.setdefault(kernel.get("launch", id(kernel)), []).append(kernel)
        if "stages" in kernel:
            name = kernel["kernel"]
            assert kernel["stages"] == ["ttir", "ttgir", "llir", "ptx", "cubin"], name
            assert kernel["cubin_bytes"] > 0 and kernel["target"] == "cuda sm_90", name
    for configs in launches.values():  # an autotuned launch needs one config that loads: Triton times the others inf
        assert any(config["refused"] is None for config in configs), configs

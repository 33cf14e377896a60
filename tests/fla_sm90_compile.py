"""Compile fla's Triton kernels for an H100 (sm_90) as hf_posenc's routing launches them, on a machine with no GPU.

Run as a script (``tests/test_fla_sm90_compile.py`` starts it in a Python of its own, since what it patches must
come before ``fla`` is imported): ``python tests/fla_sm90_compile.py [--all-configs]`` reads a case a line on stdin,
``["state", "bfloat16", 8, 6]`` (a form of :data:`FORMS`, a dtype, the key and value head sizes), and prints a
``result: {json}`` line for each: the kernels compiled, and fla's hardware answers.

How: Triton gets a driver whose target is ``GPUTarget("cuda", 90, 32)`` (an H100: 132 SMs, 227 KB of shared memory
a block) before ``fla`` is imported, so fla's hardware checks (``IS_NVIDIA_HOPPER``, ``IS_TF32_SUPPORTED``,
``check_shared_mem``) answer as on an H100 and choose the H100's tiles and autotune lists. The routing
(``linear_attention.gated_delta_rule`` -> ``fla_kernels.fla_gated_delta_rule``; ``parallel_wall_attn`` called as
``fla_kernels.fla_attention`` calls it) then runs on CPU tensors with ``fla_runs_on`` answering True. Every kernel
launch fla makes (``JITFunction.run``) is compiled with the specialization of its real arguments (dtypes,
constexprs, integer and alignment specializations) through Triton's whole pipeline, TTIR -> TTGIR -> LLVM IR -> PTX
-> cubin with Triton's bundled ptxas, and returns without launching (fla's outputs stay uninitialised memory, which
nothing reads for control flow). An autotuned kernel compiles its first config after fla's pruning, or every one
with ``--all-configs`` (a GPU benchmarks them and keeps the fastest: which one it keeps is not known here).

Patched, all in this process: ``triton.runtime.driver`` (the fake H100 driver below: target, device 0, stream 0,
device properties; it loads and launches nothing); ``torch.cuda.get_device_name``, ``get_device_capability``,
``get_device_properties`` and ``device_count`` (fla reads them when imported); fla's
``get_all_max_shared_mem`` also answers for device index ``None`` (a CPU tensor's; a CUDA tensor's is 0), so
``check_shared_mem('hopper', q.device.index)`` chooses as on an H100; ``JITFunction.run`` (compile, never launch);
``Autotuner.run`` (compile the chosen configs, no benchmark). ``TRITON_CACHE_DIR`` is a fresh directory, so every
kernel is compiled here, not read from a cache.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types


H100_SHARED_MEMORY = 232448
"""Shared memory a block can opt into on an H100 (bytes): Triton refuses to load a kernel that needs more."""
H100_REGISTERS = 65536
"""Registers of an SM, which a block's threads share."""
COMPILED: list[dict] = []


def fake_h100() -> None:
    """Triton's driver and torch.cuda's device queries answer for one H100; call before importing fla."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    properties = dict(
        max_shared_mem=H100_SHARED_MEMORY, multiprocessor_count=132, max_num_regs=65536, warpSize=32,
        sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=5120,
    )  # fmt: skip

    class H100Driver(DriverBase):  # answers Triton's questions about the target; loads and launches nothing
        def __init__(self):
            self.utils = types.SimpleNamespace(get_device_properties=lambda device=0: properties)

        @staticmethod
        def is_active():
            return True

        def map_python_to_cpp_type(self, ty):
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_benchmarker(self):
            raise RuntimeError("no GPU to benchmark on")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

    triton.runtime.driver.set_active(H100Driver())
    h100 = types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
        shared_memory_per_block=49152, shared_memory_per_block_optin=H100_SHARED_MEMORY,
    )  # fmt: skip
    torch.cuda.get_device_name = lambda device=None: h100.name
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: h100
    torch.cuda.device_count = lambda: 1
    import fla.utils.hardware as hardware  # (its checks run on import)

    class ByIndex(list):  # fla indexes the devices' shared memory by a tensor's device index: a CPU tensor's is None
        def __getitem__(self, index):
            return super().__getitem__(0 if index is None else index)

    all_max_shared_mem = hardware.get_all_max_shared_mem
    hardware.get_all_max_shared_mem = lambda: ByIndex(all_max_shared_mem())
    hardware.check_shared_mem.cache_clear()


def fla_hardware() -> dict:
    """What fla believes about the device, as its kernels' choices read it."""
    from fla import utils

    return {
        "device": utils.device,
        "device_platform": utils.device_platform,
        "IS_NVIDIA": utils.IS_NVIDIA,
        "IS_NVIDIA_HOPPER": utils.IS_NVIDIA_HOPPER,
        "IS_TF32_SUPPORTED": utils.IS_TF32_SUPPORTED,
        "IS_TMA_SUPPORTED": utils.IS_TMA_SUPPORTED,
        "check_shared_mem('hopper', None)": utils.check_shared_mem("hopper", None),
        "check_shared_mem('hopper', 0)": utils.check_shared_mem("hopper", 0),
        "multiprocessor_count": utils.get_multiprocessor_count(0),
    }


def resource_usage(cubin: bytes) -> dict[str, int]:
    """ptxas's resource usage of the (one) kernel in ``cubin``, as Triton's bundled ``cuobjdump
    --dump-resource-usage`` reads it: registers a thread (REG), static shared memory (SHARED), local memory a thread
    (LOCAL: spills and stack)."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    line = next(line for line in report.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def load_refusal(record: dict) -> str | None:
    """Why Triton (``CompiledKernel._init_handles``) would refuse to load a compiled kernel on an H100, or None: the
    shared memory it asks for past the block's opt-in limit; its threads needing more than an SM's registers (ptxas
    allocates a warp's registers in units of 256)."""
    if record["shared"] > H100_SHARED_MEMORY:
        return f"shared memory {record['shared']} > {H100_SHARED_MEMORY}"
    registers = -(-record["ptxas"]["REG"] * 32 // 256) * 256 * record["num_warps"]
    if registers > H100_REGISTERS:
        return f"registers {registers} > {H100_REGISTERS}"
    return None


def compile_instead_of_launching(all_configs: bool) -> None:
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.autotuner import Autotuner, OutOfResources, PTXASError
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    seen = set()  # the kernels compiled so far (Triton's in-memory cache returns the same object again)
    autotune = {}  # the autotuned launch and the config being compiled
    launches = itertools.count()

    def compile_only(self, *args, grid, warmup, **kwargs):
        start = time.time()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        again = id(kernel) in seen
        seen.add(id(kernel))
        asm = kernel.asm
        metadata = kernel.metadata
        names = self.arg_names
        constexprs = {
            names[k[0]] if len(k) == 1 else str(k): repr(v) for k, v in kernel.src.constants.items() if v is not None
        }
        record = {
            "kernel": self.fn.__name__,
            "module": self.fn.__module__,
            "stages": [stage for stage in ("ttir", "ttgir", "llir", "ptx", "cubin") if asm.get(stage)],
            "cubin_bytes": len(asm.get("cubin", b"")),
            "target": f"{metadata.target.backend} sm_{metadata.target.arch}",
            "shared": metadata.shared,
            "num_warps": metadata.num_warps,
            "num_stages": metadata.num_stages,
            "ptxas": resource_usage(asm["cubin"]),
            "constexprs": {k: v for k, v in constexprs.items() if not v.startswith("<")},
            "seconds": round(time.time() - start, 2),
            "again": again,  # the same specialization as an earlier launch: not compiled again
            **autotune,
        }
        record["refused"] = load_refusal(record)
        COMPILED.append(record)
        if record["refused"] and autotune:  # as Triton's loader raises it, which the autotuner's benchmark takes
            raise OutOfResources(metadata.shared, H100_SHARED_MEMORY, record["refused"])
        return kernel

    def compile_configs(self, *args, **kwargs):
        """Compile the configs a GPU would benchmark (after fla's pruning): every one with ``all_configs``, else
        until one compiles and loads. A config Triton's benchmark would time as infinite (a compile-time assertion,
        ptxas failing, out of resources at load) is recorded as refused; at least one must not be."""
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        launch = next(launches)
        kernel = None
        for number, config in enumerate(configs, 1):
            autotune.update(launch=launch, config=f"{number}/{len(configs)}: {config}")
            try:
                compiled = self.fn.run(*args, **kwargs, **config.all_kwargs())
            except (OutOfResources, CompileTimeAssertionFailure, PTXASError) as error:
                if not isinstance(error, OutOfResources):
                    message = str(error).strip().splitlines()[0]
                    COMPILED.append({"kernel": self.base_fn.__name__, **autotune, "refused": message})
                continue
            kernel = kernel or compiled
            if not all_configs:
                break
        autotune.clear()
        self.nargs = None
        if kernel is None:
            raise RuntimeError(f"{self.base_fn.__name__}: no config compiles and loads on an H100")
        return kernel

    JITFunction.run = compile_only
    Autotuner.run = compile_configs


FORMS = ("train", "prefill", "state", "recurrent", "wall", "wall_fox")
"""What each case runs, as the routing calls fla: the gated delta rule's chunked kernel in a training step (gradients,
no state in or out), a prefill of the cache (no gradients, the final state out), from a state with gradients (the
state in and out: the rule tests' case, and a continued prefill's flags); its fused recurrent kernel in a decoding
step from the cache's state; ``parallel_wall_attn`` forward and backward without and with the scalar gate."""


def delta_rule_inputs(dtype, seq: int, k_dim: int, v_dim: int, with_state: bool, grad: bool) -> list:
    """The layer's inputs to ``linear_attention.gated_delta_rule``: q, k ``(2, seq, 1, k_dim)`` and v ``(2, seq, 2,
    v_dim)`` (a key head serving two value heads) and beta in ``dtype``, g and the state float32, as the layer makes
    them."""
    import torch

    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, seq, 1, k_dim, generator=generator).to(dtype) for _ in range(2))
    v = torch.randn(2, seq, 2, v_dim, generator=generator).to(dtype)
    g = -torch.rand(2, seq, 2, generator=generator)
    beta = torch.rand(2, seq, 2, generator=generator).to(dtype)
    state = torch.randn(2, 2, k_dim, v_dim, generator=generator) if with_state else None
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta)] + [
        None if state is None else state.requires_grad_(grad)
    ]


def run_case(form: str, dtype_name: str, k_dim: int, v_dim: int) -> None:
    """One :data:`FORMS` case: 2 x 70 tokens (a chunk of 64 and a partial one), Wall's 2 x 80 (its query block of 64
    and a partial one); heads of ``k_dim`` (q, k) and ``v_dim`` (v)."""
    import torch
    from torch.nn import functional as F

    from hf_posenc import fla_kernels, linear_attention

    fla_kernels.fla_runs_on = lambda device: True
    dtype = getattr(torch, dtype_name)
    if form in ("train", "prefill", "state"):
        grad, with_state = form != "prefill", form == "state"
        *leaves, state = delta_rule_inputs(dtype, 70, k_dim, v_dim, with_state=with_state, grad=grad)
        with torch.set_grad_enabled(grad):
            output, final = linear_attention.gated_delta_rule(*leaves, state, output_final_state=form != "train")
        if grad:
            loss = output.float().sum() + (0 if final is None else final.float().sum())
            loss.backward()
    elif form == "recurrent":
        *leaves, state = delta_rule_inputs(dtype, 1, k_dim, v_dim, with_state=True, grad=False)
        with torch.no_grad():
            linear_attention.gated_delta_rule(*leaves, state, output_final_state=True)
    elif form in ("wall", "wall_fox"):  # as fla_attention calls it: (batch, len, heads, head_dim), gates float32
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 80, 2, k_dim, generator=generator).to(dtype).requires_grad_() for _ in range(3))
        log_decay = F.logsigmoid(torch.randn(2, 80, 2, k_dim, generator=generator) + 4).requires_grad_()
        log_forget = F.logsigmoid(torch.randn(2, 80, 2, generator=generator) + 4).requires_grad_()
        wall = fla_kernels.fla_module("wall_attn").parallel_wall_attn
        gate = log_forget if form == "wall_fox" else None
        wall(q, k, v, log_decay, g_scalar=gate, scale=k_dim**-0.5).float().sum().backward()
    else:
        raise ValueError(form)


def main(argv: list[str]) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fla-sm90-triton-cache-")
    fake_h100()
    compile_instead_of_launching(all_configs="--all-configs" in argv)
    for line in sys.stdin:  # a case [form, dtype, key_head_dim, value_head_dim] per line; its result per line
        COMPILED.clear()
        start = time.time()
        try:
            run_case(*json.loads(line))
            result = {"seconds": round(time.time() - start, 1), "compiled": COMPILED.copy(), "fla": fla_hardware()}
        except Exception:
            result = {"error": traceback.format_exc()}
        print("result:", json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

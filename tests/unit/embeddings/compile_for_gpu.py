"""Builds every sparse optimizer's Triton kernel for an H100/H200 (sm_90) with Triton's own ptxas, no GPU
needed, for rows of 64 and of 300 (a narrower tile on more warps); prints one line per kernel built. Run by
test_gpu_kernels.py in a process of its own: the tests' process has Triton's interpreter on
(``TRITON_INTERPRET``), which compiles nothing."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from melissa_dl.embeddings import gpu_loops

for dim in (64, 300):
    for weight in ("fp32", "bf16"):
        for optimizer in (gpu_loops.SGD, gpu_loops.ADAGRAD, gpu_loops.ROW_ADAGRAD, gpu_loops.ADAM):
            pointers = {"keys": "i64", "order": "i64", "grads": weight, "weight": weight}
            pointers |= {"state": "fp32" if optimizer != gpu_loops.SGD else weight, "run_first": "i64"}
            pointers |= {"run_stop": "i64", "scratch": "fp32", "arrivals": "i32", "step_size": "fp64"}
            scalars = {"n": "i32", "rows": "i32", "dim": "i32", "eps": "fp32", "beta1": "fp32", "beta2": "fp32"}
            constants = gpu_loops.shape(dim)
            warps = constants.pop("num_warps")
            constants["OPTIMIZER"] = optimizer
            signature = {k: f"*{v}" for k, v in pointers.items()} | scalars | dict.fromkeys(constants, "constexpr")
            built = triton.compile(
                ASTSource(fn=gpu_loops._step, signature=signature, constexprs=constants),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps},
            )
            assert built.asm["cubin"], "ptxas made no cubin"
            print(f"{dim}-{weight}-{optimizer}")

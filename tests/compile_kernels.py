"""Compile every Triton kernel ahead of time for a Hopper GPU (sm_90), without a GPU.

The interpreter runs kernels as numpy code, so it cannot see what only the compiler sees: typing
rules, unsupported constructs, tensor-core shape limits, shared memory. This script runs the real
compiler (down to ptxas, which ships with triton) on the specialisations the engine launches and
prints one JSON line per kernel: ``{"kernel": ..., "shared": bytes}``.

    python tests/compile_kernels.py      (TRITON_INTERPRET must be unset: it runs as a subprocess)
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run with TRITON_INTERPRET unset")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from asyncllm.kernels import cache_write, elementwise, paged_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(name: str, fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> None:
    """Every argument not named is an int32 scalar."""
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "fp32" if arg in floats else "i32")
                 for arg in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options={"num_warps": 4})
    print(json.dumps({"kernel": name, "shared": kernel.metadata.shared}), flush=True)


def attention(dtype: str, head_dim: int, block_m: int, tile_n: int, splits: int) -> None:
    group = 2
    pointers = {arg: f"*{dtype}" for arg in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers.update({arg: "*fp32" for arg in ("part_out_ptr", "part_m_ptr", "part_l_ptr")})
    pointers.update({arg: "*i64" for arg in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr")})
    pointers.update(qblock_seq_ptr="*i32", qblock_start_ptr="*i32")
    meta = dict(NUM_KV_HEADS=8, BLOCK_SIZE=16, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim,
                BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n, NUM_SPLITS=splits,
                UPCAST=False, IEEE_DOT=dtype == "fp32")
    compile_kernel(f"paged_attention {dtype} d{head_dim} m{block_m} n{tile_n} splits{splits}",
                   paged_attention._paged_attention_kernel, pointers, ("scale_log2",), meta)
    if splits > 1:
        meta = {k: v for k, v in meta.items() if k not in ("BLOCK_SIZE", "TILE_N", "UPCAST", "IEEE_DOT")}
        compile_kernel(f"merge_splits {dtype} splits{splits}", paged_attention._merge_splits_kernel,
                       {**pointers, "query_start_ptr": "*i64"}, (), meta)


def elementwise_ops(dtype: str) -> None:
    t = f"*{dtype}"
    compile_kernel("write_kv", cache_write._write_kv_kernel,
                   dict(key_ptr=t, value_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_ptr="*i64"), (),
                   dict(BLOCK_SIZE=16, HEAD_DIM=128, ELEMENTS=1024, ELEMENTS_PAD=1024))
    for residual in (False, True):
        compile_kernel(f"rms_norm residual={residual}", elementwise._rms_norm_kernel,
                       dict(x_ptr=t, residual_ptr=t, weight_ptr=t, out_ptr=t, sum_ptr=t), ("eps",),
                       dict(BLOCK=1024, HAS_RESIDUAL=residual))
    compile_kernel("rotary", elementwise._rotary_kernel,
                   dict(q_ptr=t, k_ptr=t, positions_ptr="*i64", cos_ptr=t, sin_ptr=t), (),
                   dict(NUM_Q_HEADS=16, NUM_K_HEADS=8, HEADS_PAD=16, HALF=64, HALF_PAD=64))
    compile_kernel("silu_and_mul", elementwise._silu_and_mul_kernel, dict(gate_ptr=t, up_ptr=t, out_ptr=t), (),
                   dict(BLOCK=1024))


if __name__ == "__main__":
    attention("bf16", 128, 16, 64, 1)    # decode
    attention("bf16", 128, 16, 64, 8)    # split-KV decode + merge
    attention("bf16", 128, 64, 64, 1)    # prefill
    attention("fp32", 128, 64, 32, 1)    # float32 prefill: exact dots, half-width tiles
    elementwise_ops("bf16")

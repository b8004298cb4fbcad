"""Compile every Triton kernel ahead of time for a Hopper GPU (sm_90), without a GPU.

The interpreter runs kernels as numpy code, so it cannot see what only the compiler sees: typing
rules, unsupported constructs, tensor-core shape limits, shared memory. This script runs the real
compiler (down to ptxas, which ships with triton) on the specialisations the engine launches and
prints one JSON line per kernel: ``{"kernel": ..., "shared": bytes}``.

Each kernel is compiled as the launcher specialises it at run time, for a Qwen3-0.6B-shaped model
(16 query / 8 KV heads of 128, hidden 1024, KV blocks of 16 tokens, 256 blocks a table): every
pointer 16-byte aligned and every integer that is a multiple of 16 marked divisible by 16 (the
``tt.divisibility`` attribute that lets the compiler vectorise loads), and an integer equal to 1
folded to a constant, as triton's JIT does. Without these it would check variants never launched.

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


DIVISIBLE = [["tt.divisibility", 16]]


def launch_specialisation(fn, pointers: dict[str, str], ints: dict[str, int], constexprs: dict):
    """``(constexprs, attrs)`` of the variant the JIT launches for these argument values: pointers
    aligned, integers divisible by 16 marked so, integers equal to 1 made constants."""
    constexprs = dict(constexprs)
    constexprs.update({arg: 1 for arg, value in ints.items() if value == 1})
    attrs = {}
    for index, arg in enumerate(fn.arg_names):
        if arg in pointers or (arg in ints and ints[arg] != 1 and ints[arg] % 16 == 0):
            attrs[(index,)] = DIVISIBLE
    return constexprs, attrs


def compile_kernel(name: str, fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict,
                   ints: dict[str, int]) -> None:
    """``ints``: the integer arguments' values at launch (each int32); every argument is named."""
    constexprs, attrs = launch_specialisation(fn, pointers, ints, constexprs)
    missing = [a for a in fn.arg_names if a not in constexprs and a not in pointers and a not in floats and a not in ints]
    assert not missing, f"{name}: no launch value for {missing}"
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "fp32" if arg in floats else "i32")
                 for arg in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options={"num_warps": 4})
    print(json.dumps({"kernel": name, "shared": kernel.metadata.shared, "divisible_args": len(attrs)}), flush=True)


def attention(dtype: str, head_dim: int, block_m: int, tile_n: int, splits: int, window: int = 0,
              softcap: bool = False, chunk: int = 0, sinks: bool = False) -> None:
    """``window``/``softcap``: Gemma 2's specialisation (a 4,096-token window, capped scores); ``chunk``:
    Llama 4's chunked attention; ``sinks``: gpt-oss's per-head sink logits."""
    group = 2
    pointers = {arg: f"*{dtype}" for arg in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    pointers.update({arg: "*fp32" for arg in ("part_out_ptr", "part_m_ptr", "part_l_ptr")})
    pointers.update({arg: "*i64" for arg in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr")})
    pointers.update(qblock_seq_ptr="*i32", qblock_start_ptr="*i32", sinks_ptr="*fp32")
    meta = dict(NUM_KV_HEADS=8, BLOCK_SIZE=16, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim,
                BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n, NUM_SPLITS=splits,
                UPCAST=False, IEEE_DOT=dtype == "fp32", HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap,
                HAS_CHUNK=chunk > 0, HAS_SINKS=sinks)
    # q: a view of the fused qkv rows ((16 + 2 * 8) heads of 128); out and the caches contiguous
    ints = dict(stride_qt=32 * head_dim, stride_qh=head_dim, stride_ot=16 * head_dim, stride_oh=head_dim,
                stride_kb=16 * 8 * head_dim, stride_ks=8 * head_dim, stride_kh=head_dim,
                stride_vb=16 * 8 * head_dim, stride_vs=8 * head_dim, stride_vh=head_dim, stride_bt=256, window=window,
                chunk=chunk or 1)
    variant = (f" window{window}" * (window > 0) + " softcap" * softcap + f" chunk{chunk}" * (chunk > 0)
               + " sinks" * sinks)
    compile_kernel(f"paged_attention {dtype} d{head_dim} m{block_m} n{tile_n} splits{splits}{variant}",
                   paged_attention._paged_attention_kernel, pointers, ("scale_log2", "softcap"), meta, ints)
    if splits > 1:
        meta = {k: v for k, v in meta.items()
                if k not in ("BLOCK_SIZE", "TILE_N", "UPCAST", "IEEE_DOT", "HAS_WINDOW", "HAS_SOFTCAP", "HAS_CHUNK")}
        compile_kernel(f"merge_splits {dtype} splits{splits}", paged_attention._merge_splits_kernel,
                       {**pointers, "query_start_ptr": "*i64"}, (), meta,
                       dict(stride_ot=16 * head_dim, stride_oh=head_dim))


def elementwise_ops(dtype: str) -> None:
    t = f"*{dtype}"
    compile_kernel("write_kv", cache_write._write_kv_kernel,
                   dict(key_ptr=t, value_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_ptr="*i64"), (),
                   dict(BLOCK_SIZE=16, HEAD_DIM=128, ELEMENTS=1024, ELEMENTS_PAD=1024),
                   dict(stride_kt=4096, stride_kh=128, stride_vt=4096, stride_vh=128, stride_kcb=16384,
                        stride_kcs=1024, stride_kch=128, stride_vcb=16384, stride_vcs=1024, stride_vch=128))
    for residual in (False, True):
        compile_kernel(f"rms_norm residual={residual}", elementwise._rms_norm_kernel,
                       dict(x_ptr=t, residual_ptr=t, weight_ptr=t, out_ptr=t, sum_ptr=t), ("eps",),
                       dict(BLOCK=1024, HAS_RESIDUAL=residual),  # hidden rows [tokens, 1024]
                       dict(inner=1, stride_xo=1024, stride_xi=0, stride_ro=1024 if residual else 0, stride_ri=0,
                            n=1024))
    # q/k norm (Qwen3): rows of 128 read in place from the fused qkv view, 16 heads a token
    compile_kernel("rms_norm q-norm", elementwise._rms_norm_kernel,
                   dict(x_ptr=t, residual_ptr=t, weight_ptr=t, out_ptr=t, sum_ptr=t), ("eps",),
                   dict(BLOCK=128, HAS_RESIDUAL=False),
                   dict(inner=16, stride_xo=4096, stride_xi=128, stride_ro=0, stride_ri=0, n=128))
    compile_kernel("rotary", elementwise._rotary_kernel,
                   dict(q_ptr=t, k_ptr=t, positions_ptr="*i64", cos_ptr=t, sin_ptr=t), (),
                   dict(NUM_Q_HEADS=16, NUM_K_HEADS=8, HEADS_PAD=16, HALF=64, HALF_PAD=64),
                   dict(stride_qt=4096, stride_qh=128, stride_kt=4096, stride_kh=128, stride_cos=128, stride_sin=128))
    compile_kernel("silu_and_mul", elementwise._silu_and_mul_kernel, dict(gate_ptr=t, up_ptr=t, out_ptr=t), (),
                   dict(BLOCK=1024), dict(stride_g=6144, stride_u=6144, n=3072))  # halves of gate/up [tokens, 6144]


if __name__ == "__main__":
    attention("bf16", 128, 16, 64, 1)    # decode
    attention("bf16", 128, 16, 64, 8)    # split-KV decode + merge
    attention("bf16", 128, 64, 64, 1)    # prefill
    attention("fp32", 128, 64, 32, 1)    # float32 prefill: exact dots, half-width tiles
    attention("bf16", 256, 16, 32, 1, window=4096, softcap=True)  # Gemma 2 decode: window and soft cap
    attention("bf16", 128, 16, 64, 1, chunk=8192)                  # Llama 4 decode: chunked attention
    attention("bf16", 64, 16, 64, 8, window=128, sinks=True)      # gpt-oss split decode: window and sinks
    elementwise_ops("bf16")

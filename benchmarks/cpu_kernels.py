"""Micro-benchmarks of the CPU path's pieces against the torch code they replace (docs/cpu.md).

    python -m benchmarks.cpu_kernels [--repeats 20] [--json out.json] [--tiny]

- linear: ``F.linear`` (MKL) against the oneDNN-packed weight of ``kernels/cpu_linear.py``, on
  ``cpu-llama``'s projection shapes at 1, 8, 64 and 2048 rows.
- paged decode: 64 decodes of 150-400 tokens with their blocks scattered over the cache (GQA 8/4,
  head_dim 64, block 16), the C kernel against the torch reference backend (gather + SDPA).

Each figure is the median of ``--repeats`` timed calls after a warm-up, in milliseconds, with the
current torch thread count. ``--tiny`` shrinks everything (what the tests run).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.measure import write_report

# cpu-llama's projections: (name, in_features, out_features)
LINEAR_SHAPES = [("qkv", 512, 1024), ("o", 512, 512), ("gate_up", 512, 2816), ("down", 1408, 512),
                 ("lm_head", 512, 16384)]


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` calls, after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_linear(shapes, rows_list, repeats: int) -> list[dict]:
    from asyncllm.kernels.cpu_linear import PackedLinear, packing_supported

    if not packing_supported(torch.device("cpu"), torch.float32):
        return []
    results = []
    for name, k, n in shapes:
        weight = torch.randn(n, k)
        packed = PackedLinear(weight, None)
        for rows in rows_list:
            x = torch.randn(rows, k)
            with torch.inference_mode():
                plain = time_ms(lambda: F.linear(x, weight), repeats)
                fast = time_ms(lambda: packed(x), repeats)
            results.append({"shape": name, "in": k, "out": n, "rows": rows, "f_linear_ms": plain,
                            "packed_ms": fast, "speedup": plain / fast})
    return results


def bench_paged_decode(num_seqs: int, lengths: tuple[int, int], repeats: int) -> dict | None:
    from asyncllm.kernels.cpu_attention import CpuAttentionBackend, cpu_kernels_available
    from asyncllm.kernels.metadata import AttentionMetadata
    from asyncllm.kernels.torch_attention import TorchAttentionBackend

    if not cpu_kernels_available():
        return None
    heads, kv_heads, dim, block = 8, 4, 64, 16
    rng = random.Random(0)
    lens = [rng.randint(*lengths) for _ in range(num_seqs)]
    needed = [-(-n // block) for n in lens]
    pool = list(range(sum(needed) + 8))
    rng.shuffle(pool)
    width = max(needed)
    tables = [[pool.pop() for _ in range(n)] + [0] * (width - n) for n in needed]
    k_cache = torch.randn(sum(needed) + 8, block, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(num_seqs, heads, dim)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.long), query_start=list(range(num_seqs + 1)),
            seq_lens=lens, block_tables=torch.tensor(tables), seq_lens_tensor=torch.tensor(lens),
            query_start_tensor=torch.arange(num_seqs + 1), block_size=block,
            decode_indices=list(range(num_seqs)), prefill_indices=[])

    results = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("c_kernel", CpuAttentionBackend())):
        m = meta()
        backend.prepare(m)  # per-step work shared by the layers: not part of one layer's call
        results[f"{name}_ms"] = time_ms(lambda: backend.forward(query, k_cache, v_cache, m, dim ** -0.5), repeats)
    kv_bytes = sum(lens) * kv_heads * dim * 4 * 2
    return {"num_seqs": num_seqs, "lengths": list(lengths), "kv_mb": kv_bytes / 1e6, **results,
            "speedup": results["torch_ms"] / results["c_kernel_ms"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--tiny", action="store_true", help="small shapes, few repeats (tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        shapes, rows, decode = [("qkv", 64, 128)], [1, 8], (8, (10, 40))
        args.repeats = min(args.repeats, 3)
    else:
        shapes, rows, decode = LINEAR_SHAPES, [1, 8, 64, 2048], (64, (150, 400))
    report = {"threads": torch.get_num_threads(), "repeats": args.repeats,
              "linear": bench_linear(shapes, rows, args.repeats),
              "paged_decode": bench_paged_decode(decode[0], decode[1], args.repeats)}
    print(f"threads {report['threads']}, median of {args.repeats} calls, ms")
    print(f"{'linear':10s} {'rows':>5s} {'F.linear':>9s} {'packed':>9s} {'speedup':>8s}")
    for r in report["linear"]:
        print(f"{r['shape']:10s} {r['rows']:5d} {r['f_linear_ms']:9.3f} {r['packed_ms']:9.3f} {r['speedup']:7.2f}x")
    d = report["paged_decode"]
    if d:
        print(f"paged decode, {d['num_seqs']} decodes of {d['lengths'][0]}-{d['lengths'][1]} tokens "
              f"({d['kv_mb']:.1f} MB of K/V): torch {d['torch_ms']:.3f} ms, C kernel {d['c_kernel_ms']:.3f} ms "
              f"({d['speedup']:.1f}x)")
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()

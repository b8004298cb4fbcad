"""Micro-benchmark of the routed experts of one mixture-of-experts layer on CPU: the torch grouped path
(``model.moe.grouped_experts``) against the C kernel (``kernels/cpu_moe.py``).

    python -m benchmarks.moe_experts [--repeats 10] [--tokens 1,8,32,128] [--threads N] [--json out.json] [--tiny]

Shapes: a Qwen3-MoE-like layer (E=64 experts, H=512, I=128, top-8) and a small Mixtral-like one (E=8,
H=1024, I=2816, top-2). Per step of T tokens the routing is random (softmax top-k of random logits); both
paths get the same routing and run everything after the router (the sort by expert included).

Each timed call finds the weights in memory, not in cache (as in a model, where the other layers' weights
pass through the caches in between): before it, a buffer larger than the L3 is read. Each figure is the
best of ``--repeats`` calls (the cores are shared with others, so the best is the least disturbed), in ms
per layer, with the effective bandwidth: the bytes of the experts the step activates (each read once) over
that time. ``floor ms`` is the memory-bound floor measured the same way: reading that many bytes from one
contiguous tensor (``torch.sum``, all threads), out of cache; ``x floor`` is the kernel's time over it.
Nothing is written unless ``--json`` is given.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.measure import write_report

SHAPES = [("qwen3-moe-like", 64, 512, 128, 8), ("mixtral-like", 8, 1024, 2816, 2)]
TOKENS = [1, 8, 32, 128]
FLUSH_BYTES = 128 << 20  # read before each timed call: four times the 32 MiB L3 of the machines measured


def _best_ms(fn, repeats: int, flush: torch.Tensor) -> float:
    """The best wall time of ``fn`` in ms over ``repeats`` calls, each after reading ``flush``."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        flush.sum()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench(shapes, tokens_list, repeats: int, flush_bytes: int) -> list[dict]:
    from asyncllm.kernels.cpu_moe import SILU, moe_experts_cpu
    from asyncllm.model.moe import expert_activation, grouped_experts, route
    from asyncllm.model.shape import MoEShape

    results = []
    gen = torch.Generator().manual_seed(0)
    flush = torch.ones(flush_bytes // 4)
    stream = torch.ones(max(3 * hidden * inter * experts for _, experts, hidden, inter, _ in shapes))  # a layer's floats
    for name, experts, hidden, inter, top_k in shapes:
        moe = MoEShape(num_experts=experts, top_k=top_k, intermediate_size=inter)
        act = expert_activation(moe)
        expert_bytes = 3 * hidden * inter * 4
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, generator=gen)
            weights, ids = route(torch.randn(tokens, experts, generator=gen), moe)
            active = int(ids.unique().numel())
            with torch.inference_mode():
                expected = grouped_experts(x, weights, ids, w13, w2, act)
                got = moe_experts_cpu(x, weights, ids, w13, w2, SILU)
                if got is None:
                    raise SystemExit("the MoE C kernel is not available here (no compiler, or ASYNCLLM_CPU_KERNELS=0)")
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
                torch_ms = _best_ms(lambda: grouped_experts(x, weights, ids, w13, w2, act), repeats, flush)
                kernel_ms = _best_ms(lambda: moe_experts_cpu(x, weights, ids, w13, w2, SILU), repeats, flush)
                floor_ms = _best_ms(lambda: stream[:active * expert_bytes // 4].sum(), repeats, flush)
            row = {"shape": name, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
                   "tokens": tokens, "active_experts": active, "torch_ms": torch_ms,
                   "kernel_ms": kernel_ms, "floor_ms": floor_ms, "speedup": torch_ms / kernel_ms,
                   "kernel_over_floor": kernel_ms / floor_ms,
                   "torch_gbps": active * expert_bytes / torch_ms / 1e6,
                   "kernel_gbps": active * expert_bytes / kernel_ms / 1e6}
            results.append(row)
            print(_format_row(row), flush=True)
    return results


def _header() -> str:
    return (f"{'shape':>15s} {'T':>4s} {'active':>6s} {'torch ms':>9s} {'GB/s':>6s} {'kernel ms':>10s} {'GB/s':>6s}"
            f" {'speedup':>8s} {'floor ms':>9s} {'x floor':>8s}")


def _format_row(row: dict) -> str:
    return (f"{row['shape']:>15s} {row['tokens']:4d} {row['active_experts']:6d} {row['torch_ms']:9.3f} "
            f"{row['torch_gbps']:6.1f} {row['kernel_ms']:10.3f} {row['kernel_gbps']:6.1f} {row['speedup']:7.1f}x"
            f" {row['floor_ms']:9.3f} {row['kernel_over_floor']:7.2f}x")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", help="comma-separated step sizes (default 1,8,32,128)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--tiny", action="store_true", help="small shapes, few repeats (tests)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads first (both paths use torch's count)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes, tokens, flush = SHAPES, TOKENS, FLUSH_BYTES
    if args.tiny:
        shapes, tokens, flush, args.repeats = [("tiny", 8, 64, 32, 2)], [1, 8], 1 << 20, min(args.repeats, 2)
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    from asyncllm.kernels.cpu_moe import kernel_isa

    print(f"threads {torch.get_num_threads()}, MoE kernel {kernel_isa() or 'unavailable'}, best of {args.repeats} "
          "calls with the weights out of cache, ms per layer; GB/s: the active experts' weights over that time")
    print(_header(), flush=True)
    report = {"threads": torch.get_num_threads(), "repeats": args.repeats, "moe_kernel": kernel_isa(),
              "results": bench(shapes, tokens, args.repeats, flush)}
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()

"""Kernel micro-benchmarks on a GPU: each Triton kernel against the torch code it replaces.

    python -m benchmarks.gpu_kernels --out DIR      (writes DIR/gpu_kernels.json)

Shapes are qwen3-0.6b's (16 query heads, 8 KV heads, head_dim 128, hidden 1024, MLP 3072), bf16,
block size 16. Paged attention: decode batches at several context lengths (Triton with its split
heuristic, Triton forced to one split, the torch reference) and prefills; elementwise ops at
decode and prefill token counts. Times are ``triton.testing.do_bench`` medians (ms), which
synchronise around the timed calls; ``kv_gb_per_s`` is the KV bytes a decode reads per second.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.measure import write_report

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 16, 8, 128, 1024, 3072, 16
DTYPE = torch.bfloat16


def bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25))


def attention_case(num_seqs: int, context: int, new_tokens: int) -> tuple:
    """A batch of ``num_seqs`` sequences with ``context`` cached tokens and ``new_tokens`` queries
    each, blocks scattered over the pool."""
    from asyncllm.kernels.metadata import AttentionMetadata

    per_seq = -(-(context + new_tokens) // BLOCK)
    pool = torch.randperm(num_seqs * per_seq, device="cuda") + 1
    tables = pool.view(num_seqs, per_seq)
    shape = (num_seqs * per_seq + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=DTYPE) for _ in range(2))
    query = torch.randn(num_seqs * new_tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    starts = [i * new_tokens for i in range(num_seqs + 1)]
    lens = [context + new_tokens] * num_seqs

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.long, device="cuda"), query_start=starts, seq_lens=lens,
            block_tables=tables, seq_lens_tensor=torch.tensor(lens, device="cuda"),
            query_start_tensor=torch.tensor(starts, device="cuda"), block_size=BLOCK,
            decode_indices=list(range(num_seqs)) if new_tokens == 1 else [],
            prefill_indices=[] if new_tokens == 1 else list(range(num_seqs)))
    return query, k_cache, v_cache, meta


def attention_rows() -> list[dict[str, Any]]:
    from asyncllm.kernels.torch_attention import TorchAttentionBackend
    from asyncllm.kernels.triton_attention import AttentionTuning, TritonAttentionBackend

    backends = {"triton": TritonAttentionBackend(HEADS, KV_HEADS),
                "triton_no_split": TritonAttentionBackend(HEADS, KV_HEADS, AttentionTuning(max_splits=1)),
                "torch": TorchAttentionBackend()}
    rows = []
    cases = [(b, c, 1) for b in (1, 8, 64, 256) for c in (512, 2048)] + [(1, 0, 2048), (8, 0, 512), (4, 512, 512)]
    for num_seqs, context, new in cases:
        query, k_cache, v_cache, make_meta = attention_case(num_seqs, context, new)
        row: dict[str, Any] = {"seqs": num_seqs, "context": context, "new_tokens": new}
        for name, backend in backends.items():
            if name == "triton_no_split" and new > 1:
                continue
            meta = make_meta()
            backend.prepare(meta)
            row[f"{name}_ms"] = bench(lambda: backend.forward(query, k_cache, v_cache, meta, HEAD_DIM ** -0.5))
            if name == "triton" and new == 1:
                row["splits"] = meta.backend_state.launches[0].num_splits
        kv_bytes = 2 * num_seqs * (context + new) * KV_HEADS * HEAD_DIM * 2
        row["kv_gb_per_s"] = kv_bytes / (row["triton_ms"] * 1e-3) / 1e9
        rows.append(row)
        del query, k_cache, v_cache
    return rows


def elementwise_rows() -> list[dict[str, Any]]:
    from asyncllm.kernels import ops

    rows = []
    for tokens in (1, 256, 8192):
        x, residual = (torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE) for _ in range(2))
        w = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
        q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        cos, sin = (torch.randn(4096, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
        positions = torch.randint(0, 4096, (tokens,), device="cuda")
        gate_up = torch.randn(tokens, 2 * INTER, device="cuda", dtype=DTYPE)
        gate, up = gate_up.chunk(2, dim=-1)
        cases = {"rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
                 "add_rms_norm": lambda: ops.add_rms_norm(x, residual, w, 1e-6),
                 "rotary": lambda: ops.rotary_embedding(positions, q, k, cos, sin),
                 "silu_and_mul": lambda: ops.silu_and_mul(gate, up)}
        for name, fn in cases.items():
            torch_ms = bench(fn)
            with ops.triton_ops():
                triton_ms = bench(fn)
            rows.append({"op": name, "tokens": tokens, "torch_ms": torch_ms, "triton_ms": triton_ms,
                         "speedup": torch_ms / triton_ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "dtype": str(DTYPE), "started": time.time()}
    for name, rows in (("elementwise", elementwise_rows), ("attention", attention_rows)):
        t0 = time.perf_counter()
        with torch.inference_mode():
            report[name] = rows()
        print(f"[gpu_kernels] {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        write_report(out / "gpu_kernels.json", report)
    for row in report["attention"]:
        print("[gpu_kernels]", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    for row in report["elementwise"]:
        print("[gpu_kernels]", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

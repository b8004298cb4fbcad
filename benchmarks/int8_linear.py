"""Micro-benchmark of the weight-only int8 linear layer (``kernels/int8_linear.py``) on CPU.

    python -m benchmarks.int8_linear [--repeats 20] [--copies 30] [--rows 1,8,32,256]
                                     [--shapes 960x576,49152x576] [--json out.json] [--tiny]

Times, on SmolLM2-360M's projection shapes (N out x K in) at 1, 8, 32 and 256 rows:

- ``F.linear``: torch's float32 linear (MKL) on the dense weight;
- ``packed``: the float32 oneDNN ``PackedLinear`` of ``kernels/cpu_linear.py`` (the CPU path's float
  baseline);
- ``i8 chan`` / ``i8 g32``: ``Int8Linear`` with one scale per output channel / per 32 columns (GGUF
  Q8_0) through its normal dispatch (the C kernel on float32 CPU inputs);
- ``i8 widen`` (64 rows and more): the per-channel int8 weight widened to float32 by torch, then
  ``F.linear``: the alternative to the C kernel for prefill-sized inputs.

Each variant is timed *hot* (the same layer called again and again, its weight in cache) and
*cold*: calls cycle over ``--copies`` distinct copies of the layer, as a model's 30 layers would,
so at one row the weight comes from memory and the figure shows the bytes each format streams.
Copies are capped at about 1 GB per variant (the LM head is far larger than any cache anyway).

Each figure is the median of ``--repeats`` timed calls (cold: sweeps over the copies, per call)
after warm-up calls, in milliseconds, with the current torch thread count. Nothing is written
unless ``--json`` is given.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.cpu_kernels import time_ms
from benchmarks.measure import write_report

# SmolLM2-360M: (N out, K in) of q (and the fused qkv is 960), o, gate_up, down, LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = [1, 8, 32, 256]
COPY_BYTES_CAP = 1 << 30


def _median_ms(fn: Callable[[], object], repeats: int, calls: int = 1) -> float:
    """Median over ``repeats`` runs of ``fn`` (which makes ``calls`` layer calls), per call, in ms."""
    return time_ms(fn, repeats) / calls


def _variants(weight: torch.Tensor, copies: int) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> ``copies`` distinct callables computing ``x @ weight.T`` (or its int8 approximation)."""
    from asyncllm.kernels.cpu_linear import PackedLinear, packing_supported
    from asyncllm.kernels.int8_linear import Int8Linear
    from asyncllm.kernels.int8_weights import dequantize_weight

    n, k = weight.shape
    float_copies = max(2, min(copies, COPY_BYTES_CAP // (n * k * 4)))
    int8_copies = max(2, min(copies, COPY_BYTES_CAP // (n * k)))
    out: dict[str, list] = {}
    dense = [weight.clone() for _ in range(float_copies)]
    out["F.linear"] = [lambda x, w=w: F.linear(x, w) for w in dense]
    if packing_supported(torch.device("cpu"), torch.float32):
        out["packed"] = [PackedLinear(w, None) for w in dense]
    for name, group in (("i8 chan", None), ("i8 g32", 32)):
        layer = Int8Linear.from_float(weight, None, group)
        out[name] = [Int8Linear(layer.qweight.clone(), layer.scales.clone()) for _ in range(int8_copies)]
    out["i8 widen"] = [lambda x, m=m: F.linear(x, dequantize_weight(m.qweight, m.scales)) for m in out["i8 chan"]]
    return out


def bench(shapes, rows_list, repeats: int, copies: int) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        weight = torch.randn(n, k, generator=gen) / k ** 0.5
        variants = _variants(weight, copies)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            row = {"n": n, "k": k, "rows": rows}
            for name, layers in variants.items():
                if name == "i8 widen" and rows < 64:
                    continue
                with torch.inference_mode():
                    first = layers[0]
                    row[f"{name} hot"] = _median_ms(lambda: first(x), repeats)
                    reps = max(3, repeats // len(layers)) if rows > 1 else repeats

                    def sweep():
                        for layer in layers:
                            layer(x)

                    row[f"{name} cold"] = _median_ms(sweep, reps, len(layers))
            results.append(row)
            print(_format_row(row), flush=True)
        del variants
    return results


_COLUMNS = ("F.linear", "packed", "i8 chan", "i8 g32", "i8 widen")


def _header() -> str:
    cells = "".join(f"{name + ' ' + kind:>15s}" for name in _COLUMNS for kind in ("hot", "cold"))
    return f"{'N':>6s} {'K':>5s} {'M':>4s}{cells}"


def _format_row(row: dict) -> str:
    cells = "".join(f"{row[key]:15.4f}" if key in row else f"{'-':>15s}"
                    for key in (f"{name} {kind}" for name in _COLUMNS for kind in ("hot", "cold")))
    return f"{row['n']:6d} {row['k']:5d} {row['rows']:4d}{cells}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--copies", type=int, default=30, help="distinct layers the cold figures cycle over")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rows", help="comma-separated row counts (default 1,8,32,256)")
    parser.add_argument("--shapes", help="comma-separated NxK weight shapes (default: SmolLM2-360M's)")
    parser.add_argument("--tiny", action="store_true", help="small shapes, few repeats (tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        shapes, rows = [(96, 64)], [1, 8, 64]
        args.repeats, args.copies = min(args.repeats, 3), min(args.copies, 3)
    else:
        shapes, rows = SHAPES, ROWS
    if args.rows:
        rows = [int(r) for r in args.rows.split(",")]
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.shapes.split(",")]
    print(f"threads {torch.get_num_threads()}, median of {args.repeats} calls, ms per call; "
          f"cold: cycling over up to {args.copies} copies of the layer")
    print(_header(), flush=True)
    report = {"threads": torch.get_num_threads(), "repeats": args.repeats, "copies": args.copies,
              "results": bench(shapes, rows, args.repeats, args.copies)}
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()

"""Micro-benchmark of the 4-bit group-quantized CPU kernel (``kernels/cpu_int4_linear.py``).

    python -m benchmarks.int4_linear [--repeats 20] [--copies 30] [--group 64] [--rows 1,8,32,256]
                                     [--shapes 1536x576,576x1536,2048x2048] [--json out.json] [--tiny]

Times, on SmolLM2-135M-like projection shapes (N out x K in: gate/up 1536x576, down 576x1536) and a
larger square one (2048x2048) at 1, 8, 32 and 256 rows:

- ``i4``: ``GroupQuantLinear`` with 4-bit weights in groups of ``--group`` columns (asymmetric: random
  zero points) through its normal dispatch, which is the C kernel on float32 CPU inputs;
- ``i4 torch``: the torch reference of the same layer (``dequantize_groups``, then ``F.linear``): what
  ``GroupQuantLinear`` ran before the kernel, and what it runs where the kernel does not apply;
- ``i8``: ``Int8Linear`` (``kernels/int8_linear.py``) with the same group size, its C kernel;
- ``F.linear``: torch's float32 linear on the dense weight.

The kernels are timed *hot* (the same layer called again and again, its weight in cache) and *cold*:
calls cycle over ``--copies`` distinct copies of the layer, as a model's 30 layers would, so at one row
the weight comes from memory and the figure shows the bytes each format streams (copies capped at
about 1 GB per variant). The torch reference is timed hot only (it widens the weight every call).

Each figure is the median of ``--repeats`` timed calls (cold: sweeps over the copies, per call) after
warm-up calls, in milliseconds, with the current torch thread count. Nothing is written unless
``--json`` is given.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.cpu_kernels import time_ms
from benchmarks.measure import write_report

SHAPES = [(1536, 576), (576, 1536), (2048, 2048)]
ROWS = [1, 8, 32, 256]
COPY_BYTES_CAP = 1 << 30
_COLUMNS = ("i4", "i4 torch", "i8", "F.linear")
_HOT_ONLY = ("i4 torch",)


def _int4_layer(weight: torch.Tensor, group: int):
    """A 4-bit GroupQuantLinear approximating ``weight`` (per-group min/max, asymmetric)."""
    from asyncllm.kernels.quant_linear import GroupQuantLinear, pack_int4

    n, k = weight.shape
    w = weight.reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-8)
    zeros = (-low / scales).round().clamp(0, 15)
    q = (w / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15).reshape(n, k)
    return GroupQuantLinear(pack_int4(q), scales, zeros, bits=4)


def _variants(weight: torch.Tensor, group: int, copies: int) -> dict[str, list]:
    """name -> distinct callables computing ``x @ weight.T`` (or its quantized approximation)."""
    from asyncllm.kernels.int8_linear import Int8Linear
    from asyncllm.kernels.quant_linear import GroupQuantLinear, dequantize_groups

    n, k = weight.shape
    float_copies = max(2, min(copies, COPY_BYTES_CAP // (n * k * 4)))
    int8_copies = max(2, min(copies, COPY_BYTES_CAP // (n * k)))
    int4_copies = max(2, min(copies, COPY_BYTES_CAP // (n * k // 2)))
    out: dict[str, list] = {}
    i4 = _int4_layer(weight, group)
    out["i4"] = [GroupQuantLinear(i4.packed.clone(), i4.scales.clone(), i4.zeros.clone(), bits=4)
                 for _ in range(int4_copies)]
    out["i4 torch"] = [lambda x, m=i4: F.linear(x, dequantize_groups(m.packed, m.scales, m.zeros, 4))]
    i8 = Int8Linear.from_float(weight, None, group)
    out["i8"] = [Int8Linear(i8.qweight.clone(), i8.scales.clone()) for _ in range(int8_copies)]
    dense = [weight.clone() for _ in range(float_copies)]
    out["F.linear"] = [lambda x, w=w: F.linear(x, w) for w in dense]
    return out


def bench(shapes, rows_list, group: int, repeats: int, copies: int) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        weight = torch.randn(n, k, generator=gen) / k ** 0.5
        variants = _variants(weight, group, copies)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            row = {"n": n, "k": k, "rows": rows, "group": group}
            for name, layers in variants.items():
                with torch.inference_mode():
                    first = layers[0]
                    row[f"{name} hot"] = time_ms(lambda: first(x), repeats)
                    if name in _HOT_ONLY:
                        continue
                    reps = max(3, repeats // len(layers)) if rows > 1 else repeats

                    def sweep():
                        for layer in layers:
                            layer(x)

                    row[f"{name} cold"] = time_ms(sweep, reps) / len(layers)
            results.append(row)
            print(_format_row(row), flush=True)
        del variants
    return results


def _keys():
    return [f"{name} {kind}" for name in _COLUMNS for kind in ("hot", "cold")
            if not (kind == "cold" and name in _HOT_ONLY)]


def _header() -> str:
    return f"{'N':>6s} {'K':>5s} {'M':>4s}" + "".join(f"{key:>15s}" for key in _keys())


def _format_row(row: dict) -> str:
    cells = "".join(f"{row[key]:15.4f}" if key in row else f"{'-':>15s}" for key in _keys())
    return f"{row['n']:6d} {row['k']:5d} {row['rows']:4d}{cells}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--copies", type=int, default=30, help="distinct layers the cold figures cycle over")
    parser.add_argument("--group", type=int, default=64, help="columns per scale and zero point (all formats)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rows", help="comma-separated row counts (default 1,8,32,256)")
    parser.add_argument("--shapes", help="comma-separated NxK weight shapes (default 1536x576,576x1536,2048x2048)")
    parser.add_argument("--tiny", action="store_true", help="small shapes, few repeats (tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        shapes, rows = [(96, 128)], [1, 8, 64]
        args.repeats, args.copies = min(args.repeats, 3), min(args.copies, 3)
    else:
        shapes, rows = SHAPES, ROWS
    if args.rows:
        rows = [int(r) for r in args.rows.split(",")]
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.shapes.split(",")]
    from asyncllm.kernels.cpu_int4_linear import kernel_isa

    print(f"threads {torch.get_num_threads()}, group {args.group}, int4 kernel {kernel_isa() or 'unavailable'}, "
          f"median of {args.repeats} calls, ms per call; cold: cycling over up to {args.copies} copies of the layer")
    print(_header(), flush=True)
    report = {"threads": torch.get_num_threads(), "group": args.group, "repeats": args.repeats,
              "copies": args.copies, "int4_kernel": kernel_isa(),
              "results": bench(shapes, rows, args.group, args.repeats, args.copies)}
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()

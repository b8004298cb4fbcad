"""W-REAL int4: SmolLM2 as a 4-bit GPTQ and AWQ checkpoint against llama.cpp's Q4_0 and Q4_K_M (docs/benchmarks.md).

    python -m benchmarks.w_int4 [--batches 1,32] [--prompt-len 128] [--gen-len 128] [--repeats 1]
                                [--engines ...] [--json out.json]

The same weights for every engine: W-REAL's float32 SmolLM2-135M-Instruct directory (``benchmarks/w_real.py``,
made once in ``--work-dir``) is

- quantized to GPTQ 4-bit, groups of 128, symmetric (``asyncllm/toy/quantized.py``, round to nearest; SmolLM2's
  576-wide inputs end in a half group, as GPTQ writes them) and to AWQ GEMM 4-bit, groups of 64 (AWQ needs whole
  groups: 576 = 9 x 64), the other tensors float32;
- converted to a float32 GGUF, then ``llama-quantize``d to Q4_0 and Q4_K_M.

Two more asyncllm engines run only when named in ``--engines``: ``asyncllm-gptq4-g64-actorder`` (GPTQ 4-bit with
act-order, groups of 64) and ``asyncllm-gptq8-asym`` (GPTQ 8-bit with zero points, groups of 128), the layouts of
the CPU decode stack's act-order and byte paths (``ASYNCLLM_CPU_DECODE_STACK=0`` runs them without it).

asyncllm runs each checkpoint twice: ``dtype="float32"`` (``asyncllm-gptq4``, ``asyncllm-awq4``) and
``dtype="bfloat16"`` (``...-bf16``: the 4-bit projections as stored, the float LM head and its tied table read as
bf16 panels, as llama.cpp's files quantize theirs).

Workload and timing are W-REAL's: B requests of ``--prompt-len`` random token ids and ``--gen-len`` greedy tokens
(ignore_eos), wall time from submission to the last token, the median of ``--repeats`` after a warm-up. Memory:
the bytes the loaded model holds (its parameters and buffers) against the checkpoint's tensor bytes, and the
process's RSS rise (W-REAL's meter).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import w_real
from benchmarks.common import machine_info
from benchmarks.measure import utc_now, write_report

GPTQ, AWQ = "asyncllm-gptq4", "asyncllm-awq4"
# the same checkpoints with dtype="bfloat16": the float LM head (SmolLM2's tied table) read as bf16 panels
GPTQ_BF16, AWQ_BF16 = "asyncllm-gptq4-bf16", "asyncllm-awq4-bf16"
# not run by default: layouts of the decode stack's other quantized paths, act-order 4 bits (groups of 64: act-order
# needs whole groups) and asymmetric 8 bits (GroupQuantLinear bytes with zero points)
GPTQ_ACT, GPTQ8 = "asyncllm-gptq4-g64-actorder", "asyncllm-gptq8-asym"
Q4_0, Q4_K_M = "llamacpp-q4_0", "llamacpp-q4_k_m"
ENGINES = (GPTQ, AWQ, GPTQ_BF16, AWQ_BF16, Q4_0, Q4_K_M)
EXTRA_ENGINES = (GPTQ_ACT, GPTQ8)
ASYNCLLM = {GPTQ: (GPTQ, "float32"), AWQ: (AWQ, "float32"), GPTQ_BF16: (GPTQ, "bfloat16"),
            AWQ_BF16: (AWQ, "bfloat16"), GPTQ_ACT: (GPTQ_ACT, "float32"),
            GPTQ8: (GPTQ8, "float32")}  # engine: (its checkpoint, its dtype)
# checkpoint: (directory name, the writer's arguments)
CHECKPOINTS = {GPTQ: ("smollm2-gptq-4bit-g128", dict(bits=4, group_size=128, sym=True)),
               AWQ: ("smollm2-awq-4bit-g64", dict(group_size=64)),
               GPTQ_ACT: ("smollm2-gptq-4bit-g64-actorder", dict(bits=4, group_size=64, sym=True, desc_act=True)),
               GPTQ8: ("smollm2-gptq-8bit-g128-asym", dict(bits=8, group_size=128, sym=False,
                                                           checkpoint_format="gptq_v2"))}
QUANT_TYPES = {Q4_0: "Q4_0", Q4_K_M: "Q4_K_M"}
TARGETS = {"batch_1": 1.0, "batch_32": 1.3, "memory": 1.3}  # vs llama.cpp Q4_0; resident / checkpoint bytes


def ensure_quantized(hf_dir: Path, work_dir: Path, engine: str) -> Path:
    """The GPTQ or AWQ directory of checkpoint ``engine`` (:data:`CHECKPOINTS`) made from ``hf_dir`` (once)."""
    import torch

    from asyncllm.toy import quantized

    name, options = CHECKPOINTS[engine]
    target = work_dir / name
    if (target / "config.json").is_file():
        return target
    w_real.log(f"making {target.name} ...")
    tmp = target.with_name(target.name + ".tmp")
    writer = quantized.write_awq if engine == AWQ else quantized.write_gptq
    writer(hf_dir, tmp, dtype=torch.float32, **options)
    tmp.rename(target)
    return target


def ensure_llamacpp_quant(work_dir: Path, f32_gguf: Path, tree: Path, qtype: str) -> Path:
    """``smollm2-<qtype>.gguf`` from the float32 GGUF with ``llama-quantize`` (once)."""
    target = work_dir / f"smollm2-{qtype.lower()}.gguf"
    if target.is_file():
        return target
    binary = w_real.llamacpp_binary(tree, "llama-quantize")
    if binary is None:
        raise w_real.Unavailable("llama-quantize is not built")
    tmp = target.with_suffix(".tmp.gguf")
    proc = subprocess.run([str(binary), str(f32_gguf), str(tmp), qtype], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed: {proc.stderr.strip().splitlines()[-1:]}")
    tmp.rename(target)
    return target


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of the tensors in a checkpoint's safetensors files."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                shape, dtype = t.get_shape(), t.get_dtype()
                count = 1
                for d in shape:
                    count *= d
                total += count * {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1,
                                  "F8_E4M3": 1}.get(dtype, 4)
    return total


def model_bytes(llm) -> int:
    """Bytes the loaded model holds: its parameters, buffers and the tensors its modules keep as plain attributes
    (oneDNN-packed weights, the LM head's panels), each storage counted once."""
    import torch

    seen, total = set(), 0
    for module in llm.engine.runner.model.modules():
        held = [*module._parameters.values(), *module._buffers.values(),
                *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for t in held:
            if t is None:
                continue
            try:
                key = t.untyped_storage().data_ptr()
                size = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # opaque (mkldnn) tensors
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=w_real._batches, default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--work-dir", type=Path, default=w_real.DEFAULT_WORK_DIR)
    p.add_argument("--llamacpp-dir", type=Path, default=w_real.DEFAULT_LLAMACPP_DIR)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.engines = [e for e in (*ENGINES, *EXTRA_ENGINES) if e in args.engines.split(",")]
    args.threads = args.threads or w_real._usable_cores()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = utc_now()
    hf_dir = w_real.ensure_hf_dir(args.work_dir)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    tree = w_real.find_llamacpp_tree(args.llamacpp_dir)
    llm_kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "skip_tokenizer_init": True,
                  "max_num_seqs": max(32, max(args.batches)), "generation_config": "none"}
    results: dict[str, Any] = {}
    first_outputs: dict[str, list[int]] = {}
    for engine in args.engines:
        entry = w_real._entry(engine)
        results[engine] = entry
        try:
            if engine in ASYNCLLM:
                checkpoint, dtype = ASYNCLLM[engine]
                model_dir = ensure_quantized(hf_dir, args.work_dir, checkpoint)
                entry["model"], entry["dtype"] = model_dir.name, dtype
                entry["checkpoint_bytes"] = checkpoint_bytes(model_dir)
                holder: dict[str, Any] = {}

                def factory(model_dir=model_dir, holder=holder, dtype=dtype):
                    run, llm = w_real.make_asyncllm(str(model_dir), {**llm_kwargs, "dtype": dtype})
                    holder["model_bytes"] = model_bytes(llm)
                    return run, llm

                w_real.run_python_engine(entry, factory, args, vocab, first_outputs)
                entry["model_bytes"] = holder.get("model_bytes")
                if entry["model_bytes"]:
                    entry["memory_ratio"] = round(entry["model_bytes"] / entry["checkpoint_bytes"], 3)
            else:
                if tree is None:
                    raise w_real.Unavailable(f"no llama.cpp build in {args.llamacpp_dir} (python -m benchmarks.w_real "
                                             "--build-llamacpp)")
                f32 = w_real.ensure_gguf(args.work_dir, hf_dir, tree, "f32")
                gguf = ensure_llamacpp_quant(args.work_dir, f32, tree, QUANT_TYPES[engine])
                entry["model"], entry["checkpoint_bytes"] = gguf.name, gguf.stat().st_size
                w_real.run_llamacpp_engine(entry, w_real.llamacpp_binary(tree, "llama-batched-bench"), gguf, args,
                                           None)
        except Exception as e:  # noqa: BLE001 - the other engines still run
            w_real._fail(entry, e)
    comparisons = {}
    for engine in ASYNCLLM:
        for peer in (Q4_0, Q4_K_M):
            for b in args.batches:
                mine = results.get(engine, {}).get("batches", {}).get(str(b))
                theirs = results.get(peer, {}).get("batches", {}).get(str(b))
                if mine and theirs:
                    comparisons[f"{engine}/{peer}@{b}"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 3)
    report = {"benchmark": "w_int4", "started": started, "machine": machine_info(), "argv": sys.argv[1:],
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
              "results": results,
              "comparisons": comparisons, "targets": TARGETS}
    print_table(results, args.batches, comparisons)
    write_report(args.json, report)
    return 0


def print_table(results: dict, batches: list[int], comparisons: dict) -> None:
    print(f"\n{'engine':18} " + " ".join(f"{'B=' + str(b) + ' tok/s':>12}" for b in batches)
          + f" {'model MiB':>10} {'ckpt MiB':>9} {'ratio':>6}")
    for name, entry in results.items():
        cells = [f"{entry['batches'][str(b)]['tokens_per_s']:12.1f}" if str(b) in entry["batches"] else f"{'-':>12}"
                 for b in batches]
        held = entry.get("model_bytes")
        ckpt = entry.get("checkpoint_bytes")
        print(f"{name:18} " + " ".join(cells) + f" {held / 2**20 if held else float('nan'):10.1f}"
              f" {ckpt / 2**20 if ckpt else float('nan'):9.1f} {entry.get('memory_ratio', float('nan')):6.2f}"
              + (f"  ({entry['status']}: {entry.get('reason') or entry.get('error')})" if entry["status"] != "ok" else ""))
    for key, value in comparisons.items():
        print(f"  {key}: {value:.2f}x")


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    w_real.log(f"done in {time.perf_counter() - t0:.0f}s")
    raise SystemExit(code)

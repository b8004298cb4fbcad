"""Quantized checkpoints written from a tiny float checkpoint, laid out as each format's own tool writes them.

Each writer reads a float Hugging Face checkpoint directory (``config.json``, safetensors, tokenizer files),
quantizes every Linear projection of the decoder layers (``q/k/v/o_proj``, ``gate/up/down_proj``; never the
embeddings, norms or ``lm_head``, as the tools do by default) with deterministic round-to-nearest, and writes
the quantized checkpoint. Passing ``dst_dequant`` also writes the *dequantized twin*: a plain float32
checkpoint (no ``quantization_config``) whose projection weights are exactly the values the quantized files
encode, and whose other tensors are the quantized checkpoint's own (upcast to float32). transformers'
``AutoModelForCausalLM`` loads the twin, so it is the oracle for a loader of the quantized checkpoint
(weights only: activation quantization, W8A8 / FP8 inputs, is runtime behaviour no float model can encode).

The formats, in short (each section below says more, field by field):

- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K * bits / 32, N]`` packed along the input dim,
  ``qzeros`` int32 ``[G, N * bits / 32]`` packed along the output dim, ``scales`` float16 ``[G, N]``, ``g_idx``
  int32 ``[K]``. ``checkpoint_format="gptq"`` (v1) stores every zero point minus one, ``"gptq_v2"`` as is.
- AWQ GEMM (AutoAWQ): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[G, N / 8]``, both packed along the
  output dim in AWQ's interleaved nibble order, ``scales`` float16 ``[G, N]``.
- compressed-tensors (llm-compressor's save path): written *by the compressed-tensors library itself*
  (its preset schemes, ``calculate_qparams``, ``apply_quantization_config`` and ``ModelCompressor``).
- Fine-grained FP8 (DeepSeek-V3 / Qwen3-FP8): ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale_inv`` float32
  ``[ceil(N / bn), ceil(K / bk)]``.

``unpack_gptq`` / ``unpack_awq`` / ``unpack_fp8_block`` re-read the files independently, the way each tool's own
dequantization reads them; ``unpack_compressed_tensors`` uses the compressed-tensors library's own
decompressors. ``tests/test_quantized_checkpoints.py`` checks them against the twins.

This module imports nothing else of asyncllm: it is the independent implementation of each spec that the
loader (model/quant_methods.py) is tested against. The benchmarks use it to quantize SmolLM2.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import zlib
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "PROJECTIONS", "CT_SCHEMES",
    "write_gptq", "write_awq", "write_compressed_tensors", "write_fp8_block", "write_bnb_config_only",
    "unpack_gptq", "unpack_awq", "unpack_fp8_block", "unpack_compressed_tensors",
    "read_tensors", "read_config", "projection_modules",
]

# The decoder-layer projections every tool quantizes by default (the tools target every nn.Linear but the LM head),
# DeepSeek's latent-attention ones included.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_PROJECTION_RE = re.compile(r"(^|\.)layers\.\d+\.(.+\.)?(" + "|".join(PROJECTIONS) + r")$")

# Files a checkpoint directory keeps next to its weights that are rewritten rather than copied.
_REWRITTEN = {"config.json", "quantize_config.json", "quant_config.json", "model.safetensors.index.json"}


# --------------------------------------------------------------------------
# Reading and writing checkpoint directories
# --------------------------------------------------------------------------

def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (one ``model.safetensors`` or the shards of an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def projection_modules(tensors: Iterable[str]) -> list[str]:
    """Module names (``model.layers.0.self_attn.q_proj``) of the decoder projections among tensor names."""
    names = {k[: -len(".weight")] for k in tensors if k.endswith(".weight")}
    return sorted(n for n in names if _PROJECTION_RE.search(n))


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer files, generation config, chat template...: everything but the weights and configs."""
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in _REWRITTEN:
            shutil.copy2(f, dst / f.name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _set_config_dtype(config: dict, dtype: torch.dtype) -> None:
    # transformers 5 writes "dtype"; older checkpoints carry "torch_dtype". Keep whichever is there.
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for k in keys:
        config[k] = _dtype_name(dtype)


def _write_config(path: Path, config: dict) -> None:
    # as transformers' PretrainedConfig.to_json_file: indent 2, sorted keys
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _cast_float(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _prepare(src: Path, dst: Path) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config = read_config(src)
    config.pop("quantization_config", None)
    tensors = read_tensors(src)
    modules = projection_modules(tensors)
    if not modules:
        raise ValueError(f"{src}: no decoder projection ({', '.join(PROJECTIONS)}) found")
    return config, tensors, modules


def _write_twin(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The dequantized twin: ``tensors`` (all floats as float32), the source config without quantization."""
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config = read_config(src)
    config.pop("quantization_config", None)
    _set_config_dtype(config, torch.float32)
    _write_config(dst / "config.json", config)
    out = {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_side_files(src, dst)
    return dst


# --------------------------------------------------------------------------
# Bit packing into int32 words (GPTQ and AWQ)
# --------------------------------------------------------------------------

def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) reinterpreted as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit values along ``dim``: word ``w`` holds elements ``w * (32 // bits) + j`` at bit
    offset ``bits * j`` (element 0 in the lowest bits). This is AutoGPTQ's packing (``QuantLinear.pack``) of both
    ``qweight`` (``dim=0``, input dim) and ``qzeros`` (``dim=1``, output dim)."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not tile an int32 word")
    per_word = 32 // bits
    v = values.long().movedim(dim, -1)
    if v.shape[-1] % per_word:
        raise ValueError(f"{v.shape[-1]} values along dim {dim} are not a multiple of {per_word}")
    if v.min() < 0 or v.max() >= 2**bits:
        raise ValueError(f"values outside [0, {2**bits})")
    v = v.reshape(*v.shape[:-1], -1, per_word)
    words = (v << (torch.arange(per_word) * bits)).sum(-1)
    return _to_int32(words).movedim(-1, dim).contiguous()


# AutoAWQ (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear): within each int32 word of 8 nibbles,
# nibble i (bits 4i..4i+3) holds column ``8 * word + AWQ_ORDER[i]``. AWQ_REVERSE_ORDER undoes it
# (awq/utils/packing_utils.py). The order matches the layout its GEMM kernel's dequantization expects.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` 4-bit values as ``[R, N / 8]`` int32 words in AWQ's interleaved order."""
    r, n = values.shape
    if n % 8:
        raise ValueError(f"AWQ packs 8 output columns per word; {n} is not a multiple of 8")
    order = torch.tensor(AWQ_ORDER)
    interleaved = values.reshape(r, n // 8, 8)[:, :, order].reshape(r, n)
    return _pack_int32(interleaved, 4, dim=1)


# --------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------
#
# What AutoGPTQ writes (auto_gptq/nn_modules/qlinear/qlinear_cuda.py QuantLinear, auto_gptq/quantization/*):
#
#   <module>.qweight  int32 [K * bits / 32, N]  the unsigned integer weights q[k, n] in 0 .. 2**bits - 1,
#                                               transposed (input dim first), packed along K: row r holds input
#                                               columns r * (32 / bits) + j at bit offset bits * j. Rows are in
#                                               the ORIGINAL input-column order, act-order or not.
#   <module>.qzeros   int32 [G, N * bits / 32]  the integer zero point of each (group, output column), packed
#                                               along N the same way. checkpoint_format "gptq" (v1) stores
#                                               zero - 1 (AutoGPTQ's pack does ``zeros -= 1``; its kernels add
#                                               the 1 back); "gptq_v2" (AutoGPTQ >= 0.8, GPTQModel) stores the
#                                               zero itself. A v1 zero of 0 is unrepresentable (it underflows).
#   <module>.scales   float16 [G, N]            the scale of each (group, output column).
#   <module>.g_idx    int32 [K]                 the group of each input column. Without act-order it is
#                                               k // group_size. With act-order (desc_act) GPTQ visits the
#                                               columns in a permuted order ``perm`` (by decreasing Hessian
#                                               diagonal), and the i-th visited column falls in group
#                                               i // group_size: g_idx[perm[i]] = i // group_size.
#   <module>.bias     (if the layer has one)    in the model's dtype.
#
#   W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
#
# G = ceil(K / group_size); group_size -1 means one group over all of K. The scale/zero of a group are
# AutoGPTQ's Quantizer.find_params over the group's columns (per output row): the range [min, max] is widened
# to include 0; symmetric: max = max(|min|, max), min = -max if min < 0, zero = (maxq + 1) / 2; asymmetric:
# zero = round(-min / scale); scale = (max - min) / maxq (a range of zero becomes [-1, 1]); and
# q = clamp(round(w / scale) + zero, 0, maxq). The real GPTQ algorithm also updates the not yet quantized columns
# from the Hessian: here it is plain round-to-nearest (the on-disk layout is the same), with the stored float16
# scale, and with a seeded random permutation standing in for the Hessian order.
#
# The quantization config (AutoGPTQ BaseQuantizeConfig.to_dict): bits, group_size, damp_percent, desc_act,
# static_groups, sym, true_sequential, model_name_or_path, model_file_base_name, quant_method ("gptq"),
# checkpoint_format. AutoGPTQ's save_quantized puts it both in config.json (``quantization_config``) and in
# quantize_config.json; older AutoGPTQ releases (and checkpoints made with them) only had quantize_config.json,
# without the quant_method / checkpoint_format keys.

_GPTQ_FORMATS = ("gptq", "gptq_v2")
_GPTQ_CONFIG_LOCATIONS = ("config.json", "quantize_config.json", "both")


def _gptq_find_params(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's Quantizer.find_params (perchannel, weight=True) for ``x`` = [N, columns]: scale, zero [N]."""
    maxq = 2**bits - 1
    xmin = torch.minimum(x.min(1).values, torch.zeros(x.shape[0]))
    xmax = torch.maximum(x.max(1).values, torch.zeros(x.shape[0]))
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    dead = (xmin == 0) & (xmax == 0)
    xmin = torch.where(dead, -1.0, xmin)
    xmax = torch.where(dead, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


# projections that read the same input: GPTQ's Hessian (from that input), hence its act-order, is theirs alike
_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def _gptq_permutation(name: str, k: int, seed: int) -> torch.Tensor:
    head, _, leaf = name.rpartition(".")
    name = f"{head}.{_SAME_INPUT.get(leaf, leaf)}" if head else _SAME_INPUT.get(leaf, leaf)
    gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF)
    return torch.randperm(k, generator=gen)


def _gptq_quantize(w: torch.Tensor, name: str, bits: int, group_size: int, sym: bool, desc_act: bool, seed: int):
    """Round-to-nearest GPTQ of one ``[N, K]`` weight: q [K, N], zeros [G, N], scales fp16 [G, N], g_idx [K]."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    groups = math.ceil(k / gs)
    perm = _gptq_permutation(name, k, seed) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        scales[g], zeros[g] = _gptq_find_params(w[:, perm[g * gs:(g + 1) * gs]], bits, sym)
    scales16 = scales.half()
    s = scales16.float()[g_idx.long()]  # [K, N]
    z = zeros[g_idx.long()]
    q = torch.clamp(torch.round(w.t() / s) + z, 0, 2**bits - 1).long()
    return q, zeros.long(), scales16, g_idx


def _gptq_config_dict(bits, group_size, desc_act, sym, checkpoint_format) -> dict:
    return {
        "bits": bits, "group_size": group_size, "damp_percent": 0.01, "desc_act": desc_act,
        "static_groups": False, "sym": sym, "true_sequential": True,
        "model_name_or_path": None, "model_file_base_name": None,
        "quant_method": "gptq", "checkpoint_format": checkpoint_format,
    }


def write_gptq(src: Path, dst: Path, *, bits: int = 4, group_size: int = 128, sym: bool = True,
               desc_act: bool = False, checkpoint_format: str = "gptq", config_location: str = "config.json",
               legacy_quantize_config: bool = False, dtype: torch.dtype | None = torch.float16, seed: int = 0,
               dst_dequant: Path | None = None) -> Path:
    """A GPTQ checkpoint of ``src`` in ``dst`` (layout in the comment above); returns ``dst``.

    ``config_location``: ``"config.json"`` (``quantization_config`` in config.json, as transformers/optimum and
    GPTQModel checkpoints), ``"quantize_config.json"`` (the older separate file only, nothing in config.json), or
    ``"both"`` (what AutoGPTQ >= 0.5 save_quantized writes). ``legacy_quantize_config`` drops the
    ``quant_method`` / ``checkpoint_format`` keys, as in quantize_config.json files of old AutoGPTQ releases
    (only with ``checkpoint_format="gptq"``). ``dtype``: the dtype the tool ran the model in (AutoGPTQ loads
    float16 by default): the non-quantized tensors and biases are stored in it; None keeps the source's. The
    scales are float16 regardless. ``seed`` picks the act-order permutations.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 here (3-bit GPTQ straddles words), got {bits}")
    if checkpoint_format not in _GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {_GPTQ_FORMATS}, got {checkpoint_format!r}")
    if config_location not in _GPTQ_CONFIG_LOCATIONS:
        raise ValueError(f"config_location must be one of {_GPTQ_CONFIG_LOCATIONS}, got {config_location!r}")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group_size must be -1 or positive, got {group_size}")
    if legacy_quantize_config and (config_location != "quantize_config.json" or checkpoint_format != "gptq"):
        raise ValueError("legacy_quantize_config describes an old quantize_config.json of a v1 checkpoint")
    src, dst = Path(src), Path(dst)
    config, tensors, modules = _prepare(src, dst)
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key[: key.rfind(".")] in modules:
            continue
        out[key] = _cast_float(value, dtype)
        twin[key] = out[key]
    for name in modules:
        w = _cast_float(tensors[f"{name}.weight"], dtype).float()
        q, zeros, scales, g_idx = _gptq_quantize(w, name, bits, group_size, sym, desc_act, seed)
        if checkpoint_format == "gptq":
            if (zeros == 0).any():
                raise ValueError(f"{name}: a zero point of 0 cannot be stored in GPTQ v1 (zero - 1 underflows); "
                                 "use checkpoint_format='gptq_v2'")
            stored_zeros = zeros - 1
        else:
            stored_zeros = zeros
        out[f"{name}.qweight"] = _pack_int32(q, bits, dim=0)
        out[f"{name}.qzeros"] = _pack_int32(stored_zeros, bits, dim=1)
        out[f"{name}.scales"] = scales
        out[f"{name}.g_idx"] = g_idx
        twin[f"{name}.weight"] = (scales.float()[g_idx.long()] * (q - zeros[g_idx.long()]).float()).t()
        if f"{name}.bias" in tensors:
            out[f"{name}.bias"] = _cast_float(tensors[f"{name}.bias"], dtype)
            twin[f"{name}.bias"] = out[f"{name}.bias"]
    qconfig = _gptq_config_dict(bits, group_size, desc_act, sym, checkpoint_format)
    if dtype is not None:
        _set_config_dtype(config, dtype)
    if config_location in ("config.json", "both"):
        config["quantization_config"] = qconfig
    _write_config(dst / "config.json", config)
    if config_location in ("quantize_config.json", "both"):
        file_config = {**qconfig, "model_name_or_path": str(dst), "model_file_base_name": "model"}
        if legacy_quantize_config:
            file_config.pop("quant_method")
            file_config.pop("checkpoint_format")
        (dst / "quantize_config.json").write_text(json.dumps(file_config, indent=2))
    # AutoGPTQ's save_quantized also records the settings in the safetensors metadata
    metadata = {"format": "pt", "gptq_bits": str(bits), "gptq_group_size": str(group_size),
                "gptq_desc_act": str(desc_act), "gptq_damp_percent": "0.01",
                "gptq_checkpoint_format": checkpoint_format, "gptq_quant_method": "gptq"}
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata=metadata)
    _copy_side_files(src, dst)
    if dst_dequant is not None:
        _write_twin(src, dst_dequant, twin)
    return dst


def _gptq_read_config(path: Path) -> dict:
    """The GPTQ settings, looked up as AutoGPTQ's BaseQuantizeConfig.from_pretrained does."""
    path = Path(path)
    for name in ("quantize_config.json", "quant_config.json"):
        if (path / name).exists():
            return json.loads((path / name).read_text())
    return read_config(path)["quantization_config"]


def unpack_gptq(path: Path) -> dict[str, torch.Tensor]:
    """``{module: float32 [N, K] weight}`` of a GPTQ checkpoint, following AutoGPTQ's QuantLinear torch path
    (qlinear_cuda.py forward without the CUDA extension): shift each word right by ``range(0, 32, bits)``, mask,
    add 1 to the v1 zeros, and ``scales[g_idx] * (weight - zeros[g_idx])``. AutoGPTQ does that last product in
    float16; here it is float32, where it is exact."""
    qc = _gptq_read_config(path)
    bits = qc["bits"]
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    tensors = read_tensors(path)
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    small = torch.int16 if bits == 8 else torch.int8
    mask = 2**bits - 1
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        qweight, qzeros = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"]
        scales, g_idx = tensors[f"{name}.scales"], tensors[f"{name}.g_idx"].long()
        zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
        zeros = torch.bitwise_and(zeros.to(small), mask)
        if v1:
            zeros = zeros + 1
        zeros = zeros.reshape(scales.shape)
        weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))
        weight = torch.bitwise_and(weight.to(small), mask)
        weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])  # [K, N]
        w = scales.float()[g_idx] * (weight - zeros[g_idx]).float()
        out[name] = w.t().contiguous()
    return out


# --------------------------------------------------------------------------
# AWQ (AutoAWQ, GEMM version)
# --------------------------------------------------------------------------
#
# What AutoAWQ writes (awq/quantize/quantizer.py AwqQuantizer, awq/modules/linear/gemm.py WQLinear_GEMM):
#
#   <module>.qweight  int32 [K, N / 8]  the unsigned 4-bit weights q[k, n] (input dim first), packed along the
#                                       OUTPUT dim, 8 columns per word in AWQ_ORDER (see above).
#   <module>.qzeros   int32 [G, N / 8]  the integer zero point of each (group, output column), stored as is
#                                       (no minus one), packed and interleaved the same way.
#   <module>.scales   float16 [G, N]    the scale of each (group, output column).
#   <module>.bias     float16 [N]       if the layer has one (WQLinear_GEMM keeps it in float16).
#
#   W[n, k] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])
#
# G = K / group_size (it must divide K). The scale/zero are AutoAWQ's pseudo_quantize_tensor with zero_point:
# per (row, group) of the float16 weight, scale = max(max - min, 1e-5) / 15 and zero = clamp(-round(min / scale),
# 0, 15); q = clamp(round(w / scale) + zero, 0, 15). AWQ proper first rescales the weights by searched
# activation-aware factors (folded into the previous op) and clips them: plain round-to-nearest here, same
# layout. AutoAWQ runs the layers in float16 and saves the model in it. GEMM packing needs zero points
# (WQLinear_GEMM.from_linear asserts them), so zero_point=False is not a GEMM checkpoint AutoAWQ writes.
#
# config.json ``quantization_config`` (AutoAWQ AwqConfig.to_transformers_dict): quant_method "awq",
# zero_point, group_size, bits 4, version "gemm", modules_to_not_convert.


def _awq_quantize(w16: torch.Tensor, group_size: int):
    """``[N, K]`` float16 weight -> q [K, N], zeros [G, N], scales fp16 [G, N] (AutoAWQ's RTN, zero point)."""
    n, k = w16.shape
    g = w16.reshape(-1, group_size)
    max_val = g.amax(dim=1, keepdim=True)
    min_val = g.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15  # float16, as AutoAWQ computes it
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    scales = scales.reshape(n, -1)
    zeros = zeros.reshape(n, -1).long()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    q = torch.clamp(torch.round(w16.float() / s) + z, 0, 15).long()
    return q.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous()


def write_awq(src: Path, dst: Path, *, group_size: int = 128, zero_point: bool = True, version: str = "gemm",
              dtype: torch.dtype | None = torch.float16, dst_dequant: Path | None = None) -> Path:
    """An AutoAWQ GEMM checkpoint of ``src`` in ``dst`` (layout in the comment above); returns ``dst``.

    ``dtype``: the dtype of the non-quantized tensors (AutoAWQ loads and saves float16); None keeps the
    source's. Scales and biases are float16 regardless."""
    if version != "gemm":
        raise NotImplementedError(f"only AWQ GEMM is written here, not {version!r}")
    if not zero_point:
        raise NotImplementedError("AutoAWQ's GEMM packing requires zero points (WQLinear_GEMM.from_linear)")
    src, dst = Path(src), Path(dst)
    config, tensors, modules = _prepare(src, dst)
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key[: key.rfind(".")] in modules:
            continue
        out[key] = _cast_float(value, dtype)
        twin[key] = out[key]
    for name in modules:
        w = tensors[f"{name}.weight"]
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"{name}: group_size {group_size} does not divide {k} input columns")
        q, zeros, scales = _awq_quantize(w.half(), group_size)
        out[f"{name}.qweight"] = _pack_awq(q)
        out[f"{name}.qzeros"] = _pack_awq(zeros)
        out[f"{name}.scales"] = scales
        s = scales.float().repeat_interleave(group_size, dim=0)
        z = zeros.repeat_interleave(group_size, dim=0)
        twin[f"{name}.weight"] = ((q - z).float() * s).t()
        if f"{name}.bias" in tensors:
            out[f"{name}.bias"] = tensors[f"{name}.bias"].half()
            twin[f"{name}.bias"] = out[f"{name}.bias"]
    if dtype is not None:
        _set_config_dtype(config, dtype)
    config["quantization_config"] = {"quant_method": "awq", "zero_point": zero_point, "group_size": group_size,
                                     "bits": 4, "version": version, "modules_to_not_convert": None}
    _write_config(dst / "config.json", config)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_side_files(src, dst)
    if dst_dequant is not None:
        _write_twin(src, dst_dequant, twin)
    return dst


def unpack_awq(path: Path) -> dict[str, torch.Tensor]:
    """``{module: float32 [N, K] weight}`` of an AWQ GEMM checkpoint, following AutoAWQ's dequantize_gemm
    (awq/utils/packing_utils.py): unpack the words column-wise with shifts ``range(0, 32, 4)``, undo the
    interleave with AWQ_REVERSE_ORDER, mask, repeat scales and zeros over each group, ``(q - zeros) * scales``
    (float32 here, exact; AutoAWQ works in float16)."""
    qc = read_config(path)["quantization_config"]
    bits, group_size = qc["bits"], qc["group_size"]
    tensors = read_tensors(path)
    shifts = torch.arange(0, 32, bits)
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        qweight, qzeros, scales = tensors[key], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"]
        iweight = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
        iweight = iweight.view(iweight.shape[0], -1)
        izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
        izeros = izeros.view(izeros.shape[0], -1)
        reverse = torch.arange(izeros.shape[-1]).view(-1, 32 // bits)[:, list(AWQ_REVERSE_ORDER)].view(-1)
        iweight = torch.bitwise_and(iweight[:, reverse], 2**bits - 1)
        izeros = torch.bitwise_and(izeros[:, reverse], 2**bits - 1)
        s = scales.float().repeat_interleave(group_size, dim=0)
        z = izeros.repeat_interleave(group_size, dim=0)
        out[name] = ((iweight - z).float() * s).t().contiguous()
    return out


# --------------------------------------------------------------------------
# Fine-grained FP8 (DeepSeek-V3, Qwen3-FP8: quant_method "fp8" with weight_block_size)
# --------------------------------------------------------------------------
#
#   <module>.weight            float8_e4m3fn [N, K]
#   <module>.weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]   one scale per (bn x bk) block of the weight;
#                              the last block row/column is partial when bn / bk do not divide N / K.
#
#   W[n, k] = float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]
#
# The name says "inverse" because it is the reciprocal of the scale the weight was multiplied by when
# quantized; it is what dequantization multiplies by. Quantization as DeepSeek-V3's weight_quant kernel
# (inference/kernel.py): weight_scale_inv = max|block| / 448 (448 = e4m3's largest finite value), weight =
# block / weight_scale_inv cast to e4m3. A block of zeros gets weight_scale_inv 1 (the kernel would divide
# by 0). config.json quantization_config, as in DeepSeek-V3's: quant_method "fp8", fmt "e4m3",
# activation_scheme "dynamic" (activations are quantized per token group of bk at run time, no scales
# stored), weight_block_size [bn, bk]. Everything else keeps its dtype (bfloat16 in the real checkpoints).

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)  # 448


def _block_expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]


def _fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    n, k = w.shape
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float().abs()
    amax = padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    q = (w.float() / _block_expand(scale_inv, block, (n, k))).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return q, scale_inv


def write_fp8_block(src: Path, dst: Path, *, block: tuple[int, int] = (128, 128), dtype: torch.dtype | None = None,
                    dst_dequant: Path | None = None) -> Path:
    """A fine-grained (block-wise) FP8 checkpoint of ``src`` in ``dst``, as DeepSeek-V3 / Qwen3-FP8 ship
    (layout in the comment above); returns ``dst``. ``block`` = (rows bn, columns bk), recorded as
    ``weight_block_size``; tiny test models want e.g. (32, 32). ``dtype``: the non-quantized tensors' dtype
    (None keeps the source's)."""
    bn, bk = int(block[0]), int(block[1])
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive sizes, got {block}")
    src, dst = Path(src), Path(dst)
    config, tensors, modules = _prepare(src, dst)
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key[: -len(".weight")] in modules and key.endswith(".weight"):
            continue
        out[key] = _cast_float(value, dtype)
        twin[key] = out[key]
    for name in modules:
        w = _cast_float(tensors[f"{name}.weight"], dtype)
        q, scale_inv = _fp8_block_quantize(w, (bn, bk))
        out[f"{name}.weight"] = q
        out[f"{name}.weight_scale_inv"] = scale_inv
        twin[f"{name}.weight"] = q.float() * _block_expand(scale_inv, (bn, bk), tuple(q.shape))
    if dtype is not None:
        _set_config_dtype(config, dtype)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [bn, bk]}
    _write_config(dst / "config.json", config)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_side_files(src, dst)
    if dst_dequant is not None:
        _write_twin(src, dst_dequant, twin)
    return dst


def unpack_fp8_block(path: Path) -> dict[str, torch.Tensor]:
    """``{module: float32 [N, K] weight}`` of a fine-grained FP8 checkpoint, as DeepSeek-V3's weight_dequant:
    every element times the scale of its block, ``x[i, j] * s[i // bn, j // bk]``, in float32."""
    bn, bk = read_config(path)["quantization_config"]["weight_block_size"]
    tensors = read_tensors(path)
    out = {}
    for key in sorted(tensors):
        if key.endswith(".weight_scale_inv"):
            name = key[: -len(".weight_scale_inv")]
            x = tensors[f"{name}.weight"].float()
            rows = torch.arange(x.shape[0]) // bn
            cols = torch.arange(x.shape[1]) // bk
            out[name] = x * tensors[key][rows[:, None], cols[None, :]]
    return out


# --------------------------------------------------------------------------
# compressed-tensors (llm-compressor's output), written by the compressed-tensors library
# --------------------------------------------------------------------------
#
# llm-compressor's flow, reproduced with the library's own pieces: a preset scheme (preset_name_to_scheme)
# targeting "Linear" with "lm_head" ignored, in a QuantizationConfig; apply_quantization_config attaches the
# scheme and empty qparams (weight_scale, weight_zero_point, input_scale...) to every targeted Linear; the
# observers fill them (llm-compressor's min-max observers reduce the weight per tensor / output channel /
# group / block, the input activations over calibration batches, then call compressed-tensors'
# calculate_qparams); ModelCompressor.from_pretrained_model rebuilds the config from the model and infers
# the format, compress_model compresses every module in place, the model is saved with save_pretrained, and
# update_config writes config.json's quantization_config. llm-compressor also saves its recipe.yaml: not here.
#
# What the files then hold per quantized Linear (weight [N, K]):
#
#   pack-quantized (int weights, no activation quantization: W4A16, W4A16_ASYM, W8A16):
#     weight_packed      int32 [N, ceil(K * bits / 32)]  the signed ints q in [-2**(bits-1), 2**(bits-1)) plus
#                        2**(bits-1) (so unsigned), packed densely along K: element j at bit j * bits of the
#                        row's bit stream, word by word, lowest bits first (a value may straddle two words
#                        when 32 % bits != 0).
#     weight_shape       int64 [2]                       [N, K].
#     weight_scale       [N, K / group_size] (group) or [N, 1] (channel), in the model's dtype.
#     weight_zero_point  int32 [ceil(N * bits / 32), G]  asymmetric only: the signed zero points, offset and
#                        packed the same way but along N (dim 0).
#   int-quantized (W8A8): weight int8 [N, K]; weight_scale [N, 1]; activations quantized per token at run time.
#   float-quantized (FP8*): weight float8_e4m3fn [N, K]; weight_scale [1] (tensor), [N, 1] (channel) or
#     [ceil(N / bh), ceil(K / bw)] (block); FP8 static per-tensor also input_scale [1].
#
#   W = (q - zero_point) * scale, with scale/zero_point broadcast over their group / channel / block; computed
#   in the scale's dtype (compressed-tensors' _dequantize). Symmetric schemes store no zero point (it is 0).

# The test-facing names -> compressed-tensors preset names.
CT_SCHEMES = {
    "W4A16": "W4A16",            # int4 weights, symmetric, group 128
    "W4A16_ASYM": "W4A16_ASYM",  # int4 weights with zero points, group 128
    "W8A16": "W8A16",            # int8 weights, symmetric, group 128, still pack-quantized
    "W8A8": "W8A8",              # int8 per-channel weights, int8 dynamic per-token activations (int-quantized)
    "FP8": "FP8_DYNAMIC",        # fp8 per-channel weights, fp8 dynamic per-token activations
    "FP8_TENSOR": "FP8",         # fp8 per-tensor weights and static per-tensor activations (input_scale)
    "FP8_BLOCK": "FP8_BLOCK",    # fp8 128x128 block weights, fp8 dynamic per-group (128) activations
}


def _args_with(args, **changes):
    """A QuantizationArgs with ``changes``, re-validated, serialized like the preset (only its set fields)."""
    fields = {k: getattr(args, k) for k in args.model_fields_set}
    return type(args)(**{**fields, **changes})


def _ct_scheme(scheme: str, group_size: int | None, block: tuple[int, int] | None):
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme

    if scheme not in CT_SCHEMES:
        raise ValueError(f"scheme must be one of {list(CT_SCHEMES)}, got {scheme!r}")
    s = preset_name_to_scheme(CT_SCHEMES[scheme], ["Linear"])
    if group_size is not None:
        if s.weights.strategy != QuantizationStrategy.GROUP:
            raise ValueError(f"{scheme} weights are not group-quantized")
        s = s.model_copy(update={"weights": _args_with(s.weights, group_size=group_size)})
    if block is not None:
        if s.weights.strategy != QuantizationStrategy.BLOCK:
            raise ValueError(f"{scheme} weights are not block-quantized")
        s = s.model_copy(update={"weights": _args_with(s.weights, block_structure=[int(block[0]), int(block[1])])})
        # the activations are quantized in groups of the block's width (DeepSeek's 1 x 128 tiles)
        s = s.model_copy(update={"input_activations": _args_with(s.input_activations, group_size=int(block[1]))})
    return type(s).model_validate(s.model_dump())


def _ct_weight_min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-qparam min/max of a weight as llm-compressor's memoryless min-max observer reduces it."""
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    if args.strategy == S.TENSOR:
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == S.CHANNEL:
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy == S.GROUP:
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == S.BLOCK:
        bh, bw = args.block_structure
        p = maybe_pad_tensor_for_block_quant(w, (bh, bw))  # zero padding: does not distort the qparams
        b = p.reshape(p.shape[0] // bh, bh, p.shape[1] // bw, bw).transpose(1, 2).flatten(-2)
        return b.amin(-1), b.amax(-1)
    raise ValueError(f"weight strategy {args.strategy} not handled")


def _default_calibration_ids(vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(5, min(vocab_size, 1000), (2, 24), generator=gen)


def write_compressed_tensors(src: Path, dst: Path, scheme: str = "W4A16", *, group_size: int | None = None,
                             block: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
                             calibration_ids: torch.Tensor | None = None,
                             dst_dequant: Path | None = None) -> Path:
    """A compressed-tensors checkpoint of ``src`` in ``dst``, compressed and configured by the compressed-tensors
    library as llm-compressor saves it (see the comment above); returns ``dst``.

    ``scheme``: a key of :data:`CT_SCHEMES`. ``group_size`` overrides the preset's weight group (128) and
    ``block`` its weight block (128 x 128; the activation group follows the block width): tiny models are
    narrower than 128. ``dtype``: the dtype the model is loaded and saved in (None: the source's), which is also
    the scales' dtype. ``calibration_ids`` (``[batch, seq]`` token ids; default: fixed random ids) feed the
    static activation observer of FP8_TENSOR.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    quant_scheme = _ct_scheme(scheme, group_size, block)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    src_config = read_config(src)
    load_dtype = dtype or getattr(torch, src_config.get("dtype") or src_config.get("torch_dtype") or "float32")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=load_dtype).eval()

    # Static input activations (FP8_TENSOR): llm-compressor's static_minmax observer keeps the running min and
    # max of each targeted Linear's inputs over the calibration batches.
    inputs = quant_scheme.input_activations
    input_ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if inputs is not None and not inputs.dynamic:
        ids = calibration_ids if calibration_ids is not None else _default_calibration_ids(model.config.vocab_size)
        hooks = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and _PROJECTION_RE.search(name):
                def record(mod, args, name=name):
                    x = args[0].detach()
                    lo, hi = x.amin(), x.amax()
                    if name in input_ranges:
                        lo, hi = torch.minimum(lo, input_ranges[name][0]), torch.maximum(hi, input_ranges[name][1])
                    input_ranges[name] = (lo, hi)
                hooks.append(module.register_forward_pre_hook(record))
        with torch.no_grad():
            for row in ids:
                model(input_ids=row[None], use_cache=False)
        for h in hooks:
            h.remove()

    split = _split_stacked_experts(model)
    if split and input_ranges:
        raise ValueError(f"scheme {scheme!r}: static input scales need a calibration forward pass, which the "
                         "per-expert Linear modules written for a mixture-of-experts model do not run")
    config = QuantizationConfig(config_groups={"group_0": quant_scheme}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            module_scheme = getattr(module, "quantization_scheme", None)
            if module_scheme is None:
                continue
            if not _PROJECTION_RE.search(name):
                raise AssertionError(f"compressed-tensors targeted {name}, not a decoder projection")
            lo, hi = _ct_weight_min_max(module.weight.float(), module_scheme.weights)
            scale, zero = calculate_qparams(lo, hi, module_scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):
                scale, zero = calculate_qparams(input_ranges[name][0].reshape(1), input_ranges[name][1].reshape(1),
                                                module_scheme.input_activations)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
                if hasattr(module, "input_zero_point"):
                    module.input_zero_point.copy_(zero.reshape(module.input_zero_point.shape))

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(dst)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    compressor.update_config(str(dst))
    _copy_side_files(src, dst)
    if dst_dequant is not None:
        _write_twin(src, dst_dequant, _ct_dequantize_spec(dst))
    return dst


class _ExpertLinears(torch.nn.Module):
    """One expert as three Linear modules (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
            linear.weight.data.copy_(weight)
            setattr(self, name, linear)


def _split_stacked_experts(model: torch.nn.Module) -> int:
    """transformers' stacked experts (``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] parameters of one
    module) replaced by one module of Linear layers per expert, as llm-compressor unfuses them before it
    quantizes a mixture-of-experts model (its tools target Linear modules); they save as
    ``experts.<e>.<proj>.*``. The model is only saved afterwards, not run. Returns how many were split."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)
             and isinstance(getattr(module, "down_proj", None), torch.nn.Parameter)
             and module.gate_up_proj.dim() == 3 and not getattr(module, "is_transposed", False)]
    for name, module in found:
        gate, up = module.gate_up_proj.data.chunk(2, dim=1)
        experts = torch.nn.ModuleList(_ExpertLinears(gate[e], up[e], module.down_proj.data[e])
                                      for e in range(gate.shape[0]))
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, experts)
    return len(found)


def _unpack_dense_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense packing read from the spec: row r's element j is the ``bits``-bit field at bit
    ``j * bits`` of the row's words taken in order, lowest bit first; returns unsigned values [rows, count]."""
    words = packed.long() & 0xFFFFFFFF
    start = torch.arange(count) * bits
    word, offset = start // 32, start % 32
    value = words[:, word] >> offset
    spill = offset + bits > 32
    if spill.any():
        nxt = torch.zeros_like(value)
        nxt[:, spill] = words[:, word[spill] + 1] << (32 - offset[spill])
        value = value | nxt
    return value & (2**bits - 1)


def _ct_dequantize_spec(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a compressed-tensors checkpoint written here, with each quantized Linear's compressed
    tensors replaced by its dequantized ``weight``, read from the format's spec (comment above) without the
    library. This is the twin's content."""
    qc = read_config(path)["quantization_config"]
    (group,) = qc["config_groups"].values()
    fmt = group.get("format") or qc["format"]
    args = group["weights"]
    bits, strategy = args["num_bits"], args["strategy"]
    tensors = read_tensors(path)
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    out = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in modules or k.endswith(".bias")}
    for name in modules:
        scale = tensors[f"{name}.weight_scale"]
        zp = None
        if fmt == "pack-quantized":
            n, k = (int(v) for v in tensors[f"{name}.weight_shape"])
            q = _unpack_dense_int32(tensors[f"{name}.weight_packed"], bits, k) - 2 ** (bits - 1)
            if f"{name}.weight_zero_point" in tensors:
                zp = _unpack_dense_int32(tensors[f"{name}.weight_zero_point"].t(), bits, n).t() - 2 ** (bits - 1)
        elif fmt in ("int-quantized", "float-quantized"):
            q = tensors[f"{name}.weight"]
            n, k = q.shape
            zp = tensors.get(f"{name}.weight_zero_point")
        else:
            raise ValueError(f"format {fmt!r} not handled")
        if strategy == "group":
            expand = lambda t: t.repeat_interleave(args["group_size"], dim=1)  # noqa: E731
        elif strategy == "block":
            expand = lambda t: _block_expand(t, tuple(args["block_structure"]), (n, k))  # noqa: E731
        else:  # channel [N, 1] / tensor [1]: broadcast
            expand = lambda t: t  # noqa: E731
        w = q.to(scale.dtype)
        if zp is not None:
            w = w - expand(zp.to(scale.dtype))
        out[f"{name}.weight"] = w * expand(scale)
    return out


def unpack_compressed_tensors(path: Path) -> dict[str, torch.Tensor]:
    """``{module: [N, K] weight}`` of a compressed-tensors checkpoint, decompressed by the compressed-tensors
    library: the scheme from config.json, the compressor registered for its format, and that compressor's
    ``decompress`` on each module's tensors (the model-free path its converters use)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(read_config(path)["quantization_config"])
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
    tensors = read_tensors(path)
    local: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, param = key.rpartition(".")
        local.setdefault(module, {})[param] = value
    out = {}
    for module, params in sorted(local.items()):
        if "weight_scale" in params:
            params = {k: v for k, v in params.items() if k in compressor.compression_param_names(scheme)
                      or k == "weight"}
            out[module] = compressor.decompress(params, scheme)["weight"]
    return out


# --------------------------------------------------------------------------
# bitsandbytes: a config only
# --------------------------------------------------------------------------

def write_bnb_config_only(src: Path, dst: Path, *, load_in_4bit: bool = True) -> Path:
    """The float checkpoint ``src`` unchanged, but with a bitsandbytes ``quantization_config`` in config.json
    (transformers' BitsAndBytesConfig.to_dict: quantize on load, 4-bit NF4 or 8-bit LLM.int8()). A loader that
    cannot quantize with bitsandbytes must refuse it rather than silently load the float weights."""
    from transformers import BitsAndBytesConfig

    src, dst = Path(src), Path(dst)
    config, tensors, _ = _prepare(src, dst)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if load_in_4bit \
        else BitsAndBytesConfig(load_in_8bit=True)
    config["quantization_config"] = bnb.to_dict()
    _write_config(dst / "config.json", config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    _copy_side_files(src, dst)
    return dst

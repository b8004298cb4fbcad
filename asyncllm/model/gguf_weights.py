"""Weights out of a GGUF file (llama.cpp's format), named as Hugging Face checkpoints name them.

The file is read with the ``gguf`` package (llama.cpp's own reader); its ``dequantize`` widens every
type it knows (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...) to float32. Q8_0 tensors can
instead come out as they are stored: int8 values with one scale per 32 (:class:`QuantizedRows`), which
the engine's int8 linear layers run directly.

llama.cpp's converter reorders the rows of the query and key projections of Llama-architecture
files (it interleaves the two rotary halves of every head); :func:`unpermute_rows` undoes that, on
float rows and on int8 rows with their scales alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..errors import ModelLoadError

Q8_0_GROUP = 32  # values per Q8_0 block (one float16 scale, 32 int8)

# GGUF tensor name (per layer, after "blk.N.") -> Hugging Face module path (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# GGUF architectures whose tensors this module maps (each family declares its own: gguf_architectures);
# only "llama" files carry permuted q/k rows
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "granite", "olmo2", "smollm3", "glm4",
                               "command-r", "gemma", "gemma3")
_SCALARS = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64", "FLOAT32", "FLOAT64", "BOOL"}


@dataclass
class QuantizedRows:
    """An int8 weight as stored: ``qweight`` [rows, cols] int8 and ``scales`` [rows, cols // group]
    float32; the weight is ``qweight * scales`` repeated over each group of columns."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def group_size(self) -> int:
        return self.qweight.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        from ..kernels.int8_weights import dequantize_weight

        return dequantize_weight(self.qweight, self.scales)


def hf_name(gguf_name: str, renamed: dict[str, str] | None = None) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor (None for tensors the engine does not use);
    ``renamed``: the family's per-layer names where they differ from Llama's (``gguf_names`` of its class)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **(renamed or {})}
    match = _LAYER_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, kind, param = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{param}"


def unpermute_rows(rows: int, num_heads: int) -> np.ndarray:
    """Row order that turns a llama.cpp-permuted q/k projection back into Hugging Face's: for each head,
    llama.cpp stores rows (pair j, half s) where Hugging Face stores (half s, pair j)."""
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot unpermute {rows} rows over {num_heads} heads")
    return np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def gguf_architecture(reader) -> str:
    field = reader.get_field("general.architecture")
    if field is None:
        raise ModelLoadError("GGUF file has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def read_tensor_table(file: Path) -> dict:
    """The file's architecture and where each tensor lies (type, array shape and dtype, byte offset),
    read once by ``gguf``'s reader and kept with the converted metadata (model/source.py): parsing
    the metadata of a file with a 50k-token vocabulary takes the reader seconds, while reading the
    tensors from known offsets takes none."""
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    arch = gguf_architecture(reader)
    fields = {}  # the architecture's scalar metadata, by key after "<arch>." (model/source.py reads it)
    for key, field in reader.fields.items():
        if key.startswith(f"{arch}.") and len(field.types) == 1 and field.data and field.types[0].name in _SCALARS:
            fields[key[len(arch) + 1:]] = float(field.parts[field.data[0]][0])
    return {"architecture": arch, "fields": fields,
            "tensors": [{"name": t.name, "type": t.tensor_type.name, "shape": list(t.data.shape),
                         "dtype": t.data.dtype.str, "offset": int(t.data_offset)} for t in reader.tensors]}


def read_rope_freqs(file: Path, table: dict, name: str = "rope_freqs.weight") -> list[float] | None:
    """A small float32 tensor of rope factors, if the file has it: llama.cpp's converter stores a
    Llama 3.x model's rope scaling as one divisor per rotary frequency (``rope_freqs``) and longrope's
    two factor sets as ``rope_factors_long``/``rope_factors_short``, instead of as metadata."""
    entry = next((t for t in table["tensors"] if t["name"] == name), None)
    if entry is None:
        return None
    if entry["type"] != "F32":
        raise ModelLoadError(f"GGUF tensor {name} has type {entry['type']}, expected F32")
    data = np.memmap(file, dtype=np.dtype(entry["dtype"]), mode="r", offset=entry["offset"],
                     shape=tuple(entry["shape"]))
    return [float(x) for x in np.asarray(data, dtype=np.float32).reshape(-1)]


def linear_quant_types(table: dict) -> set[str]:
    """The GGML types of the projection weights (what decides whether a file runs as int8)."""
    return {t["type"] for t in table["tensors"]
            if len(t["shape"]) == 2 and t["name"].startswith("blk.") and t["name"].endswith(".weight")}


def iter_gguf_tensors(file: Path, table: dict, num_heads: int, num_kv_heads: int, keep_q8_0: bool,
                      architectures: tuple[str, ...] = SUPPORTED_GGUF_ARCHITECTURES,
                      renamed: dict[str, str] | None = None, permuted_qk: bool | None = None
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Every tensor of ``file`` the engine uses, as (Hugging Face name, float32 tensor or QuantizedRows).

    ``table`` is :func:`read_tensor_table`'s. ``keep_q8_0``: Q8_0 projection weights come out as
    :class:`QuantizedRows` instead of float32 (the token embedding is always widened: it is looked
    up, not multiplied)."""
    from gguf import GGMLQuantizationType, dequantize

    arch = table["architecture"]
    if arch not in architectures:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported for this model (supported: "
                             f"{', '.join(architectures)})")
    if permuted_qk is None:
        permuted_qk = arch == "llama"
    for entry in table["tensors"]:
        name = hf_name(entry["name"], renamed)
        if name is None:
            continue
        qtype = GGMLQuantizationType[entry["type"]]
        data = np.memmap(file, dtype=np.dtype(entry["dtype"]), mode="r", offset=entry["offset"],
                         shape=tuple(entry["shape"]))
        permute_heads = None
        if permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            permute_heads = num_heads if "q_proj" in name else num_kv_heads
        if (keep_q8_0 and qtype == GGMLQuantizationType.Q8_0 and len(entry["shape"]) == 2
                and name != "model.embed_tokens.weight"):
            value = _q8_0_rows(np.asarray(data))
            if permute_heads:
                order = torch.from_numpy(unpermute_rows(value.shape[0], permute_heads))
                value = QuantizedRows(value.qweight[order].contiguous(), value.scales[order].contiguous())
        else:
            array = dequantize(np.asarray(data), qtype)
            if permute_heads:
                array = array[unpermute_rows(array.shape[0], permute_heads)]
            value = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        yield name, value


def _q8_0_rows(data: np.ndarray) -> QuantizedRows:
    """Split Q8_0 blocks ([rows, blocks * 34] bytes: float16 scale, then 32 int8) into int8 and scales."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 2 + Q8_0_GROUP)
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, -1).astype(np.float32)
    qweight = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, -1)
    return QuantizedRows(torch.from_numpy(qweight), torch.from_numpy(scales))

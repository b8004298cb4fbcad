"""Reading a checkpoint's quantization_config: the formats run here, the ones refused (with a clear error),
and ``quantization=`` agreeing with the checkpoint (docs/quantization.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncllm import LLM
from asyncllm.errors import ConfigError, ModelLoadError
from asyncllm.model.quant_formats import check_requested, checkpoint_format


def _with_config(src: Path, dst: Path, quantization_config: dict | None, legacy: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    if legacy is not None:
        (dst / "quantize_config.json").write_text(json.dumps(legacy))
    return dst


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}


@pytest.mark.parametrize("config, expected", [
    (GPTQ, ("gptq", "int", 4, 128, False, True, 1)),
    ({**GPTQ, "checkpoint_format": "gptq_v2", "group_size": -1, "bits": 8}, ("gptq", "int", 8, None, False, True, 0)),
    ({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64, "zero_point": True},
     ("awq", "int", 4, 64, False, False, 0)),
    (CT_W4A16, ("compressed-tensors", "int", 4, 32, True, False, 0)),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     ("fp8", "fp8", 8, None, True, False, 0)),
])
def test_formats_are_read_from_config_json(tmp_path, llama_dir, config, expected):
    fmt = checkpoint_format(_with_config(llama_dir, tmp_path / "q", config))
    assert (fmt.method, fmt.kind, fmt.bits, fmt.group_size, fmt.sym, fmt.desc_act, fmt.zero_offset) == expected


def test_older_gptq_exports_say_it_in_quantize_config_json(tmp_path, llama_dir):
    fmt = checkpoint_format(_with_config(llama_dir, tmp_path / "q", None,
                                         legacy={"bits": 4, "group_size": 32, "desc_act": False, "sym": True}))
    assert (fmt.method, fmt.bits, fmt.group_size, fmt.sym) == ("gptq", 4, 32, True)


def test_ignored_modules_stay_float():
    fmt = checkpoint_format.__globals__["_compressed_tensors"]({**CT_W4A16, "ignore": ["lm_head", "re:.*mlp.down_proj$"]})
    assert fmt.skips("lm_head") and fmt.skips("model.layers.3.mlp.down_proj")
    assert not fmt.skips("model.layers.3.mlp.gate_up_proj")


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
    ({"quant_method": "hqq", "nbits": 4}, "hqq"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4}, "gemv"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
    ({**CT_W4A16, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                            "strategy": "tensor_group"}}}, "format": "nvfp4-pack-quantized"},
     "nvfp4"),
])
def test_unsupported_methods_are_refused_by_name(tmp_path, llama_dir, config, named):
    """Loading goes no further than the config, and the error names the method and what is supported."""
    model = _with_config(llama_dir, tmp_path / "q", config)
    with pytest.raises(ModelLoadError, match=named):
        LLM(str(model), dtype="float32")


def test_a_float_checkpoint_carrying_a_bitsandbytes_config_is_not_silently_float(tmp_path, llama_dir):
    model = _with_config(llama_dir, tmp_path / "q", {"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(ModelLoadError, match="supported: gptq, awq, compressed-tensors, fp8"):
        LLM(str(model), dtype="float32")


@pytest.mark.parametrize("requested, config, message", [
    ("gptq", None, "not quantized"),
    ("awq", GPTQ, "disagrees"),
    ("int8", GPTQ, "already quantized"),
    ("none", CT_W4A16, "already quantized"),
])
def test_quantization_argument_must_agree_with_the_checkpoint(tmp_path, llama_dir, requested, config, message):
    model = _with_config(llama_dir, tmp_path / "q", config) if config else llama_dir
    with pytest.raises(ConfigError, match=message):
        LLM(str(model), dtype="float32", quantization=requested)


def test_quantization_names_are_checked_and_aliases_agree():
    fmt = checkpoint_format.__globals__["_gptq"](GPTQ)
    check_requested("gptq_marlin", fmt)  # vLLM's kernel-named alias of the same format
    check_requested(None, fmt)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        LLM("/nowhere", quantization="int3")

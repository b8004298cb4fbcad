"""asyncllm/toy/quantized.py: each quantized checkpoint against its dequantized twin and the formats' specs.

For every writer: the files hold the tensors the format specifies (names, dtypes, shapes, config keys); an
independent reading of the files (AutoGPTQ's / AutoAWQ's / DeepSeek's dequantization, compressed-tensors'
own decompressors and converters, transformers' loaders) gives exactly the twin's weights; the twin is a
plain float checkpoint transformers loads; and the dequantized weights are the original ones up to half a
quantization step (which catches a scale applied to the wrong group, row or column).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from asyncllm.toy import quantized as qc

TINY = dict(hidden_size=64, intermediate_size=128)  # the default llama: q/o 64x64, k/v 32x64, mlp 128x64 / 64x128


def _float_weights(path):
    return {k[: -len(".weight")]: v.float() for k, v in qc.read_tensors(path).items() if k.endswith(".weight")}


def _twin_projections(path):
    tensors = qc.read_tensors(path)
    return {name: tensors[f"{name}.weight"] for name in qc.projection_modules(tensors)}


def _assert_same(actual: dict, expected: dict):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name


def _assert_twin(twin, quantized, expected: dict):
    """The twin: float32, no quantization_config, every non-projection tensor the quantized checkpoint's own,
    loadable by transformers with the projection weights in ``expected``."""
    from transformers import AutoModelForCausalLM

    config = json.loads((twin / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert not (twin / "quantize_config.json").exists()
    assert (twin / "tokenizer.json").exists()
    tensors = qc.read_tensors(twin)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    stored = qc.read_tensors(quantized)
    for key, value in tensors.items():
        if key.rsplit(".", 1)[0] not in expected:
            assert torch.equal(value, stored[key].float()), key
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    state = model.state_dict()
    for name, weight in expected.items():
        assert torch.equal(state[f"{name}.weight"], weight), name


def _assert_close_to_original(dequant: dict, original: dict, step: dict, bits: int):
    """|W - dequant(W)| <= half a step, element-wise, plus what the stored scale's own rounding moves the grid:
    the scales are rounded to float16 (by up to 2**-11 of themselves), which shifts a weight's position on the
    grid by up to 2**-11 of its distance, in steps, from the zero point (at most |W| / step + 2**bits)."""
    for name, w in dequant.items():
        err = (w - original[name]).abs()
        bound = 0.5 * step[name] + 2**-11 * (original[name].abs() + 2**bits * step[name]) + 1e-7
        assert (err <= bound).all(), (name, float((err / step[name]).max()))


# --------------------------------------------------------------------------
# packing known answers
# --------------------------------------------------------------------------

def test_int32_packing_known_answers():
    # GPTQ: 8 nibbles of one column, element j at bits 4j..4j+3
    q = torch.arange(1, 9).reshape(8, 1)
    assert qc._pack_int32(q, 4, dim=0).item() == 0x87654321 - 2**32
    assert qc._pack_int32(torch.tensor([[0x12, 0x34, 0x56, 0x78]]), 8, dim=1).item() == 0x78563412
    # AWQ: word nibble i holds column AWQ_ORDER[i] -> columns 0..7 with value c give nibbles 0,2,4,6,1,3,5,7
    assert qc._pack_awq(torch.arange(8).reshape(1, 8)).item() == 0x75316420
    # compressed-tensors' dense packing, read from the spec, against the library's packer (int8 signed inputs)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4, 5, 8):
        values = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (3, 40), generator=gen).to(torch.int8)
        packed = pack_to_int32(values, bits)
        assert packed.shape == (3, math.ceil(40 * bits / 32))
        assert torch.equal(qc._unpack_dense_int32(packed, bits, 40) - 2 ** (bits - 1), values.long())


# --------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------

def _autogptq_pack_loop(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ QuantLinear.pack's qweight loop over intweight [K, N] (uint32), for 2/4/8 bits."""
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 32 // bits):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    return qweight.astype(np.int32)


GPTQ_CASES = [
    dict(bits=4, group_size=32, sym=True, desc_act=False, checkpoint_format="gptq", config_location="config.json"),
    dict(bits=4, group_size=32, sym=True, desc_act=True, checkpoint_format="gptq", config_location="both"),
    dict(bits=4, group_size=64, sym=False, desc_act=True, checkpoint_format="gptq_v2",
         config_location="quantize_config.json"),
    dict(bits=8, group_size=32, sym=True, desc_act=False, checkpoint_format="gptq_v2", config_location="config.json"),
    dict(bits=8, group_size=-1, sym=False, desc_act=False, checkpoint_format="gptq", config_location="config.json"),
    dict(bits=4, group_size=32, sym=False, desc_act=False, checkpoint_format="gptq",
         config_location="quantize_config.json", legacy_quantize_config=True),
]


@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_gptq(model_dir_factory, tmp_path, case):
    src = model_dir_factory("llama")
    dst = qc.write_gptq(src, tmp_path / "q", dst_dequant=tmp_path / "twin", **case)
    bits, gs, sym = case["bits"], case["group_size"], case["sym"]
    config = json.loads((dst / "config.json").read_text())
    assert config["dtype"] == "float16"
    if case["config_location"] == "quantize_config.json":
        assert "quantization_config" not in config
        qconfig = json.loads((dst / "quantize_config.json").read_text())
    else:
        qconfig = config["quantization_config"]
        if case["config_location"] == "both":
            assert json.loads((dst / "quantize_config.json").read_text())["bits"] == bits
        else:
            assert not (dst / "quantize_config.json").exists()
    if case.get("legacy_quantize_config"):
        assert "quant_method" not in qconfig and "checkpoint_format" not in qconfig
    else:
        assert qconfig["quant_method"] == "gptq" and qconfig["checkpoint_format"] == case["checkpoint_format"]
    assert (qconfig["bits"], qconfig["group_size"], qconfig["sym"], qconfig["desc_act"]) == \
        (bits, gs, sym, case["desc_act"])

    tensors = qc.read_tensors(dst)
    original = _float_weights(src)
    modules = qc.projection_modules(qc.read_tensors(src))
    assert len(modules) == 14 and not any(k.endswith(("embed_tokens.qweight", "lm_head.qweight")) for k in tensors)
    assert tensors["lm_head.weight"].dtype == torch.float16 and tensors["model.norm.weight"].dtype == torch.float16
    twin = _twin_projections(tmp_path / "twin")
    step = {}
    for name in modules:
        n, k = original[name].shape
        groups = 1 if gs == -1 else k // gs
        assert f"{name}.weight" not in tensors
        qweight, qzeros, scales, g_idx = (tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx"))
        assert qweight.dtype == torch.int32 and qweight.shape == (k * bits // 32, n)
        assert qzeros.dtype == torch.int32 and qzeros.shape == (groups, n * bits // 32)
        assert scales.dtype == torch.float16 and scales.shape == (groups, n)
        assert g_idx.dtype == torch.int32 and g_idx.shape == (k,)
        assert torch.bincount(g_idx.long(), minlength=groups).tolist() == [k // groups] * groups
        if case["desc_act"] and groups > 1:
            assert not torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // gs)  # a real permutation
        elif not case["desc_act"]:
            assert torch.equal(g_idx.long(), torch.arange(k) // (k if gs == -1 else gs))
        if sym:  # the zero point is (maxq + 1) / 2, stored minus one in v1: every field 7/127 (v1) or 8/128 (v2)
            field = 2 ** (bits - 1) - (case["checkpoint_format"] == "gptq")
            word = sum(field << (bits * j) for j in range(32 // bits))
            assert (qzeros.long() & 0xFFFFFFFF == word).all()
            # qweight, packed again by AutoGPTQ's own loop from the integers the twin implies
            intweight = torch.round(twin[name].t() / scales.float()[g_idx.long()] + 2 ** (bits - 1)).long()
            assert torch.equal(torch.from_numpy(_autogptq_pack_loop(intweight.numpy().astype(np.uint32), bits)),
                               qweight)
        step[name] = scales.float()[g_idx.long()].t()
    _assert_same(qc.unpack_gptq(dst), twin)
    fp16_original = {k: v.half().float() for k, v in original.items()}
    _assert_close_to_original(twin, fp16_original, step, bits)
    _assert_twin(tmp_path / "twin", dst, twin)


def test_gptq_bias_and_source_dtype(model_dir_factory, tmp_path):
    src = model_dir_factory("llama_bias")
    dst = qc.write_gptq(src, tmp_path / "q", bits=4, group_size=32, dtype=None, dst_dequant=tmp_path / "twin")
    tensors, source = qc.read_tensors(dst), qc.read_tensors(src)
    assert json.loads((dst / "config.json").read_text())["dtype"] == "float32"
    for name in qc.projection_modules(source):
        assert torch.equal(tensors[f"{name}.bias"], source[f"{name}.bias"])
    assert torch.equal(tensors["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    twin = _twin_projections(tmp_path / "twin")
    _assert_same(qc.unpack_gptq(dst), twin)
    _assert_twin(tmp_path / "twin", dst, twin)


# --------------------------------------------------------------------------
# AWQ
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind,group_size", [("llama", 32), ("llama_bias", 64)])
def test_awq(model_dir_factory, tmp_path, kind, group_size):
    src = model_dir_factory(kind)
    dst = qc.write_awq(src, tmp_path / "q", group_size=group_size, dst_dequant=tmp_path / "twin")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "zero_point": True, "group_size": group_size,
                                             "bits": 4, "version": "gemm", "modules_to_not_convert": None}
    tensors = qc.read_tensors(dst)
    original = _float_weights(src)
    modules = qc.projection_modules(qc.read_tensors(src))
    step = {}
    for name in modules:
        n, k = original[name].shape
        qweight, qzeros, scales = (tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales"))
        assert qweight.dtype == torch.int32 and qweight.shape == (k, n // 8)
        assert qzeros.dtype == torch.int32 and qzeros.shape == (k // group_size, n // 8)
        assert scales.dtype == torch.float16 and scales.shape == (k // group_size, n)
        assert f"{name}.weight" not in tensors and f"{name}.g_idx" not in tensors
        if kind == "llama_bias":
            assert tensors[f"{name}.bias"].dtype == torch.float16
        step[name] = scales.float().repeat_interleave(group_size, 0).t()
    twin = _twin_projections(tmp_path / "twin")
    _assert_same(qc.unpack_awq(dst), twin)

    # compressed-tensors' AutoAWQ converter (its own unpacking and reverse order), then its decompressor
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert import AutoAWQConverter

    converter = AutoAWQConverter.from_autoawq_config(config["quantization_config"])
    converted = converter.process(dict(tensors))
    (scheme,) = converter._build_quant_config().config_groups.values()
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    for name in modules:
        local = {p: converted[f"{name}.{p}"] for p in ("weight_packed", "weight_shape", "weight_zero_point")}
        local["weight_scale"] = converted[f"{name}.weight_scale"].float()  # float16 would round the product
        assert torch.equal(compressor.decompress(local, scheme)["weight"], twin[name]), name

    _assert_close_to_original(twin, {k: v.half().float() for k, v in original.items()}, step, 4)
    _assert_twin(tmp_path / "twin", dst, twin)


# --------------------------------------------------------------------------
# fine-grained FP8
# --------------------------------------------------------------------------

def _assert_fp8_close(twin: dict, original: dict, step: dict):
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4, plus half the smallest subnormal step (2**-9 * scale)
    for name, w in twin.items():
        err = (w - original[name]).abs()
        assert (err <= 2**-4 * original[name].abs() + 2**-10 * step[name] + 1e-7).all(), name


@pytest.mark.parametrize("block", [(32, 32), (48, 40)])
def test_fp8_block(model_dir_factory, tmp_path, block):
    src = model_dir_factory("llama")
    dst = qc.write_fp8_block(src, tmp_path / "q", block=block, dst_dequant=tmp_path / "twin")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(block)}
    tensors = qc.read_tensors(dst)
    original = _float_weights(src)
    twin = _twin_projections(tmp_path / "twin")
    step = {}
    for name in qc.projection_modules(qc.read_tensors(src)):
        n, k = original[name].shape
        w, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and w.shape == (n, k)
        assert s.dtype == torch.float32 and s.shape == (math.ceil(n / block[0]), math.ceil(k / block[1]))
        step[name] = qc._block_expand(s, block, (n, k))
        # every block reaches e4m3's largest value 448 (the scale is the block's amax / 448)
        padded = torch.zeros(s.shape[0] * block[0], s.shape[1] * block[1])
        padded[:n, :k] = w.float().abs()
        assert (padded.reshape(s.shape[0], block[0], s.shape[1], block[1]).amax(dim=(1, 3)) == 448).all()
    assert tensors["lm_head.weight"].dtype == torch.float32
    _assert_same(qc.unpack_fp8_block(dst), twin)

    # compressed-tensors' FP8 block dequantizer (its own padding and block reshape)
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    dequantizer = FP8BlockDequantizer.from_pretrained(dst, weight_block_size=block, dtype=torch.float32)
    dequantized = dequantizer.process(dict(tensors))
    _assert_same({name: dequantized[f"{name}.weight"] for name in twin}, twin)
    if all(w.shape[0] % block[0] == 0 and w.shape[1] % block[1] == 0 for w in twin.values()):
        # transformers' fine-grained FP8 loader, dequantizing on load (it needs whole blocks)
        from transformers import AutoModelForCausalLM, FineGrainedFP8Config

        model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True))
        state = model.state_dict()
        _assert_same({name: state[f"{name}.weight"] for name in twin}, twin)
    _assert_fp8_close(twin, original, step)
    _assert_twin(tmp_path / "twin", dst, twin)


# --------------------------------------------------------------------------
# compressed-tensors
# --------------------------------------------------------------------------

CT_CASES = {
    # scheme: (format, overrides, expected per-module tensors {suffix: (dtype, shape(n, k))})
    "W4A16": ("pack-quantized", dict(group_size=32), {
        "weight_packed": (torch.int32, lambda n, k: (n, k // 8)),
        "weight_scale": (torch.float32, lambda n, k: (n, k // 32)),
        "weight_shape": (torch.int64, lambda n, k: (2,))}),
    "W4A16_ASYM": ("pack-quantized", dict(group_size=32), {
        "weight_packed": (torch.int32, lambda n, k: (n, k // 8)),
        "weight_scale": (torch.float32, lambda n, k: (n, k // 32)),
        "weight_zero_point": (torch.int32, lambda n, k: (n // 8, k // 32)),
        "weight_shape": (torch.int64, lambda n, k: (2,))}),
    "W8A16": ("pack-quantized", dict(group_size=32), {
        "weight_packed": (torch.int32, lambda n, k: (n, k // 4)),
        "weight_scale": (torch.float32, lambda n, k: (n, k // 32)),
        "weight_shape": (torch.int64, lambda n, k: (2,))}),
    "W8A8": ("int-quantized", {}, {
        "weight": (torch.int8, lambda n, k: (n, k)),
        "weight_scale": (torch.float32, lambda n, k: (n, 1))}),
    "FP8": ("float-quantized", {}, {
        "weight": (torch.float8_e4m3fn, lambda n, k: (n, k)),
        "weight_scale": (torch.float32, lambda n, k: (n, 1))}),
    "FP8_TENSOR": ("float-quantized", {}, {
        "weight": (torch.float8_e4m3fn, lambda n, k: (n, k)),
        "weight_scale": (torch.float32, lambda n, k: (1,)),
        "input_scale": (torch.float32, lambda n, k: (1,))}),
    "FP8_BLOCK": ("float-quantized", dict(block=(32, 32)), {
        "weight": (torch.float8_e4m3fn, lambda n, k: (n, k)),
        "weight_scale": (torch.float32, lambda n, k: (n // 32, k // 32))}),
}


def _ct_step(tensors, name, n, k, fmt, args):
    scale = tensors[f"{name}.weight_scale"].float()
    if args["strategy"] == "group":
        return scale.repeat_interleave(args["group_size"], 1)
    if args["strategy"] == "block":
        return qc._block_expand(scale, tuple(args["block_structure"]), (n, k))
    return scale.expand(n, k)


@pytest.mark.parametrize("scheme", list(CT_CASES))
def test_compressed_tensors(model_dir_factory, tmp_path, scheme):
    fmt, overrides, expected = CT_CASES[scheme]
    src = model_dir_factory("llama")
    dst = qc.write_compressed_tensors(src, tmp_path / "q", scheme, dst_dequant=tmp_path / "twin", **overrides)
    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == fmt
    assert qconfig["quantization_status"] == "compressed" and qconfig["ignore"] == ["lm_head"]
    (group,) = qconfig["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    weights, inputs = group["weights"], group["input_activations"]
    if scheme.startswith("W4") or scheme == "W8A16":
        assert inputs is None and weights["strategy"] == "group" and weights["group_size"] == 32
        assert weights["symmetric"] == (scheme != "W4A16_ASYM")
    elif scheme in ("W8A8", "FP8"):
        assert weights["strategy"] == "channel" and inputs["strategy"] == "token" and inputs["dynamic"] is True
    elif scheme == "FP8_TENSOR":
        assert weights["strategy"] == "tensor" and inputs["strategy"] == "tensor" and inputs["dynamic"] is False
    else:
        assert weights["block_structure"] == [32, 32] and inputs["group_size"] == 32 and inputs["dynamic"] is True

    tensors = qc.read_tensors(dst)
    original = _float_weights(src)
    modules = qc.projection_modules(qc.read_tensors(src))
    step = {}
    for name in modules:
        n, k = original[name].shape
        found = {key.rsplit(".", 1)[1] for key in tensors if key.rsplit(".", 1)[0] == name}
        assert found == set(expected), (name, found)
        for suffix, (dtype, shape) in expected.items():
            assert tensors[f"{name}.{suffix}"].dtype == dtype, (name, suffix)
            assert tuple(tensors[f"{name}.{suffix}"].shape) == shape(n, k), (name, suffix)
        if "weight_shape" in expected:
            assert tensors[f"{name}.weight_shape"].tolist() == [n, k]
        step[name] = _ct_step(tensors, name, n, k, fmt, weights)
    assert tensors["lm_head.weight"].dtype == torch.float32 and "lm_head.weight_scale" not in tensors
    if scheme == "FP8_TENSOR":
        assert all(tensors[f"{name}.input_scale"].item() > 0 for name in modules)

    twin = _twin_projections(tmp_path / "twin")
    _assert_same(qc.unpack_compressed_tensors(dst), twin)
    # transformers' compressed-tensors integration, decompressing on load
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    state = model.state_dict()
    _assert_same({name: state[f"{name}.weight"] for name in twin}, twin)
    if weights["type"] == "float":
        _assert_fp8_close(twin, original, step)
    else:
        _assert_close_to_original(twin, original, step, weights["num_bits"])
    _assert_twin(tmp_path / "twin", dst, twin)


def test_compressed_tensors_presets_on_wider_model(model_dir_factory, tmp_path):
    """The presets unchanged (group 128, 128x128 blocks) on a model wide enough for them; k/v have 64 rows,
    so their FP8 blocks are partial (ceil)."""
    src = model_dir_factory("llama", hidden_size=128, intermediate_size=256)
    for scheme, shapes in (("W4A16", {"model.layers.0.self_attn.k_proj.weight_scale": (64, 1),
                                      "model.layers.0.mlp.down_proj.weight_scale": (128, 2)}),
                           ("FP8_BLOCK", {"model.layers.0.self_attn.k_proj.weight_scale": (1, 1),
                                          "model.layers.0.mlp.down_proj.weight_scale": (1, 2)})):
        dst = qc.write_compressed_tensors(src, tmp_path / scheme, scheme, dst_dequant=tmp_path / f"{scheme}-twin")
        (group,) = json.loads((dst / "config.json").read_text())["quantization_config"]["config_groups"].values()
        assert group["weights"].get("group_size") == 128 or group["weights"].get("block_structure") == [128, 128]
        tensors = qc.read_tensors(dst)
        for key, shape in shapes.items():
            assert tuple(tensors[key].shape) == shape, key
        _assert_same(qc.unpack_compressed_tensors(dst), _twin_projections(tmp_path / f"{scheme}-twin"))


# --------------------------------------------------------------------------
# bitsandbytes: config only
# --------------------------------------------------------------------------

@pytest.mark.parametrize("load_in_4bit", [True, False])
def test_bnb_config_only(model_dir_factory, tmp_path, load_in_4bit):
    src = model_dir_factory("llama")
    dst = qc.write_bnb_config_only(src, tmp_path / "q", load_in_4bit=load_in_4bit)
    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "bitsandbytes"
    assert (qconfig["load_in_4bit"], qconfig["load_in_8bit"]) == (load_in_4bit, not load_in_4bit)
    if load_in_4bit:
        assert qconfig["bnb_4bit_quant_type"] == "nf4"
    source, written = qc.read_tensors(src), qc.read_tensors(dst)
    assert sorted(source) == sorted(written) and all(torch.equal(source[k], written[k]) for k in source)
    assert (dst / "tokenizer.json").exists()


def test_writer_argument_checks(model_dir_factory, tmp_path):
    src = model_dir_factory("llama")
    with pytest.raises(ValueError, match="checkpoint_format"):
        qc.write_gptq(src, tmp_path / "a", checkpoint_format="marlin")
    with pytest.raises(ValueError, match="config_location"):
        qc.write_gptq(src, tmp_path / "b", config_location="elsewhere.json")
    with pytest.raises(NotImplementedError, match="zero points"):
        qc.write_awq(src, tmp_path / "c", group_size=32, zero_point=False)
    with pytest.raises(ValueError, match="does not divide"):
        qc.write_awq(src, tmp_path / "d", group_size=48)
    with pytest.raises(ValueError, match="scheme"):
        qc.write_compressed_tensors(src, tmp_path / "e", "W3A16")

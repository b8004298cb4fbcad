"""Where models come from (model/source.py): hub ids from a local hub cache, GGUF files (float and
Q8_0, the latter run as int8), and the loader's niceties (architectures from model_type,
skip_tokenizer_init, generation_config.json defaults)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.errors import ConfigError, InvalidRequestError, ModelLoadError
from asyncllm.model.gguf_weights import unpermute_rows
from asyncllm.model.source import resolve_model_source
from asyncllm.toy.gguf_export import export_gguf, permute_rows

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41], [9, 8, 7, 6, 5, 4, 3, 200, 100], [700]]


def make_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = "c" * 40, ref: str = "main") -> Path:
    """A Hugging Face hub cache entry for ``repo_id`` holding ``source``'s files (blobs + snapshot links)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        if file.is_file():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copy(file, blob)
            link = snapshot / file.name
            if not link.exists():
                link.symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _greedy(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# ---- hub ids ---------------------------------------------------------------------------------------

def test_hub_id_loads_from_the_local_hub_cache(offline_hub, model_dirs):
    make_hub_cache(offline_hub, "toy-org/tiny-llama", model_dirs["llama"])
    by_id = LLM("toy-org/tiny-llama", dtype="float32")
    assert by_id.engine.model_dir.parent.parent.name == "models--toy-org--tiny-llama"
    assert by_id.engine.source.hub_id == "toy-org/tiny-llama"
    assert _greedy(by_id) == _greedy(LLM(str(model_dirs["llama"]), dtype="float32"))


def test_hub_revision_and_missing_ids_are_clear_errors(offline_hub, model_dirs):
    make_hub_cache(offline_hub, "toy-org/tiny-llama", model_dirs["llama"], commit="d" * 40, ref="v1")
    assert resolve_model_source("toy-org/tiny-llama", revision="v1").root.name == "d" * 40
    with pytest.raises(ModelLoadError, match=r"'toy-org/absent' is not in the local cache and HF_HUB_OFFLINE=1"):
        LLM("toy-org/absent")
    with pytest.raises(ModelLoadError, match="at revision 'v2'"):
        resolve_model_source("toy-org/tiny-llama", revision="v2")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("./no/such/dir")


# ---- GGUF --------------------------------------------------------------------------------------------

def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.arange(8 * 12 * 3).reshape(8 * 12, 3).numpy()
    for heads in (1, 4, 12):
        permuted = permute_rows(weight, heads)
        assert (permuted != weight).any()
        assert (permuted[unpermute_rows(weight.shape[0], heads)] == weight).all()


@pytest.fixture(scope="module")
def toy_ggufs(model_dir_factory, tmp_path_factory):
    """The llama toy checkpoint with 2 KV heads (GQA: q and k permuted over different head counts)
    as F32 and Q8_0 GGUF files."""
    source = model_dir_factory("llama", num_key_value_heads=2)
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for qtype in ("F32", "Q8_0"):
        folder = out / qtype
        folder.mkdir()
        files[qtype] = export_gguf(source, folder / f"toy-{qtype}.gguf", qtype)
    return source, files


def _transformers_greedy(gguf: Path, prompts=PROMPTS, new_tokens: int = 12, config=None) -> list[list[int]]:
    """transformers' greedy output on the GGUF file's (dequantized) weights; ``config``: the original
    checkpoint's config, whose rope scaling transformers' GGUF reader does not read from the file."""
    from transformers import AutoModelForCausalLM

    kwargs = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 **kwargs).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            full = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False)
            outs.append(full[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_greedy_equals_transformers_reading_the_same_file(toy_ggufs, qtype):
    """The oracle is transformers on the file's weights with the original config: the toy Llama has
    llama3 rope scaling, which the file holds only as llama.cpp's rope_freqs tensor."""
    from transformers import AutoConfig

    source, files = toy_ggufs
    llm = LLM(str(files[qtype]), dtype="float32")
    assert llm.engine.runner.weight_format.int8 == (qtype == "Q8_0")  # Q8_0 runs as int8, as stored
    assert llm.engine.hf_config.rope_freq_factors  # read from the file
    assert _greedy(llm) == _transformers_greedy(files[qtype], config=AutoConfig.from_pretrained(source))
    # a directory holding one .gguf file is the same model; the chat template came along
    assert _greedy(LLM(str(files[qtype].parent), dtype="float32")) == _greedy(llm)
    assert llm.tokenizer.chat_template


def test_llama3_scaled_gguf_equals_the_float_original(toy_ggufs):
    """An F32 GGUF of a llama3-scaled Llama is the original checkpoint: same greedy tokens as
    transformers on the safetensors original (plain rope, what transformers' GGUF reader gives,
    would differ: checked too, so the scaling decides tokens here)."""
    from checkpoints import load_reference_model, reference_greedy

    source, files = toy_ggufs
    long_prompts = [list(range(5, 300)), [7, 8, 9] * 40]  # past original_max_position_embeddings (256)
    llm = LLM(str(files["F32"]), dtype="float32")
    got = [o.outputs[0].token_ids for o in llm.generate(long_prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                     ignore_eos=True))]
    assert got == reference_greedy(source, long_prompts, 12, model=load_reference_model(source))
    assert got != _transformers_greedy(files["F32"], long_prompts)


def test_q8_0_int8_equals_its_widened_weights(toy_ggufs):
    _, files = toy_ggufs
    as_int8 = LLM(str(files["Q8_0"]), dtype="float32")
    widened = LLM(str(files["Q8_0"]), dtype="float32", quantization="none")
    assert not widened.engine.runner.weight_format.int8
    logprob = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a, b = as_int8.generate(PROMPTS, logprob), widened.generate(PROMPTS, logprob)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=1e-3)


def test_gguf_tokenizer_and_metadata_cache(toy_ggufs, monkeypatch, tmp_path):
    source, files = toy_ggufs
    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model_source(files["F32"])
    assert first.is_gguf and (first.root / "config.json").is_file()
    assert resolve_model_source(files["F32"]).root == first.root  # converted once
    llm = LLM(str(files["F32"]), dtype="float32")
    reference = LLM(str(source), dtype="float32")
    text = "The quick brown fox, naïve café 日本語"
    assert llm.tokenizer.encode(text) == reference.tokenizer.encode(text)
    (out,) = llm.generate([[{"role": "user", "content": "hi"}]], SamplingParams(temperature=0, max_tokens=4))
    (ref,) = reference.generate([[{"role": "user", "content": "hi"}]], SamplingParams(temperature=0, max_tokens=4))
    assert out.prompt_token_ids == ref.prompt_token_ids  # the chat template came along
    ids = list(range(5, 400, 7))
    assert llm.tokenizer.decode(ids) == reference.tokenizer.decode(ids)


def test_bad_gguf_paths(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        LLM(str(tmp_path))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        LLM(str(text))
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(tmp_path / "a.gguf"))


# ---- int8 for any checkpoint ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int8_quantization_of_a_float_checkpoint(kind, model_dirs, tmp_path):
    float32 = LLM(str(model_dirs[kind]), dtype="float32")
    int8 = LLM(str(model_dirs[kind]), dtype="float32", quantization="int8")
    runner = int8.engine.runner
    assert runner.weight_format.int8 and runner.weight_format.group_size is None
    from asyncllm.kernels.int8_linear import Int8Linear

    assert isinstance(runner.model.lm_head, Int8Linear)
    assert isinstance(runner.model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    # the exact reference: float32 on the checkpoint's weights rounded to int8 and back
    rounded = _rounded_checkpoint(model_dirs[kind], tmp_path / "rounded")
    logprob = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    got, expected = int8.generate(PROMPTS, logprob), LLM(str(rounded), dtype="float32").generate(PROMPTS, logprob)
    for x, y in zip(got, expected):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=1e-3)
    # and the int8 model stays close to the float one: per-layer relative error well under 1%
    dense = float32.engine.runner.model.model.layers[0].mlp.down_proj.weight
    quantized = runner.model.model.layers[0].mlp.down_proj.weight
    assert ((dense - quantized).norm() / dense.norm()).item() < 0.01
    with pytest.raises(ConfigError, match="quantization"):
        LLM(str(model_dirs[kind]), quantization="int4")  # (no such method: "fp8" quantizes at load, see quantization.md)


def _rounded_checkpoint(source: Path, out: Path) -> Path:
    """A copy of ``source`` whose projection weights and LM head went through per-channel int8 and
    back (a head tied to the embeddings becomes a separate rounded head: the engine looks tokens up
    in the float table and multiplies by the int8 one)."""
    from safetensors.torch import load_file, save_file

    from asyncllm.kernels.int8_weights import dequantize_weight, quantize_weight

    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        for name, tensor in tensors.items():
            if tensor.dim() == 2 and ("proj" in name or "lm_head" in name):
                tensors[name] = dequantize_weight(*quantize_weight(tensor.float()))
        save_file(tensors, file, metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- loader niceties -----------------------------------------------------------------------------------

def test_architectures_missing_falls_back_to_model_type(tmp_path, model_dirs):
    copy = tmp_path / "no-arch"
    shutil.copytree(model_dirs["qwen2"], copy)
    config = json.loads((copy / "config.json").read_text())
    del config["architectures"]
    (copy / "config.json").write_text(json.dumps(config))
    assert _greedy(LLM(str(copy), dtype="float32")) == _greedy(LLM(str(model_dirs["qwen2"]), dtype="float32"))


def test_skip_tokenizer_init_serves_token_ids(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", skip_tokenizer_init=True)
    assert llm.tokenizer is None
    (out,) = llm.generate([PROMPTS[0]], GREEDY)
    assert out.outputs[0].token_ids == _greedy(LLM(str(model_dirs["llama"]), dtype="float32"))[0]
    assert out.outputs[0].text == ""
    for prompt, kwargs, field in (("text", {}, "prompt"), ([{"role": "user", "content": "x"}], {}, "prompt"),
                                  (PROMPTS[0], {"stop": ["x"]}, "stop"), (PROMPTS[0], {"regex": "a+"}, "regex")):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([prompt], SamplingParams(max_tokens=2, **kwargs))
        assert info.value.field == field and "skip_tokenizer_init" in str(info.value)

    async def stream():
        async with AsyncLLM(str(model_dirs["llama"]), dtype="float32", skip_tokenizer_init=True) as allm:
            tokens = []
            async for out in allm.stream_outputs(PROMPTS[0], temperature=0, max_tokens=12, ignore_eos=True):
                tokens.extend(out.outputs[0].token_ids)
            return tokens

    assert asyncio.run(stream()) == out.outputs[0].token_ids

    async def serve() -> None:
        from asyncllm.server import create_app

        async with AsyncLLM(str(model_dirs["llama"]), dtype="float32", skip_tokenizer_init=True) as allm:
            with pytest.raises(ConfigError, match="skip_tokenizer_init"):
                create_app(allm)

    asyncio.run(serve())


def test_generation_config_defaults_apply_to_unset_fields(tmp_path, model_dirs):
    copy = tmp_path / "with-defaults"
    shutil.copytree(model_dirs["llama"], copy)
    (copy / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 5}))
    llm = LLM(str(copy), dtype="float32")
    request = llm.inputs.process(PROMPTS[0], None, sampling_kwargs={"ignore_eos": True})[1]
    assert request.params.temperature == 0.0 and request.max_tokens == 5
    explicit = llm.inputs.process(PROMPTS[0], None, sampling_kwargs={"temperature": 0.7, "max_tokens": 3})[1]
    assert explicit.params.temperature == 0.7 and explicit.max_tokens == 3
    given = llm.inputs.process(PROMPTS[0], SamplingParams(max_tokens=4))[1]  # an explicit object is kept
    assert given.params.temperature == 1.0
    off = LLM(str(copy), dtype="float32", generation_config="none")
    assert off.inputs.process(PROMPTS[0], None)[1].params.temperature == 1.0
    with pytest.raises(ConfigError, match="generation_config"):
        LLM(str(copy), generation_config="vllm")
    # values no request could use are dropped (with a warning), not applied to every request
    (copy / "generation_config.json").write_text(json.dumps({"temperature": -3, "top_p": 0.5, "max_new_tokens": 0}))
    request = LLM(str(copy), dtype="float32").inputs.process(PROMPTS[0], None)[1]
    assert request.params.temperature == 1.0 and request.params.top_p == 0.5 and request.max_tokens == 16
    for bad in ({"revision": ""}, {"revision": 3}, {"hf_token": 5}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            LLM(str(copy), **bad)


def test_server_names_a_hub_model_by_its_id(offline_hub, model_dirs):
    from asyncllm.server.app import default_model_name

    make_hub_cache(offline_hub, "toy-org/tiny-llama", model_dirs["llama"])

    async def name() -> tuple[str, str]:
        async with AsyncLLM("toy-org/tiny-llama", dtype="float32") as by_id, \
                AsyncLLM(str(model_dirs["llama"]), dtype="float32") as by_path:
            return default_model_name(by_id), default_model_name(by_path)

    assert asyncio.run(name()) == ("toy-org/tiny-llama", model_dirs["llama"].name)

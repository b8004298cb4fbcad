"""Multi-LoRA: parity with PEFT's merged models, mixed batches, more adapters than slots, hot loads."""

import asyncio
import json
import random
import threading
import time

import pytest
import torch

from asyncllm import LLM, AsyncLLM, LoRARequest, SamplingParams
from asyncllm.errors import LoRAError
from checkpoints import load_reference_model, reference_greedy

ADAPTERS = {  # name: (rank, alpha, target modules, rsLoRA)
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp2": (2, 4, ["o_proj", "up_proj", "down_proj"], False),
    "kg16": (16, 16, ["k_proj", "gate_proj"], False),
}
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(3, 20))] for _ in range(count)]


@pytest.fixture(scope="module")
def lora_setup(model_dirs, tmp_path_factory):
    """PEFT adapters with random non-zero A and B, and the greedy tokens of each merged model."""
    from peft import LoraConfig, get_peft_model

    base_dir = model_dirs["llama"]
    prompts = _prompts(0)
    paths, expected = {}, {"base": reference_greedy(base_dir, prompts, NEW_TOKENS)}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(load_reference_model(base_dir), LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False))
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_A" in param_name:
                    param.mul_(3.0)  # make every adapter change the greedy text
        paths[name] = tmp_path_factory.mktemp(f"lora-{name}")
        peft_model.save_pretrained(paths[name])
        merged = peft_model.merge_and_unload()
        expected[name] = reference_greedy(base_dir, prompts, NEW_TOKENS, model=merged)
        assert expected[name] != expected["base"]
    return {"base_dir": str(base_dir), "paths": paths, "prompts": prompts, "expected": expected}


def test_each_adapter_alone_equals_peft_merged(lora_setup):
    llm = LLM(lora_setup["base_dir"], dtype="float32", block_size=4)
    for name, path in lora_setup["paths"].items():
        llm.add_lora(name, str(path))
    assert llm.list_loras() == sorted(ADAPTERS)
    for name in ADAPTERS:
        outputs = llm.generate(lora_setup["prompts"], GREEDY, lora=name)
        assert [o.outputs[0].token_ids for o in outputs] == lora_setup["expected"][name], name
    base = llm.generate(lora_setup["prompts"], GREEDY)
    assert [o.outputs[0].token_ids for o in base] == lora_setup["expected"]["base"]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("max_loras", [8, 2])
def test_mixed_batch_of_all_adapters_and_base(lora_setup, max_loras):
    """Every adapter and the base model in one batch; with max_loras=2 the 4 adapters take turns."""
    llm = LLM(lora_setup["base_dir"], dtype="float32", block_size=4, max_loras=max_loras)
    names = [None] + list(ADAPTERS)
    prompts, loras, want = [], [], []
    for name in names * 2:
        for p, expected in zip(lora_setup["prompts"], lora_setup["expected"][name or "base"]):
            prompts.append(p)
            loras.append(None if name is None else LoRARequest(name, str(lora_setup["paths"][name])))
            want.append(expected)
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    outputs = llm.generate([prompts[i] for i in order], GREEDY, lora=[loras[i] for i in order])
    assert [o.outputs[0].token_ids for o in outputs] == [want[i] for i in order]
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["loras_in_use"] == 0


def test_adapters_never_share_prefix_cache_blocks(lora_setup):
    llm = LLM(lora_setup["base_dir"], dtype="float32", block_size=4)
    prompt = lora_setup["prompts"][1]
    llm.generate([prompt], GREEDY)
    hits = llm.stats()["prefix_cache_hits"]
    lora = LoRARequest("qv4", str(lora_setup["paths"]["qv4"]))
    (out,) = llm.generate([prompt], GREEDY, lora=lora)
    assert llm.stats()["prefix_cache_hits"] == hits  # the base model's blocks were not reused
    (again,) = llm.generate([prompt], GREEDY, lora=lora)
    assert llm.stats()["prefix_cache_hits"] > hits  # but the adapter's own blocks are
    assert out.outputs[0].token_ids == again.outputs[0].token_ids == lora_setup["expected"]["qv4"][1]


def test_async_mixed_streams_and_hot_load_do_not_pause_others(lora_setup):
    registry_load_seconds = 0.6

    async def main():
        llm = AsyncLLM(lora_setup["base_dir"], dtype="float32", block_size=4, max_loras=2)
        real_load = llm.engine.loras.load

        def slow_load(*args, **kwargs):  # a slow disk: the load runs in a worker thread
            time.sleep(registry_load_seconds)
            return real_load(*args, **kwargs)

        llm.engine.loras.load = slow_load
        stamps: list[float] = []

        async def base_stream():
            async for delta in llm.stream_outputs([5, 6, 7], max_tokens=400, ignore_eos=True, temperature=0):
                stamps.extend([time.monotonic()] * len(delta.outputs[0].token_ids))

        runner = asyncio.create_task(base_stream())
        while len(stamps) < 3:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        results = await asyncio.gather(*(
            llm.generate(p, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                         lora=LoRARequest(name, str(lora_setup["paths"][name])))
            for name in ADAPTERS for p in lora_setup["prompts"]))
        during = [t for t in stamps if started < t < started + registry_load_seconds]
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        got = [r.outputs[0].token_ids for r in results]
        want = [e for name in ADAPTERS for e in lora_setup["expected"][name]]
        assert got == want
        assert len(during) >= 5, "the running stream stalled while adapters were loading"
        assert sorted(llm.list_loras()) == sorted(ADAPTERS)
        await llm.aclose()

    asyncio.run(main())


def _copy_adapter(src, dst, *, config_update=None, drop_weights=False):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(config_update or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    if not drop_weights:
        (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_bad_adapters_raise_lora_error_and_engine_keeps_serving(lora_setup, tmp_path, model_dir_factory):
    from peft import LoraConfig, get_peft_model

    llm = LLM(lora_setup["base_dir"], dtype="float32", max_lora_rank=8)
    good = lora_setup["paths"]["qv4"]
    wide = model_dir_factory("llama", hidden_size=96)  # a different base model: shapes do not fit
    other = tmp_path / "other-base"
    get_peft_model(load_reference_model(wide), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(other)
    cases = {
        "does not exist": tmp_path / "missing",
        "adapter_model.safetensors": _copy_adapter(good, tmp_path / "noweights", drop_weights=True),
        "max_lora_rank": lora_setup["paths"]["kg16"],
        "lacks": _copy_adapter(good, tmp_path / "badtarget", config_update={"target_modules": ["c_attn"]}),
        "base model needs": other,
    }
    for message, path in cases.items():
        with pytest.raises(LoRAError, match=message):
            llm.add_lora("bad", str(path))
    with pytest.raises(LoRAError, match="unknown LoRA adapter"):
        llm.generate([[5, 6]], GREEDY, lora="never-added")
    outputs = llm.generate(lora_setup["prompts"], GREEDY, lora=LoRARequest("qv4", str(good)))
    assert [o.outputs[0].token_ids for o in outputs] == lora_setup["expected"]["qv4"]
    llm.remove_lora("qv4")
    with pytest.raises(LoRAError):
        llm.generate([[5, 6]], GREEDY, lora="qv4")


def test_multi_lora_example(lora_setup):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "multi_lora.py"
    spec = importlib.util.spec_from_file_location("multi_lora", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    adapters = {name: str(lora_setup["paths"][name]) for name in ("qv4", "mlp2")}
    results = asyncio.run(example.run(lora_setup["base_dir"], adapters, max_tokens=5))
    assert len(results) == 3 * len(example.PROMPTS)
    texts = {name: [results[(name, p)].outputs[0].text for p in example.PROMPTS] for name in ("base", "qv4", "mlp2")}
    assert texts["base"] != texts["qv4"] and texts["base"] != texts["mlp2"]


def test_mixed_adapters_under_tensor_parallelism_equal_peft_merged(lora_setup):
    """TP=2: each rank holds its cut of every adapter (B rows for column-parallel projections, A
    columns for row-parallel ones); a batch mixing all adapters and the base model, with adapters
    taking turns in 2 slots, gives every merged model's greedy tokens."""
    with LLM(lora_setup["base_dir"], dtype="float32", block_size=4, max_loras=2, tensor_parallel_size=2,
             kv_cache_memory=4 << 20, max_model_len=256) as llm:
        for name, path in lora_setup["paths"].items():
            llm.add_lora(name, str(path))
        names = [None] + list(ADAPTERS)
        prompts, loras, want = [], [], []
        for name in names:
            for p, expected in zip(lora_setup["prompts"], lora_setup["expected"][name or "base"]):
                prompts.append(p)
                loras.append(name)
                want.append(expected)
        outputs = llm.generate(prompts, GREEDY, lora=loras)
        assert [o.outputs[0].token_ids for o in outputs] == want

"""Tensor parallelism on the CPU (gloo): shards, greedy parity, streams, worker faults, two "nodes".

Each engine here starts real worker processes (a fresh interpreter each: a few seconds), so the
file keeps to a handful of engines; LoRA under TP lives in test_lora.py, SmolLM2 at TP=3 in
test_real_model.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.distributed.parallel import TensorParallel, check_tensor_parallel
from asyncllm.errors import ConfigError, EngineDeadError
from asyncllm.model.gguf_weights import QuantizedRows
from asyncllm.model.shape import DecoderShape
from checkpoints import reference_greedy
from ports import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[11, 42, 7, 300, 25], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [900]]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=4 << 20, block_size=4)


def _shape(heads=8, kv=2, vocab=103) -> DecoderShape:
    return DecoderShape(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=heads,
                        num_kv_heads=kv, head_dim=2, rms_norm_eps=1e-6, qkv_bias=True, qk_norm=False,
                        tie_word_embeddings=False)


@pytest.mark.parametrize("size,kv", [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_shards_put_back_together_equal_the_checkpoint(size, kv):
    """Every rank's layers, loaded from whole checkpoint tensors, put back together are the checkpoint
    (KV heads replicated when there are fewer than ranks; vocabulary padded on the last rank; the
    row-parallel bias on rank 0 only)."""
    from asyncllm.model.decoder import VocabParallelEmbedding
    from asyncllm.model.layers import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                       VocabParallelLMHead)

    shape = _shape(kv=kv)
    q, kvs, inter, hd = shape.num_heads * 2, kv * 2, shape.intermediate_size, shape.head_dim
    full = {"q": torch.randn(q, 16), "k": torch.randn(kvs, 16), "v": torch.randn(kvs, 16),
            "o": torch.randn(16, q), "o_bias": torch.randn(16), "down": torch.randn(16, inter),
            "gate": torch.randn(inter, 16), "up": torch.randn(inter, 16),
            "embed": torch.randn(shape.vocab_size, 16), "bias": torch.randn(q + 2 * kvs)}
    fused_qkv = torch.cat([full["q"], full["k"], full["v"]])
    ranks = [TensorParallel(r, size) for r in range(size)]
    qkv, fused, o, gate_up, down, embed, head = [], [], [], [], [], [], []
    for tp in ranks:
        layer = QKVParallelLinear(16, shape.num_heads, kv, hd, True, tp)
        for p in "qkv":
            layer.weight_loader("weight", full[p], p, f"{p}_proj.weight")
        layer.weight_loader("bias", full["bias"], None, "qkv_proj.bias")  # biases stored fused too (Phi-3)
        qkv.append(layer)
        stored_fused = QKVParallelLinear(16, shape.num_heads, kv, hd, False, tp)
        stored_fused.weight_loader("weight", fused_qkv, None, "qkv_proj.weight")
        fused.append(stored_fused)
        share = tp.split(shape.num_heads)
        row = RowParallelLinear(q // size, 16, True, (share[0] * hd, share[1] * hd), tp)
        row.weight_loader("weight", full["o"], None, "o_proj.weight")
        row.weight_loader("bias", full["o_bias"], None, "o_proj.bias")
        o.append(row)
        merged = MergedColumnParallelLinear(16, [inter, inter], False, tp)
        merged.weight_loader("weight", full["gate"], 0, "gate_proj.weight")
        merged.weight_loader("weight", full["up"], 1, "up_proj.weight")
        gate_up.append(merged)
        d = RowParallelLinear(inter // size, 16, False, tp.split(inter), tp)
        d.weight_loader("weight", full["down"], None, "down_proj.weight")
        down.append(d)
        e = VocabParallelEmbedding(shape.vocab_size, 16, tp)
        e.weight_loader("weight", full["embed"], None, "embed_tokens.weight")
        embed.append(e)
        h = VocabParallelLMHead(16, shape.vocab_size, tp)
        h.weight_loader("weight", full["embed"], None, "lm_head.weight")
        head.append(h)
    half = inter // size
    assert torch.equal(torch.cat([m.weight[:half] for m in gate_up]), full["gate"])
    assert torch.equal(torch.cat([m.weight[half:] for m in gate_up]), full["up"])
    assert torch.equal(torch.cat([r.weight for r in o], 1), full["o"])
    assert torch.equal(sum(r.bias for r in o), full["o_bias"])  # the all-reduce adds it once
    assert torch.equal(torch.cat([r.weight for r in down], 1), full["down"])
    for table in (torch.cat([e.weight for e in embed]), torch.cat([h.weight for h in head])):
        assert table.shape[0] == -(-shape.vocab_size // size) * size
        assert torch.equal(table[:shape.vocab_size], full["embed"]) and not table[shape.vocab_size:].any()
    for rank, (layer, stored_fused) in enumerate(zip(qkv, fused)):
        tp = ranks[rank]
        first, count = tp.kv_heads(kv)
        local_q = (shape.num_heads // size) * 2
        assert torch.equal(layer.weight[:local_q], full["q"][rank * local_q:(rank + 1) * local_q])
        assert torch.equal(layer.weight[local_q:local_q + count * 2], full["k"][first * 2:(first + count) * 2])
        assert torch.equal(stored_fused.weight, layer.weight)  # a fused checkpoint is cut into the same pieces
        assert layer.bias.shape[0] == layer.weight.shape[0]
        # each rank's query heads read the KV head it keeps
        local = tp.local_shape(shape)
        group = shape.num_heads // kv
        heads = range(rank * local.num_heads, (rank + 1) * local.num_heads)
        assert {h // group for h in heads} <= set(range(first, first + count))


def test_int8_rows_are_cut_on_group_boundaries():
    from asyncllm.model.layers import RowParallelLinear, use_int8

    rows = QuantizedRows(torch.randint(-127, 127, (4, 64), dtype=torch.int8), torch.rand(4, 2))
    layer = RowParallelLinear(32, 4, False, (0, 32), TensorParallel(0, 2))
    assert isinstance(layer.cut("weight", None, rows), QuantizedRows)  # cut as stored: 32 columns = one group
    assert layer.cut("weight", None, rows).shape == (4, 32)
    holder = torch.nn.Module()
    holder.layer = layer
    use_int8(holder, 32)
    layer.weight_loader("weight", rows, None, "o_proj.weight")
    assert torch.equal(layer.method.slot.qweight, rows.qweight[:, :32])


def test_sizes_that_do_not_divide_the_model_are_refused_naming_the_argument(llama_dir):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 .*4 attention heads"):
        check_tensor_parallel(_shape(heads=4, kv=2), 3)
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        LLM(str(llama_dir), tensor_parallel_size=3, **ENGINE)
    for bad, match in [(dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(nnodes=0), "nnodes"),
                       (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
                       (dict(tensor_parallel_size=3, nnodes=2), "multiple of nnodes")]:
        with pytest.raises(ConfigError, match=match):
            LLM(str(llama_dir), **bad, **ENGINE)


def test_multi_node_needs_the_rendezvous_address(llama_dir, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        LLM(str(llama_dir), tensor_parallel_size=2, nnodes=2, **ENGINE)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_tp2_greedy_equals_transformers(model_dir_factory, kind):
    """Llama (GQA: 2 KV heads, one per rank) and Mistral (one KV head, replicated on both ranks)."""
    model_dir = model_dir_factory(kind)
    expected = reference_greedy(model_dir, PROMPTS, GREEDY.max_tokens)
    threads = torch.get_num_threads()
    with LLM(str(model_dir), tensor_parallel_size=2, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.stats()["kv_blocks_used"] == 0
        processes = llm.engine.runner.workers.processes
    assert all(p.poll() is not None for p in processes)  # close() ended the workers
    assert torch.get_num_threads() == threads  # and gave the host process its threads back
    if kind == "mistral":  # streams too (Llama's are in the next test)
        assert asyncio.run(_stream_all(model_dir)) == expected


async def _collect(llm: AsyncLLM, prompt) -> list[int]:
    tokens = []
    async for out in llm.stream_outputs(prompt, GREEDY):
        tokens.extend(out.outputs[0].token_ids)  # each output is the step's delta
    return tokens


async def _stream_all(model_dir) -> list[list[int]]:
    """Every prompt streamed concurrently from a TP=2 AsyncLLM: each request's tokens."""
    async with AsyncLLM(str(model_dir), tensor_parallel_size=2, **ENGINE) as llm:
        return list(await asyncio.gather(*(_collect(llm, p) for p in PROMPTS)))


def test_tp2_async_streams_equal_transformers_and_a_dead_worker_fails_every_stream(llama_dir):
    expected = reference_greedy(llama_dir, PROMPTS, GREEDY.max_tokens)

    async def main():
        llm = AsyncLLM(str(llama_dir), tensor_parallel_size=2, **ENGINE)
        try:
            assert await asyncio.gather(*(_collect(llm, p) for p in PROMPTS)) == expected
            # kill the worker while three long streams are open: every one ends with EngineDeadError
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            started = asyncio.Event()
            results: list = []

            async def stream(prompt):
                try:
                    async for _ in llm.stream(prompt, long):
                        started.set()
                    results.append("finished")
                except EngineDeadError as exc:
                    results.append(exc)

            tasks = [asyncio.create_task(stream(p)) for p in PROMPTS]
            await asyncio.wait_for(started.wait(), 60)
            worker = llm.engine.runner.workers.processes[0]
            os.kill(worker.pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert len(results) == 3 and all(isinstance(r, EngineDeadError) for r in results), results
            with pytest.raises(EngineDeadError, match="tensor-parallel worker"):
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                await llm.generate(PROMPTS[0], GREEDY)
        finally:
            await llm.aclose()

    asyncio.run(main())


def test_one_tensor_parallel_engine_per_process_and_idle_keep_alive(llama_dir, monkeypatch):
    from asyncllm.distributed import workers

    with LLM(str(llama_dir), tensor_parallel_size=2, **ENGINE):
        with pytest.raises(ConfigError, match="one tensor-parallel engine per process"):
            LLM(str(llama_dir), tensor_parallel_size=2, **ENGINE)
    monkeypatch.setattr(workers, "KEEPALIVE_S", 0.3)  # idle ranks wait inside a collective that times out
    with LLM(str(llama_dir), tensor_parallel_size=2, **ENGINE) as again:  # the first one closed: fine
        group = again.engine.runner.workers
        before = group._last_message
        deadline = time.monotonic() + 10
        while group._last_message == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert group._last_message > before and group.healthy  # a no-op went out while idle
        assert again.generate([PROMPTS[2]], GREEDY)[0].outputs[0].token_ids


def test_two_nodes_on_loopback(llama_dir, monkeypatch):
    """Node 1 is ``asyncllm serve MODEL --tensor-parallel-size 2 --nnodes 2 --node-rank 1`` (it runs
    rank 1 only); node 0 is this process's engine. They meet through MASTER_ADDR/MASTER_PORT."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    node1 = subprocess.Popen([sys.executable, "-m", "asyncllm.cli", "serve", str(llama_dir),
                              "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"], env=env)
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        expected = reference_greedy(llama_dir, PROMPTS, GREEDY.max_tokens)
        with LLM(str(llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=0, **ENGINE) as llm:
            assert llm.engine.runner.workers.processes == []  # no local workers: rank 1 is on "node 1"
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert node1.wait(timeout=60) == 0  # the stop message ended node 1's rank cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def _worker_pids() -> set[int]:
    found = subprocess.run(["pgrep", "-f", "asyncllm.distributed.workers"], capture_output=True, text=True)
    return {int(pid) for pid in found.stdout.split()}


def test_serve_with_tensor_parallelism_answers_and_leaves_no_worker_behind(llama_dir):
    from server_helpers import start_serve

    before = _worker_pids()
    proc, base = start_serve(str(llama_dir), "--tensor-parallel-size", "2", "--dtype", "float32",
                             "--kv-cache-memory", str(4 << 20), "--max-model-len", "256", timeout=120)
    try:
        assert len(_worker_pids() - before) == 1
        import httpx

        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": GREEDY.max_tokens,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == _tp1_text(llama_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert not _worker_pids() - before


def _tp1_text(model_dir) -> str:
    """The one-process engine's greedy text for the first prompt."""
    with LLM(str(model_dir), **ENGINE) as llm:
        return llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].text


def test_q8_0_gguf_under_tp2_equals_one_process(llama_dir, tmp_path):
    """Int8 rows of a Q8_0 file are cut on their groups of 32 (GGUF's q/k row permutation undone
    on the whole tensor first): each rank runs exactly the one-process engine's int8 weights."""
    from asyncllm.toy.gguf_export import export_gguf

    q8 = export_gguf(llama_dir, tmp_path / "toy-q8_0.gguf", "Q8_0")
    engine = dict(ENGINE, dtype="float32")
    with LLM(str(q8), **engine) as one:
        assert one.engine.runner.weight_format.int8
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    with LLM(str(q8), tensor_parallel_size=2, **engine) as tp:
        assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, GREEDY)] == expected

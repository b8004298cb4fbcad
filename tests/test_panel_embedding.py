"""A tied model on CPU reads its embedding table from the LM head's panels: held once, the same values."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.kernels.cpu_decode_stack import panels_supported
from asyncllm.kernels.cpu_panel_linear import PanelEmbedding, PanelLinear
from checkpoints import random_prompts, reference_greedy

pytestmark = pytest.mark.skipif(not panels_supported(), reason="the panel kernel needs an AVX-512 build")


def test_rows_from_panels_are_the_table_exactly():
    table = torch.randn(70, 24)  # 70: the last panel is partial
    embedding = PanelEmbedding(PanelLinear(table))
    ids = torch.tensor([[0, 69, 31, 32], [5, 5, 64, 33]])
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding.weight, table)


def test_a_tied_model_holds_its_table_once_and_equals_transformers(model_dir_factory):
    model_dir = model_dir_factory("qwen2")  # the toy Qwen2 ties its embeddings, as SmolLM2 does
    prompts = random_prompts("panel-embedding", [1, 7, 30])
    expected = reference_greedy(model_dir, prompts, 12)
    with LLM(str(model_dir), dtype="float32", block_size=4) as llm:
        model = llm.engine.runner.model
        assert llm.engine.runner.shape.tie_word_embeddings
        assert isinstance(model.model.embed_tokens, PanelEmbedding)
        assert model.model.embed_tokens.head[0] is model.lm_head
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                   ignore_eos=True))]
    assert got == expected

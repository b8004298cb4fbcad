"""DeepSeek V2 and V3: multi-head latent attention (model/mla.py), dense MLPs in the first
``first_k_dense_replace`` layers, then mixture-of-experts MLPs with a shared expert (model/moe.py).

The two differ in their routers and their rope layout, as transformers implements them:

* V2 softmaxes the router's logits and keeps the ``num_experts_per_tok`` best, from the best
  ``topk_group`` groups (a group scores its best expert) under ``topk_method="group_limited_greedy"``;
  the weights are not renormalised, and are scaled by ``routed_scaling_factor``. Its rope rotates
  neighbouring pairs of dimensions (transformers multiplies them as complex numbers).
* V3 takes the sigmoid of the logits; the choice adds ``e_score_correction_bias`` and keeps the best
  ``topk_group`` of ``n_group`` groups (a group scores the sum of its two best experts); the chosen
  experts' plain sigmoid scores are renormalised (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor``. Its rope rotates neighbouring pairs with ``rope_interleave`` (the default),
  else the two halves.

The checkpoint's ``shared_experts`` is the engine's ``shared_expert`` (one MLP of
``n_shared_experts * moe_intermediate_size``). Multi-token-prediction layers (``num_nextn_predict_layers``,
stored as ``model.layers.<N>`` past ``num_hidden_layers``) are not used and not loaded.
"""

from __future__ import annotations

import re

from ..errors import ModelLoadError
from .decoder import DecoderModel, FastPaths
from .mla import softmax_scale
from .moe import moe_shape
from .rotary import RotaryEmbedding
from .shape import DecoderShape, MLAShape, MoEShape

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(DecoderModel):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # q_proj stays q_proj
    renamed = {"shared_experts": "shared_expert"}
    # adapters on the latent attention's projections (not kv_b_proj: the absorbed form never applies it as a
    # matmul) and on the routed experts (PEFT target_parameters, model/moe_lora.py)
    lora_targets = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
    expert_lora = True
    fast_paths = FastPaths(decode_stack=False, cuda_graphs=False, tensor_parallel=True)
    supported_rope_types = ("default", "linear", "yarn")

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        mla = MLAShape(q_lora_rank=int(config.q_lora_rank) if config.q_lora_rank else None,
                       kv_lora_rank=int(config.kv_lora_rank), qk_nope_head_dim=int(config.qk_nope_head_dim),
                       qk_rope_head_dim=int(config.qk_rope_head_dim), v_head_dim=int(config.v_head_dim))
        # the cache's one "KV head" is the latent plus the rope key (what the backends attend over)
        shape.mla, shape.num_kv_heads, shape.head_dim = mla, 1, mla.cache_dim
        shape.attention_scale = softmax_scale(config, mla)
        shape.moe = cls.read_moe(config)
        dense = int(config.first_k_dense_replace or 0)
        shape.moe_layers = tuple(i >= dense for i in range(shape.num_layers))
        return shape

    @classmethod
    def read_moe(cls, config) -> MoEShape:
        grouped = config.topk_method == "group_limited_greedy"
        return moe_shape(config, router="softmax_topk", renormalize=False,
                         num_groups=int(config.n_group) if grouped else 1,
                         topk_groups=int(config.topk_group) if grouped else 1,
                         routed_scaling=float(config.routed_scaling_factor),
                         shared_intermediate_size=int(config.moe_intermediate_size) * int(config.n_shared_experts or 0))

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        cls.check_routing(config)
        freq = getattr(config, "moe_layer_freq", None)
        if freq not in (None, 1):
            raise ModelLoadError(f"{cls.__name__}: moe_layer_freq={freq} (config key moe_layer_freq) is not "
                                 "supported: transformers makes every layer from first_k_dense_replace on sparse")
        dense = config.first_k_dense_replace or 0
        if not 0 <= int(dense) <= config.num_hidden_layers:
            raise ModelLoadError(f"{cls.__name__}: first_k_dense_replace={dense} (config key first_k_dense_replace) "
                                 f"must be between 0 and num_hidden_layers={config.num_hidden_layers}")

    @classmethod
    def check_routing(cls, config) -> None:
        name = cls.__name__
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(f"{name}: topk_method {config.topk_method!r} (config key topk_method) is not "
                                 "supported; supported: greedy, group_limited_greedy")
        if config.norm_topk_prob:
            raise ModelLoadError(f"{name}: norm_topk_prob=True (config key norm_topk_prob) is not supported: "
                                 "transformers' DeepSeek V2 never renormalises the routing weights")
        if config.topk_method == "group_limited_greedy":
            per_group = cls._group_size(config)
            if per_group * int(config.topk_group) < int(config.num_experts_per_tok):
                raise ModelLoadError(f"{name}: topk_group={config.topk_group} groups of {per_group} experts (config "
                                     "key topk_group) hold fewer than num_experts_per_tok="
                                     f"{config.num_experts_per_tok}")

    @classmethod
    def _group_size(cls, config) -> int:
        """Experts per group, after checking ``n_group`` and ``topk_group``."""
        experts, groups, kept = int(config.n_routed_experts), config.n_group, config.topk_group
        if not groups or experts % int(groups) or not kept or not 1 <= int(kept) <= int(groups):
            raise ModelLoadError(f"{cls.__name__}: n_group={groups} and topk_group={kept} (config keys n_group, "
                                 f"topk_group) must split the {experts} experts evenly and keep 1 to n_group groups")
        return experts // int(groups)

    @classmethod
    def rope_interleaved(cls, config) -> bool:
        return True  # V2 rotates (x0, x1), (x2, x3)... as complex numbers

    @classmethod
    def make_rotaries(cls, config, shape: DecoderShape, max_positions: int) -> list[RotaryEmbedding | None]:
        """One rope over the ``qk_rope_head_dim`` dimensions of the queries and the shared rope key."""
        rotary = RotaryEmbedding.from_config(config, shape.mla.qk_rope_head_dim, max_positions,
                                             interleaved=cls.rope_interleaved(config))
        return [rotary] * shape.num_layers

    @classmethod
    def kv_cache_layout(cls, shape: DecoderShape) -> tuple[int, int, bool]:
        """One tensor per layer, both K and V cache: each token's latent and rope key (``mla.cache_dim`` values)."""
        return 1, shape.mla.cache_dim, True

    def skips_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers stored after the model's own."""
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= self.shape.num_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def read_moe(cls, config) -> MoEShape:
        return moe_shape(config, router="sigmoid_topk", renormalize=bool(config.norm_topk_prob),
                         score_correction_bias=True, num_groups=int(config.n_group),
                         topk_groups=int(config.topk_group), routed_scaling=float(config.routed_scaling_factor),
                         shared_intermediate_size=int(config.moe_intermediate_size) * int(config.n_shared_experts or 0))

    @classmethod
    def check_routing(cls, config) -> None:
        if cls._group_size(config) < 2:  # a group scores the sum of its two best experts
            raise ModelLoadError(f"{cls.__name__}: n_group={config.n_group} (config key n_group) leaves fewer than "
                                 "two experts per group")

    @classmethod
    def rope_interleaved(cls, config) -> bool:
        return bool(getattr(config, "rope_interleave", True))

"""The sparse mixture-of-experts MLP: a router, experts stacked per layer, and an optional shared expert.

A layer whose ``DecoderShape.is_moe`` is true gets a :class:`SparseMoE` as its ``mlp``:

* ``gate`` (:class:`MoERouter`): one logit per expert, turned into each token's ``top_k`` experts and
  weights by :func:`route` as the family's ``MoEShape.router`` says (softmax or sigmoid, before or after
  the choice; grouped top-k, score-correction bias and routed scaling as DeepSeek V3 does);
* ``experts`` (:class:`ExpertStack`): every expert's gate/up rows in one ``[E, 2I, H]`` tensor and its
  down projection in one ``[E, H, I]`` tensor, loaded from either checkpoint form (one tensor per expert
  and projection, or the stacked tensors some families ship) and cut by the stack itself to this rank:
  a share of every expert's intermediate columns under tensor parallelism, whole experts under expert
  parallelism;
* ``shared_expert``: a dense MLP every token goes through (Qwen2-MoE with its sigmoid gate, Llama 4,
  DeepSeek).

The experts run grouped (:func:`grouped_experts`): a step's (token, expert) pairs are sorted by expert,
so each active expert's weights are read once for all the tokens routed to it. That is what decides CPU
speed at batch > 1; on CUDA the Triton kernel of kernels/triton_moe.py does the same in one launch.
:func:`reference_experts` is transformers' per-expert loop, the oracle in tests.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel import SINGLE, TensorParallel
from ..errors import ModelLoadError
from .expert_groups import run_grouped
from .mlp import MLP
from .mxfp4 import PendingPairs, dequantize, is_mxfp4_tensor
from .shape import DecoderShape, MoEShape


def route(logits: torch.Tensor, moe: MoEShape, correction: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (float32 weights ``[T, k]``, expert ids ``[T, k]``)."""
    logits = logits.float()
    k = moe.top_k
    if moe.router == "topk_softmax":  # the k best logits, softmaxed among themselves (GraniteMoe, gpt-oss)
        values, ids = logits.topk(k, dim=-1)
        return values.softmax(dim=-1), ids
    if moe.router == "topk_sigmoid":  # the k best logits, each through a sigmoid (Llama 4)
        values, ids = logits.topk(k, dim=-1)
        return torch.sigmoid(values), ids
    scores = logits.softmax(dim=-1) if moe.router == "softmax_topk" else torch.sigmoid(logits)
    choice = scores if correction is None else scores + correction.float()
    if moe.num_groups > 1:
        choice = _best_groups(choice, moe)
    _, ids = choice.topk(k, dim=-1, sorted=moe.num_groups == 1)
    weights = scores.gather(1, ids)
    # as transformers does, even a single chosen weight is divided by itself (top-1 Mixtral: weight 1)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.router == "sigmoid_topk" else 0.0))
    if moe.routed_scaling != 1.0:
        weights = weights * moe.routed_scaling
    return weights, ids


def _best_groups(choice: torch.Tensor, moe: MoEShape) -> torch.Tensor:
    """``choice`` with the experts outside each token's best ``topk_groups`` groups ruled out. Under a sigmoid
    router (DeepSeek V3) a group scores the sum of its two best experts and the others become -inf (a negative
    correction bias can push a kept expert's choice below zero); otherwise (V2's softmax) a group scores its best
    expert and the others become zero."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, moe.num_groups, experts // moe.num_groups)
    group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if moe.router == "sigmoid_topk"
                    else grouped.max(dim=-1).values)
    best = group_scores.topk(moe.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
    out = float("-inf") if moe.router == "sigmoid_topk" else 0.0
    return grouped.masked_fill(~keep.unsqueeze(-1), out).view(tokens, experts)


def expert_activation(moe: MoEShape):
    """The experts' gated activation: ``f(gate_up) -> hidden`` over the ``[gate | up]`` halves."""
    if moe.activation == "swiglu_clamped":  # gpt-oss: both halves clamped, gate * sigmoid(alpha * gate) * (up + 1)
        alpha, limit = moe.swiglu_alpha, moe.swiglu_limit

        def clamped(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        return clamped

    def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return swiglu


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, activation, first_expert: int = 0, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, weights_on_input: bool = False) -> torch.Tensor:
    """The routed experts' weighted sum for every token, grouped by expert.

    ``x`` [T, H]; ``weights``/``ids`` [T, k]; ``w13`` [E_local, 2I, H] and ``w2`` [E_local, H, I] hold experts
    ``first_expert ..``; ids outside them (other expert-parallel ranks') are skipped. Every (token, expert)
    pair is sorted by expert, so each expert's weights are read once for all of its tokens."""
    def expert(e: int, state: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(state, w13[e], None if b13 is None else b13[e])
        return F.linear(activation(gate_up), w2[e], None if b2 is None else b2[e])

    return run_grouped(x, weights, ids, first_expert, w13.shape[0], weights_on_input, expert)


def reference_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, activation, b13=None, b2=None, weights_on_input: bool = False) -> torch.Tensor:
    """The oracle: every token through each of its experts one at a time, as transformers computes it."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, w = int(ids[t, j]), weights[t, j].to(x.dtype)
            state = x[t:t + 1] * w if weights_on_input else x[t:t + 1]
            gate_up = F.linear(state, w13[e], None if b13 is None else b13[e])
            y = F.linear(activation(gate_up), w2[e], None if b2 is None else b2[e])
            out[t] += (y if weights_on_input else y * w)[0]
    return out


class Int8Experts(nn.Module):
    """Stacked expert weights as int8 rows with float32 scales; ``self[e]`` is expert ``e``'s float weight."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)   # [E, N, K] int8
        self.register_buffer("scales", scales)     # [E, N, K // G] float32
        self.dtype = dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int | None) -> "Int8Experts":
        from ..kernels.int8_weights import quantize_weight

        e, n, k = weight.shape
        qweight, scales = quantize_weight(weight.reshape(e * n, k), group_size)
        return cls(qweight.view(e, n, k), scales.view(e, n, -1), weight.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        q, s = self.qweight[e], self.scales[e]
        n, k = q.shape
        return (q.view(n, s.shape[1], -1).float() * s.unsqueeze(-1)).view(n, k).to(self.dtype)


class MoERouter(nn.Module):
    """The router projection (``[E, H]``, a bias for gpt-oss, DeepSeek V3's score-correction bias)."""

    def __init__(self, hidden: int, moe: MoEShape) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None
        if moe.score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from ..kernels.ops import use_cpu

        if use_cpu(x):  # the CPU path: projection, softmax, top-k and renormalisation in one C call
            from ..kernels.cpu_moe import route_cpu

            routed = route_cpu(x, self.weight, self.bias, self.moe)
            if routed is not None:
                return routed
        if self.moe.router == "sigmoid_topk":  # DeepSeek V3 scores in float32 whatever the model's dtype
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        return route(logits, self.moe, getattr(self, "e_score_correction_bias", None))


# per-expert checkpoint tensors: "<expert>.<projection>.weight" (Mixtral names them w1/w3/w2)
_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)$")
# ... and any tensor of a per-expert projection (a quantized checkpoint's qweight, scales, weight_scale_inv...)
_PER_EXPERT_ANY = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(\w+)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# the tensors quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) store next to or instead of a weight
_QUANTIZED_KINDS = {"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
                    "weight_scale_inv", "weight_shape", "weight_g_idx", "input_scale"}
# stacked checkpoint tensors -> (part, transposed): [E, H, 2I]/[E, I, H] (Llama 4, gpt-oss) or [E, 2I, H]/[E, H, I]
_STACKED = {"gate_up_proj": ("gate_up", True), "down_proj": ("down", True),
            "input_linear.weight": ("gate_up", False), "output_linear.weight": ("down", False),
            "gate_up_proj_bias": ("gate_up_bias", False), "down_proj_bias": ("down_bias", False)}


class ExpertStack(nn.Module):
    """Every local expert's weights: ``w13`` [E_local, 2 * I_local, H] (gate rows, then up rows) and ``w2``
    [E_local, H, I_local], with biases where the family has them.

    Under tensor parallelism each rank keeps a share of every expert's intermediate columns (its outputs
    are partial sums, reduced by the caller); under expert parallelism (``tp.expert_parallel``) it keeps
    whole experts ``first_expert .. first_expert + E_local``."""

    def __init__(self, hidden: int, moe: MoEShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.moe, self.tp, self.hidden = moe, tp, hidden
        self.interleaved = moe.gate_up_interleaved  # stacked gate/up columns alternate (gpt-oss)
        experts, inter = moe.num_experts, moe.intermediate_size
        if tp.enabled and tp.expert_parallel:
            self.first_expert, self.local_experts = tp.split(experts)
            self.column_start, self.columns = 0, inter
        else:
            self.first_expert, self.local_experts = 0, experts
            self.column_start, self.columns = tp.split(inter)
        e, i = self.local_experts, self.columns
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, i))
        self.b13 = nn.Parameter(torch.empty(e, 2 * i)) if moe.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(e, hidden)) if moe.expert_bias else None
        self.activation = expert_activation(moe)
        self._mxfp4 = PendingPairs()  # an MXFP4 projection's blocks or scales, until its partner arrives
        self.quantized = None  # CheckpointExperts of a quantized checkpoint (model/moe_quantized.py), or None
        self._checkpoint_format = None  # a quantized checkpoint's QuantizedFormat, until its experts' tensors say
        self._float_loaded = False      # whether float expert tensors have been placed

    def use_checkpoint_format(self, fmt) -> None:
        """The checkpoint is quantized (``fmt``: its QuantizedFormat; before loading). Whether its experts are
        is read from their first tensor: a quantization method's tools quantize the Linear modules they
        find, and transformers' stacked experts are not Linear modules, so some checkpoints keep them float.
        ``quantization="fp8"`` on a float checkpoint quantizes them at load like every projection."""
        self._checkpoint_format = fmt
        if fmt.dynamic:
            self._keep_quantized()

    def _keep_quantized(self) -> None:
        """From now on each local expert's projections hold the checkpoint's tensors as stored; the float
        stacks are dropped."""
        from .moe_quantized import CheckpointExperts

        self.quantized = CheckpointExperts(self, self._checkpoint_format)
        self.w13 = self.w2 = None

    # ---- loading (model/loader.py hands over every tensor under this module's name) ----

    def expected_pieces(self, path: str) -> set[str]:
        parts = ["gate", "up", "down"] + (["gate_up_bias", "down_bias"] if self.moe.expert_bias else [])
        return {f"{path}.{self.first_expert + e}.{part}" for e in range(self.local_experts) for part in parts}

    def load_checkpoint_tensor(self, path: str, rest: str, tensor: torch.Tensor, name: str) -> set[str]:
        """Place checkpoint tensor ``name`` (``rest``: its name below this module); the pieces it filled."""
        kind = rest.rpartition(".")[2]
        quantized = (not isinstance(tensor, torch.Tensor) or kind in _QUANTIZED_KINDS
                     or tensor.element_size() == 1)  # (FP8 and int8 weights)
        if quantized and self.quantized is None and self._checkpoint_format is not None and not self._float_loaded:
            self._keep_quantized()
        if self.quantized is not None:
            return self._load_quantized(path, rest, tensor, name)
        if is_mxfp4_tensor(rest) and isinstance(tensor, torch.Tensor):  # gpt-oss as published (model/mxfp4.py)
            return self._load_mxfp4(path, rest, tensor, name)
        if quantized:
            why = ("but config.json has no quantization_config saying how to read it" if self._checkpoint_format is None
                   else "next to float expert tensors of the same layer")
            raise ModelLoadError(f"tensor {name!r}: a quantized expert tensor, {why} (docs/moe.md)")
        self._float_loaded = True
        match = _PER_EXPERT.match(rest)
        if match:
            expert, part, kind = int(match.group(1)), _PART[match.group(2)], match.group(3)
            if kind == "bias":
                raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (per-expert biases)")
            self._check_expert(expert, name)
            if self._is_local(expert):
                self._put(expert - self.first_expert, part, tensor, name)
            return {f"{path}.{expert}.{part}"}
        if rest not in _STACKED:
            raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (no matching expert weight)")
        part, transposed = _STACKED[rest]
        if tensor.dim() < 2 or tensor.shape[0] != self.moe.num_experts:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}: expected "
                                 f"{self.moe.num_experts} experts stacked on its first dimension")
        if transposed:
            tensor = tensor.transpose(1, 2)
        local = tensor[self.first_expert:self.first_expert + self.local_experts]
        if part in ("gate_up", "gate_up_bias"):
            gate, up = ((local[:, 0::2], local[:, 1::2]) if self.interleaved else local.chunk(2, dim=1))
            for e in range(self.local_experts):
                self._put(e, "gate" if part == "gate_up" else "gate_bias", gate[e], name)
                self._put(e, "up" if part == "gate_up" else "up_bias", up[e], name)
            parts = ("gate", "up") if part == "gate_up" else ("gate_up_bias",)
        else:
            for e in range(self.local_experts):
                self._put(e, part, local[e], name)
            parts = (part,)
        return {f"{path}.{e}.{p}" for e in range(self.moe.num_experts) for p in parts}

    def _load_quantized(self, path: str, rest: str, tensor: torch.Tensor, name: str) -> set[str]:
        """A tensor of a quantized checkpoint's expert (one per expert and projection, as such checkpoints
        store them); the piece it filled once the projection's weight tensor is in."""
        match = _PER_EXPERT_ANY.match(rest)
        if match is None:
            raise ModelLoadError(f"tensor {name!r}: a quantized checkpoint's experts must be stored one tensor set "
                                 "per expert and projection (experts.<e>.gate_proj.qweight ...); stacked quantized "
                                 "experts are not supported")
        expert, part, kind = int(match.group(1)), _PART[match.group(2)], match.group(3)
        self._check_expert(expert, name)
        if not self._is_local(expert):
            return {f"{path}.{expert}.{part}"} if kind in ("qweight", "weight_packed", "weight") else set()
        if self.quantized.load(expert - self.first_expert, part, kind, tensor, name):
            return {f"{path}.{expert}.{part}"}
        return set()

    def _load_mxfp4(self, path: str, rest: str, tensor: torch.Tensor, name: str) -> set[str]:
        """One of an MXFP4 projection's blocks/scales; once both are here, each local expert dequantized and
        placed, one at a time (a whole stack in float is several times the checkpoint's bytes)."""
        pair = self._mxfp4.add(rest, tensor, name)
        if pair is None:
            return set()
        projection, blocks, scales = pair
        if blocks.dim() != 4 or blocks.shape[0] != self.moe.num_experts:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(blocks.shape)}: expected MXFP4 blocks of "
                                 f"{self.moe.num_experts} experts [E, N, K / 32, 16]")
        for e in range(self.local_experts):
            try:  # [N, K]: the projection's output rows, as per-expert checkpoints store them
                weight = dequantize(blocks[self.first_expert + e], scales[self.first_expert + e], self.w13.dtype)
            except ValueError as exc:
                raise ModelLoadError(f"tensor {name!r}: {exc}") from exc
            if projection == "gate_up_proj":
                gate, up = (weight[0::2], weight[1::2]) if self.interleaved else weight.chunk(2)
                self._put(e, "gate", gate, name)
                self._put(e, "up", up, name)
            else:
                self._put(e, "down", weight, name)
        parts = ("gate", "up") if projection == "gate_up_proj" else ("down",)
        return {f"{path}.{e}.{p}" for e in range(self.moe.num_experts) for p in parts}

    def _check_expert(self, expert: int, name: str) -> None:
        if not 0 <= expert < self.moe.num_experts:
            raise ModelLoadError(f"tensor {name!r}: expert {expert} is outside the config's "
                                 f"{self.moe.num_experts} experts")

    def _is_local(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.local_experts

    def _put(self, e: int, part: str, tensor: torch.Tensor, name: str) -> None:
        """One local expert's piece, cut to this rank's intermediate columns."""
        inter, i, c0 = self.moe.intermediate_size, self.columns, self.column_start
        if part in ("gate", "up"):
            expected, value = (inter, self.hidden), tensor[c0:c0 + i] if tensor.shape[0] == inter else tensor
            target = self.w13.data[e, :i] if part == "gate" else self.w13.data[e, i:]
        elif part == "down":
            expected, value = (self.hidden, inter), tensor[:, c0:c0 + i] if tensor.dim() == 2 else tensor
            target = self.w2.data[e]
        elif part in ("gate_bias", "up_bias"):
            expected, value = (inter,), tensor[c0:c0 + i]
            target = self.b13.data[e, :i] if part == "gate_bias" else self.b13.data[e, i:]
        else:  # down_bias: added once to the summed output
            expected, value = (self.hidden,), tensor
            if self.tp.enabled and not self.tp.expert_parallel and self.tp.rank != 0:
                value = torch.zeros_like(tensor)
            target = self.b2.data[e]
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)} per expert, expected {expected}")
        target.copy_(value)

    def project_gate_up(self, e: int, state: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s gate/up projection of ``state`` (whichever way its weights are held)."""
        if self.quantized is not None:
            return self.quantized.gate_up[e](state)
        w13 = self.w13 if self.w13 is not None else self.w13_int8
        return F.linear(state, w13[e], None if self.b13 is None else self.b13[e])

    def project_down(self, e: int, hidden: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s down projection of its activated ``hidden`` rows."""
        if self.quantized is not None:
            return self.quantized.down[e](hidden)
        w2 = self.w2 if self.w2 is not None else self.w2_int8
        return F.linear(hidden, w2[e], None if self.b2 is None else self.b2[e])

    def to_int8(self, group_size: int | None = None) -> None:
        """Weight-only int8 (``quantization="int8"``): every expert's rows as int8 with float32 scales (one per row,
        or per ``group_size`` columns), the float weights dropped; each active expert is widened as it runs."""
        self.w13_int8 = Int8Experts.quantize(self.w13.data, group_size)
        self.w2_int8 = Int8Experts.quantize(self.w2.data, group_size)
        self.w13 = self.w2 = None

    # ---- the forward pass ----

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the routed experts' weighted sum (a partial sum under TP/EP)."""
        from ..kernels.ops import use_cpu, use_triton

        if self.w13 is None:  # int8 experts, or a quantized checkpoint's (model/moe_quantized.py): expert by expert
            return run_grouped(x, weights, ids, self.first_expert, self.local_experts, self.moe.weights_on_input,
                               lambda e, state: self.project_down(e, self.activation(self.project_gate_up(e, state))))
        if use_triton(x):
            from ..kernels.triton_moe import triton_available_for, triton_fused_experts

            if triton_available_for(self):
                return triton_fused_experts(x, weights, ids, self)
        if use_cpu(x):  # the C kernel of kernels/cpu_moe.py: the whole step in one call (None: shapes it skips)
            from ..kernels.cpu_moe import stack_experts_cpu

            out = stack_experts_cpu(x, weights, ids, self)
            if out is not None:
                return out
        return grouped_experts(x, weights, ids, self.w13, self.w2, self.activation, self.first_expert,
                               self.b13, self.b2, self.moe.weights_on_input)


class SparseMoE(nn.Module):
    """A layer's mixture-of-experts MLP: routed experts, plus the shared expert where the family has one."""

    def __init__(self, shape: DecoderShape, layer_index: int, tp: TensorParallel = SINGLE,
                 full: DecoderShape | None = None, lora=None) -> None:
        super().__init__()
        full = full or shape
        moe = shape.moe
        self.moe, self.tp, self.layer_index = moe, tp, layer_index
        self.lora = lora  # LoRASlots shared by all layers (adapters on the experts), or None
        self.gate = MoERouter(shape.hidden_size, moe)
        self.experts = ExpertStack(shape.hidden_size, moe, tp)
        if moe.shared_intermediate_size:
            size = moe.shared_intermediate_size
            self.shared_expert = MLP(dataclasses.replace(shape, intermediate_size=size // tp.size), layer_index,
                                     None, tp, dataclasses.replace(full, intermediate_size=size))
            if moe.shared_gate:
                self.shared_expert_gate = nn.Linear(shape.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        adapters = self.lora.experts_of(self.layer_index) if self.lora is not None and self.lora.groups else None
        if adapters:  # an adapter of this step has weights on these experts (model/moe_lora.py)
            from .moe_lora import experts_with_lora

            routed = experts_with_lora(self.experts, x, weights, ids, self.lora.row_slots, adapters)
        else:
            routed = self.experts(x, weights, ids)
        out = self.tp.all_reduce(routed)
        if self.moe.shared_intermediate_size:
            shared = self.shared_expert(x)
            if self.moe.shared_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def moe_shape(config, **overrides) -> MoEShape:
    """The MoEShape most configs describe with the same keys (``num_experts``/``num_local_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``); ``overrides`` set the rest."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) \
        or getattr(config, "n_routed_experts", None)
    if not experts:
        raise ModelLoadError("mixture-of-experts config without num_experts/num_local_experts")
    values = dict(num_experts=int(experts), top_k=int(config.num_experts_per_tok),
                  intermediate_size=int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size))
    values.update(overrides)
    if values["top_k"] > values["num_experts"] or values["top_k"] < 1:
        raise ModelLoadError(f"num_experts_per_tok={values['top_k']} must be between 1 and the "
                             f"{values['num_experts']} experts")
    return MoEShape(**values)

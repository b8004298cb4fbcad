"""Turns a step record (engine/step_input.py) into tensors, runs the model and returns the logits that are needed."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..adapters.slots import LoRASlots
from ..config import EngineConfig
from ..distributed.parallel import SINGLE, TensorParallel, check_tensor_parallel
from ..distributed.sharding import Sharding
from ..errors import ConfigError, ModelLoadError
from ..kernels.cpu_attention import CpuAttentionBackend
from ..kernels.cpu_decode_stack import DecodeStack, StackLimits
from ..kernels.cpu_linear import pack_linear_layers
from ..kernels.cpu_memory import keep_large_buffers
from ..kernels.cpu_panel_linear import PanelEmbedding, PanelLinear
from ..kernels.metadata import AttentionMetadata
from ..kernels.ops import cpu_ops, triton_ops
from ..kernels.torch_attention import TorchAttentionBackend
from ..kernels.transfer import stage, to_device
from .cuda_graphs import DecodeGraphs
from .image_embeddings import ImageEmbeddings
from .mixed_steps import MixedSplit, split_mixed
from ..platform import Platform, decide_platform
from .loader import load_weights
from ..kernels.quant_linear import GROUP_QUANT_BF16_ROWS, Fp8Linear, GroupQuantLinear
from .layers import finish_layers, use_checkpoint_quantization, use_int8
from .quant_formats import check_requested, checkpoint_format, requested_format
from .quantization import WeightFormat, decide_weight_format, int8_tied_head
from .source import ModelSource, gguf_linear_types
from .step_io import StepInput, StepOutput
from .registry import architecture_for
from .shape import DecoderShape

logger = logging.getLogger(__name__)

_CPU_KV_SHARE, _CPU_KV_CAP = 0.25, 4 * 2**30   # default KV budget on CPU: a quarter of free RAM, at most 4 GiB
_CUDA_KV_SHARE = 0.85                           # of free device memory after the weights are loaded


def build_attention_backend(platform: Platform, shape: DecoderShape):
    """The attention backend the platform chose (docs/architecture.md, docs/kernels.md, docs/cpu.md)."""
    if platform.attention_backend == "torch":
        return TorchAttentionBackend()
    if platform.attention_backend == "cpu":
        return CpuAttentionBackend()
    from ..kernels.triton_attention import TritonAttentionBackend  # imports triton: only when asked for

    return TritonAttentionBackend(shape.num_heads, shape.num_kv_heads)


class ModelRunner:
    """Owns the model weights and the paged KV cache tensors.

    Under tensor parallelism every rank has one, built with its ``tp``; the processes themselves
    (starting them, sending each step) are the executor's (engine/executor.py). ``shape`` is
    always the whole model's; each rank holds its shard."""

    def __init__(self, config: EngineConfig, hf_config, source: ModelSource | Path, max_model_len: int,
                 tp: TensorParallel | None = None, agree_num_blocks=None) -> None:
        """``tp``: this rank's place under tensor parallelism; ``agree_num_blocks``: how the ranks settle
        on one KV-cache size (called with a function computing this rank's; engine/executor.py)."""
        self.architecture = architecture_for(hf_config, config.model_impl)
        self.model_class = self.architecture.model_class()
        self.shape = self.check(config, hf_config, max_model_len)
        self.tp = tp or SINGLE
        self._agree = agree_num_blocks
        self._length_dependent: bool | None = None
        self._build(config, hf_config, source, max_model_len)

    @staticmethod
    def check(config: EngineConfig, hf_config, max_model_len: int) -> DecoderShape:
        """The model's shape, or ConfigError/ModelLoadError for what this engine cannot run (before any
        process is started)."""
        model_class = architecture_for(hf_config, config.model_impl).model_class()
        shape = _inside_context(model_class.read_shape(hf_config), max_model_len)
        if config.tensor_parallel_size > 1 and not model_class.fast_paths.tensor_parallel:
            raise ConfigError(f"tensor_parallel_size={config.tensor_parallel_size}: {shape.architecture} "
                              "runs on one device only (docs/models.md)")
        check_tensor_parallel(shape, config.tensor_parallel_size, config.enable_expert_parallel)
        return shape

    def _build(self, config: EngineConfig, hf_config, source: ModelSource | Path, max_model_len: int) -> None:
        self.platform = decide_platform(config, hf_config)
        self.device, self.dtype = self.platform.device, self.platform.dtype
        self.block_size = config.block_size
        self.local_shape = self.tp.local_shape(self.shape)
        source = source if isinstance(source, ModelSource) else ModelSource(Path(source))
        self.lora = LoRASlots(self.local_shape, config.max_loras, config.max_lora_rank, self.device, self.dtype,
                              Sharding(self.tp, self.shape) if self.tp.enabled else None)
        if self.architecture.native:
            self._load_native(config, hf_config, source, max_model_len)
        else:
            self._load_through_transformers(config, hf_config, source, max_model_len)
        # dtype="bfloat16" on CPU (Platform.bf16_weights): bf16-rounded weights, read as bf16 panels (docs/cpu.md)
        self.bf16_weights = (self.platform.bf16_weights and self.architecture.native and not self.weight_format.int8
                             and self.weight_format.checkpoint is None)
        if self.bf16_weights:
            _round_to_bf16(self.model)
        # dtype="bfloat16" on a quantized checkpoint: its projections stay as stored, and the float LM head (with
        # a tied table) is read as bf16 panels: half the bytes of the largest float matmul of a decode step
        self.bf16_head = self.bf16_weights or (
            self.platform.bf16_weights and config.dtype == "bfloat16" and self.architecture.native
            and self.weight_format.checkpoint is not None and not self.weight_format.int8)
        # dtype="bfloat16" on int8 weights (quantization="int8", a Q8_0 GGUF, 8-bit checkpoints): the weights stay
        # int8, and calls of more than 12 rows (prefill, decode batches) multiply with bf16 dot products
        self.int8_bf16_dot = (self.platform.bf16_weights and config.dtype == "bfloat16" and self.weight_format.int8
                              and _int8_bf16_dot_here())
        if self.int8_bf16_dot:
            _use_int8_bf16_dot(self.model)
        # ... and on 4- or 8-bit zero-point checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized): prefill-sized
        # calls through a transient bf16 copy and oneDNN's bf16 matmul (decode steps keep the C kernels)
        if self.bf16_head and not self.bf16_weights and _bf16_matmuls():
            for module in self.model.modules():
                if isinstance(module, GroupQuantLinear):
                    module.bf16_rows = GROUP_QUANT_BF16_ROWS
        if self.device.type == "cpu":  # large step buffers reused, not faulted in each layer (kernels/cpu_memory.py)
            keep_large_buffers()
        self.kv_dtype = self._kv_cache_dtype(config)
        self.num_blocks = self._agree_num_blocks(config, max_model_len)
        # every running sequence's block table, kept across steps (engine/block_tables.py)
        self._table_buffer = np.zeros((config.max_num_seqs, -(-max_model_len // self.block_size)), dtype=np.int64)
        self.kv_caches = self._allocate_kv_caches()
        # before packing: the decode stack reads the dense float weights (kernels/cpu_decode_stack.py)
        stored = self.weight_format.checkpoint
        # a quantized checkpoint's integer layers: 4-bit, or 8-bit with zero points (GroupQuantLinear; symmetric
        # 8-bit ones are Int8Linear, weight_format.int8)
        grouped = {4: "int4", 8: "uint8"}.get(getattr(stored, "bits", None)) \
            if stored is not None and getattr(stored, "kind", None) == "int" else None
        kind = ("int8" if self.weight_format.int8 else grouped if grouped
                else "bfloat16" if self.bf16_weights else "float32")
        self.decode_stack = (DecodeStack.build(self.model, self.kv_caches, kind, self.weight_format.group_size)
                             if self.platform.decode_stack and self.model_class.fast_paths.decode_stack
                             # a quantized checkpoint's FP8 layers are not in the kernel; its integer ones are when
                             # every projection is one kind the kernel reads (DecodeStack.build checks)
                             and (stored is None or self.weight_format.int8 or grouped) else None)
        if not self.weight_format.int8 and self.platform.packed_linears:
            self._pack_cpu_linears()
        if not self.architecture.native:
            self.model.attach_lora(self.lora)
        self.cuda_graphs = self._capture_cuda_graphs(config, max_model_len)
        self.image_embeddings = ImageEmbeddings(self.model, self.device, self.dtype, config.image_cache_memory)

    def _load_native(self, config: EngineConfig, hf_config, source: ModelSource, max_model_len: int) -> None:
        """The family's model built on the meta device, then filled tensor by tensor (model/loader.py)."""
        self.backend = build_attention_backend(self.platform, self.local_shape)
        rotaries = self.model_class.make_rotaries(hf_config, self.shape, max_model_len)
        with torch.device("meta"):
            model = self.model_class(self.local_shape, rotaries, self.backend, self.lora, self.tp,
                                     self.shape).to(self.dtype)
        self.model = model.to_empty(device=self.device).eval()
        stored = (None if source.is_gguf  # GPTQ, AWQ, FP8... (gpt-oss's MXFP4 experts: float once loaded)
                  else checkpoint_format(source.root, self.model_class.dequantized_formats))
        check_requested(config.quantization, stored)
        stored = requested_format(config.quantization, stored)
        if stored is not None:
            self._load_quantized(source, stored)
            return
        self.weight_format = decide_weight_format(config.quantization, source.is_gguf,
                                                  gguf_linear_types(source) if source.is_gguf else set())
        if self.weight_format.int8:
            use_int8(self.model, self.weight_format.group_size)
        load_weights(self.model, source, self.architecture, keep_q8_0=self.weight_format.int8, shape=self.shape)
        count = finish_layers(self.model)
        if self.weight_format.int8:
            for module in list(self.model.modules()):
                if hasattr(module, "to_int8"):  # mixture-of-experts stacks (model/moe.py)
                    module.to_int8(self.weight_format.group_size)
                    count += 1
            if self.shape.tie_word_embeddings:
                int8_tied_head(self.model, self.weight_format)
                count += 1
            logger.info("int8 weights: %d layers (groups of %s)", count, self.weight_format.group_size or "a row")
        self.model.build_rotaries(self.device, self.dtype)

    def _load_quantized(self, source: ModelSource, stored) -> None:
        """A quantized checkpoint: each projection keeps the checkpoint's quantized weights (model/quant_methods.py)."""
        from ..kernels.int8_linear import Int8Linear

        count = use_checkpoint_quantization(self.model, stored)
        load_weights(self.model, source, self.architecture, shape=self.shape)
        finish_layers(self.model)
        layers = [m for layer in self.model.model.layers for m in layer.modules()
                  if isinstance(m, (Int8Linear, GroupQuantLinear, Fp8Linear))]
        # int8 layers throughout (W8A8, symmetric 8-bit GPTQ): the int8 decode stack reads them as they are
        int8 = bool(layers) and all(isinstance(m, Int8Linear) for m in layers)
        group = {None if m.group_size == m.in_features else m.group_size for m in layers} if int8 else set()
        self.weight_format = WeightFormat(int8 and len(group) == 1, next(iter(group)) if len(group) == 1 else None,
                                          checkpoint=stored)
        held = sum(t.numel() * t.element_size() for m in layers for t in m.buffers())
        logger.info("%s checkpoint: %d projections kept quantized, %.1f MiB (%.2f bytes per weight)",
                    stored.describe(), count, held / 2**20,
                    held / max(1, sum(m.in_features * m.out_features for m in layers)))
        self.model.build_rotaries(self.device, self.dtype)

    def _load_through_transformers(self, config: EngineConfig, hf_config, source: ModelSource,
                                   max_model_len: int) -> None:
        """An architecture without a native file: transformers' modules, checked against transformers'
        own attention at load (model/transformers_backend.py), which also fixes the KV layout."""
        from .transformers_backend import TransformersModel, verify

        name = self.architecture.name
        if source.is_gguf:
            raise ModelLoadError(f"{name}: GGUF files load for the native families only (docs/models.md)")
        if config.quantization not in (None, "none"):
            raise ConfigError(f"quantization={config.quantization!r}: {name} runs through transformers' modules, which "
                              "take float weights only")
        self.backend = build_attention_backend(self.platform, self.local_shape)
        self.model = TransformersModel.load(hf_config, source.root, self.shape, self.backend, self.dtype, self.device)
        self.shape = self.local_shape = verify(self.model, self.block_size, max_model_len)
        self.backend = self.model.backend = build_attention_backend(self.platform, self.local_shape)
        self.weight_format = WeightFormat()
        # adapters go on transformers' own projections (hooked once the CPU packing has replaced them)
        self.lora = LoRASlots(self.local_shape, config.max_loras, config.max_lora_rank, self.device, self.dtype,
                              layout=self.model.lora_layout())

    @property
    def length_dependent_rope(self) -> bool:
        """Whether the model's rope depends on the sequence length (longrope, dynamic NTK); read per step."""
        if self._length_dependent is None:
            self._length_dependent = any(r.length_dependent for r in getattr(self.model, "rotaries", ()))
        return self._length_dependent

    def rope_cache_key(self, prompt_len: int):
        """What prompt-cached KV must agree on besides its tokens: for length-dependent rope, the
        rotation a prompt of this length gets (None: any prompt's KV serves any other)."""
        keys = tuple(r.cache_key(prompt_len) for r in getattr(self.model, "rotaries", ()) if r.length_dependent)
        return keys or None

    def _agree_num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        """This rank's KV-cache size, or the size the ranks agree on (every rank needs the same count)."""
        count = lambda: self._count_blocks(config, max_model_len)  # noqa: E731
        return self._agree(count) if self._agree is not None else count()

    @property
    def cpu_fast_path(self) -> bool:
        """Packed linears, C kernels and the fused greedy pick (the platform's CPU choice)."""
        return self.platform.fused_greedy

    def _pack_cpu_linears(self) -> None:
        """On CPU, hand every projection to oneDNN with pre-packed weights, and the LM head to the
        panel kernel where it runs (kernels/cpu_panel_linear.py), else to oneDNN too."""
        if not self.architecture.native:  # transformers' modules: their projections, not the head's panels
            pack_linear_layers(self.model.hf)
            return
        tied = self.shape.tie_word_embeddings
        head = self.model.model.embed_tokens.weight if tied else self.model.lm_head.weight
        panel_head = PanelLinear.build(head, bf16=self.bf16_head)
        if panel_head is not None and self.bf16_head and not self.bf16_weights:
            logger.info("dtype=bfloat16 on a quantized checkpoint: the LM head%s held as bf16 panels",
                        " and the tied embedding table" if tied else "")
        if panel_head is not None:
            self.model.lm_head = panel_head  # not an nn.Linear: packing leaves it alone
            if tied and not self.tp.enabled:  # the table is read from the head's panels: held once, not twice
                self.model.model.embed_tokens = PanelEmbedding(panel_head)
        # dtype="bfloat16": prefill (and any step off the decode stack) through oneDNN's bf16 matmuls
        pack_linear_layers(self.model, extra={"lm_head": head} if tied and panel_head is None else None,
                           compute_dtype=torch.bfloat16 if self.bf16_weights and _bf16_matmuls() else None)

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(KV heads, head dim, shared) of each layer's cache on this rank: the family's ``kv_cache_layout``
        (model/decoder.py); shared means one tensor is both K and V (DeepSeek's latent cache)."""
        layout = getattr(self.model_class, "kv_cache_layout", None)
        s = self.local_shape
        return layout(s) if layout is not None else (s.num_kv_heads, s.head_dim, False)

    def _kv_cache_dtype(self, config: EngineConfig) -> torch.dtype:
        """The KV cache's element type: the activations' by default, or bfloat16 under float32 activations on the
        CPU's attention paths, which write it rounded and widen it as they read (half the bytes per block).
        ``"auto"`` picks that under ``dtype="bfloat16"`` on CPU (bf16 weights, float32 activations), as vLLM's CPU
        build keeps a bf16 cache for a bf16 model."""
        if config.kv_cache_dtype == "auto":
            bf16_path = (self.platform.bf16_weights and self.dtype == torch.float32 and self.backend.name == "cpu"
                         and not self.kv_layout[2])
            if bf16_path:
                logger.info("dtype=bfloat16 on CPU: the KV cache in bfloat16 (kv_cache_dtype='float32' keeps float32)")
            return torch.bfloat16 if bf16_path else self.dtype
        wanted = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.kv_cache_dtype]
        if wanted == self.dtype:
            return wanted
        if self.platform.is_cuda or self.backend.name not in ("cpu", "torch") or wanted != torch.bfloat16:
            raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype!r} with dtype {str(self.dtype)[6:]!r}: a cache "
                              "dtype other than the model's is a bfloat16 cache under float32 activations, on the "
                              f"CPU attention backends ('cpu', 'torch'; this engine uses {self.backend.name!r})")
        if self.kv_layout[2]:
            raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype!r}: this family's latent KV cache "
                              "(one tensor for keys and values) stays in the model's dtype")
        logger.info("KV cache in bfloat16 under float32 activations: half the bytes per block")
        return wanted

    @property
    def bytes_per_block(self) -> int:
        kv_heads, head_dim, shared = self.kv_layout
        tensors = 1 if shared else 2
        return (tensors * self.local_shape.num_layers * self.block_size * kv_heads * head_dim
                * torch.finfo(self.kv_dtype).bits // 8)

    def _count_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        budget = config.kv_cache_memory or self._default_kv_bytes()
        useful = config.max_num_seqs * -(-max_model_len // self.block_size) + 1  # more would never be used
        num_blocks = min(budget // self.bytes_per_block, useful)
        needed = -(-max_model_len // self.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"kv_cache_memory of {budget} bytes holds {num_blocks} blocks of {self.block_size} tokens, "
                f"fewer than the {needed} one sequence of max_model_len={max_model_len} needs; "
                "raise kv_cache_memory or lower max_model_len")
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block / 2**20)
        return num_blocks

    def _default_kv_bytes(self) -> int:
        if self.platform.is_cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * _CUDA_KV_SHARE)
        return int(min(_available_ram() * _CPU_KV_SHARE, _CPU_KV_CAP))

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv_heads, head_dim, shared = self.kv_layout
        shape = (self.num_blocks, self.block_size, kv_heads, head_dim)
        caches = []
        for _ in range(self.local_shape.num_layers):
            # zeros, not empty: masked-out slots must not hold NaN bit patterns (0 * NaN = NaN)
            k_cache = _zeros(shape, self.kv_dtype, self.device)
            caches.append((k_cache, k_cache if shared else _zeros(shape, self.kv_dtype, self.device)))
        return caches

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step: the logits ([len(step.logit_rows), vocab], float32) of the chosen flat positions,
        and the final hidden states (after the last norm) of ``step.pool_rows`` for embeddings."""
        self._copy_blocks(step.block_copies)
        self._prepare_lora(step)
        ready = self._encode_ahead(step)
        split = self._split_mixed(step)
        if split is not None:
            hidden, gathers = self._forward_split(step, split), _Gathers.of(step, self.device)
        else:
            input_ids, positions, meta, gathers = self._prepare(step)
            embeds = self.image_embeddings.embed(input_ids, step.images) if step.images else None
            hidden = self._forward(input_ids, positions, meta, embeds)
        pooled = hidden[gathers.pool_index].float() if step.pool_rows else None
        if not step.logit_rows:  # a step of embedding prompts only: no LM head
            return StepOutput(torch.empty(0, self.shape.vocab_size, device=self.device), pooled, ready)
        if gathers.logit_index is not None:
            hidden = hidden[gathers.logit_index]
        return StepOutput(self.model.compute_logits(hidden).float(), pooled, ready)

    def _encode_ahead(self, step: StepInput) -> list[str]:
        """Advance the encodings of images too large for one step (model/image_embeddings.py); the hashes
        of those now encoded."""
        if not step.encode_ahead and not self.image_embeddings.pending:
            return []
        return self.image_embeddings.advance(step.encode_ahead, step.encode_ahead_rows,
                                             keep={rows.image.content_hash for rows in step.images})

    def _split_mixed(self, step: StepInput) -> MixedSplit | None:
        """A CPU step of decodes and prefill chunks that the decode stack can take the decodes of
        (model/mixed_steps.py); None: run the step whole."""
        if (self.decode_stack is None or self.lora.groups or not self._host_decode_path or step.images
                or step.rope_positions is not None or step.pool_rows or self.length_dependent_rope
                or step.table_rows is None):
            return None
        decodes = sum(1 for n in step.num_new_tokens if n == 1)
        if not 0 < decodes < step.num_seqs or decodes > self.decode_stack.max_rows or self._fits_chained(step):
            return None
        self._apply_table_updates(step)  # once, for both parts
        return split_mixed(step)

    def _forward_split(self, step: StepInput, split: MixedSplit) -> torch.Tensor:
        """The final hidden states of a mixed step, its decodes through the decode stack and its prefill
        chunks through the model, in the step's flat order."""
        ids, positions, meta = self._prepare_rows(split.decodes, chained=False)
        decoded = self._forward(ids, positions, meta)
        ids, positions, meta, _ = self._prepare_staged(split.prefills)
        prefilled = self._forward(ids, positions, meta)
        hidden = torch.empty(len(step.token_ids), decoded.shape[1], dtype=prefilled.dtype, device=self.device)
        hidden[torch.from_numpy(split.decode_rows)] = decoded.to(prefilled.dtype)
        hidden[torch.from_numpy(split.prefill_rows)] = prefilled
        return hidden

    def _prepare_lora(self, step: StepInput) -> None:
        """Slot the step's adapters and group its tokens by slot (no adapters: nothing to do)."""
        adapters = {lora.adapter_id: lora for lora in step.loras if lora is not None}
        if not adapters:
            self.lora.groups = []
            return
        slots = self.lora.activate(list(adapters.values()), step.loras_in_use)
        rows: dict[int, list[int]] = {}
        start = 0
        for lora, n in zip(step.loras, step.num_new_tokens):
            if lora is not None:
                rows.setdefault(slots[lora.adapter_id], []).extend(range(start, start + n))
            start += n
        self.lora.set_groups(rows)

    @property
    def uses_triton(self) -> bool:
        return self.backend.name == "triton"

    def _capture_cuda_graphs(self, config: EngineConfig, max_model_len: int) -> DecodeGraphs | None:
        if not self.platform.cuda_graphs or not self.model_class.fast_paths.cuda_graphs:
            return None
        if any(r.dynamic is not None for r in getattr(self.model, "rotaries", ())):
            logger.info("CUDA graphs off: dynamic NTK rope computes each step's frequencies on the host")
            return None
        with self._on_device(), triton_ops(True):
            graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, config.max_num_seqs, max_model_len,
                                  self.block_size)
            return graphs.capture()

    def _fused_ops(self):
        """The elementwise kernels that go with the attention backend (none for the torch reference)."""
        family = self.platform.kernel_family
        return triton_ops(True) if family == "triton" else cpu_ops(family == "cpu")

    def _on_device(self):
        """Make the engine's GPU current: Triton launches on the current device, and a thread's
        current device is cuda:0 whatever device the engine was given."""
        return torch.cuda.device(self.device) if self.platform.is_cuda else contextlib.nullcontext()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder over the flattened batch: a CUDA graph replay for a decode-only step that fits
        one, else eagerly. Steps with LoRA adapters run eagerly: graphs are captured without them.
        ``embeds``: the step's input rows with its images in (always eager)."""
        with self._on_device(), self._fused_ops():
            if embeds is not None:
                return self.model(input_ids, positions, meta, self.kv_caches, input_embeds=embeds)
            if self.cuda_graphs is not None and not self.lora.groups and self.cuda_graphs.fits(meta):
                return self.cuda_graphs.replay(input_ids, positions, meta)
            if (self.decode_stack is not None and not self.lora.groups
                    and self.decode_stack.fits(meta, input_ids.shape[0])):
                return self.decode_stack.run(input_ids, positions, meta)
            return self.model(input_ids, positions, meta, self.kv_caches)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = stage([[c[0] for c in copies], [c[1] for c in copies]], self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            if v_cache is not k_cache:  # a shared (latent) cache is copied once
                v_cache[dst] = v_cache[src]

    def _host_block_tables(self, step: StepInput, max_blocks: int) -> np.ndarray:
        """The step's block tables on the host, ``[sequences, max_blocks]``: rows of the persistent
        buffer after applying the step's changes (the engine's records), or padded from full tables
        (a hand-made record)."""
        if step.table_rows is None:
            tables = np.zeros((step.num_seqs, max_blocks), dtype=np.int64)
            for i, table in enumerate(step.block_tables):
                tables[i, :min(len(table), max_blocks)] = table[:max_blocks]
            return tables
        self._apply_table_updates(step)
        return self._table_buffer[step.table_rows, :max_blocks]

    def _apply_table_updates(self, step: StepInput) -> None:
        buffer = self._table_buffer  # numpy: these small writes cost a microsecond, a torch op ten
        for row, start, blocks in step.table_updates:
            if start == 0:  # a row taken over by another sequence: no stale blocks behind its table
                buffer[row] = 0
            buffer[row, start:start + len(blocks)] = blocks

    def _prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, "_Gathers"]:
        # a step with image rows runs the model eagerly, which needs the backend's plans (the staged path);
        # so does one with 3-D (M-RoPE) positions: only the eager rotary takes them
        rope = step.rope_positions
        if (step.table_rows is not None and self._host_decode_path and not step.images
                and (rope is None or rope.ndim == 1)):
            if all(n == 1 for n in step.num_new_tokens):
                return self._host_rows(step, chained=False)
            if self._fits_chained(step):
                return self._host_rows(step, chained=True)
        return self._prepare_staged(step)

    def _host_rows(self, step: StepInput, chained: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, "_Gathers"]:
        ids, positions, meta = self._prepare_rows(step, chained)
        if step.rope_positions is not None:  # M-RoPE: rope rotates by the sequence position + the prompt's delta
            positions = torch.from_numpy(step.rope_positions)
        return ids, positions, meta, _Gathers.of(step, self.device)

    @property
    def stack_limits(self) -> StackLimits | None:
        """Which steps the CPU decode stack runs whole; None without one. Other steps pay an eager model
        pass, which the stall-free policy's step-time model prices apart (engine/step_time.py)."""
        if self.decode_stack is None or not self._host_decode_path:
            return None
        return self.decode_stack.limits

    @property
    def _host_decode_path(self) -> bool:
        """CPU kernels read decode metadata straight from numpy (``_prepare_rows``); the Triton
        kernels (CUDA, or the interpreter) take the staged path below."""
        return not self.platform.is_cuda and not self.uses_triton

    def _prepare_staged(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, "_Gathers"]:
        """The step's metadata computed in numpy on the host, then moved to the device as one
        page-locked buffer with one non-blocking copy (kernels/transfer.py): building it never waits
        for the device, so the host prepares step k+1 while the GPU still runs step k."""
        new = np.asarray(step.num_new_tokens, dtype=np.int64)
        starts = np.asarray(step.start_positions, dtype=np.int64)
        query_start = np.zeros(step.num_seqs + 1, dtype=np.int64)
        np.cumsum(new, out=query_start[1:])
        seq_lens = starts + new
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        tables = self._host_block_tables(step, max_blocks)
        seq_index = np.repeat(np.arange(step.num_seqs), new)
        positions = np.arange(len(step.token_ids), dtype=np.int64) + (starts - query_start[:-1])[seq_index]
        slots = tables[seq_index, positions // self.block_size] * self.block_size + positions % self.block_size
        logit_index = None if _is_range(step.logit_rows, len(step.token_ids)) else step.logit_rows
        rope_lens = None
        if self.length_dependent_rope and step.prompt_lens is not None:
            rope_lens = np.maximum(seq_lens, np.asarray(step.prompt_lens, dtype=np.int64))
        rotary = positions if step.rope_positions is None else step.rope_positions  # M-RoPE: what rope rotates by
        arrays = [step.token_ids, rotary, slots, seq_lens, query_start, tables, logit_index or [], step.pool_rows,
                  rope_lens if rope_lens is not None else []]
        ids, pos, slot_mapping, lens, starts_t, tables_t, logit_t, pool_t, rope_t = stage(arrays, self.device)
        if rotary.ndim == 2:
            pos = pos.view(3, -1)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start=query_start.tolist(), seq_lens=seq_lens.tolist(),
            block_tables=tables_t.view(step.num_seqs, max_blocks), seq_lens_tensor=lens,
            query_start_tensor=starts_t, block_size=self.block_size,
            decode_indices=[i for i, n in enumerate(step.num_new_tokens) if n == 1],
            prefill_indices=[i for i, n in enumerate(step.num_new_tokens) if n > 1])
        if rope_lens is not None:
            meta.rope_lens, meta.rope_lens_tensor = rope_lens.tolist(), rope_t
        if step.images and getattr(self.shape.vision, "bidirectional", False):
            meta.bidirectional = _image_spans(step, query_start)
        self.backend.prepare(meta)
        return ids, pos, meta, _Gathers(logit_t if logit_index is not None else None, pool_t)

    def _fits_chained(self, step: StepInput) -> bool:
        """A small multi-token step (a speculative verification, or decodes beside a small prefill chunk)
        the decode stack can run row by row."""
        if self.decode_stack is None or self.lora.groups:
            return False
        ends = [start + n for start, n in zip(step.start_positions, step.num_new_tokens)]
        return self.decode_stack.limits.runs_whole(step.num_new_tokens, ends)

    def _prepare_rows(self, step: StepInput, chained: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``_prepare`` of a CPU step laid out one row per token: a decode-only step (the batch-1
        latency path), or with ``chained`` a small multi-token step for the decode stack, where a
        sequence verifying k drafts becomes 1 + k rows at consecutive positions over its block table."""
        if chained:
            starts, rows = _expand_rows(step)
        else:
            starts, rows = np.asarray(step.start_positions, dtype=np.int64), step.table_rows
        max_blocks = int(starts.max()) // self.block_size + 1
        self._apply_table_updates(step)
        meta = _decode_metadata(starts, self._table_buffer[rows, :max_blocks], self.block_size)
        meta.chained = chained
        if not chained and (self.decode_stack is None or self.lora.groups
                            or not self.decode_stack.fits(meta, len(starts))):
            self.backend.prepare(meta)  # the decode stack needs none of the backend's plans
        return torch.tensor(step.token_ids), torch.from_numpy(starts), meta


class _Gathers(NamedTuple):
    """Which rows of the step's hidden states go on: the LM head's (None: every row, in order) and
    the pooled ones (embeddings), as device index tensors."""

    logit_index: torch.Tensor | None
    pool_index: torch.Tensor | None

    @classmethod
    def of(cls, step: StepInput, device: torch.device) -> "_Gathers":
        logit = None if _is_range(step.logit_rows, len(step.token_ids)) else to_device(step.logit_rows, device)
        return cls(logit, to_device(step.pool_rows, device) if step.pool_rows else None)


def _bf16_matmuls() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here (AVX512-BF16 or AMX)."""
    return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())


def _int8_bf16_dot_here() -> bool:
    from ..kernels.int8_linear import bf16_dot_available

    return bf16_dot_available()


def _use_int8_bf16_dot(model: torch.nn.Module) -> None:
    """Every int8 layer of ``model`` (the LM head included) multiplies calls of 13+ rows in bf16 dot products."""
    from ..kernels.int8_linear import Int8Linear

    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    for layer in layers:
        layer.bf16_dot = True
    logger.info("dtype=bfloat16 on int8 weights: %d int8 layers multiply in bf16 dot products from 13 rows",
                len(layers))


@torch.no_grad()
def _round_to_bf16(model: torch.nn.Module) -> None:
    """Every float32 weight of ``model`` rounded to the nearest bfloat16 value, in place (still float32 tensors:
    the module path computes float32 on them, and the bf16 panels built from them hold them exactly). Buffers
    (rotary tables) stay float32, as a bf16 model's rope is computed in float32."""
    count = 0
    for tensor in model.parameters():
        if tensor.dtype == torch.float32:
            tensor.copy_(tensor.to(torch.bfloat16))
            count += 1
    logger.info("dtype=bfloat16 on CPU: %d weight tensors rounded to bfloat16; float32 activations and KV cache", count)


def _image_spans(step: StepInput, query_start: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """Per sequence, the absolute positions of the step's image rows (each image whole: the scheduler never
    splits an image of a model that attends inside images both ways)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for r in step.images:
        i = int(np.searchsorted(query_start, r.row, side="right")) - 1
        first = step.start_positions[i] + r.row - int(query_start[i])
        spans.setdefault(i, []).append((first, first + r.count))
    return spans


def _is_range(rows: list[int], n: int) -> bool:
    """``rows`` is ``0, 1, ..., n - 1``: every row, in order (no gather needed)."""
    return len(rows) == n and (n == 0 or (rows[0] == 0 and rows[-1] == n - 1 and rows == list(range(n))))


def _expand_rows(step: StepInput) -> tuple[np.ndarray, list[int]]:
    """One row per token: its position, and its sequence's block-table row."""
    starts, rows = [], []
    for start, n, row in zip(step.start_positions, step.num_new_tokens, step.table_rows):
        starts.extend(range(start, start + n))
        rows.extend([row] * n)
    return np.asarray(starts, dtype=np.int64), rows


def _decode_metadata(starts: np.ndarray, tables: np.ndarray, block_size: int) -> AttentionMetadata:
    """The metadata of a decode-only step (one new token per sequence at position ``starts[i]``),
    computed in numpy on the CPU: a handful of microseconds instead of a dozen torch operations."""
    n = len(starts)
    seq_lens = starts + 1
    slots = tables[np.arange(n), starts // block_size] * block_size + starts % block_size
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots), query_start=list(range(n + 1)), seq_lens=seq_lens.tolist(),
        block_tables=torch.from_numpy(tables), seq_lens_tensor=torch.from_numpy(seq_lens),
        query_start_tensor=torch.arange(n + 1), block_size=block_size, decode_indices=list(range(n)),
        prefill_indices=[])


def _inside_context(shape: DecoderShape, max_model_len: int) -> DecoderShape:
    """``shape`` without the sliding windows and attention chunks no sequence can outgrow (they change
    nothing, and the fast paths take only global attention)."""
    windows = tuple(w if w is not None and w < max_model_len else None for w in shape.layer_windows)
    shape.layer_windows = windows if any(w is not None for w in windows) else ()
    chunks = tuple(c if c is not None and c < max_model_len else None for c in shape.layer_chunks)
    shape.layer_chunks = chunks if any(c is not None for c in chunks) else ()
    return shape


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU it lives in an anonymous memory mapping: the OS hands out its
    pages already zeroed and backs them only once written, so a large KV cache costs resident
    memory as blocks are used, not up front (``torch.zeros`` writes, and so commits, every byte).
    The mapping keeps the system's default page size: no transparent huge pages. A 2 MiB first
    touch costs ~7 ms on the VMs we measured (the host backs the page then), and a new block touches
    one fresh page in each layer's K and V at once, so one decode step absorbed 100-170 ms; 4 KiB
    faults cost ~0.6 ms per MiB spread over every step, and warm decode steps ran no faster with
    huge pages (docs/benchmarks.md, W-STREAM)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.finfo(dtype).bits // 8
    memory = mmap.mmap(-1, max(1, size), flags=mmap.MAP_PRIVATE)  # private anonymous memory (the default is shared)
    # frombuffer keeps a reference to the mapping, which lives as long as the tensor
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    return flat[:size].view(dtype).view(shape)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30

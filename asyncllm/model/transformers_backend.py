"""Any decoder transformers implements, run by transformers' own modules with the engine's paged attention.

For an architecture without a native file (``model/registry.py``), the checkpoint is loaded with
``AutoModelForCausalLM.from_pretrained`` and its attention layers call :func:`paged_attention`
through transformers' attention interface (``AttentionInterface.register``, selected with
``attn_implementation``). Everything around the model is the engine's: continuous batching over
one flattened batch (``[1, tokens]`` with each token's position), the paged KV cache, prefix
caching, streams, structured output. transformers builds no attention mask for an implementation it
does not know, so the step's layout reaches the kernel only through the engine's metadata.

What this path cannot see it checks before serving (:func:`verify`): at load, a short prompt is run
once through the engine's path, prefill then one decode step, and once through transformers' eager
attention; the logits must agree, or the load fails naming the architecture. That catches models
whose attention carries something the paged kernel does not (ALiBi biases, attention sinks),
models that read positions from elsewhere than ``position_ids``, and logit post-processing the LM
head path below does not reproduce. Sliding windows must reach the attention call as its
``sliding_window`` argument; a model that keeps its window in the mask alone is refused too.

Speed: transformers' modules run eagerly, layer by layer, with separate q/k/v projections and
none of the engine's fused CPU kernels, the C decode stack or CUDA graphs (docs/models.md has the
figures). Not available on this path: tensor parallelism, int8 weights and GGUF files. LoRA adapters apply to
the projections named as PEFT names Llama's (``q_proj`` ... ``down_proj``), through forward hooks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels.metadata import AttentionMetadata
from .decoder import FastPaths
from .shape import DecoderShape

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "asyncllm_paged"
_UNSUPPORTED_ATTENTION_ARGS = ("s_aux", "sinks", "alibi", "position_bias")
_step = threading.local()  # the step the engine thread is running (models run on one thread at a time)


@dataclass
class _Step:
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: object
    seen: dict[int, dict] = field(default_factory=dict)  # layer -> what its attention call saw (verify)
    probe: bool = False  # only record the layouts (no cache yet): attention returns zeros


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature over the engine's paged cache: writes the step's keys and
    values into the layer's cache and attends. query/key/value: [1, heads, tokens, head_dim]."""
    step: _Step | None = getattr(_step, "current", None)
    if step is None:
        raise RuntimeError("asyncllm's paged attention was called outside an engine step")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ModelLoadError(f"{type(module).__name__} has no layer_idx: the transformers backend cannot place its KV")
    for name in _UNSUPPORTED_ATTENTION_ARGS:
        if kwargs.get(name) is not None:
            raise ModelLoadError(f"{type(module).__name__} passes {name!r} to attention, which the paged kernel lacks")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    step.seen[layer] = {"kv_heads": k.shape[1], "head_dim": k.shape[2], "heads": q.shape[1],
                        "window": window, "v_dim": v.shape[2]}
    if step.probe:
        return torch.zeros_like(q).unsqueeze(0), None
    k_cache, v_cache = step.kv_caches[layer]
    step.backend.write_kv(k, v, k_cache, v_cache, step.meta)
    variant = {name: value for name, value in (("window", window), ("softcap", softcap)) if value is not None}
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.backend.forward(q.contiguous(), k_cache, v_cache, step.meta, scale, **variant)
    return out.unsqueeze(0), None  # [1, tokens, heads, head_dim]


def _lora_hook(slots, layer: int, target: str):
    def hook(module, inputs, output):
        if slots.groups:
            x = inputs[0]
            slots.apply(layer, target, x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1]))
        return output
    return hook


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class TransformersModel(nn.Module):
    """A transformers causal LM whose attention runs on the engine's paged KV cache."""

    packed_modules: dict = {}
    renamed: dict = {}
    lora_targets: tuple = ()
    fast_paths = FastPaths(decode_stack=False, cuda_graphs=False, tensor_parallel=False)
    LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    gguf_architectures: tuple = ()
    rotaries: tuple = ()

    def __init__(self, hf_model: nn.Module, shape: DecoderShape, backend) -> None:
        super().__init__()
        self.hf, self.shape, self.backend = hf_model, shape, backend
        config = hf_model.config
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._logit_scale = getattr(config, "logit_scale", None)
        self._logits_scaling = getattr(config, "logits_scaling", None)

    # ---- the declaration the registry and runner read ----

    @classmethod
    def check_config(cls, config) -> None:
        from transformers import AutoModelForCausalLM

        mapping = AutoModelForCausalLM._model_mapping
        if type(config) not in mapping:
            raise ModelLoadError(f"architecture {getattr(config, 'architectures', None) or config.model_type!r} "
                                 "is neither native to asyncllm nor a causal LM transformers implements")
        model_class = mapping[type(config)]
        if not getattr(model_class, "_supports_attention_backend", False):
            raise ModelLoadError(f"{model_class.__name__} does not take custom attention in transformers "
                                 "(_supports_attention_backend), so the transformers backend cannot run it")

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        """The sizes from the config; the KV layout is confirmed by :func:`verify` at load."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv = (getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None)
              or (1 if getattr(text, "multi_query", False) else heads))
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        names = list(getattr(config, "architectures", None) or [config.model_type])
        return DecoderShape(vocab_size=text.vocab_size, hidden_size=text.hidden_size,
                            intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
                            num_layers=text.num_hidden_layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                            rms_norm_eps=1e-6, qkv_bias=False, qk_norm=False,
                            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
                            architecture=names[0])

    @classmethod
    def make_rotaries(cls, config, shape, max_positions):
        return []  # transformers' modules rotate q/k themselves

    @classmethod
    def load(cls, config, root: Path, shape: DecoderShape, backend, dtype: torch.dtype,
             device: torch.device) -> "TransformersModel":
        """The checkpoint at ``root`` through transformers, attention pointed at the paged cache."""
        from transformers import AutoModelForCausalLM

        register_attention()
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(root, config=config, dtype=dtype, local_files_only=True,
                                                            attn_implementation=ATTN_IMPLEMENTATION)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"transformers could not load {root}: {exc}") from exc
        hf_model = hf_model.to(device).eval()
        logger.info("%s has no native asyncllm implementation: running transformers' modules with paged "
                    "attention (model_impl='transformers'; slower than a native family, docs/models.md)",
                    shape.architecture)
        return cls(hf_model, shape, backend)

    # ---- LoRA: PEFT adapters on the model's own projections ----

    def _lora_modules(self) -> dict[tuple[int, str], nn.Module]:
        """(layer, PEFT target) -> the projection, for the Llama-style names transformers' models use."""
        found = {}
        for name, module in self.hf.named_modules():
            parts = name.split(".")
            leaf = parts[-1]
            layer = next((int(p) for p in reversed(parts[:-1]) if p.isdigit()), None)
            if leaf in self.LORA_MODULES and layer is not None and hasattr(module, "in_features"):
                found[(layer, leaf)] = module
        return found

    def lora_layout(self):
        """Where adapters go: each projection named as PEFT names it applies its own target (the
        architecture's targets are those every layer has with one size)."""
        from ..adapters.peft_loader import LoRALayout

        modules = self._lora_modules()
        shapes: dict[str, tuple[int, int]] = {}
        for (layer, leaf), module in modules.items():
            size = (module.in_features, module.out_features)
            if shapes.setdefault(leaf, size) != size:
                shapes[leaf] = None  # differs between layers: not a target
        layers = {layer for layer, _ in modules}
        targets = tuple(t for t in self.LORA_MODULES if shapes.get(t) is not None
                        and all((layer, t) in modules for layer in layers))
        return LoRALayout(targets, {t: shapes[t] for t in targets}, {t: (t,) for t in targets})

    def attach_lora(self, slots) -> None:
        """Let every target projection add the step's adapter deltas to its output (after any packing:
        the hooks sit on the modules that run)."""
        for (layer, leaf), module in self._lora_modules().items():
            if leaf in slots.layout.targets:
                module.register_forward_hook(_lora_hook(slots, layer, leaf))

    # ---- the forward pass, as the runner calls it ----

    def build_rotaries(self, device: torch.device, dtype: torch.dtype) -> None:
        pass

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend=None, probe: bool = False) -> torch.Tensor:
        """[tokens] ids and positions -> [tokens, hidden] final hidden states (after the last norm).
        ``probe``: record each layer's query/key layout instead of attending (before a cache exists)."""
        step = _Step(meta, kv_caches, backend or self.backend, probe=probe)
        previous, _step.current = getattr(_step, "current", None), step
        try:
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _step.current = previous
        self.last_step = step
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits


@torch.inference_mode()
def verify(model: TransformersModel, block_size: int, max_model_len: int) -> DecoderShape:
    """Run a 6-token prompt through the engine's path (prefill of 5, then one decode step) and through
    transformers' eager attention; return the shape with the KV layout the attention calls showed.
    ModelLoadError when the logits disagree, the layers' KV layouts differ, or a configured sliding
    window never reaches the attention call."""
    from ..kernels.torch_attention import TorchAttentionBackend

    hf, shape = model.hf, model.shape
    device = next(hf.parameters()).device
    dtype = next(hf.parameters()).dtype
    vocab = shape.vocab_size
    ids = torch.tensor([3, 17, 5, 11, 29, 7], device=device) % vocab
    try:
        model.forward(ids[:2], torch.arange(2, device=device), None, [], probe=True)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise ModelLoadError(f"{shape.architecture}: the transformers backend cannot run it ({exc})") from exc
    seen = model.last_step.seen
    layouts = {(s["kv_heads"], s["head_dim"], s["v_dim"]) for s in seen.values()}
    if not seen or sorted(seen) != list(range(len(seen))) or len(layouts) != 1:
        raise ModelLoadError(f"{shape.architecture}: its layers' KV layouts differ ({sorted(layouts)}), "
                             "which one paged cache cannot hold")
    kv_heads, head_dim, v_dim = layouts.pop()
    if v_dim != head_dim:
        raise ModelLoadError(f"{shape.architecture}: values of width {v_dim} beside keys of {head_dim}")
    shape.num_layers, shape.num_kv_heads, shape.head_dim = len(seen), kv_heads, head_dim
    shape.num_heads = next(iter(seen.values()))["heads"]
    blocks = -(-len(ids) // block_size)
    caches = [(torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device),
               torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device))
              for _ in range(shape.num_layers)]
    backend = TorchAttentionBackend()
    table = torch.arange(blocks, device=device)[None]

    def meta_for(start: int, count: int) -> AttentionMetadata:
        positions = torch.arange(start, start + count, device=device)
        return AttentionMetadata(slot_mapping=positions, query_start=[0, count], seq_lens=[start + count],
                                 block_tables=table, seq_lens_tensor=torch.tensor([start + count], device=device),
                                 query_start_tensor=torch.tensor([0, count], device=device), block_size=block_size,
                                 decode_indices=[0] if count == 1 else [], prefill_indices=[] if count == 1 else [0])

    try:
        first = model.forward(ids[:5], torch.arange(5, device=device), meta_for(0, 5), caches, backend)
        last = model.forward(ids[5:], torch.tensor([5], device=device), meta_for(5, 1), caches, backend)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise ModelLoadError(f"{shape.architecture}: the transformers backend cannot run it ({exc})") from exc
    window = getattr(hf.config, "sliding_window", None)
    if (window and window < max_model_len and getattr(hf.config, "use_sliding_window", True) is not False
            and not any(s["window"] for s in seen.values())):
        raise ModelLoadError(f"{shape.architecture}: its sliding window (config key sliding_window={window}) lives "
                             "in transformers' attention mask, which the paged path does not build; "
                             f"load it with max_model_len <= {window}")
    ours = model.compute_logits(torch.cat([first[-1:], last])).float()
    hf.set_attn_implementation("eager")
    try:
        theirs = hf(input_ids=ids[None], use_cache=False).logits[0, [4, 5]].float()
    finally:
        hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    scale = theirs.abs().max().clamp(min=1.0)
    if not torch.allclose(ours, theirs, atol=tolerance * float(scale), rtol=0):
        raise ModelLoadError(f"{shape.architecture}: transformers' modules with paged attention do not reproduce "
                             f"transformers' own logits (max difference {float((ours - theirs).abs().max()):.3g}); "
                             "this architecture needs something the paged path lacks")
    return shape

"""The platform decision: where and how the model runs, decided once per engine.

Device, dtype, attention backend, the fused-kernel family that goes with it, packed CPU linears,
the fused greedy sampler, CUDA graphs, the default token budget and the torch.distributed backend
all follow from the engine arguments and the machine. They are decided here, in one function, and
the model runner, the engine core and the sampler read the resulting :class:`Platform` instead of
branching on device strings themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import EngineConfig
from .errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TOKEN_BUDGET = {"cpu": 2048, "cuda": 8192}  # per engine step (docs/cpu.md has the CPU trade-off)


@dataclass(frozen=True)
class Platform:
    """What :func:`decide_platform` chose; read-only."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str        # "triton", "cpu" (the C kernels) or "torch" (the reference)
    kernel_family: str | None     # fused elementwise ops: "triton", "cpu", or None (plain torch)
    packed_linears: bool          # CPU: projections through oneDNN with weights packed at load
    fused_greedy: bool            # CPU: greedy rows picked by the C kernel (argmax + logprob in one pass)
    decode_stack: bool            # CPU: small decode-only steps run all layers in one C call (kernels/cpu_decode_stack.py)
    cuda_graphs: bool             # decode steps replayed as CUDA graphs
    default_token_budget: int     # max_num_batched_tokens when the engine arguments leave it unset
    distributed_backend: str      # torch.distributed backend for tensor parallelism: "nccl" or "gloo"
    # CPU, dtype="bfloat16" on an AVX-512 build: the weights rounded to bf16 and read as paired bf16 panels by the
    # decode stack and the LM head (bf16 dot products from 8 rows on AVX512-BF16), float32 activations between the
    # projections and a float32 KV cache (``dtype`` is then float32; docs/cpu.md)
    bf16_weights: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available")
    return device


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend of tensor parallelism on ``device``: NCCL on CUDA, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


def stored_dtype(hf_config) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are stored in, or None where it names none we know."""
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return DTYPES.get(str(stored).replace("torch.", "")) if stored is not None else None


def resolve_dtype(name: str, hf_config, device: torch.device, native_bf16_cpu: bool = False) -> torch.dtype:
    """``auto`` on CUDA: the checkpoint's dtype, with float32 checkpoints run in bfloat16. On CPU: bfloat16
    for a checkpoint stored in 16 bits (bfloat16 or float16, not quantized) where ``native_bf16_cpu`` (the
    CPU multiplies bf16 natively and the bf16 panel path runs here, :func:`decide_platform`), as vLLM's CPU
    build does; else float32, which keeps float32 checkpoints exact (the oracle of the tests)."""
    if name != "auto":
        return DTYPES[name]
    stored = stored_dtype(hf_config)
    if device.type == "cpu":
        quantized = getattr(hf_config, "quantization_config", None) is not None
        sixteen_bits = stored in (torch.bfloat16, torch.float16)
        return torch.bfloat16 if native_bf16_cpu and sixteen_bits and not quantized else torch.float32
    stored = stored or torch.bfloat16
    return torch.bfloat16 if stored == torch.float32 else stored


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: the Triton kernels on CUDA (when triton is installed); on CPU in float32 the C decode
    kernel (when a C compiler could build it), else the torch reference. ``triton`` forces the kernels
    (on CPU only under TRITON_INTERPRET=1); ``cpu`` forces the C kernel; ``torch`` forces the reference."""
    from .kernels.cpu_attention import cpu_kernels_available
    from .kernels.triton_utils import check_triton_device, triton_available

    if name == "auto":
        if device.type == "cuda" and triton_available():
            name = "triton"
        elif device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available():
            return "cpu"
        else:
            return "torch"
    if name == "cpu":
        if device.type != "cpu" or dtype != torch.float32:
            raise ConfigError(f"attention_backend='cpu' runs float32 on the CPU, not {dtype} on {device.type}")
        if not cpu_kernels_available():
            raise ConfigError("attention_backend='cpu' needs a C compiler to build its kernel (see the log), "
                              "or set ASYNCLLM_CPU_KERNELS=1 if it was turned off; use 'torch' instead")
    if name == "triton":
        check_triton_device(device)
    return name


def decide_platform(config: EngineConfig, hf_config) -> Platform:
    """Every platform choice of one engine, from its arguments and this machine."""
    from .kernels.cpu_linear import packing_supported
    from .kernels.triton_utils import interpreting

    device = resolve_device(config.device)
    # The CPU fast path (packed oneDNN weights, C kernels, fused greedy sampling) unless the torch
    # reference was asked for: attention_backend="torch" stays plain torch, the tests' oracle.
    cpu_fast_path = device.type == "cpu" and config.attention_backend != "torch"
    native_bf16 = (cpu_fast_path and config.dtype == "auto" and config.attention_backend in ("auto", "cpu")
                   and _bf16_dot_products_here())
    dtype = resolve_dtype(config.dtype, hf_config, device, native_bf16)
    bf16_weights = (cpu_fast_path and dtype == torch.bfloat16 and config.attention_backend in ("auto", "cpu")
                    and _bf16_panels_here())
    if bf16_weights:  # bf16 weights, float32 activations: the decode stack's bf16 panels (kernels/cpu_decode_stack.py)
        dtype = torch.float32
    backend = resolve_attention_backend(config.attention_backend, device, dtype)
    # Tensor parallelism sums partial outputs between layers: no single call may run them all
    # (the decode stack), and collectives are not captured in CUDA graphs.
    parallel = config.tensor_parallel_size > 1
    return Platform(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        kernel_family={"triton": "triton", "cpu": "cpu"}.get(backend),
        packed_linears=cpu_fast_path and packing_supported(device, dtype),
        fused_greedy=cpu_fast_path,
        decode_stack=cpu_fast_path and backend == "cpu" and dtype == torch.float32 and not parallel,
        cuda_graphs=(config.enable_cuda_graphs and device.type == "cuda" and backend == "triton"
                     and not interpreting() and not parallel),
        default_token_budget=DEFAULT_TOKEN_BUDGET.get(device.type, 2048),
        distributed_backend=distributed_backend(device),
        bf16_weights=bf16_weights and backend == "cpu",
    )


def _bf16_dot_products_here() -> bool:
    """Whether the bf16 panel path runs here and multiplies with bf16 dot products (AVX512-BF16 builds)."""
    from .kernels.cpu_decode_stack import bf16_dot_rows

    return _bf16_panels_here() and bf16_dot_rows() > 0


def _bf16_panels_here() -> bool:
    """Whether this machine's decode-stack build reads bf16 panels (AVX-512) and the C kernels load."""
    from .kernels.cpu_attention import cpu_kernels_available
    from .kernels.cpu_decode_stack import enabled, panels_supported

    return enabled() and cpu_kernels_available() and panels_supported()

"""Engine arguments (the keyword arguments of ``LLM`` and ``AsyncLLM``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

from .errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "triton", "cpu")
_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class EngineConfig:
    """Every engine knob in one place; see docs/api.md for their meaning."""

    model: str                         # a checkpoint directory, a .gguf file or a hub id (model/source.py)
    revision: str | None = None        # hub ids: branch, tag or commit
    hf_token: str | bool | None = None  # hub ids: access token (None: HF_TOKEN or the saved login)
    quantization: str | None = None    # None (the checkpoint decides), "int8" or "none" (model/quantization.py)
    model_impl: str = "auto"           # "auto", "native" or "transformers" (model/registry.py, docs/models.md)
    skip_tokenizer_init: bool = False  # token ids in, token ids out: no tokenizer is loaded
    generation_config: str = "auto"    # "auto": generation_config.json's sampling defaults apply; "none": ignored
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"       # "auto" (the activations'), "float32", "bfloat16" (CPU: half the cache bytes)
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_n: int = 128                   # the largest n a request may ask for (OpenAI's bound)
    max_waiting_requests: int = 4096   # requests queued beyond those running; more are refused (HTTP 429)
    max_num_batched_tokens: int | None = None
    max_itl_ms: float | str | None = "auto"  # inter-token latency target for prefill chunking (engine/step_budget.py)
    arrival_window_ms: float = 3.0     # AsyncLLM: an idle engine's wait for a burst's next request (engine_thread.py)
    block_size: int = 16
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    tensor_parallel_size: int = 1      # ranks splitting the model (distributed/, docs/scaling.md)
    enable_expert_parallel: bool = False  # mixture-of-experts layers: whole experts per rank (docs/moe.md)
    nnodes: int = 1                    # machines those ranks span (MASTER_ADDR/MASTER_PORT rendezvous)
    node_rank: int = 0                 # this machine's place among them; 0 runs the engine
    attention_backend: str = "auto"
    enable_cuda_graphs: bool = True    # CUDA + Triton only: replay decode steps as CUDA graphs (docs/kernels.md)
    speculative_config: dict | str | None = None  # speculative decoding (engine/speculation.py, docs/decoding.md)
    seed: int = 0
    # vision-language models (docs/multimodal.md): what a prompt's images may be and where they come from
    limit_mm_per_prompt: dict | None = None  # {"image": N}: images per prompt (default 8)
    max_image_bytes: int = 20 * 2**20          # an image's encoded size (a data: URL, a file, a download)
    max_image_pixels: int = 40_000_000         # width x height, checked before the pixels are decoded
    allowed_local_media_path: str | Sequence[str] | None = None  # image parts may name files under these directories
    allowed_media_domains: list | None = None  # http(s) image URLs of these hosts are fetched ("*": any); None: none
    media_fetch_timeout: float = 10.0          # seconds for one image download
    image_cache_memory: int = 256 * 2**20      # bytes of encoder outputs kept by image content hash
    encoder_token_budget: int | None = None    # image rows one step may start encoding (None: the step's token budget)
    mm_processor_kwargs: dict | None = None    # passed to every call of the model's processor (e.g. do_pan_and_scan)

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict[str, Any]) -> "EngineConfig":
        """Build a config, naming any unknown argument in the error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        config = cls(model=str(model), **kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in _BACKENDS:
            raise ConfigError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        for name in ("max_num_seqs", "block_size", "max_loras", "max_lora_rank", "max_cpu_loras", "max_n",
                     "max_waiting_requests"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        itl = self.max_itl_ms
        if not (itl is None or itl == "auto" or (isinstance(itl, (int, float)) and not isinstance(itl, bool)
                                                   and 0 < itl < float("inf"))):
            raise ConfigError(f"max_itl_ms must be a positive number of milliseconds, 'auto' or None, got {itl!r}")
        window = self.arrival_window_ms
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window <= 1000:
            raise ConfigError(f"arrival_window_ms must be a number of milliseconds from 0 to 1000, got {window!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ConfigError(f"revision must be a branch, tag or commit name, got {self.revision!r}")
        if self.hf_token is not None and not isinstance(self.hf_token, (str, bool)):
            raise ConfigError("hf_token must be a string, True/False or None")
        from .model.quantization import QUANTIZATION_CHOICES

        if self.quantization not in QUANTIZATION_CHOICES:
            raise ConfigError(f"quantization must be one of {', '.join(map(repr, QUANTIZATION_CHOICES))}; "
                              f"got {self.quantization!r}")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ConfigError(f"model_impl must be 'auto', 'native' or 'transformers', got {self.model_impl!r}")
        if self.generation_config not in ("auto", "none"):
            raise ConfigError(f"generation_config must be 'auto' or 'none', got {self.generation_config!r}")
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ConfigError(f"skip_tokenizer_init must be True or False, got {self.skip_tokenizer_init!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if not isinstance(self.enable_cuda_graphs, bool):
            raise ConfigError(f"enable_cuda_graphs must be True or False, got {self.enable_cuda_graphs!r}")
        from .engine.speculation import SpeculativeConfig  # (the engine package imports this module)
        SpeculativeConfig.parse(self.speculative_config)
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank!r}")
        self._validate_media()
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                              f"nnodes={self.nnodes} (each node runs the same number of ranks)")

    @property
    def max_images_per_prompt(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", 8)

    def _validate_media(self) -> None:
        extra = self.mm_processor_kwargs
        if extra is not None and (not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)
                                  or {"text", "images", "return_tensors"} & set(extra)):
            raise ConfigError("mm_processor_kwargs must be a mapping of the processor's keyword arguments "
                              f"(not text, images or return_tensors), got {extra!r}")
        limit = self.limit_mm_per_prompt
        if limit is not None:
            if not isinstance(limit, dict) or set(limit) - {"image"}:
                raise ConfigError(f"limit_mm_per_prompt must be a mapping like {{'image': 4}}, got {limit!r}")
            count = limit.get("image", 8)
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ConfigError(f"limit_mm_per_prompt['image'] must be a non-negative integer, got {count!r}")
        if self.encoder_token_budget is not None and (not isinstance(self.encoder_token_budget, int)
                                                      or isinstance(self.encoder_token_budget, bool)
                                                      or self.encoder_token_budget < 1):
            raise ConfigError(f"encoder_token_budget must be a positive integer or None, got {self.encoder_token_budget!r}")
        for name in ("max_image_bytes", "max_image_pixels", "image_cache_memory"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        timeout = self.media_fetch_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ConfigError(f"media_fetch_timeout must be a positive number of seconds, got {timeout!r}")
        domains = self.allowed_media_domains
        if domains is not None and (isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains)):
            raise ConfigError(f"allowed_media_domains must be a list of host names (or ['*']), got {domains!r}")
        paths = self.allowed_local_media_path
        if paths is not None:
            import os

            listed = [paths] if isinstance(paths, (str, os.PathLike)) else paths
            if not isinstance(listed, (list, tuple)) or not listed:
                raise ConfigError("allowed_local_media_path must be a directory or a list of directories, "
                                  f"got {paths!r}")
            for path in listed:
                if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
                    raise ConfigError(f"allowed_local_media_path must name existing directories, got {path!r}")

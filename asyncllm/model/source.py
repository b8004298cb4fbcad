"""Where a model comes from: a local checkpoint directory, a GGUF file, or a Hugging Face hub id.

:func:`resolve_model_source` turns the ``model`` argument into a :class:`ModelSource`: a directory
holding the config, tokenizer and chat template files (what transformers reads), plus the GGUF file
when the weights come from one. Everything after this point reads local files only.

- A local directory with ``config.json``: used as it is.
- A ``.gguf`` file, or a directory holding exactly one: its metadata (config, tokenizer, chat
  template) is converted once by transformers' GGUF support and kept in the cache
  (``$ASYNCLLM_CACHE_DIR/gguf/<key>``, keyed by the file's path, size and modification time), because
  reading 100,000 vocabulary entries out of a GGUF file takes seconds. The weights are read from the
  file itself at every load (``model/gguf_weights.py``).
- Anything else is a hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``): ``huggingface_hub`` downloads (or, with
  ``HF_HUB_OFFLINE=1``, finds in its cache) the config, tokenizer, chat template, generation config
  and safetensors files only, at ``revision``, with ``token``; ``HF_HOME`` / ``HF_HUB_CACHE`` say
  where its cache lives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

logger = logging.getLogger(__name__)

# The files a hub snapshot needs: nothing else (no .bin, no .gguf, no ONNX/TF/Flax exports).
HUB_FILE_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                     "chat_template.jinja", "chat_template.json", "*.safetensors", "model.safetensors.index.json"]
GGUF_INFO = "gguf_source.json"
_GGUF_META_VERSION = "10"  # bump when the cached conversion's content changes


@dataclass(frozen=True)
class ModelSource:
    """A model on local disk: ``root`` holds config and tokenizer files; ``gguf_file`` the weights
    when they come from a GGUF file (else ``root``'s safetensors files)."""

    root: Path
    gguf_file: Path | None = None
    name: str = ""  # what the user asked for (a path or a hub id), for messages
    hub_id: str | None = None  # set when ``name`` was resolved on the hub

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model_source(model: str | os.PathLike, revision: str | None = None,
                         token: str | bool | None = None) -> ModelSource:
    """The local files behind ``model`` (a directory, a GGUF file or a hub id); see the module doc."""
    name = str(model)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model {name!r} is a file but not a .gguf file; pass a checkpoint directory, "
                                 "a .gguf file or a hub id")
        return _gguf_source(path.resolve(), name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path.resolve(), None, name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0].resolve(), name)
        if len(ggufs) > 1:
            raise ModelLoadError(f"{name!r} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs[:4])}); "
                                 "pass the path of the one to load")
        raise ModelLoadError(f"{name!r} has no config.json and no .gguf file: not a model directory")
    if _looks_like_local_path(name):
        raise ModelLoadError(f"model path {name!r} does not exist")
    return ModelSource(_hub_snapshot(name, revision, token), None, name, hub_id=name)


def _looks_like_local_path(name: str) -> bool:
    """Names that can only be paths: absolute, ``./``/``../``/``~``, a .gguf name, or more than one ``/``."""
    return (name.startswith(("/", "./", "../", "~")) or name.lower().endswith(".gguf") or name.count("/") > 1
            or "\\" in name)


def _hub_snapshot(repo_id: str, revision: str | None, token: str | bool | None) -> Path:
    """The local snapshot of hub repository ``repo_id`` (downloaded unless offline and cached)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as e:  # huggingface_hub comes with transformers; this is a broken install
        raise ModelLoadError(f"model {repo_id!r} is not a local path and huggingface_hub is not importable: {e}") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=HUB_FILE_PATTERNS)
    except HFValidationError as e:
        raise ModelLoadError(f"model {repo_id!r} is neither a local path nor a valid hub id ({e})") from e
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"hub model {repo_id!r} has no revision {revision!r}") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"hub model {repo_id!r} was not found (or needs a token: pass token=... "
                             "or set HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE=1 is set" if offline else "the hub cannot be reached"
        raise ModelLoadError(f"hub model {repo_id!r}{f' at revision {revision!r}' if revision else ''} is not in "
                             f"the local cache and {where}; download it once online "
                             f"(or pass a local directory)") from e
    except OSError as e:  # network failures surface as OSError subclasses (requests/httpx errors)
        raise ModelLoadError(f"cannot fetch hub model {repo_id!r}: {e}") from e
    root = Path(folder)
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"hub model {repo_id!r} has no config.json (GGUF-only repositories: download the "
                             ".gguf file and pass its path)")
    return root


# ---- GGUF metadata ----------------------------------------------------------------------------

def _gguf_source(file: Path, name: str) -> ModelSource:
    return ModelSource(gguf_metadata_dir(file), file, name)


def gguf_metadata_dir(file: Path) -> Path:
    """A directory with config.json and tokenizer files converted from ``file``'s metadata (cached)."""
    from ..kernels.cpu_build import cache_dir

    stat = file.stat()
    key = hashlib.sha256(f"{_GGUF_META_VERSION}\0{file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    target = cache_dir() / "gguf" / key
    if (target / "config.json").is_file():
        return target
    logger.info("converting the metadata of %s (once; cached in %s)", file.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        _convert_gguf_metadata(file, staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf_metadata(file: Path, out: Path) -> None:
    try:
        import gguf  # noqa: F401 - transformers needs it; say so here rather than deep inside
    except ImportError as e:
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install gguf") from e
    from transformers import AutoConfig, AutoTokenizer

    from .gguf_weights import read_rope_freqs, read_tensor_table

    try:
        table = read_tensor_table(file)
        if table["architecture"] in OWN_GGUF_CONFIGS:  # architectures transformers' GGUF reader lacks
            config = _config_from_metadata(table)
            tokenizer = _tokenizer_from_file(file)
        else:
            config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises ValueError/KeyError/... for unsupported files
        raise ModelLoadError(f"cannot read the metadata of GGUF file {file.name}: {e}") from e
    factors = read_rope_freqs(file, table)
    if factors is not None:  # llama.cpp's form of llama3 rope scaling: per-frequency divisors (model/rotary.py)
        config.rope_freq_factors = factors
    _apply_missing_metadata(config, table.get("fields", {}))
    names = {t["name"] for t in table["tensors"]}
    for key, tensor in (("attention_bias", "blk.0.attn_q.bias"), ("mlp_bias", "blk.0.ffn_down.bias")):
        if hasattr(config, key):  # transformers' reader does not look: the tensors say whether there are biases
            setattr(config, key, tensor in names)
    long, short = (read_rope_freqs(file, table, f"rope_factors_{which}.weight") for which in ("long", "short"))
    if long is not None and short is not None:  # Phi-3 longrope (model/rotary.py)
        original = int(table.get("fields", {}).get("rope.scaling.original_context_length", 0)) or None
        if original is None:
            raise ModelLoadError(f"{file.name}: longrope factors without rope.scaling.original_context_length")
        config.original_max_position_embeddings = original
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "longrope", "long_factor": long,
                                  "short_factor": short, "original_max_position_embeddings": original}
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / GGUF_INFO).write_text(json.dumps({"file": str(file), **table}))


# llama.cpp architecture -> (transformers model_type, "<arch>." metadata key -> config attribute beyond the common ones)
OWN_GGUF_CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "granite": ("granite", {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                            "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", {}),  # llama.cpp, like transformers' default, leaves every 4th layer without rope
    "glm4": ("glm4", {}),
    "gemma": ("gemma", {}),
    "gemma3": ("gemma3_text", {"final_logit_softcapping": "final_logit_softcapping"}),
    "command-r": ("cohere", {"logit_scale": "logit_scale", "attention.layer_norm_epsilon": "layer_norm_eps"}),
}
_COMMON_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
                "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
_INT_KEYS = {"max_position_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "vocab_size"}


def _config_from_metadata(table: dict):
    """A transformers config from a GGUF file's metadata, for an architecture in :data:`OWN_GGUF_CONFIGS`
    (the metadata keys are llama.cpp's; their meaning the converter's)."""
    from transformers import AutoConfig

    from .registry import MODEL_TYPES

    model_type, extra = OWN_GGUF_CONFIGS[table["architecture"]]
    fields = table.get("fields", {})
    missing = [key for key in _COMMON_KEYS
               if key not in fields and key not in ("vocab_size", "attention.layer_norm_rms_epsilon")]
    if missing:
        raise ModelLoadError(f"GGUF {table['architecture']!r} metadata lacks {', '.join(missing)}")
    kwargs = {attr: fields[key] for key, attr in {**_COMMON_KEYS, **extra}.items() if key in fields}
    kwargs = {k: int(v) if k in _INT_KEYS else v for k, v in kwargs.items()}
    if "vocab_size" not in kwargs:
        kwargs["vocab_size"] = next(t["shape"][0] for t in table["tensors"] if t["name"] == "token_embd.weight")
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.get("rope.freq_base", 10000.0)}
    names = {t["name"] for t in table["tensors"]}
    kwargs["tie_word_embeddings"] = "output.weight" not in names
    kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if "attention.key_length" in fields:
        kwargs["head_dim"] = int(fields["attention.key_length"])
    if model_type == "gemma3_text":
        kwargs.update(_gemma3_settings(kwargs, fields))
    config = AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [MODEL_TYPES[model_type]]
    return config


def _gemma3_settings(kwargs: dict, fields: dict) -> dict:
    """Gemma 3 as llama.cpp runs it: every sixth layer global, local layers' rope base 10000, global
    layers' from the file (linearly scaled when it says so), and the softmax scale of Gemma 2's rule."""
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    full = {"rope_type": "default", "rope_theta": fields.get("rope.freq_base", 1000000.0)}
    if fields.get("rope.scaling.factor", 1.0) != 1.0:
        full = {**full, "rope_type": "linear", "factor": fields["rope.scaling.factor"]}
    return {"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            "sliding_window": int(fields.get("attention.sliding_window", 4096)),
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": full},
            "query_pre_attn_scalar": _gemma_query_scalar(layers, hidden, heads, kwargs.get("head_dim", hidden // heads))}


def _gemma_query_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """Gemma 2/3's ``query_pre_attn_scalar``, which GGUF does not store: llama.cpp scales by the head size,
    except for the 27B models (Gemma 2: 46 layers of 4608, Gemma 3: 62 of 5376), by hidden / heads,
    which is what their checkpoints say."""
    return hidden // heads if (layers, hidden) in ((46, 4608), (62, 5376)) else head_dim


def _tokenizer_from_file(file: Path):
    """The file's tokenizer through transformers' GGUF tokenizer conversion (which does not depend on
    the architecture)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)


def _apply_missing_metadata(config, fields: dict) -> None:
    """What transformers' GGUF reader does not take from the metadata: Gemma 2's soft caps and softmax
    scale, a partial rotary dimension, a sliding window."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key in fields and hasattr(config, key):
            setattr(config, key, fields[key])
    if "attention.sliding_window" in fields and hasattr(config, "sliding_window"):
        config.sliding_window = int(fields["attention.sliding_window"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "model_type", "") == "gemma2" and "attention.key_length" in fields:
        config.query_pre_attn_scalar = _gemma_query_scalar(config.num_hidden_layers, config.hidden_size,
                                                           config.num_attention_heads,
                                                           int(fields["attention.key_length"]))
    rotary = int(fields.get("rope.dimension_count", head_dim))
    if rotary != head_dim and isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotary / head_dim}


def gguf_tensor_table(source: ModelSource) -> dict:
    """Where the tensors of a GGUF source lie, as recorded at conversion (gguf_weights.read_tensor_table)."""
    return json.loads((source.root / GGUF_INFO).read_text())


def gguf_linear_types(source: ModelSource) -> set[str]:
    """The GGML types of a GGUF source's projection weights."""
    from .gguf_weights import linear_quant_types

    return linear_quant_types(gguf_tensor_table(source))

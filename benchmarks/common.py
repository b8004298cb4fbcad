"""Shared pieces of the asyncllm benchmarks (workloads: docs/benchmarks.md).

- :func:`build_cpu_llama` builds (once, cached on disk) the random-weight ``cpu-llama`` checkpoint plus a tokenizer.
- :func:`w_cpu_workload` generates the W-CPU request mix (optionally shrunk with ``scale``).
- :func:`workload_flops`, :func:`measure_matmul_gflops` and :func:`roofline` give the physical floor.
- :func:`machine_info` describes the machine for the JSON report.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------------------------
# Model spec
# --------------------------------------------------------------------------------------------------------------------

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# cpu-llama of BENCHMARKS.md.
CPU_LLAMA_SPEC: dict[str, Any] = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    vocab_size=16384,
    tie_word_embeddings=False,
)
# Bump when the way the checkpoint is built changes, so stale caches are rebuilt.
BUILD_VERSION = 1
SEED = 0

DEFAULT_CACHE_DIR = Path(os.environ.get("ASYNCLLM_BENCH_CACHE", Path.home() / ".cache" / "asyncllm-bench"))

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the tokens before it.
Paged attention stores the key and value cache in fixed-size blocks, so memory is not wasted on padding.
Continuous batching lets new requests join the running batch at every step instead of waiting for the batch to end.
Throughput is the number of useful output tokens divided by the wall time from the first submission to the last token.
def generate(prompt, max_tokens=16):
    tokens = tokenizer.encode(prompt)
    for _ in range(max_tokens):
        logits = model(tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokenizer.decode(tokens)
{"name": "asyncllm", "version": "0.1.0", "license": "MIT", "tags": ["llm", "inference", "serving"]}
Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris, Tokyo or New York?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 4096 3.14159 2.71828 -1 +1 = < > [ ] ( ) { } # @ $ % ^ & * ~ `
Les modeles de langue generent du texte. Die Sprachmodelle erzeugen Text. Los modelos de lenguaje generan texto.
"""


def model_spec() -> dict[str, Any]:
    """Everything that determines the cached checkpoint (hashed into the cache key)."""
    import transformers

    return {
        "name": "cpu-llama",
        "config": CPU_LLAMA_SPEC,
        "seed": SEED,
        "build_version": BUILD_VERSION,
        "transformers": transformers.__version__,
    }


def _spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _is_complete(d: Path, spec_hash: str) -> bool:
    marker = d / "bench_build.json"
    if not marker.is_file():
        return False
    try:
        if json.loads(marker.read_text()).get("spec_hash") != spec_hash:
            return False
    except (OSError, ValueError):
        return False
    return all((d / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a small embedded corpus, then padded with synthetic merges so that its
    vocabulary is exactly ``vocab_size`` (every id the model can emit decodes to something).

    Returns a ``transformers.PreTrainedTokenizerFast`` with bos/eos/pad set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 2048),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)

    # Pad the vocabulary with deterministic merges of pairs of byte-level characters.
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = state["model"]["merges"]
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    next_id = max(vocab.values()) + 1
    for a in alphabet:
        if next_id >= vocab_size:
            break
        for b in alphabet:
            if next_id >= vocab_size:
                break
            if a + b in vocab:
                continue
            vocab[a + b] = next_id
            merges.append([a, b])
            next_id += 1
    state["model"]["vocab"] = vocab
    state["model"]["merges"] = merges
    tok = Tokenizer.from_str(json.dumps(state))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template,
        model_max_length=2048,
    )


def build_cpu_llama(cache_dir: str | os.PathLike | None = None, *, force: bool = False, verbose: bool = True) -> Path:
    """Return the directory of the ``cpu-llama`` checkpoint, building it first if needed.

    Default location: ``~/.cache/asyncllm-bench/cpu-llama`` (``$ASYNCLLM_BENCH_CACHE`` overrides the parent).
    The checkpoint is float32 safetensors with random weights drawn after ``torch.manual_seed(0)``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR / "cpu-llama"
    spec = model_spec()
    h = _spec_hash(spec)
    if not force and _is_complete(target, h):
        return target

    if verbose:
        print(f"[bench] building cpu-llama checkpoint in {target} ...", flush=True)
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".cpu-llama-build-", dir=target.parent))
    try:
        config = LlamaConfig(
            **CPU_LLAMA_SPEC,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            max_position_embeddings=2048,
        )
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        build_tokenizer(CPU_LLAMA_SPEC["vocab_size"]).save_pretrained(tmp)
        (tmp / "bench_build.json").write_text(json.dumps({"spec_hash": h, "spec": spec}, indent=2, sort_keys=True))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"[bench] built cpu-llama in {time.perf_counter() - t0:.1f}s", flush=True)
    return target


# --------------------------------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    scale: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scale": self.scale,
            "num_requests": len(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "max_prompt_len": max(r.prompt_len for r in self.requests),
            "max_output_len": max(r.max_tokens for r in self.requests),
            **self.params,
        }


def _scaled(x: int, scale: float) -> int:
    return max(1, int(round(x * scale)))


def w_cpu_workload(vocab_size: int = CPU_LLAMA_SPEC["vocab_size"], scale: float = 1.0, seed: int = 0) -> Workload:
    """W-CPU: 64 requests, prompt length U[16, 256], output length U[16, 256], ids U[10, vocab).

    Draw order with ``random.Random(seed)``: per request, prompt length, output length, then the prompt ids.
    ``scale`` < 1 shrinks the request count and both length ranges proportionally (for quick tests); scale=1.0 is
    the official workload."""
    if scale <= 0:
        raise ValueError("scale must be > 0")
    rng = random.Random(seed)
    n = _scaled(64, scale)
    p_lo, p_hi = _scaled(16, scale), _scaled(256, scale)
    o_lo, o_hi = _scaled(16, scale), _scaled(256, scale)
    reqs = []
    for _ in range(n):
        plen = rng.randint(p_lo, p_hi)
        olen = rng.randint(o_lo, o_hi)
        ids = [rng.randint(10, vocab_size - 1) for _ in range(plen)]
        reqs.append(Request(ids, olen))
    return Workload(
        "W-CPU",
        reqs,
        scale,
        {"prompt_len_range": [p_lo, p_hi], "output_len_range": [o_lo, o_hi], "seed": seed},
    )


# --------------------------------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------------------------------


def matmul_params(cfg: dict[str, Any]) -> int:
    """Parameters that take part in a matmul per token: all decoder layers plus the LM head (the embedding lookup is
    a gather, not a matmul; norms are negligible and left out)."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * inter
    return cfg["num_hidden_layers"] * (attn + mlp) + h * cfg["vocab_size"]


def workload_flops(workload: Workload, cfg: dict[str, Any] = CPU_LLAMA_SPEC) -> dict[str, float]:
    """FLOPs to process every prompt and output token of the workload once:
    2 * matmul_params per token, plus attention 4 * ctx * layers * heads * head_dim per token, where a token at
    position p (0-based) attends to ctx = p + 1 positions."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    layers = cfg["num_hidden_layers"]
    p = matmul_params(cfg)
    tokens = 0
    ctx_sum = 0
    for r in workload.requests:
        n = r.prompt_len + r.max_tokens
        tokens += n
        ctx_sum += n * (n + 1) // 2
    linear = 2.0 * p * tokens
    attention = 4.0 * ctx_sum * layers * heads * hd
    return {
        "matmul_params": p,
        "tokens": tokens,
        "linear_flops": linear,
        "attention_flops": attention,
        "total_flops": linear + attention,
    }


def measure_matmul_gflops(n: int = 1024, repeats: int = 10, inner: int = 4) -> float:
    """Best float32 ``torch.matmul`` rate of an n x n by n x n product on this machine, in GFLOP/s (current torch
    thread count)."""
    import torch

    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    out = torch.empty(n, n, dtype=torch.float32)
    for _ in range(3):  # warm up
        torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2.0 * n**3 / best / 1e9


def roofline(workload: Workload, gflops: float, cfg: dict[str, Any] = CPU_LLAMA_SPEC) -> dict[str, float]:
    """Compute-bound floor for the workload: floor seconds = total flops / measured matmul rate, and the matching
    output tokens/s (the workload's requested output tokens over the floor)."""
    f = workload_flops(workload, cfg)
    floor_s = f["total_flops"] / (gflops * 1e9)
    return {
        **f,
        "matmul_gflops": gflops,
        "floor_seconds": floor_s,
        "roofline_tokens_per_s": workload.output_tokens / floor_s,
    }


# --------------------------------------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------------------------------------


def _first_cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not line.strip() and fields:
                    break
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _first_cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_identity() -> dict[str, Any]:
    """Which x86 generation this is, as far as /proc/cpuinfo says: VMs name every AMD host "AMD EPYC", and two
    2-core VMs of that name ran our CPU benchmarks 2.5x apart (docs/benchmarks.md, W-STREAM)."""
    fields = _first_cpu_info()
    info: dict[str, Any] = {name: fields[key] for key, name in
                            (("cpu family", "cpu_family"), ("model", "cpu_model_number"), ("stepping", "cpu_stepping"))
                            if key in fields}
    if "flags" in fields:
        flags = set(fields["flags"].split())
        info.update(avx512="avx512f" in flags, avx512_bf16="avx512_bf16" in flags, amx="amx_tile" in flags)
    return info


def matmul_gflops(size: tuple[int, int, int] = (512, 512, 1408), seconds: float = 0.3) -> float:
    """Float32 matmul rate of this machine right now (torch, all its threads), a ruler for comparing runs made on
    different VMs: the shape is a cpu-llama MLP projection at a 512-token prefill chunk."""
    import torch

    m, k, n = size
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    count, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        a @ b
        count += 1
    return round(2 * m * k * n * count / (time.perf_counter() - begin) / 1e9, 1)


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gb = round(int(line.split()[1]) / 1024**2, 1)
                    break
    except OSError:
        pass
    return {
        "cpu_model": cpu_model(),
        **cpu_identity(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_gflops": matmul_gflops(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "mem_total_gb": mem_gb,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
    }


def as_dict(obj: Any) -> Any:
    return asdict(obj)

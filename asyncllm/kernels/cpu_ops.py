"""ctypes bindings of the CPU kernels in ``csrc/elementwise.c``, ``csrc/sampling.c`` and ``csrc/lora.c``
(float32, and bfloat16 for the RMSNorm, SiLU-and-multiply and rotary of bf16 prefill layers).

Callers go through :mod:`asyncllm.kernels.ops`, which only sends float32 CPU tensors here and only
for engines on the ``cpu`` attention backend; these functions check their inputs anyway.
"""

from __future__ import annotations

import ctypes

import torch

from .cpu_build import load_library

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_ELEMENTWISE = (
    ("rms_norm_f32", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int), None),
    ("rms_norm_mixed", (_ptr, _int, _ptr, _ptr, _ptr, _int, _ptr, _i64, _i64, _f32, _int), None),
    ("silu_and_mul_f32", (_ptr, _ptr, _i64, _ptr, _i64, _i64, _int), None),
    ("silu_and_mul_bf16", (_ptr, _ptr, _i64, _ptr, _i64, _i64, _int), None),
    ("rotary_f32", (_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int), _int),
    ("rotary_bf16", (_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int), _int),
)
_SAMPLING = (("greedy_pick_f32", (_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int), _int),)
_LORA = (("lora_apply_f32", (_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _int),
          _int),)


def _library() -> ctypes.CDLL | None:
    return load_library("elementwise", _ELEMENTWISE)


def _sampling_library() -> ctypes.CDLL | None:
    return load_library("sampling", _SAMPLING)


def _lora_library() -> ctypes.CDLL | None:
    return load_library("lora", _LORA)


def available() -> bool:
    """Whether the elementwise kernels could be built and loaded here."""
    return _library() is not None


def greedy_kernel_available() -> bool:
    return _sampling_library() is not None


def greedy_pick(logits: torch.Tensor, bitmask: torch.Tensor | None = None,
                mask_rows: list[int] | None = None) -> tuple[list[int], list[float]] | None:
    """Per row of ``logits`` ([rows, vocab] float32 on CPU): argmax (first maximum) and its log-softmax value.

    With ``bitmask`` ([n, ceil(vocab / 32)] int32, bit set = allowed) and ``mask_rows`` (per logits row,
    its bitmask row or -1), constrained rows pick among their allowed tokens; log-probabilities stay
    those of the unmasked rows. ``None`` when the kernel is unavailable, the tensors do not qualify,
    or a row holds NaN (the caller's torch path then decides, as torch.argmax does)."""
    if (logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return None
    lib = _sampling_library()
    if lib is None:
        return None
    rows, vocab = logits.shape
    mask_ptr, words, rows_ptr = None, 0, None
    if bitmask is not None:
        if (bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.device.type != "cpu"
                or bitmask.shape[1] * 32 < vocab or mask_rows is None or len(mask_rows) != rows):
            return None
        index = torch.tensor(mask_rows, dtype=torch.int64)
        mask_ptr, words, rows_ptr = bitmask.data_ptr(), bitmask.shape[1], index.data_ptr()
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    if lib.greedy_pick_f32(logits.data_ptr(), logits.stride(0), rows, vocab, mask_ptr, words, rows_ptr,
                           ids.data_ptr(), logprobs.data_ptr(), torch.get_num_threads()):
        return None
    return ids.tolist(), logprobs.tolist()


def _check(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, cols, rows_per_token, token_stride) of a 2-d [tokens, cols] or 3-d [tokens, heads, cols]
    tensor whose heads are contiguous within a token."""
    cols = x.shape[-1]
    if x.dim() == 2:
        return x.shape[0], cols, 1, x.stride(0)
    if x.dim() == 3 and x.stride(1) == cols:
        return x.shape[0] * x.shape[1], cols, x.shape[1], x.stride(0)
    raise ValueError(f"expected [tokens, cols] or [tokens, heads, cols] with contiguous heads, got {tuple(x.shape)}")


def _residual_total(residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The output buffer of ``x + residual`` (None without a residual), after checking the residual."""
    if residual is None:
        return None
    _check("residual", residual)
    if not residual.is_contiguous() or residual.shape != x.shape:
        raise ValueError("residual must be contiguous with x's shape")
    return torch.empty_like(residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual) or (rms_norm(x) * weight, None)."""
    _check("x", x)
    _check("weight", weight)
    rows, cols, per_token, token_stride = _rows(x)
    normed = torch.empty(x.shape, dtype=x.dtype)
    total = _residual_total(residual, x)
    _library().rms_norm_f32(x.data_ptr(), per_token, token_stride,
                            residual.data_ptr() if residual is not None else None,
                            total.data_ptr() if total is not None else None, normed.data_ptr(),
                            weight.data_ptr(), rows, cols, eps, torch.get_num_threads())
    return normed, total


def rms_norm_mixed(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight in ``out_dtype``, x + residual in float32), or (rms_norm(x) * weight, None):
    ``x`` bf16 or float32 (float32 without a residual), ``residual`` float32, all contiguous [rows, cols]; the
    numbers of widening ``x``, :func:`rms_norm`, then rounding to ``out_dtype`` (bf16 to nearest even)."""
    _check("weight", weight)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() != 2 or not x.is_contiguous() or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be a contiguous [rows, {weight.shape[0]}] tensor, got {tuple(x.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if residual is None and x.dtype != torch.float32:
        raise TypeError("x must be float32 when there is no residual to add it to")
    total = _residual_total(residual, x)
    normed = torch.empty(x.shape, dtype=out_dtype)
    _library().rms_norm_mixed(x.data_ptr(), x.dtype == torch.bfloat16,
                              residual.data_ptr() if residual is not None else None,
                              total.data_ptr() if total is not None else None, normed.data_ptr(),
                              out_dtype == torch.bfloat16, weight.data_ptr(), x.shape[0], x.shape[1], eps,
                              torch.get_num_threads())
    return normed, total


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, cols] halves of one fused gate_up tensor (or any two same-stride tensors),
    float32 or bfloat16 (computed in float32, rounded once to bf16: the output has the inputs' dtype)."""
    if gate.dtype == torch.bfloat16 and up.dtype == torch.bfloat16 and gate.device.type == "cpu":
        if gate.stride(-1) != 1 or up.stride(-1) != 1:
            raise ValueError("gate and up must have a contiguous last dimension")
        kernel = _library().silu_and_mul_bf16
    else:
        _check("gate", gate)
        _check("up", up)
        kernel = _library().silu_and_mul_f32
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride(0) != up.stride(0):
        raise ValueError("gate and up must be 2-d tensors of one shape and row stride")
    out = torch.empty(gate.shape, dtype=gate.dtype)
    kernel(gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), gate.shape[0], gate.shape[1],
           torch.get_num_threads())
    return out


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """Rotate q and k ([tokens, heads, head_dim], heads contiguous) in place by the angles at ``positions``: float32,
    or both bfloat16 (float32 arithmetic, rounded once; the tables stay float32)."""
    bf16 = q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
    for name, t in (("q", q), ("k", k)):
        if bf16:
            if t.device.type != "cpu" or t.stride(-1) != 1:
                raise ValueError(f"{name} must be a CPU tensor with a contiguous last dimension")
        else:
            _check(name, t)
        if t.dim() != 3 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} must be [tokens, heads, head_dim] with contiguous heads")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t)
        if not t.is_contiguous() or t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} must be a contiguous [positions, head_dim] table")
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise TypeError("positions must be a contiguous int64 tensor")
    kernel = _library().rotary_bf16 if bf16 else _library().rotary_f32
    if kernel(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], q.shape[2],
              positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], q.shape[0], torch.get_num_threads()):
        raise IndexError(f"a position is outside the rotary tables (0..{cos.shape[0] - 1})")


def lora_available() -> bool:
    return _lora_library() is not None


def lora_apply(x: torch.Tensor, y: torch.Tensor, y_offset: int, a_stack: torch.Tensor, bt_stack: torch.Tensor,
               slot_ranks: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``y[rows[i], y_offset:y_offset+out] += (x[rows[i]] @ A[s].T) @ Bt[s]`` for ``s = slots[i]``, in place.

    a_stack: [slots, max_rank, in]; bt_stack: [slots, max_rank, out] (B transposed); both contiguous,
    zero-padded beyond each slot's rank ``slot_ranks[s]`` (0: the slot adds nothing here)."""
    for name, t in (("x", x), ("y", y), ("a_stack", a_stack), ("bt_stack", bt_stack)):
        _check(name, t)
    if not (a_stack.is_contiguous() and bt_stack.is_contiguous()):
        raise ValueError("a_stack and bt_stack must be contiguous")
    for name, t in (("slot_ranks", slot_ranks), ("rows", rows), ("slots", slots)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise TypeError(f"{name} must be a contiguous int64 CPU tensor")
    max_rank, out_features = bt_stack.shape[1], bt_stack.shape[2]
    if y_offset + out_features > y.shape[1] or a_stack.shape[2] != x.shape[1]:
        raise ValueError("the stacks do not fit x and y")
    if _lora_library().lora_apply_f32(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), y_offset, a_stack.data_ptr(), bt_stack.data_ptr(),
            slot_ranks.data_ptr(), max_rank, x.shape[1], out_features, rows.data_ptr(), slots.data_ptr(),
            rows.numel(), torch.get_num_threads()):
        raise MemoryError("the CPU LoRA kernel could not allocate its scratch memory")

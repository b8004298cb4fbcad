"""The CPU C kernel of a mixture-of-experts layer's routed experts (``csrc/moe_experts.c``), bound with ctypes.

:func:`moe_experts_cpu` computes what :func:`asyncllm.model.moe.grouped_experts` computes (float32,
the same summation order over experts) in one call for the whole step: the (token, expert) pairs
sorted by expert, then per active expert the gate/up rows, the activation and the down projection,
each weight row read once for all of the expert's tokens. The torch path pays ~50 us of per-op
overhead per active expert (2.5 ms a layer at one token for 64 experts, top-8); the kernel is bound
by reading the active experts' weights. :func:`stack_experts_cpu` takes an ``ExpertStack``.

Both return ``None`` where the kernel does not run, and the caller takes the torch path:

- no C compiler, a failed build, or ``ASYNCLLM_CPU_KERNELS=0``;
- tensors that are not float32 on CPU, weights that are not contiguous, or autograd recording;
- H or I not a multiple of 16, or an activation other than SiLU-gated and gpt-oss's clamped one.

Threads: OpenMP, ``torch.get_num_threads()`` of them (the libgomp torch loaded, see ``cpu_build``).
The checked pointers of a stack's weights are kept per ``w13`` tensor (a weak reference) and checked
against the tensors' current data pointers, so a call costs a few us of Python.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from .cpu_build import load_library

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = (
    ("moe_experts_f32", (_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                         _int, _f32, _f32, _int, _ptr, _int, _int), _int),
    ("moe_experts_isa", (), _int),
    ("moe_route_f32", (_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _int, _int, _ptr, _ptr, _int), _int),
)
# MoEShape.router -> the routing kernel's scheme (the others stay in torch: model/moe.py route())
ROUTER_SCHEMES = {"softmax_topk": 0, "topk_softmax": 1}
MAX_ROUTED_EXPERTS = 1024
SILU, CLAMPED = 0, 1
# MoEShape.activation -> the kernel's activation kind
ACTIVATIONS = {"silu": SILU, "swiglu_clamped": CLAMPED}


def _library() -> ctypes.CDLL | None:
    return load_library("moe_experts", _SIGNATURES)


def cpu_kernel_available() -> bool:
    """Whether the C kernel could be built and loaded here (False under ``ASYNCLLM_CPU_KERNELS=0``)."""
    return _library() is not None


def kernel_isa() -> str | None:
    """The code the loaded build runs: ``"avx512"``, ``"avx2"``, ``"scalar"``, or None without the kernel."""
    lib = _library()
    return None if lib is None else ("scalar", "avx2", "avx512")[lib.moe_experts_isa()]


def supported_shape(hidden: int, intermediate: int) -> bool:
    """Whether the kernel takes experts of this hidden size H and intermediate size I."""
    return hidden > 0 and intermediate > 0 and hidden % 16 == 0 and intermediate % 16 == 0


class _Experts:
    """A stack's checked kernel arguments: its tensors (for identity checks), their data pointers, E, H, I."""

    __slots__ = ("w2", "b13", "b2", "pointers", "experts", "hidden", "inter")

    def __init__(self, w13, w2, b13, b2):
        self.w2, self.b13, self.b2 = w2, b13, b2
        self.pointers = tuple(None if t is None else t.data_ptr() for t in (w13, w2, b13, b2))
        self.experts, inter2, self.hidden = w13.shape
        self.inter = inter2 // 2

    def current(self, w13, w2, b13, b2) -> bool:
        """Still these tensors, at the same addresses (``param.data = ...`` keeps the object, not the memory)."""
        return (self.w2 is w2 and self.b13 is b13 and self.b2 is b2
                and self.pointers == tuple(None if t is None else t.data_ptr() for t in (w13, w2, b13, b2)))


# id(w13) -> (weak reference to w13, its _Experts); an entry goes when its w13 does
_CACHE: dict[int, tuple[weakref.ref, _Experts]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _CACHE.get(key)
    if entry is not None and entry[0] is ref:
        del _CACHE[key]


def _usable(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    return t is None or (t.dtype is torch.float32 and t.is_cpu and tuple(t.shape) == shape and t.is_contiguous())


def _check(w13, w2, b13, b2) -> _Experts | None:
    entry = _CACHE.get(id(w13))
    if entry is not None and entry[0]() is w13 and entry[1].current(w13, w2, b13, b2):
        return entry[1]
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3:
        return None
    experts, inter2, hidden = w13.shape
    if inter2 % 2 or not supported_shape(hidden, inter2 // 2):
        return None
    inter = inter2 // 2
    if not (_usable(w13, (experts, inter2, hidden)) and _usable(w2, (experts, hidden, inter))
            and _usable(b13, (experts, inter2)) and _usable(b2, (experts, hidden))):
        return None
    args = _Experts(w13, w2, b13, b2)
    key = id(w13)
    _CACHE[key] = (weakref.ref(w13, lambda ref, key=key: _forget(key, ref)), args)
    return args


def moe_experts_cpu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, activation: int = SILU, first_expert: int = 0,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    weights_on_input: bool = False, alpha: float = 1.702, limit: float = 7.0,
                    num_threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """The routed experts' weighted sum ``[T, H]`` (as ``grouped_experts``) by the C kernel, or None where it
    does not run (see the module doc). ``x`` [T, H]; ``weights``/``ids`` [T, k]; ``w13`` [E, 2I, H], ``w2``
    [E, H, I] hold experts ``first_expert ..``; ``activation``: :data:`SILU` or :data:`CLAMPED` (gpt-oss, with
    ``alpha`` and ``limit``). ``lib``: another build of the library (tests)."""
    if x.dtype is not torch.float32 or x.dim() != 2 or not x.is_cpu or activation not in (SILU, CLAMPED):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad):
        return None  # the kernel records no graph
    args = _check(w13, w2, b13, b2)
    if args is None or x.shape[1] != args.hidden or ids.dim() != 2 or tuple(weights.shape) != tuple(ids.shape):
        return None
    lib = lib or _library()
    if lib is None:
        return None
    if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.contiguous()
    if ids.dtype is not torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    if weights.dtype is not torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    tokens, k = ids.shape
    out = torch.empty(tokens, args.hidden, dtype=torch.float32)
    rc = lib.moe_experts_f32(x.data_ptr(), tokens, args.hidden, x.stride(0), ids.data_ptr(), weights.data_ptr(), k,
                             *args.pointers, args.experts, first_expert, args.inter, activation, alpha, limit,
                             int(weights_on_input), out.data_ptr(), 0,
                             torch.get_num_threads() if num_threads is None else num_threads)
    if rc:
        raise RuntimeError(f"the mixture-of-experts kernel failed ({'out of memory' if rc == 1 else 'bad shapes'})")
    return out


def stack_experts_cpu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, stack) -> torch.Tensor | None:
    """:func:`moe_experts_cpu` for an ``ExpertStack`` (model/moe.py), or None where the kernel does not run."""
    moe = stack.moe
    activation = ACTIVATIONS.get(moe.activation)
    if activation is None or stack.w13 is None:
        return None
    return moe_experts_cpu(x, weights, ids, stack.w13, stack.w2, activation, stack.first_expert, stack.b13,
                           stack.b2, moe.weights_on_input, moe.swiglu_alpha, moe.swiglu_limit)


def route_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, moe) -> tuple | None:
    """``route(x @ weight.T + bias)`` (model/moe.py) by the C kernel: (float32 weights [T, k], int64 ids [T, k]),
    or None where it does not run (other routers, grouped or corrected choices, scaled weights, dtypes)."""
    scheme = ROUTER_SCHEMES.get(moe.router)
    if (scheme is None or moe.num_groups > 1 or moe.score_correction_bias or moe.routed_scaling != 1.0
            or x.dtype is not torch.float32 or x.dim() != 2 or not x.is_cpu or not _usable(weight, tuple(weight.shape))
            or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] > MAX_ROUTED_EXPERTS
            or not _usable(bias, (weight.shape[0],)) or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    lib = _library()
    if lib is None:
        return None
    if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.contiguous()
    tokens, k = x.shape[0], moe.top_k
    ids = torch.empty(tokens, k, dtype=torch.int64)
    weights = torch.empty(tokens, k, dtype=torch.float32)
    rc = lib.moe_route_f32(x.data_ptr(), tokens, x.shape[1], x.stride(0), weight.data_ptr(),
                           None if bias is None else bias.data_ptr(), weight.shape[0], k, scheme,
                           int(moe.renormalize), ids.data_ptr(), weights.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError("the mixture-of-experts routing kernel got bad shapes")
    return weights, ids

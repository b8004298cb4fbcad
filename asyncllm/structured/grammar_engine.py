"""The grammar engine, llguidance, imported where it is installed.

It is a core dependency, but an environment can lack it (a GPU image with only its own packages):
asyncllm then imports and serves unconstrained requests, and a request that asks for structured
output or a forced tool call gets an InvalidRequestError that says what to install.
"""

from __future__ import annotations

from ..errors import InvalidRequestError

try:
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError as exc:  # pragma: no cover - exercised by the GPU-image rehearsal (scripts/gpu_rehearsal.sh)
    llguidance = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""


def require_grammar_engine(field: str) -> None:
    """Raise InvalidRequestError naming ``field`` where llguidance cannot be imported."""
    if llguidance is None:
        raise InvalidRequestError(
            f"{field}: structured output needs the llguidance package, which cannot be imported here "
            f"({_IMPORT_ERROR}); install it with `pip install llguidance`", field=field)

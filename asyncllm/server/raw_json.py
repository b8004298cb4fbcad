"""``RawJSON``: text that is already JSON, written into an answer as it is (server/serving.py json_bytes).

For parts of an answer that would otherwise be tens of thousands of dicts (a long prompt's logprobs):
strings are not tracked by the garbage collector, dicts are, and allocating that many containers
sets off full collections of the host's whole heap while its event loop waits.
"""

from __future__ import annotations


class RawJSON(str):
    """A JSON document as text; set on a response model's field without validation."""

    __slots__ = ()

"""Tool calls as the fronts hand them out, whole or as streamed fragments."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    """A function call the model made (``CompletionOutput.tool_calls``).

    In a streamed delta it is a fragment, as in OpenAI's chunks: the first fragment of a call
    carries ``id`` and ``name`` (and empty ``arguments``), the next ones only pieces of
    ``arguments``. Joined, the pieces are the arguments' JSON text exactly as the model wrote it.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """A whole call in the shape of OpenAI's ``message.tool_calls`` items."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_openai_delta(self) -> dict[str, Any]:
        """A fragment in the shape of OpenAI's ``delta.tool_calls`` items."""
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def merge_fragments(calls: list[ToolCall], fragments: list[ToolCall]) -> None:
    """Fold streamed fragments into whole calls (in place): a fragment with a name starts a call,
    the others extend the arguments of the call with their index."""
    by_index = {call.index: call for call in calls}
    for fragment in fragments:
        call = by_index.get(fragment.index)
        if call is None:
            call = ToolCall(fragment.index, fragment.id, fragment.name, "")
            by_index[fragment.index] = call
            calls.append(call)
        call.id = call.id or fragment.id
        call.name = call.name or fragment.name
        call.arguments += fragment.arguments


def compact_fragments(fragments: list[ToolCall]) -> list[ToolCall]:
    """Adjacent fragments of one call merged (fewer, bigger pieces for a slow consumer)."""
    out: list[ToolCall] = []
    for fragment in fragments:
        last = out[-1] if out else None
        if last is not None and last.index == fragment.index and fragment.name is None:
            out[-1] = ToolCall(last.index, last.id, last.name, last.arguments + fragment.arguments)
        else:
            out.append(ToolCall(fragment.index, fragment.id, fragment.name, fragment.arguments))
    return out

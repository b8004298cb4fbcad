"""Tool calling: tool definitions in the prompt, tool-call parsers, grammars that force a call.

* :mod:`.spec` validates ``tools`` / ``tool_choice`` into a :class:`ToolContext`.
* :mod:`.prompting` renders tools (with a fallback for chat templates that ignore them) and
  picks a model family's format.
* :mod:`.formats` has the parsers (hermes/Qwen, Llama 3 JSON, Mistral): per-sequence state
  machines fed text deltas, each also able to write the grammar that forces its calls.
"""

from .calls import ToolCall, compact_fragments, merge_fragments
from .formats import PARSERS, HermesParser, Llama3JsonParser, MistralParser
from .parser_base import ToolParser
from .prompting import detect_tool_parser, parser_class, prepare_messages
from .spec import ToolContext, ToolFunction, build_tool_context

__all__ = ["ToolCall", "ToolContext", "ToolFunction", "ToolParser", "HermesParser", "Llama3JsonParser",
           "MistralParser", "PARSERS", "build_tool_context", "compact_fragments", "detect_tool_parser",
           "merge_fragments", "parser_class", "prepare_messages"]

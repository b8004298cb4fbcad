"""The Jinja sandbox that chat templates render in: transformers' chat-template environment, plus a
bound on the size of every value a template builds and on its ``range()`` loops.

The environment takes its configuration from the one transformers builds for ``apply_chat_template``
(whitespace options, the ``generation`` tag and loop-control extensions, the ``tojson`` filter,
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``): those objects are read from it,
not rewritten, so a template renders here exactly as it does there.

Sizes are checked against the bound of the render in progress (:func:`render_budget`, per thread):

* before computing them, for the operators that can multiply a size (``*``, ``**``, ``+``, ``%``),
  the string methods and filters that take a width or repeat their input (``center``, ``ljust``,
  ``indent``, ``replace``, ``join``, ``format``, ``tojson``'s indent, ``lipsum``, ...) and every value
  printed by ``{{ }}``;
* after computing them, for the result of every other filter and call and of ``~``: those grow
  their input by at most a small factor, so a value can only pass the bound once, by that factor,
  before it is refused.

A value's size is the characters it takes when printed, estimated (containers are walked, and the
walk stops as soon as the bound is passed). The rendered text itself is counted by the caller.
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any, Callable, Iterator, Mapping

from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import generate_lorem_ipsum

TEMPLATE_FILENAME = "<asyncllm chat template>"  # the code of compiled templates says it comes from here
DEFAULT_MAX_CHARS = 8_000_000  # the size bound when a caller gives none
DEFAULT_RANGE_ITEMS = 1_000_000  # range() items one render may iterate over, all loops together


class TemplateLimitError(Exception):
    """A template rendering went past one of its bounds; the message names the bound and its value."""


@dataclass
class RenderBudget:
    """The bounds of one render: the size of any value (and of the output), and range() items left."""

    max_chars: int = DEFAULT_MAX_CHARS
    range_items: int = DEFAULT_RANGE_ITEMS

    def __post_init__(self) -> None:
        self.range_left = self.range_items

    def refuse_over(self, size: int) -> None:
        if size > self.max_chars:
            raise TemplateLimitError(f"output size limit of {self.max_chars} characters")

    def charge_range(self, items: int) -> None:
        self.range_left -= items
        if self.range_left < 0:
            raise TemplateLimitError(f"loop limit of {self.range_items} range() items")


class _Current(threading.local):
    budget: RenderBudget | None = None  # the render in progress in this thread


_current = _Current()


@contextmanager
def render_budget(max_chars: int = DEFAULT_MAX_CHARS,
                  range_items: int = DEFAULT_RANGE_ITEMS) -> Iterator[RenderBudget]:
    """The bounds that templates rendered by this thread meet until the block ends."""
    previous = _current.budget
    _current.budget = budget = RenderBudget(max_chars, range_items)
    try:
        yield budget
    finally:
        _current.budget = previous


def _budget() -> RenderBudget:
    # Outside a render (compile-time constant folding, a template used directly) the default bounds
    # apply, afresh for each check: no range() count accumulates across unrelated uses.
    return _current.budget or RenderBudget()


# ---- sizes --------------------------------------------------------------------------------------


def _digits(n: int) -> int:
    return n.bit_length() * 30103 // 100_000 + 1  # log10(2) = 0.30103: decimal digits, without str()


def value_size(value: Any, stop: int) -> int:
    """Characters ``value`` takes when printed (estimated), counted until just past ``stop``."""
    total, pending = 0, [value]
    while pending and total <= stop:
        item = pending.pop()
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item) + 2  # quotes, when inside a container
        elif isinstance(item, int):
            total += _digits(item)
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            pending.extend(item)
        else:  # floats, None, Undefined, namespaces: short when printed
            total += 8
    return total


def _check(value: Any) -> None:
    budget = _budget()
    if isinstance(value, (str, bytes, bytearray)):  # the common case, without the walk
        budget.refuse_over(len(value))
    elif isinstance(value, (list, tuple, set, frozenset, Mapping)):
        budget.refuse_over(value_size(value, budget.max_chars))


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    return value_size(value, _budget().max_chars)


def _width(value: Any) -> int:
    return len(value) if isinstance(value, str) else value if isinstance(value, int) else 0


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_NESTED_FORMAT = re.compile(r"\{[^{}]*:[^{}]*\{")
_NUMBER = re.compile(r"\d{1,12}")  # 12 digits already exceed any bound, without int()'s digit limit


def _format_size(fmt: Any, values: Any) -> int:
    """``fmt % values`` or ``fmt.format(*values)``: the text, the widths and precisions it asks for,
    and the values it may print."""
    if not isinstance(fmt, str):
        return 0
    values = list(values.values()) if isinstance(values, Mapping) else (
        list(values) if isinstance(values, (tuple, list)) else [values])
    size = len(fmt) + sum(_size(v) for v in values)
    widths = [w for spec in _PERCENT_SPEC.finditer(fmt) for w in spec.groups() if w]
    widths += [n for spec in _FORMAT_SPEC.findall(fmt) for n in _NUMBER.findall(spec)]
    size += sum(int(w) for w in widths if w != "*")
    if "*" in widths or _NESTED_FORMAT.search(fmt):  # widths taken from the values
        size += sum(v for v in values if isinstance(v, int))
    return size


def _replace_size(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)) or len(new) <= len(old):
        return 0
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _join_size(items: list, separator: Any) -> int:
    return sum(_size(item) for item in items) + _width(separator) * max(len(items) - 1, 0)


def _json_size(value: Any, indent: Any) -> int:
    # With an indent every value gets a line, indented once per level it is nested in.
    size, width = _size(value), _width(indent)
    if width:
        nodes, depth, pending = 0, 0, [(value, 1)]
        while pending and nodes * (depth * width + 1) <= _budget().max_chars:
            item, level = pending.pop()
            nodes, depth = nodes + 1, max(depth, level)
            if isinstance(item, Mapping):
                pending.extend((v, level + 1) for v in item.values())
            elif isinstance(item, (list, tuple)):
                pending.extend((v, level + 1) for v in item)
        size += nodes * (depth * width + 1)
    return size


def _binop_size(operator: str, left: Any, right: Any) -> int:
    sized = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            return _digits(left) + _digits(right)
        if isinstance(left, int):
            left, right = right, left
        if isinstance(left, sized) and isinstance(right, int):
            return _size(left) * max(right, 0)
    elif operator == "+":
        if isinstance(left, sized) and isinstance(right, sized):
            return _size(left) + _size(right)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            return _digits(left) * right
    elif operator == "%":
        return _format_size(left, right)
    return 0


# What a filter or call will produce, from its arguments (the filter's own signature, after any
# context argument jinja passes). Only filters that take a width or repeat their input need one.
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80: max(_size(value), _width(width)),
    "indent": lambda s, width=4, first=False, blank=False: _size(s) + (
        (s.count("\n") + 1) * _width(width) if isinstance(s, str) else 0),
    "replace": _replace_size,
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: _size(s) + (
        _size(s) // max(_width(width), 1) + 1) * (_width(wrapstring) or 1),
    "format": lambda value, *args, **kwargs: _format_size(value, kwargs or args),
    "join": lambda value, d="", attribute=None: _join_size(value, d) if attribute is None else 0,
    "tojson": lambda x, ensure_ascii=False, indent=None, *args, **kwargs: _json_size(x, indent) * (
        6 if ensure_ascii else 1),  # \uXXXX escapes
    "string": lambda value: _size(value),
    "pprint": lambda value: _size(value),
}
_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda s, width, fillchar=" ": _width(width),
    "ljust": lambda s, width, fillchar=" ": _width(width),
    "rjust": lambda s, width, fillchar=" ": _width(width),
    "zfill": lambda s, width: _width(width),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * _width(tabsize),
    "replace": lambda s, old, new, count=-1: _replace_size(s, old, new, count),
    "translate": lambda s, table: len(s) * max(
        (len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, Mapping) else 0,
    "join": lambda s, items: _join_size(items, s),
    "format": lambda s, *args, **kwargs: _format_size(s, [*args, *kwargs.values()]),
    "format_map": lambda s, mapping: _format_size(s, mapping),
}
_CALL_SIZES: dict[Any, Callable[..., int]] = {
    generate_lorem_ipsum: lambda n=5, html=True, min=20, max=100: _width(n) * _width(max) * 16,
}


def _refuse_estimate(estimate: Callable[..., int], args: tuple, kwargs: dict) -> None:
    try:
        size = estimate(*args, **kwargs)
    except (TypeError, ValueError, AttributeError):  # arguments the real call rejects: it says why
        return
    _budget().refuse_over(size)


def _listed(value: Any) -> Any:
    # An iterator would be used up by the estimate: the call gets the same items as a list.
    return value if isinstance(value, (str, bytes, list, tuple, Mapping)) else list(value)


def _bounded_filter(name: str, function: Callable) -> Callable:
    estimate = _FILTER_SIZES.get(name)
    context_args = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @wraps(function)  # keeps jinja_pass_arg: jinja still passes the context argument
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if estimate is not None:
            if name == "join" and len(args) > context_args:
                args = (*args[:context_args], _listed(args[context_args]), *args[context_args + 1:])
            _refuse_estimate(estimate, args[context_args:], kwargs)
        result = function(*args, **kwargs)
        _check(result)
        return result

    return bounded


def _bounded_range(*args: int) -> range:
    items = safe_range(*args)  # jinja's own sandbox range: the same errors for a single huge range
    _budget().charge_range(len(items))
    return items


def _check_printed(value: Any) -> Any:
    # Before {{ value }} becomes text (a list of a million references to one long string would be
    # a huge one); short strings, nearly every value printed, are let through first, and cheaply.
    if value.__class__ is not str or len(value) > 4096:
        _check(value)
    return value


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``a ~ b`` checked once joined (``~`` is no interceptable operator)."""

    def visit_Concat(self, node, frame) -> None:  # noqa: N802 - jinja's visitor naming
        self.write("environment.checked_text(")
        super().visit_Concat(node, frame)
        self.write(")")


_OPTIONS = ("block_start_string", "block_end_string", "variable_start_string", "variable_end_string",
            "comment_start_string", "comment_end_string", "line_statement_prefix", "line_comment_prefix",
            "trim_blocks", "lstrip_blocks", "newline_sequence", "keep_trailing_newline", "undefined",
            "autoescape", "optimized")


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (copied from ``reference``), with sizes bounded."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, reference: Any) -> None:
        options = {name: getattr(reference, name) for name in _OPTIONS}
        extensions = [type(extension) for extension in reference.extensions.values()]
        super().__init__(extensions=extensions, finalize=_check_printed, **options)
        if reference.finalize is not None:  # none today; kept in the chain should transformers add one
            self.finalize = lambda value, _theirs=reference.finalize: _check_printed(_theirs(value))
        self.policies.update(reference.policies)
        for mine, theirs in ((self.filters, reference.filters), (self.tests, reference.tests),
                             (self.globals, reference.globals)):
            mine.update({name: value for name, value in theirs.items() if mine.get(name) is not value})
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}
        self.globals["range"] = _bounded_range

    def concat(self, parts: Any) -> str:
        """The output of a macro, a call block or a ``{% set %}`` block, counted as it is joined."""
        pieces, total, budget = [], 0, _budget()
        for piece in parts:
            total += len(piece)
            budget.refuse_over(total)
            pieces.append(piece)
        return "".join(pieces)

    @staticmethod
    def checked_text(text: Any) -> Any:
        """``a ~ b`` once joined (compiled templates call this)."""
        _check(text)
        return text

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """``*``, ``**``, ``+`` and ``%``, refused before they compute a result past the bound."""
        if operator == "+" and left.__class__ is str and right.__class__ is str:  # most template arithmetic:
            budget = _current.budget  # inline, since every Python call costs a trace event during a render
            if budget is None or len(left) + len(right) > budget.max_chars:
                _budget().refuse_over(len(left) + len(right))
            return left + right
        _budget().refuse_over(_binop_size(operator, left, right))
        return self.binop_table[operator](left, right)  # what jinja's call_binop does

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """A call from template code: width-taking string methods and ``lipsum`` are refused before
        they run past the bound, every result after."""
        target = getattr(obj, "__wrapped__", obj)  # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):  # a method of a string: its own arguments after the string
            name = getattr(target, "__name__", "")
            estimate = _METHOD_SIZES.get(name)
            if estimate is not None:
                if name == "join" and args:
                    args = (_listed(args[0]), *args[1:])
                _refuse_estimate(estimate, (owner, *args), kwargs)
        else:
            try:
                estimate = _CALL_SIZES.get(obj)
            except TypeError:  # an unhashable callable: none of those
                estimate = None
            if estimate is not None:
                _refuse_estimate(estimate, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        _check(result)
        return result

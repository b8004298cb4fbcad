"""Bounds on what reaches the grammar engine's native compiler.

llguidance compiles recursively on its native stack: a JSON schema whose ``$ref`` links chain
through 1,000 definitions, or a Lark grammar of 3,000 rules each naming the next, overflows it and
the whole process dies (SIGSEGV), 600 links being fine. Nothing in a request may do that, so each
source is measured here first, without recursion of our own (a deep input would otherwise raise
RecursionError), and refused with an InvalidRequestError naming the field and the numbers.
Real schemas and grammars stay far inside these bounds (pydantic's nested models: a few levels).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from ..errors import InvalidRequestError

MAX_NESTING = 64        # objects/arrays inside each other in a JSON schema
MAX_REF_CHAIN = 128     # $ref links followed one after another (recursion back to a definition is fine)
MAX_RULE_CHAIN = 128    # Lark rules each referring to the next
MAX_DEFINITIONS = 2000  # definitions in one schema, rules in one grammar


def _refuse(field: str, what: str, found: int, limit: int) -> None:
    raise InvalidRequestError(f"{field}: {what} is {found} deep, more than the {limit} allowed", field=field)


def check_nesting(value: Any, field: str, limit: int = MAX_NESTING) -> None:
    """Objects and arrays nested at most ``limit`` deep (measured without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            _refuse(field, "the nesting of objects and arrays", depth, limit)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def longest_chain(nodes: Iterable[str], edges: Callable[[str], Iterable[str]], start: Iterable[str]) -> int:
    """The most nodes on a path of ``edges`` from any of ``start`` that visits no node twice
    (a cycle, i.e. recursion, ends a path), found iteratively; memoised per node."""
    known = set(nodes)
    best: dict[str, int] = {}
    longest = 0
    for root in start:
        if root not in known:
            continue
        on_path: set[str] = {root}
        stack: list[tuple[str, Iterable[str]]] = [(root, iter([n for n in edges(root) if n in known]))]
        depth_below: dict[str, int] = {}
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(node)
                best[node] = 1 + depth_below.pop(node, 0)
                if stack:
                    parent = stack[-1][0]
                    depth_below[parent] = max(depth_below.get(parent, 0), best[node])
                continue
            if child in on_path:
                continue
            if child in best:
                depth_below[node] = max(depth_below.get(node, 0), best[child])
                continue
            on_path.add(child)
            stack.append((child, iter([n for n in edges(child) if n in known])))
        longest = max(longest, best.get(root, 0))
    return longest


def _refs_in(subtree: Any) -> list[str]:
    found, stack = [], [subtree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found.append(ref)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return found


def _resolve(schema: Any, pointer: str) -> Any:
    node = schema
    for part in pointer.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_schema(schema: Any, field: str) -> None:
    """A JSON schema the compiler can take: bounded nesting, ``$ref`` chains and definition count."""
    check_nesting(schema, field)
    refs: dict[str, list[str]] = {}
    pending = ["#"]
    while pending:  # every pointer reachable by references, each resolved once
        pointer = pending.pop()
        if pointer in refs:
            continue
        target = _resolve(schema, pointer)
        refs[pointer] = _refs_in(target) if target is not None else []
        if len(refs) > MAX_DEFINITIONS:
            raise InvalidRequestError(f"{field}: more than {MAX_DEFINITIONS} referenced definitions", field=field)
        pending.extend(r for r in refs[pointer] if r not in refs)
    chain = longest_chain(refs, lambda p: refs[p], ["#"]) - 1  # links, not nodes
    if chain > MAX_REF_CHAIN:
        _refuse(field, "the chain of $ref links", chain, MAX_REF_CHAIN)


_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
# string literals, regular expressions and comments: names inside them are not rule references
_NOT_NAMES = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|/(?:[^/\\\n]|\\.)+/[a-z]*|//[^\n]*|%json\s*\{.*')
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_lark(grammar: str, field: str) -> None:
    """A Lark grammar the compiler can take: bounded rule count and chains of rules naming rules."""
    starts = list(_RULE.finditer(grammar))
    if len(starts) > MAX_DEFINITIONS:
        raise InvalidRequestError(f"{field}: {len(starts)} rules, more than the {MAX_DEFINITIONS} allowed",
                                  field=field)
    bodies: dict[str, set[str]] = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(grammar)
        body = _NOT_NAMES.sub(" ", grammar[match.end():end])
        bodies.setdefault(match.group(1), set()).update(_NAME.findall(body))
    chain = longest_chain(bodies, lambda name: bodies[name], list(bodies))
    if chain > MAX_RULE_CHAIN:
        _refuse(field, "the chain of rules referring to rules", chain, MAX_RULE_CHAIN)

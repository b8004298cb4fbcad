"""Stream chunks of completions and chat completions turned back into RequestOutput deltas."""

from __future__ import annotations

import time
from typing import Any

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..tools.calls import ToolCall, merge_fragments
from .requests import CHAT

_ID_PREFIX = "token_id:"  # the server's return_tokens_as_token_ids spelling


class DeltaReader:
    """One request's chunks as the RequestOutput deltas ``AsyncLLM.stream_outputs`` yields, and their sum.

    ``logprobs`` is the SamplingParams value: with it, tokens come back as ``token_id:N`` and each
    delta's logprobs are ``{token id: logprob}`` dicts, the sampled token's included."""

    def __init__(self, route: str, request_id: str, prompt: Any, n: int, logprobs: int | None,
                 prompt_logprobs: int | None) -> None:
        self.route = route
        self.logprobs = logprobs
        self.want_prompt_logprobs = prompt_logprobs is not None
        self.total = RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                                   prompt_token_ids=list(prompt) if _token_ids(prompt) else [],
                                   outputs=[self._empty(i) for i in range(n)],
                                   metrics=RequestMetrics(arrival_time=time.monotonic()))
        self._prompt_ids_seen = False

    def _empty(self, index: int) -> CompletionOutput:
        wanted = self.logprobs is not None
        return CompletionOutput(index, logprobs=[] if wanted else None, cumulative_logprob=0.0 if wanted else None)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.total.outputs)

    def feed(self, chunk: dict[str, Any]) -> RequestOutput | None:
        """The delta one chunk holds (None when it holds nothing new)."""
        prompt_ids = chunk.get("prompt_token_ids")  # chat: at the top, in a chunk of its own
        new_prompt_ids = self._take_prompt_ids(prompt_ids)
        outputs: list[CompletionOutput] = []
        prompt_logprobs = None
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if not 0 <= index < len(self.total.outputs):
                continue
            new_prompt_ids = self._take_prompt_ids(choice.get("prompt_token_ids")) or new_prompt_ids
            if self.want_prompt_logprobs and choice.get("prompt_logprobs") is not None:
                prompt_logprobs = [None if entry is None else {_token_id(k): v["logprob"] for k, v in entry.items()}
                                   for entry in choice["prompt_logprobs"]]
                self.total.prompt_logprobs = prompt_logprobs
            delta = self._choice_delta(index, choice)
            if delta is not None:
                outputs.append(delta)
        if not outputs and new_prompt_ids is None and prompt_logprobs is None:
            return None
        metrics = self.total.metrics
        if outputs and metrics.first_token_time is None and any(c.token_ids or c.text for c in outputs):
            metrics.first_token_time = time.monotonic()
        if self.finished and metrics.finish_time is None:
            metrics.finish_time = time.monotonic()
        return RequestOutput(self.total.request_id, self.total.prompt, list(self.total.prompt_token_ids), outputs,
                             finished=self.finished, prompt_logprobs=prompt_logprobs, metrics=metrics)

    def aborted(self) -> RequestOutput:
        """The last delta of a request aborted by the client: every open output ends with "abort"."""
        outputs = []
        for c in self.total.outputs:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                outputs.append(CompletionOutput(c.index, finish_reason="abort",
                                                logprobs=[] if c.logprobs is not None else None,
                                                cumulative_logprob=c.cumulative_logprob))
        self.total.finished = True
        return RequestOutput(self.total.request_id, self.total.prompt, list(self.total.prompt_token_ids), outputs,
                             finished=True, metrics=self.total.metrics)

    def _take_prompt_ids(self, ids: list[int] | None) -> list[int] | None:
        if ids is None or self._prompt_ids_seen:
            return None
        self._prompt_ids_seen = True
        self.total.prompt_token_ids = list(ids)
        return self.total.prompt_token_ids

    def _choice_delta(self, index: int, choice: dict[str, Any]) -> CompletionOutput | None:
        if self.route == CHAT:
            message = choice.get("delta") or {}
            text = message.get("content") or ""
            calls = [_fragment(item) for item in message.get("tool_calls") or []]
            entries = ((choice.get("logprobs") or {}).get("content")) or []
            logprobs = [_chat_entry(e) for e in entries]
        else:
            text, calls = choice.get("text") or "", []
            logprobs = _completion_entries(choice.get("logprobs"))
        token_ids = list(choice.get("token_ids") or [])
        finish_reason, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        if finish_reason == "function_call":  # (a server answering the legacy API)
            finish_reason = "tool_calls"
        if not (text or calls or token_ids or logprobs or finish_reason):
            return None
        total = self.total.outputs[index]
        total.text += text
        total.token_ids.extend(token_ids)
        if calls:
            total.tool_calls = total.tool_calls or []
            merge_fragments(total.tool_calls, calls)
        delta = CompletionOutput(index, text=text, token_ids=token_ids, tool_calls=calls or None)
        if self.logprobs is not None:
            entries = [entry for entry, _ in logprobs]
            total.logprobs.extend(entries)
            total.cumulative_logprob += sum(lp for _, (_, lp) in logprobs if lp is not None)
            delta.logprobs, delta.cumulative_logprob = entries, total.cumulative_logprob
        if finish_reason is not None:
            total.finish_reason, total.stop_reason = finish_reason, stop_reason
            delta.finish_reason, delta.stop_reason = finish_reason, stop_reason
        return delta

    def output(self) -> RequestOutput:
        """Everything so far (``generate``'s answer once finished)."""
        self.total.finished = self.finished
        return self.total


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _token_id(token: str) -> int | str:
    return int(token[len(_ID_PREFIX):]) if token.startswith(_ID_PREFIX) else token


def _fragment(item: dict[str, Any]) -> ToolCall:
    function = item.get("function") or {}
    return ToolCall(item.get("index", 0), item.get("id"), function.get("name"), function.get("arguments") or "")


def _chat_entry(entry: dict[str, Any]) -> tuple[dict, tuple]:
    """One generated token's ``({token id: logprob}, (sampled id, its logprob))``."""
    chosen = (_token_id(entry["token"]), entry["logprob"])
    ranked = {_token_id(top["token"]): top["logprob"] for top in entry.get("top_logprobs") or []}
    return {chosen[0]: chosen[1], **ranked}, chosen


def _completion_entries(logprobs: dict[str, Any] | None) -> list[tuple[dict, tuple]]:
    if not logprobs:
        return []
    out = []
    for token, lp, top in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [],
                              logprobs.get("top_logprobs") or []):
        chosen = (_token_id(token), lp)
        out.append(({chosen[0]: lp, **{_token_id(k): v for k, v in (top or {}).items()}}, chosen))
    return out

"""Prometheus metrics of one app: engine gauges read at scrape time, latencies measured here.

Every app has its own ``CollectorRegistry``, so two apps in one process (or in one test session)
never collide. Names follow vLLM's (``vllm:`` becomes ``asyncllm:``) so existing dashboards need
only the prefix changed. Latencies are measured where the deltas reach the server, which is what
a client sees (queueing, tokenization and detokenization included).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import EngineOverloadedError, InvalidRequestError, LoRAError
from ..outputs import RequestOutput

if TYPE_CHECKING:
    from ..async_llm import AsyncLLM

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads ``llm.stats()`` on every scrape, so gauges are never stale."""

    def __init__(self, llm: "AsyncLLM", model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self.llm.stats()
        total = stats.get("kv_blocks_total", 0)
        yield self._gauge("num_requests_running", "Requests being computed (prefill or decode).",
                          stats.get("num_running", 0))
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.get("num_waiting", 0))
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by live requests (0 to 1).",
                          stats.get("kv_blocks_used", 0) / total if total else 0.0)
        yield self._gauge("kv_cache_blocks_total", "KV-cache blocks in the pool.", total)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.get("prefix_cache_queries", 0))
        yield self._counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                            stats.get("prefix_cache_hits", 0))
        yield self._counter("num_preemptions", "Requests preempted (KV blocks freed, recomputed later).",
                            stats.get("num_preemptions", 0))
        yield self._gauge("lora_adapters_loaded", "LoRA adapters registered with the engine.",
                          len(self.llm.list_loras()))
        drafts = stats.get("spec_num_drafts", 0)
        accepted = stats.get("spec_accepted_tokens", 0)
        yield self._counter("spec_decode_num_drafts", "Speculative verification steps (a sequence verifying "
                            "at least one draft token).", drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                            stats.get("spec_draft_tokens", 0))
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", accepted)
        yield self._gauge("spec_decode_mean_accepted_length", "Tokens per verification step since start "
                          "(1 + accepted drafts per step; 0 before the first).",
                          1 + accepted / drafts if drafts else 0.0)
        yield self._gauge("itl_target_seconds", "Inter-token latency target of the latest step with decodes "
                          "(the stall-free policy; 0 without one).", stats.get("itl_target_ms", 0) / 1000)
        yield self._counter("prefill_bursts", "Steps with decodes that took the whole token budget for a wave of "
                            "short prompts (the stall-free policy's bursts).", stats.get("num_prefill_bursts", 0))

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"asyncllm:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"asyncllm:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


class ServerMetrics:
    """The registry of one app and the instruments its routes feed."""

    def __init__(self, llm: "AsyncLLM", model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm, model_name))
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("asyncllm:prompt_tokens", "Prompt tokens of admitted requests.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("asyncllm:generation_tokens", "Generated tokens.",
                                         labels, registry=reg).labels(model_name)
        self.request_success = Counter("asyncllm:request_success", "Finished choices by finish reason "
                                       "(each of a request's n choices counts once).",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("asyncllm:time_to_first_token_seconds", "From request arrival to its first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("asyncllm:inter_token_latency_seconds", "Between successive tokens of a request.",
                             labels, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("asyncllm:e2e_request_latency_seconds", "From arrival to the last token.",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        self.lora_running = Gauge("asyncllm:lora_requests_running", "Requests in flight per LoRA adapter.",
                                  labels + ["lora_name"], registry=reg)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def finished(self, reason: str, count: int = 1) -> None:
        self.request_success.labels(self.model_name, reason).inc(count)

    async def track(self, stream: AsyncIterator[RequestOutput], n: int,
                    lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Pass ``stream`` through, counting tokens and timing each delta as it arrives."""
        start = time.monotonic()
        last_token: float | None = None
        unfinished: set[int] | None = None  # the choices not yet finished, known from the first delta
        admitted = False
        if lora is not None:
            self.lora_running.labels(self.model_name, lora).inc()
        try:
            async for delta in stream:
                if not admitted:
                    admitted = True
                    unfinished = set(range(len(delta.outputs)))  # n was validated by now
                    self.prompt_tokens.inc(len(delta.prompt_token_ids))
                last_token = self._observe(delta, start, last_token, unfinished)
                yield delta
            self.e2e.observe(time.monotonic() - start)
        except (InvalidRequestError, LoRAError, EngineOverloadedError):
            unfinished = set()  # refused before it was queued: nothing to count
            raise
        finally:
            await stream.aclose()
            left = n if unfinished is None else len(unfinished)
            if left:  # the client left or the stream failed: the engine aborted the rest
                self.finished("abort", left)
            if lora is not None:
                self.lora_running.labels(self.model_name, lora).dec()

    def _observe(self, delta: RequestOutput, start: float, last_token: float | None,
                 unfinished: set[int]) -> float | None:
        now = time.monotonic()
        new_tokens = max((len(c.token_ids) for c in delta.outputs), default=0)
        self.generation_tokens.inc(sum(len(c.token_ids) for c in delta.outputs))
        if new_tokens:
            if last_token is None:
                self.ttft.observe(now - start)
            else:
                # a late consumer gets several tokens in one delta: spread the gap over them
                gap = (now - last_token) / new_tokens
                for _ in range(new_tokens):
                    self.itl.observe(gap)
            last_token = now
        for c in delta.outputs:
            if c.finish_reason is not None and c.index in unfinished:
                unfinished.discard(c.index)
                self.finished(c.finish_reason)
        return last_token

"""The frontend's Prometheus figures, with vLLM's names (``vllm:`` becomes ``tandem:``) where vLLM has them.

Measured at the HTTP boundary, so they are what an API client sees (the bus hops included), unlike
the workers' figures of the same name (see :mod:`tandem.services.common.service_metrics`); the
``service`` label of a scrape (``frontend``) tells them apart.

- ``tandem:time_to_first_token_seconds``: HTTP request received to its first token;
- ``tandem:inter_token_latency_seconds``: between consecutive token chunks of a request;
- ``tandem:e2e_request_latency_seconds``: HTTP request received to its last token;
- ``tandem:request_prompt_tokens`` / ``tandem:request_generation_tokens`` per finished request,
  ``tandem:prompt_tokens_total`` / ``tandem:generation_tokens_total``;
- ``tandem:request_success_total{finished_reason}``: requests that ran to their end;
- ``tandem:num_requests_running``: generation requests in flight here (one per prompt, as on the bus);
- ``tandem:http_requests_total{handler,status}``: every HTTP answer (the name the instrumentator
  that vLLM's API server uses gives it), errors included.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.services.common.service_metrics import ITL_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS
from tandem.shared.infra.metrics import MetricsRegistry


class FrontendMetrics:
    def __init__(self, prom: MetricsRegistry, running: Callable[[], float]) -> None:
        h = prom.histogram
        self.ttft = h("tandem:time_to_first_token_seconds", "HTTP request to its first token", TTFT_BUCKETS)
        self.itl = h("tandem:inter_token_latency_seconds", "between consecutive token chunks", ITL_BUCKETS)
        self.e2e = h("tandem:e2e_request_latency_seconds", "HTTP request to its last token", LATENCY_BUCKETS)
        self.prompt_len = h("tandem:request_prompt_tokens", "prompt tokens per finished request", TOKEN_BUCKETS)
        self.output_len = h("tandem:request_generation_tokens", "output tokens per finished request", TOKEN_BUCKETS)
        self.prompt_tokens = prom.counter("tandem:prompt_tokens_total", "prompt tokens of finished requests")
        self.generation_tokens = prom.counter("tandem:generation_tokens_total", "output tokens of finished requests")
        self.success = prom.counter("tandem:request_success_total", "requests run to their end", ("finished_reason",))
        self.http = prom.counter("tandem:http_requests_total", "HTTP answers", ("handler", "status"))
        prom.gauge_fn("tandem:num_requests_running", "generation requests in flight here (one per prompt)", running)

    def finished(self, prompt_tokens: int, output_tokens: int, reason: str | None) -> None:
        self.prompt_len.observe(prompt_tokens)
        self.output_len.observe(output_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.success.labels(reason or "abort").inc()

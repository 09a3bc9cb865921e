"""The frontend's Prometheus figures.

Measured at the HTTP boundary, so they are what an API client sees (the bus hops included). A
figure that means something else than the workers' (:mod:`tandem.services.common.service_metrics`)
has a name of its own, ``tandem:http_...``: one name, one meaning, whichever service a dashboard or
the planner reads it from.

- ``tandem:http_time_to_first_token_seconds``: HTTP request received to its first token sent back
  (the workers' ``tandem:time_to_first_token_seconds`` runs from the router's accept to the first
  token handed to the bus);
- ``tandem:http_inter_token_latency_seconds``: between consecutive token chunks of a request sent back;
- ``tandem:http_e2e_request_latency_seconds``: HTTP request received to its last token sent back;
- ``tandem:http_prompt_tokens_total`` / ``tandem:http_generation_tokens_total``: the prompt and output
  tokens of the requests finished here (the workers count the tokens they prefilled and sampled);
- ``tandem:http_generation_requests_running``: generation requests in flight here (one per prompt,
  as on the bus; the workers' ``tandem:num_requests_running`` counts sequences in their batches);
- ``tandem:http_requests_total{handler,status}``: every HTTP answer (the name the instrumentator
  that vLLM's API server uses gives it), errors included.

Per finished request, with the workers' names and meanings (vLLM's, ``vllm:`` becoming ``tandem:``;
the ``service`` label of a scrape or snapshot, ``frontend``, tells the two counts apart):
``tandem:request_prompt_tokens`` / ``tandem:request_generation_tokens`` (histograms) and
``tandem:request_success_total{finished_reason}``. An embedding request counts once per input, as
a request finished with reason ``embedded`` and its prompt tokens (no output tokens, no first token).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.services.common.service_metrics import ITL_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS
from tandem.shared.infra.metrics import MetricsRegistry


class FrontendMetrics:
    def __init__(self, prom: MetricsRegistry, running: Callable[[], float]) -> None:
        h = prom.histogram
        self.ttft = h("tandem:http_time_to_first_token_seconds", "HTTP request to its first token sent back",
                      TTFT_BUCKETS)
        self.itl = h("tandem:http_inter_token_latency_seconds", "between consecutive token chunks sent back",
                     ITL_BUCKETS)
        self.e2e = h("tandem:http_e2e_request_latency_seconds", "HTTP request to its last token sent back",
                     LATENCY_BUCKETS)
        self.prompt_len = h("tandem:request_prompt_tokens", "prompt tokens per finished request", TOKEN_BUCKETS)
        self.output_len = h("tandem:request_generation_tokens", "output tokens per finished request", TOKEN_BUCKETS)
        self.prompt_tokens = prom.counter("tandem:http_prompt_tokens_total", "prompt tokens of requests finished here")
        self.generation_tokens = prom.counter("tandem:http_generation_tokens_total",
                                              "output tokens of requests finished here")
        self.success = prom.counter("tandem:request_success_total", "requests run to their end", ("finished_reason",))
        self.http = prom.counter("tandem:http_requests_total", "HTTP answers", ("handler", "status"))
        prom.gauge_fn("tandem:http_generation_requests_running", "generation requests in flight here (one per prompt)",
                      running)

    def finished(self, prompt_tokens: int, output_tokens: int, reason: str | None) -> None:
        self.prompt_len.observe(prompt_tokens)
        self.output_len.observe(output_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.success.labels(reason or "abort").inc()

    def embedded(self, prompt_tokens: int) -> None:
        """One input of an embedding request, done."""
        self.prompt_len.observe(prompt_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.success.labels("embedded").inc()

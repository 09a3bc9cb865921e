"""The serving metrics of tandem's services, named after vLLM's (``vllm:`` becomes ``tandem:``).

One name, one meaning: the HTTP front end's figures that mean something else (its time to first
token runs from the HTTP request to the first token sent back) are ``tandem:http_...``
(:mod:`tandem.services.frontend.metrics`); those it shares with the workers mean the same there.

Workers (:class:`WorkerMetrics`, fed from each engine step's outputs in ``EngineWorker.on_outputs``):

- ``tandem:time_to_first_token_seconds``: from the router's accept time (``arrival_time`` of the
  request's spec, which prefill and decode requests carry; the worker's own arrival time when 0)
  to the first token handed to the publisher, recorded by whichever worker samples it (the prefill
  worker, or a decode worker prefilling locally). Router and workers on one host share a clock;
  across hosts it includes their clock offset. A client sees this plus two bus hops (client to
  router, worker to client).
- ``tandem:inter_token_latency_seconds``: between consecutive outputs of a request; the decode
  worker's first one is measured from the prefill worker's first token (``first_token_time``), so
  it includes the KV hand-off, as the client sees it.
- ``tandem:request_time_per_output_token_seconds`` (per request, after the first token),
  ``tandem:e2e_request_latency_seconds`` (router accept to last token),
  ``tandem:request_queue_time_seconds`` (worker arrival to the first engine step that runs it),
  ``tandem:request_prompt_tokens`` / ``tandem:request_generation_tokens`` (per finished request);
- ``tandem:prompt_tokens_total`` (prompt tokens prefilled here, embeddings' included),
  ``tandem:generation_tokens_total`` (tokens sampled here), ``tandem:request_success_total{finished_reason}``
  (requests finished here; an embedding's reason is ``embedded``);
- read from the engine: ``tandem:num_requests_running``, ``tandem:num_requests_waiting``,
  ``tandem:num_requests_swapped`` (preempted to the swap space), ``tandem:kv_cache_usage_perc``
  (0..1), ``tandem:prefix_cache_queries_total`` and ``tandem:prefix_cache_hits_total`` (tokens),
  ``tandem:num_preemptions_total`` and, of those, ``tandem:num_swap_preemptions_total``,
  ``tandem:engine_busy_seconds_total`` (time inside engine steps: prefill throughput for the
  planner), ``tandem:engine_steps_total``, ``tandem:worker_draining``.

LoRA adapters (workers; names only, never ``name@version``, so a republished adapter keeps its series):

- ``tandem:lora_requests_info{running_lora_adapters,waiting_lora_adapters,max_lora}``: vLLM's
  ``vllm:lora_requests_info``, exported only by a worker with adapter slots (``--max-loras``): the
  adapter names of its running and of its waiting (and swapped) sequences, comma-joined and sorted,
  and its slot count; the value is the scrape's unix time. A scrape shows only the current label set.
- ``tandem:lora_requests_total{adapter}``: requests finished here (as ``request_success_total``
  counts them) per adapter name; ``adapter=""`` is the base model (no adapter name is empty);
- ``tandem:lora_slots`` (``--max-loras``; 0: serves no adapters), ``tandem:lora_adapters_resident``
  (adapters in device slots now), ``tandem:lora_adapter_loads_total`` (adapters read from disk into
  host memory) and ``tandem:lora_slot_writes_total`` (adapters copied into a slot: slot misses).

Router (:class:`RouterMetrics`): ``tandem:router_requests_total``, ``tandem:router_rejected_total{code}``,
``tandem:router_request_prompt_tokens`` and ``tandem:router_request_max_tokens`` (the arriving load),
``tandem:router_placement_seconds``, ``tandem:router_workers{service}``, and the admission queue's
``tandem:router_queue_depth`` and ``tandem:router_queue_prompt_tokens`` (requests and prompt tokens
waiting now) and ``tandem:router_queue_wait_seconds`` (per request, whatever its outcome; 0 when
placed at once). Refusals past its bounds count in ``router_rejected_total{code="overloaded"}``.
KV-store (:func:`kvstore_metrics`): tier usage, capacity, blocks, hits, misses, puts, evictions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.shared.infra.metrics import MetricsRegistry

if TYPE_CHECKING:
    from tandem.services.common.worker import Stream
    from tandem.shared.engine.sequence import RequestOutput

# vLLM's buckets, with finer ones below 10 ms for small models on CPU.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISHED = "prefilled"  # a prefill worker's hand-off: the request goes on elsewhere
EMBEDDED = "embedded"  # an embedding's end: its prompt was prefilled, nothing sampled


class WorkerMetrics:
    """Per-request latencies and token counts of one prefill or decode worker."""

    def __init__(self, prom: MetricsRegistry, stats: Callable[[], dict], busy_s: Callable[[], float],
                 steps: Callable[[], int], draining: Callable[[], bool], max_loras: int = 0) -> None:
        h = prom.histogram
        self.ttft = h("tandem:time_to_first_token_seconds", "router accept to first token handed to the bus",
                      TTFT_BUCKETS)
        self.itl = h("tandem:inter_token_latency_seconds", "time between consecutive outputs", ITL_BUCKETS)
        self.tpot = h("tandem:request_time_per_output_token_seconds", "per request, after the first token",
                      ITL_BUCKETS)
        self.e2e = h("tandem:e2e_request_latency_seconds", "router accept to last token", LATENCY_BUCKETS)
        self.queue = h("tandem:request_queue_time_seconds", "arrival here to first engine step", LATENCY_BUCKETS)
        self.req_prompt = h("tandem:request_prompt_tokens", "prompt tokens per finished request", TOKEN_BUCKETS)
        self.req_gen = h("tandem:request_generation_tokens", "output tokens per finished request", TOKEN_BUCKETS)
        self.prompt_tokens = prom.counter("tandem:prompt_tokens_total", "prompt tokens prefilled here")
        self.generation_tokens = prom.counter("tandem:generation_tokens_total", "tokens sampled here")
        self.success = prom.counter("tandem:request_success_total", "requests finished here", ["finished_reason"])
        stat = lambda key: (lambda: stats().get(key, 0))  # noqa: E731 - read at scrape time
        prom.gauge_fn("tandem:num_requests_running", "sequences in the running batch", stat("running"))
        prom.gauge_fn("tandem:num_requests_waiting", "sequences waiting for admission", stat("waiting"))
        prom.gauge_fn("tandem:num_requests_swapped", "preempted sequences in the swap space", stat("swapped"))
        prom.gauge_fn("tandem:kv_cache_usage_perc", "KV blocks in use, 0..1", stat("usage"))
        prom.counter_fn("tandem:prefix_cache_queries", "prompt tokens looked up", stat("prefix_cache_queries"))
        prom.counter_fn("tandem:prefix_cache_hits", "of those, tokens found cached", stat("prefix_cache_hits"))
        prom.counter_fn("tandem:num_preemptions", "sequences preempted", stat("preemptions"))
        prom.counter_fn("tandem:num_swap_preemptions", "of those, swapped out (not recomputed)", stat("swaps"))
        prom.counter_fn("tandem:engine_busy_seconds", "time spent inside engine steps", busy_s)
        prom.counter_fn("tandem:engine_steps", "engine steps run", steps)
        prom.gauge_fn("tandem:worker_draining", "1 while draining", lambda: float(draining()))
        self.lora_requests = prom.counter("tandem:lora_requests_total", "requests finished here per LoRA adapter "
                                          "name (\"\": the base model)", ["adapter"])
        prom.gauge_fn("tandem:lora_slots", "LoRA adapter slots on the device (--max-loras)", lambda: max_loras)
        prom.gauge_fn("tandem:lora_adapters_resident", "LoRA adapters in device slots now",
                      lambda: len(stats().get("adapters_resident", ())))
        prom.counter_fn("tandem:lora_adapter_loads", "LoRA adapters read from disk", stat("adapter_loads"))
        prom.counter_fn("tandem:lora_slot_writes", "LoRA adapters copied into a device slot",
                        stat("adapter_slot_writes"))
        if max_loras:  # as vLLM: only where adapters are served
            prom.gauge_fn("tandem:lora_requests_info", "adapters of the running and waiting requests (value: "
                          "unix time)", lambda: lora_info(stats(), max_loras),
                          ["running_lora_adapters", "waiting_lora_adapters", "max_lora"])

    def on_output(self, out: RequestOutput, stream: Stream, now: float | None = None) -> None:
        """Account one engine output before its chunk goes out (``stream.next_index`` not yet moved)."""
        now = time.time() if now is None else now
        n = len(out.new_token_ids)
        if n:
            if stream.next_index == 0 and not stream.later_outputs:  # the request's first token, of any output
                self.ttft.observe(max(0.0, now - stream.arrival))
                self.prompt_tokens.inc(out.num_prompt_tokens)
                stream.first_token = now
            elif stream.last_token and out.sample_index == 0:  # latencies between output 0's tokens
                self.itl.observe(max(0.0, now - stream.last_token))
            if out.sample_index == 0:
                stream.last_token = now
            self.generation_tokens.inc(n)
        if out.finish_reason == EMBEDDED:
            self.prompt_tokens.inc(out.num_prompt_tokens)
        if out.ends_request and out.finish_reason != FINISHED:
            self.success.labels(out.finish_reason or "unknown").inc()
            self.lora_requests.labels(stream.adapter).inc()
            self.e2e.observe(max(0.0, now - stream.arrival))
            self.req_prompt.observe(out.num_prompt_tokens)
            self.req_gen.observe(out.num_output_tokens)
            if out.num_output_tokens > 1 and stream.first_token:
                self.tpot.observe(max(0.0, now - stream.first_token) / (out.num_output_tokens - 1))

    def on_scheduled(self, stream: Stream, started: float) -> None:
        """The first engine step that runs this request began at ``started``."""
        self.queue.observe(max(0.0, started - stream.received))


def lora_info(stats: dict, max_loras: int) -> dict[tuple[str, ...], float]:
    """``tandem:lora_requests_info``'s one sample: the adapter names (sorted, comma-joined) of the
    running and of the waiting sequences, as vLLM labels its ``vllm:lora_requests_info``."""
    running = ",".join(stats.get("adapters_running", ()))
    waiting = ",".join(stats.get("adapters_waiting", ()))
    return {(running, waiting, str(max_loras)): time.time()}


class RouterMetrics:
    """The arriving load as the router sees it."""

    def __init__(self, prom: MetricsRegistry, workers: Callable[[], dict[tuple[str, ...], float]],
                 queue_depth: Callable[[], float] = lambda: 0, queue_tokens: Callable[[], float] = lambda: 0) -> None:
        self.requests = prom.counter("tandem:router_requests_total", "requests placed")
        self.rejected = prom.counter("tandem:router_rejected_total", "requests refused", ["code"])
        self.prompt_tokens = prom.histogram("tandem:router_request_prompt_tokens", "prompt tokens per placed request",
                                            TOKEN_BUCKETS)
        self.max_tokens = prom.histogram("tandem:router_request_max_tokens", "max_tokens asked per placed request",
                                         TOKEN_BUCKETS)
        self.placement = prom.histogram("tandem:router_placement_seconds", "accept to placed", LATENCY_BUCKETS)
        prom.gauge_fn("tandem:router_workers", "live workers known from heartbeats", workers, ["service"])
        prom.gauge_fn("tandem:router_queue_depth", "requests waiting in the admission queue", queue_depth)
        prom.gauge_fn("tandem:router_queue_prompt_tokens", "prompt tokens waiting in the admission queue", queue_tokens)
        self.queue_wait = prom.histogram("tandem:router_queue_wait_seconds", "time in the admission queue",
                                         TTFT_BUCKETS)

    def placed(self, prompt_tokens: int, max_tokens: int | None, accepted_at: float) -> None:
        """One request placed; ``max_tokens`` None for an embedding (it generates nothing)."""
        self.requests.inc()
        self.prompt_tokens.observe(prompt_tokens)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)
        self.placement.observe(max(0.0, time.time() - accepted_at))


def kvstore_metrics(prom: MetricsRegistry, stats: Callable[[], dict]) -> None:
    """Tier figures of a KV-store, read from its last ``KVBlockStore.stats()``."""
    def tiers(fmt: str) -> Callable[[], dict[tuple[str, ...], float]]:
        return lambda: {(tier,): stats().get(fmt.format(tier), 0) for tier in ("ram", "disk")}

    prom.gauge_fn("tandem:kvstore_usage_bytes", "bytes held per tier", tiers("{}_bytes"), ["tier"])
    prom.gauge_fn("tandem:kvstore_capacity_bytes", "tier capacity", tiers("{}_capacity"), ["tier"])
    prom.gauge_fn("tandem:kvstore_blocks", "blocks held per tier", tiers("{}_blocks"), ["tier"])
    prom.counter_fn("tandem:kvstore_hits", "blocks served per tier", tiers("hits_{}"), ["tier"])
    prom.counter_fn("tandem:kvstore_evictions", "blocks evicted per tier", tiers("evictions_{}"), ["tier"])
    prom.counter_fn("tandem:kvstore_misses", "blocks asked for and not held", lambda: stats().get("misses", 0))
    prom.counter_fn("tandem:kvstore_puts", "blocks offered", lambda: stats().get("puts", 0))
    prom.counter_fn("tandem:kvstore_corrupt_blocks", "blocks dropped on a checksum failure",
                    lambda: stats().get("corrupt_blocks", 0))

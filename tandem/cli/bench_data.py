"""Workloads and statistics of ``tandem bench serve`` (the manner of ``vllm bench serve``).

Datasets make prompts as token ids drawn uniformly from ``[0, vocab_size)`` of the served model
(the router advertises it), so every prompt is valid for the model whatever its tokenizer:

- ``random``: input and output lengths uniform in ``[len * (1 - range_ratio), len * (1 + range_ratio)]``;
- ``prefix``: the same, with the first ``prefix_ratio`` of every prompt shared (``num_prefixes``
  different prefixes, assigned round robin), as for a common system prompt;
- ``json``: ``random``'s prompts, each output constrained to :data:`JSON_DATASET_SCHEMA` (records
  with integers, bounded strings and enums; at least 1,000 of them, so no output completes the
  document before its ``output_len`` and lengths stay exact).

Arrivals: gaps drawn from a gamma distribution with shape ``burstiness`` and mean ``1/rate``
(burstiness 1 is a Poisson process; lower is burstier); rate ``inf`` sends everything at once.

Statistics per request: TTFT, TPOT (``(e2e - ttft) / (output tokens - 1)``), ITL (every gap
between tokens), end-to-end latency; over the run, the first failed request's reason too. Goodput
is DistServe's: requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el`` in
milliseconds).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# The json dataset's schema: what a structured-output workload's masks look like (objects, strings,
# numbers, enums), long enough that every request decodes its whole output_len.
JSON_DATASET_SCHEMA = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "score"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "name": {"type": "string", "maxLength": 16},
                             "score": {"type": "number"},
                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "hot", "old"]}}}},
}
DATASETS = ("random", "prefix", "json")


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int
    schema: dict | None = None  # the JSON schema its output is held to (the json dataset)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # tokens received
    max_tokens: int = 0  # tokens asked for (with ignore_eos, exactly what arrives)
    ok: bool = True
    error: str = ""
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


def _lengths(n: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(dataset: str, n: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0,
                  prefix_ratio: float = 0.0, num_prefixes: int = 1, seed: int = 0) -> list[BenchRequest]:
    """``n`` requests of one of :data:`DATASETS`."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r} ({', '.join(DATASETS)})")
    rng = random.Random(seed)
    inputs = _lengths(n, input_len, range_ratio, rng)
    outputs = _lengths(n, output_len, range_ratio, rng)
    prefix_len = int(round(input_len * prefix_ratio)) if dataset == "prefix" else 0
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(max(1, num_prefixes))]
    requests = []
    for i, (inp, out) in enumerate(zip(inputs, outputs)):
        prefix = prefixes[i % len(prefixes)][: inp - 1] if prefix_len else []
        requests.append(BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(inp - len(prefix))], out,
                                     JSON_DATASET_SCHEMA if dataset == "json" else None))
    return requests


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each request (the first waits nothing)."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else math.nan
    ms = lambda x: x * 1e3  # noqa: E731
    return {"mean": ms(mean), "median": ms(percentile(values, 50)), "std": ms(std),
            "p90": ms(percentile(values, 90)), "p99": ms(percentile(values, 99))}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (seconds); ``ValueError`` naming the
    item that is not ``KEY:MS`` with a known key and a finite MS > 0."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if key not in ("ttft", "tpot", "e2el") or not 0 < ms < math.inf:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS with MS > 0, not {item!r}")
        slos[key] = ms / 1e3
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
    return r.ok and all(got[k] <= v for k, v in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict:
    """The figures ``vllm bench serve`` prints, in one dict (times in milliseconds)."""
    ok = [r for r in results if r.ok]
    inputs, outputs = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration_s if duration_s else math.nan,
        "output_throughput": outputs / duration_s if duration_s else math.nan,
        "total_token_throughput": (inputs + outputs) / duration_s if duration_s else math.nan,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.output_len > 1]),
        "itl_ms": _stats([gap for r in ok for gap in r.itls]),
        "e2el_ms": _stats([r.e2e for r in ok]),
        # In request order: with every request failing alike, the first says why for all of them.
        "first_failure": next((r.error for r in results if not r.ok), None),
    }
    if slos:
        good = sum(meets(r, slos) for r in results)
        summary["goodput_slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration_s if duration_s else math.nan
    return summary

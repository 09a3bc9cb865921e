"""How many prefill and decode workers to run: the planner's formulas, hysteresis and cooldown.

Pure logic (no bus), so the decisions can be tested step by step; ``service.py`` feeds it the load
measured over a window (:class:`Load`, built by ``window.py``) every ``planner_interval_s``.

Prefill (DistServe's queueing model; Dynamo's planner sizes prefill the same way, from measured
throughput against the arriving prompt tokens):

- one prompt's prefill time on one worker is ``D = mean_prompt_len / throughput``, where
  ``throughput`` is the prompt tokens a prefill worker computes per second while busy (measured:
  ``tandem:prompt_tokens_total`` over ``tandem:engine_busy_seconds_total``);
- a prefill worker is an M/D/1 queue, so its mean TTFT is ``D + rho*D / (2*(1 - rho))`` at
  utilization ``rho``; meeting the TTFT target ``T`` allows ``rho <= 2k / (1 + 2k)`` with
  ``k = (T - D) / D``, kept within [0.25, 0.9] (0.25 when ``T <= D``: the target is out of reach
  of one worker per prompt, and the least queueing is the best that more workers can give);
- wanted prefill workers = ``prompt_tokens_rate / (throughput * rho)``; and at least one more than
  now when the measured TTFT p50 is over target while prompts are queued at prefill workers.

Decode (TPOT and KV usage, as Dynamo's decode planner scales on ITL and KV load):

- wanted decode workers = ``decode_workers * max(ITL_p50 / TPOT_target, KV_usage / KV_target)``:
  a worker at its TPOT target or its KV budget is full, and the load spreads over more workers.

Both then go through :func:`step`: up at once to ``ceil(wanted)``; down one worker at a time and
only when ``wanted <= (current - 1) * scale_down_margin`` (the hysteresis band: the smaller count
must still have room to spare, so a load near a boundary does not flap); never outside the
minimum and maximum; and no change within ``cooldown_s`` of the previous one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MAX_UTILIZATION = 0.9
MIN_UTILIZATION = 0.25


@dataclass
class Load:
    """What the planner decides on: the load over its window and the live worker counts."""

    request_rate: float = 0.0  # requests/s placed by the routers
    prompt_tokens_rate: float = 0.0  # prompt tokens/s arriving
    mean_prompt_len: float = 0.0
    mean_output_len: float = 0.0  # max_tokens asked, mean
    prefill_tokens_per_s: float = 0.0  # one prefill worker's throughput while busy; 0: not measured
    prefill_busy: float = 0.0  # mean share of the window prefill workers spent in engine steps
    prefill_waiting: int = 0
    decode_running: int = 0
    decode_waiting: int = 0
    kv_usage: float = 0.0  # highest decode worker's KV usage, 0..1
    ttft_p50: float = math.nan  # seconds, from the services' histograms over the window
    ttft_p99: float = math.nan
    itl_p50: float = math.nan
    itl_p99: float = math.nan
    prefill_workers: int = 0  # live and not draining
    decode_workers: int = 0

    def inputs(self) -> dict[str, float]:
        """The figures for :class:`ScalingDecision.inputs` (unknown ones left out)."""
        return {k: float(v) for k, v in asdict(self).items() if not (isinstance(v, float) and math.isnan(v))}


@dataclass
class Targets:
    ttft_s: float = 1.0
    tpot_s: float = 0.1
    kv_usage: float = 0.8
    scale_down_margin: float = 0.6
    cooldown_s: float = 30.0
    prefill_tokens_per_s: float = 0.0  # assumed throughput until one is measured (0: unknown, hold)
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4


@dataclass
class Decision:
    prefill: int
    decode: int
    reason: str
    changed: bool
    inputs: dict[str, float] = field(default_factory=dict)


def prefill_demand(load: Load, t: Targets) -> tuple[float, str]:
    """Prefill workers the load needs (fractional; NaN: cannot tell) and how that was worked out."""
    if load.request_rate <= 0 or load.prompt_tokens_rate <= 0:
        return 0.0, "no prompts arriving"
    throughput = load.prefill_tokens_per_s or t.prefill_tokens_per_s
    if throughput <= 0:
        return math.nan, "prefill throughput not measured yet"
    service_s = load.mean_prompt_len / throughput
    slack = (t.ttft_s - service_s) / service_s if service_s > 0 else math.inf
    rho = 2 * slack / (1 + 2 * slack) if slack > 0 else 0.0
    rho = min(MAX_UTILIZATION, max(MIN_UTILIZATION, rho))
    needed = load.prompt_tokens_rate / (throughput * rho)
    why = (f"{load.prompt_tokens_rate:.0f} prompt tok/s / ({throughput:.0f} tok/s per worker x {rho:.2f} busy "
           f"for TTFT {t.ttft_s * 1e3:.0f} ms) = {needed:.2f}")
    if slack <= 0:
        why += f" (one prompt alone takes {service_s * 1e3:.0f} ms)"
    if load.ttft_p50 > t.ttft_s and load.prefill_waiting > 0 and needed < load.prefill_workers + 1:
        needed = load.prefill_workers + 1
        why += f"; TTFT p50 {load.ttft_p50 * 1e3:.0f} ms over target with {load.prefill_waiting} queued"
    return needed, why


def decode_demand(load: Load, t: Targets) -> tuple[float, str]:
    """Decode workers the load needs (fractional) and how that was worked out."""
    workers = max(load.decode_workers, 1)
    itl = load.itl_p50 / t.tpot_s if not math.isnan(load.itl_p50) else 0.0
    kv = load.kv_usage / t.kv_usage
    if load.request_rate <= 0 and load.decode_running + load.decode_waiting == 0:
        return 0.0, "no sequences decoding"
    needed = workers * max(itl, kv)
    return needed, f"{workers} x max(ITL p50/target {itl:.2f}, KV {kv:.2f}) = {needed:.2f}"


def step(current: int, needed: float, lo: int, hi: int, margin: float) -> int:
    """The next count: up at once, down by one only below the hysteresis band, within [lo, hi]."""
    clamp = min(max(current, lo), hi)
    if math.isnan(needed):
        return clamp
    up = math.ceil(needed - 1e-9)
    if up > clamp:
        return min(max(up, lo), hi)
    if clamp > lo and needed <= (clamp - 1) * margin:
        return clamp - 1
    return clamp


class Planner:
    """Keeps the wanted counts; :meth:`decide` moves them as the load asks, :meth:`request` as an operator does."""

    def __init__(self, targets: Targets) -> None:
        self.t = targets
        self.prefill: int | None = None  # wanted counts; None until the first decision
        self.decode: int | None = None
        self.last_change = -math.inf

    def clamp(self, prefill: int, decode: int) -> tuple[int, int]:
        t = self.t
        return min(max(prefill, t.min_prefill), t.max_prefill), min(max(decode, t.min_decode), t.max_decode)

    def decide(self, load: Load, now: float) -> Decision:
        if self.prefill is None:
            self.prefill, self.decode = self.clamp(load.prefill_workers, load.decode_workers)
        p_need, p_why = prefill_demand(load, self.t)
        d_need, d_why = decode_demand(load, self.t)
        p_new = step(self.prefill, p_need, self.t.min_prefill, self.t.max_prefill, self.t.scale_down_margin)
        d_new = step(self.decode, d_need, self.t.min_decode, self.t.max_decode, self.t.scale_down_margin)
        inputs = {**load.inputs(), "prefill_needed": p_need, "decode_needed": d_need,
                  "ttft_target_s": self.t.ttft_s, "tpot_target_s": self.t.tpot_s}
        inputs = {k: v for k, v in inputs.items() if not math.isnan(v)}
        if (p_new, d_new) == (self.prefill, self.decode):
            return Decision(p_new, d_new, f"hold: prefill {p_why}; decode {d_why}", False, inputs)
        if now - self.last_change < self.t.cooldown_s:
            left = self.t.cooldown_s - (now - self.last_change)
            return Decision(self.prefill, self.decode,
                            f"cooldown ({left:.0f}s left) holds prefill {self.prefill}, decode {self.decode} "
                            f"(would be {p_new}, {d_new})", False, inputs)
        parts = []
        if p_new != self.prefill:
            parts.append(f"prefill {self.prefill}->{p_new}: {p_why}")
        if d_new != self.decode:
            parts.append(f"decode {self.decode}->{d_new}: {d_why}")
        self.prefill, self.decode, self.last_change = p_new, d_new, now
        return Decision(p_new, d_new, "; ".join(parts), True, inputs)

    def request(self, prefill: int | None, decode: int | None, reason: str, now: float) -> Decision:
        """An operator's counts (within the limits); they hold at least one cooldown."""
        current = (self.prefill or 0, self.decode or 0)
        p, d = self.clamp(current[0] if prefill is None else prefill, current[1] if decode is None else decode)
        self.prefill, self.decode, self.last_change = p, d, now
        return Decision(p, d, f"operator asked prefill {p}, decode {d}" + (f": {reason}" if reason else ""),
                        (p, d) != current)

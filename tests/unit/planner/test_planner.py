"""The planner's decision logic, step by step: formulas, hysteresis, cooldown, limits, and the
load window it reads from MetricsSnapshots and heartbeats. No processes."""

from __future__ import annotations

import math

import pytest

from tandem.services.planner.policy import Load, Planner, Targets, decode_demand, prefill_demand, step
from tandem.services.planner.window import LoadWindow
from tandem.shared.protocol.fleet import Heartbeat, HistogramSnapshot, MetricsSnapshot

TARGETS = Targets(ttft_s=0.5, tpot_s=0.05, kv_usage=0.8, scale_down_margin=0.6, cooldown_s=10.0,
                  min_prefill=1, max_prefill=4, min_decode=1, max_decode=4)


def load(rate: float, prompt_len: float, prefill: int, decode: int = 1, itl: float = 0.01, kv: float = 0.1,
         throughput: float = 20_000.0, **extra) -> Load:
    return Load(request_rate=rate, prompt_tokens_rate=rate * prompt_len, mean_prompt_len=prompt_len,
                mean_output_len=64, prefill_tokens_per_s=throughput, itl_p50=itl, kv_usage=kv,
                prefill_workers=prefill, decode_workers=decode, **extra)


LOW, HIGH = (2.0, 200.0), (20.0, 2000.0)


def test_prefill_formula_is_mdl_queueing_against_the_ttft_target():
    needed, why = prefill_demand(load(*HIGH, prefill=1), TARGETS)
    service = 2000 / 20_000  # 0.1 s per prompt; k = (0.5 - 0.1) / 0.1 = 4, rho = 8/9
    assert needed == pytest.approx(40_000 / (20_000 * (8 / 9)))
    assert "TTFT 500 ms" in why
    assert prefill_demand(load(0.0, 0.0, prefill=1), TARGETS)[0] == 0.0
    # A target below one prompt's own prefill time: least queueing (25% busy), never fewer workers.
    slow, why = prefill_demand(load(1.0, 20_000.0, prefill=1), TARGETS)
    assert slow == pytest.approx(20_000 / (20_000 * 0.25)) and "alone takes 1000 ms" in why
    assert service < TARGETS.ttft_s


def test_unknown_prefill_throughput_holds_the_count():
    needed, why = prefill_demand(load(*HIGH, prefill=2, throughput=0.0), TARGETS)
    assert math.isnan(needed) and "not measured" in why
    assert step(2, needed, 1, 4, 0.6) == 2


def test_decode_scales_with_itl_and_kv_against_targets():
    assert decode_demand(load(*LOW, prefill=1, decode=2, itl=0.1), TARGETS)[0] == pytest.approx(4.0)
    assert decode_demand(load(*LOW, prefill=1, decode=1, itl=0.01, kv=0.96), TARGETS)[0] == pytest.approx(1.2)
    idle = Load(decode_workers=2)
    assert decode_demand(idle, TARGETS)[0] == 0.0


@pytest.mark.parametrize("current, needed, want", [
    (1, 0.04, 1),  # at the minimum
    (1, 2.3, 3),  # up at once to what is needed
    (3, 9.0, 4),  # never past the maximum
    (3, 2.1, 3),  # inside the band: hold
    (3, 1.2, 2),  # below (3-1)*0.6: down by one only
    (2, 0.61, 2),  # just above (2-1)*0.6: hold
    (2, 0.0, 1),
    (0, 0.0, 1),  # below the minimum (a crashed worker): back to it
])
def test_step_hysteresis_band(current, needed, want):
    assert step(current, needed, 1, 4, 0.6) == want


def test_step_load_scales_prefill_up_then_back_down_with_cooldown():
    planner = Planner(TARGETS)
    t = 0.0
    first = planner.decide(load(*LOW, prefill=1), t)
    assert (first.prefill, first.decode, first.changed) == (1, 1, False) and first.reason.startswith("hold")

    up = planner.decide(load(*HIGH, prefill=1), t := t + 5)
    assert (up.prefill, up.decode, up.changed) == (3, 1, True), up.reason
    assert up.reason.startswith("prefill 1->3") and "\n" not in up.reason
    assert up.inputs["prompt_tokens_rate"] == pytest.approx(40_000)

    held = planner.decide(load(*HIGH, prefill=1, itl=0.2), t := t + 2)  # decode would scale: cooldown holds
    assert (held.prefill, held.decode, held.changed) == (3, 1, False) and "cooldown" in held.reason

    counts = []
    for _ in range(8):  # low load again, one decision every 5 s, cooldown 10 s
        d = planner.decide(load(*LOW, prefill=planner.prefill), t := t + 5)
        counts.append(d.prefill)
    assert counts == [3, 2, 2, 1, 1, 1, 1, 1], "down one worker per cooldown, to the minimum"


def test_load_near_a_boundary_does_not_flap():
    planner = Planner(TARGETS)
    rate = lambda n: n * 20_000 * (8 / 9) / 2000  # noqa: E731 - requests/s giving n workers at 2000-token prompts
    planner.decide(load(rate(1.9), 2000.0, prefill=2), 0.0)
    assert planner.prefill == 2
    # needed alternates 1.9 and 2.1 workers: one step up, then it stays.
    seen = [planner.decide(load(rate(n), 2000.0, prefill=planner.prefill), 20.0 * i).prefill
            for i, n in enumerate([1.9, 2.1, 1.9, 2.1, 1.9, 1.9], start=1)]
    assert seen == [2, 3, 3, 3, 3, 3]


def test_ttft_over_target_with_a_queue_adds_a_worker_even_if_the_formula_does_not():
    slow = load(*LOW, prefill=1, ttft_p50=0.9, prefill_waiting=3)
    needed, why = prefill_demand(slow, TARGETS)
    assert needed == 2 and "over target" in why


def test_operator_request_is_clamped_and_holds_a_cooldown():
    planner = Planner(TARGETS)
    planner.decide(load(*LOW, prefill=1), 0.0)
    d = planner.request(9, None, "console", 1.0)
    assert (d.prefill, d.decode, d.changed) == (4, 1, True) and "console" in d.reason
    assert planner.decide(load(*LOW, prefill=4), 5.0).prefill == 4, "the operator's count holds a cooldown"


def snapshot(service: str, iid: str, t: float, counters: dict | None = None, gauges: dict | None = None,
             hists: dict | None = None) -> MetricsSnapshot:
    return MetricsSnapshot(service=service, instance_id=iid, host="h", time=t, counters=counters or {},
                           gauges=gauges or {}, histograms=hists or {})


def hist(count: int, total: float) -> HistogramSnapshot:
    return HistogramSnapshot(bounds=[100.0, 1000.0, 10_000.0], counts=[0, count, 0, 0], sum=total, count=count)


def test_window_turns_snapshots_and_heartbeats_into_load():
    window = LoadWindow(window_s=30.0, stale_s=3.0)
    key = "tandem:router_request_prompt_tokens"
    window.add_snapshot(snapshot("router", "r", 100.0, hists={key: hist(0, 0)}), now=0.0)
    window.add_snapshot(snapshot("router", "r", 110.0, hists={key: hist(20, 4000)}), now=10.0)
    window.add_snapshot(snapshot("prefill", "p", 100.0, {"tandem:prompt_tokens_total": 0,
                                                         "tandem:engine_busy_seconds_total": 0}), now=0.0)
    window.add_snapshot(snapshot("prefill", "p", 110.0, {"tandem:prompt_tokens_total": 4000,
                                                         "tandem:engine_busy_seconds_total": 0.4},
                                 {"tandem:num_requests_waiting": 2}), now=10.0)
    window.add_snapshot(snapshot("decode", "d", 110.0, gauges={"tandem:kv_cache_usage_perc": 0.25}), now=10.0)
    for iid, service, draining in [("p", "prefill", False), ("p2", "prefill", True), ("d", "decode", False)]:
        window.add_heartbeat(Heartbeat(service=service, instance_id=iid, host="h", pid=1, model="m",
                                       draining=draining), now=10.0)
    got = window.load(now=10.5)
    assert got.request_rate == pytest.approx(2.0) and got.prompt_tokens_rate == pytest.approx(400.0)
    assert got.mean_prompt_len == pytest.approx(200.0)
    assert got.prefill_tokens_per_s == pytest.approx(10_000.0) and got.prefill_busy == pytest.approx(0.04)
    assert got.prefill_waiting == 2 and got.kv_usage == 0.25
    assert (got.prefill_workers, got.decode_workers) == (1, 1), "draining workers do not count"
    assert window.load(now=20.0).prefill_workers == 0, "silent workers are gone"

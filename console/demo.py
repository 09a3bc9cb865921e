"""A fixed, made-up :class:`ConsoleState`: the snapshot tests and ``docs/make_screenshots.py`` use it.

Everything is derived from constants (no clock, no randomness), so every pane renders the same
picture on every run: two decode and two prefill workers (three of them with LoRA adapter slots),
a router, a KV-store, a planner, a trainer's step timeline, KV hand-offs, scaling decisions and
routing decisions.
"""

from __future__ import annotations

import math

from tandem.console.state import ConsoleState, ServiceRow, WorkerAdapters
from tandem.console.widgets import hidden_fraction
from tandem.shared.protocol.fleet import RouteCandidate, RoutingDecision, ScalingDecision
from tandem.shared.protocol.training import TimelineOp, TrainStepMetrics, TrainTimeline
from tandem.shared.protocol.views import BlockSnapshot, KVTransferEvent, SequenceBlocks

NOW = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
MIB = 1 << 20


def _services() -> list[ServiceRow]:
    rows = [
        ("decode", "decode-a", 5400, 1834, 0, 0.0008, ""),
        ("decode", "decode-b", 5390, 1790, 1, 0.0009, "invalid_request: prompt is empty"),
        ("kvstore", "kvstore-a", 5410, 912, 0, 0.0031, ""),
        ("planner", "planner-a", 5405, 3, 0, 0.0002, ""),
        ("prefill", "prefill-a", 5400, 1211, 0, 0.0012, ""),
        ("prefill", "prefill-b", 610, 140, 0, 0.0011, ""),
        ("router", "router-a", 5399, 3625, 2, 0.0042, "prompt_too_long: prompt has 4096 tokens"),
        ("trainer", "trainer-a", 3600, 1, 0, 0.0005, ""),
    ]
    data = {"decode": {"running": 3, "waiting": 0, "free_blocks": 606, "num_blocks": 640, "cached_blocks": 172,
                       "prefix_cache_queries": 48210, "prefix_cache_hits": 30112, "kv_transfers_nats": 812},
            "prefill": {"running": 1, "waiting": 2, "free_blocks": 240, "num_blocks": 256, "preemptions": 0},
            "kvstore": {"ram_blocks": 700, "disk_blocks": 5200, "puts": 6400}}
    return [ServiceRow(service=s, instance_id=i, host="gpu-node-1" if s != "router" else "edge-1", started=NOW - up,
                       requests=r, errors=e, mean_latency_s=lat, last_error=err, version="0.1.0", data=data.get(s, {}))
            for s, i, up, r, e, lat, err in rows]


def _blocks() -> BlockSnapshot:
    """decode-a's pool of 640 blocks: two requests sharing a system prompt, one request of three
    samples sharing their prompt's blocks (two of them copied the partly filled last one on
    writing), some cached blocks."""
    states, refs = bytearray(640), bytearray(640)
    system_prompt = [0, 1, 2, 3]  # shared by two sequences (ref count 2)
    seq_a = system_prompt + [4, 5, 6, 7, 8, 9, 10, 11]
    seq_b = system_prompt + [40, 41, 42, 43, 44, 45]
    samples_prompt = [80 + i for i in range(16)]  # forked to the request's three samples (ref count 3)
    samples = [samples_prompt + [96, 97, 98, 99], samples_prompt + [100, 101], samples_prompt + [102, 103]]
    for table in (seq_a, seq_b, *samples):
        for block in table:
            refs[block] += 1
    for block, count in enumerate(refs):
        if count:
            states[block] = 3 if count > 1 else 1
    for block in list(range(120, 160)) + list(range(200, 212)) + list(range(300, 420)):
        states[block] = 2
    sequences = [
        SequenceBlocks(request_id="req-0001", num_tokens=190, block_table=seq_a, prefix_cached_blocks=0,
                       imported_blocks=11, adapter="sql-lora"),
        SequenceBlocks(request_id="req-0002", num_tokens=150, block_table=seq_b, prefix_cached_blocks=4,
                       imported_blocks=5, constrained="json_schema"),
        *(SequenceBlocks(request_id="req-0003", num_tokens=tokens, block_table=table, sample_index=i,
                         adapter="chat-lora")
          for i, (table, tokens) in enumerate(zip(samples, (317, 281, 290)))),
    ]
    return BlockSnapshot(instance_id="decode-a", num_blocks=640, block_size=16, states=bytes(states),
                         ref_counts=bytes(refs), cow_copies=2, sequences=sequences)


def _adapters() -> dict[str, WorkerAdapters]:
    """What the workers' heartbeats say of their LoRA adapters (most recently used last); prefill-b
    has no slots."""
    return {
        "decode-a": WorkerAdapters(4, ("sql-lora", "chat-lora"), ("summarize", "sql-lora", "chat-lora")),
        "decode-b": WorkerAdapters(4, ("sql-lora",), ("sql-lora",)),
        "prefill-a": WorkerAdapters(2, ("chat-lora", "sql-lora"), ("chat-lora", "sql-lora")),
        "prefill-b": WorkerAdapters(0),
    }


def _timeline() -> TrainTimeline:
    """Four layers forward and backward: each layer's upload runs under the previous layer's compute,
    each layer's gradients go down under the next one's."""
    ops: list[TimelineOp] = []
    c = 0.012
    for phase, layers, compute_s in (("fwd", range(4), 0.018), ("bwd", range(3, -1, -1), 0.030)):
        for layer in layers:
            ops.append(TimelineOp(lane="h2d", layer=layer, phase=phase, start_s=c - 0.012, end_s=c - 0.002,
                                  bytes=64 * MIB))
            ops.append(TimelineOp(lane="compute", layer=layer, phase=phase, start_s=c, end_s=c + compute_s))
            if phase == "bwd":
                ops.append(TimelineOp(lane="d2h", layer=layer, phase=phase, start_s=c + compute_s + 0.001,
                                      end_s=c + compute_s + 0.011, bytes=64 * MIB))
            c += compute_s + 0.002
    ops.append(TimelineOp(lane="optimizer", layer=-1, phase="opt", start_s=c + 0.012, end_s=c + 0.032))
    return TrainTimeline(job_id="demo", step=42, ops=ops, hidden_fraction=round(hidden_fraction(ops), 2))


def _transfers() -> list[KVTransferEvent]:
    events = []
    for i in range(12):
        path = ("ring", "nats", "store")[i % 3]
        start = NOW - 6.0 + i * 0.45
        duration = {"ring": 0.02, "nats": 0.15, "store": 0.3}[path]
        events.append(KVTransferEvent(request_id=f"req-{i:04d}", source="prefill-a" if path != "store" else "kvstore-a",
                                      dest="decode-a" if i % 2 else "decode-b", path=path, blocks=8 + i,
                                      bytes=(8 + i) * MIB, start=start, end=start + duration))
    return events


def _decisions() -> list[ScalingDecision]:
    rows = [
        (-600, 1, 1, 1, 2, "TPOT p99 112 ms over target 80 ms: add a decode worker"),
        (-420, 1, 2, 1, 2, "within targets"),
        (-240, 1, 2, 2, 2, "TTFT p99 1.9 s over target 1.0 s with 14 queued prompts: add a prefill worker"),
        (-60, 2, 2, 2, 2, "within targets"),
    ]
    return [ScalingDecision(time=NOW + dt, prefill_current=pc, decode_current=dc, prefill_wanted=pw, decode_wanted=dw,
                            reason=why, inputs={"ttft_target_s": 1.0, "tpot_target_s": 0.08})
            for dt, pc, dc, pw, dw, why in rows]


def _routing() -> list[RoutingDecision]:
    out = []
    for i in range(6):
        candidates = [
            RouteCandidate(instance_id="decode-a", cached_blocks=12 - i, load=3 + i % 2, cost=float(4 + i)),
            RouteCandidate(instance_id="decode-b", cached_blocks=2, load=1, cost=float(13 - i)),
        ]
        best = min(candidates, key=lambda c: c.cost)
        out.append(RoutingDecision(
            request_id=f"req-{100 + i:04d}", prompt_tokens=230 + 16 * i, prompt_blocks=(230 + 16 * i) // 16,
            candidates=candidates, decode_worker=best.instance_id, prefill_worker="prefill-a" if i % 3 else None,
            reason="prefill remote: 0 blocks cached there" if i % 3 else "uncached part short: decode prefills locally",
        ))
    return out


def demo_state() -> ConsoleState:
    """The made-up system, with decode-a selected in the block view."""
    state = ConsoleState(url="nats://nats:4222", connection="connected", now=NOW, discovered=True,
                         services=_services(), selected_worker=("decode", "decode-a"), planner_stream=True)
    state.blocks["decode-a"] = _blocks()
    state.adapters.update(_adapters())
    state.kvstores["kvstore-a"] = {
        "ram_bytes": 700 * MIB, "ram_capacity": 1024 * MIB, "ram_blocks": 700, "disk_bytes": 5200 * MIB,
        "disk_capacity": 8192 * MIB, "disk_blocks": 5200, "hits_ram": 3100, "hits_disk": 800, "misses": 1300,
        "puts": 6400, "evictions_ram": 320, "evictions_disk": 0, "corrupt_blocks": 0,
    }
    state.timeline = _timeline()
    state.train_step = TrainStepMetrics(job_id="demo", step=42, loss=2.314, grad_norm=0.91, lr=3e-4,
                                        tokens_per_s=6810.0, model_tflops=131.0, step_time_s=0.32)
    state.transfers.extend(_transfers())
    for decision in _decisions():
        state.add_decision(decision)
    for i in range(40):  # smooth, fixed latency curves
        wave = math.sin(i / 5)
        state.latency["ttft"].p50.append(0.40 + 0.10 * wave)
        state.latency["ttft"].p99.append(0.90 + 0.35 * wave + 0.25 * math.sin(i / 2))
        state.latency["tpot"].p50.append(0.045 + 0.005 * wave)
        state.latency["tpot"].p99.append(0.070 + 0.015 * math.cos(i / 4))
    state.routing.extend(_routing())
    state.version = 1
    return state

"""A worker's LoRA metrics (``services/common/service_metrics.py``): finished requests counted per
adapter name (the base model as ``adapter=""``), vLLM's ``lora_requests_info`` with the running and
waiting adapters' names, and the slot and load figures read from the engine's stats; a worker
without adapter slots exports no ``lora_requests_info``. And the engine's stats those come from:
the adapters of its running and waiting sequences, its slots' contents, its loads and slot writes."""

from __future__ import annotations

from pathlib import Path

from factories import make_engine, make_request
from lora_support import ALL_TARGETS, make_peft_adapter
from model_support import make_hf_checkpoint

from tandem.services.common.service_metrics import WorkerMetrics
from tandem.services.common.worker import Stream
from tandem.shared.engine.sequence import RequestOutput
from tandem.shared.infra.metrics import MetricsRegistry
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.adapters import AdapterRef

NOW = 1_000.0


def finished(request_id: str, reason: str = "stop") -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[5], text_delta="x", finished=True,
                         finish_reason=reason, num_prompt_tokens=4, num_output_tokens=1)


def worker_metrics(stats: dict, max_loras: int) -> tuple[MetricsRegistry, WorkerMetrics]:
    prom = MetricsRegistry()
    return prom, WorkerMetrics(prom, lambda: stats, lambda: 0.0, lambda: 0, lambda: False, max_loras)


def test_requests_are_counted_per_adapter_name_and_the_slots_come_from_the_stats() -> None:
    stats = {"adapter_loads": 3, "adapter_slot_writes": 5, "adapters_resident": ["sql@v2", "chat@1"],
             "adapters_running": ["chat", "sql"], "adapters_waiting": ["sql"]}
    prom, metrics = worker_metrics(stats, max_loras=4)
    for request_id, adapter in (("a", "sql"), ("b", "sql"), ("c", ""), ("d", "chat")):
        metrics.on_output(finished(request_id), Stream("_INBOX.x", arrival=NOW - 1, adapter=adapter), NOW)
    # A prefill worker's hand-off finishes nothing here (the decode worker counts the request).
    metrics.on_output(finished("e", "prefilled"), Stream("_INBOX.x", arrival=NOW - 1, adapter="sql"), NOW)
    snap = prom.snapshot("decode", "decode-a", "host")
    assert snap.counters['tandem:lora_requests_total{adapter="sql"}'] == 2
    assert snap.counters['tandem:lora_requests_total{adapter="chat"}'] == 1
    assert snap.counters['tandem:lora_requests_total{adapter=""}'] == 1
    assert snap.gauges["tandem:lora_slots"] == 4 and snap.gauges["tandem:lora_adapters_resident"] == 2
    assert snap.counters["tandem:lora_adapter_loads_total"] == 3
    assert snap.counters["tandem:lora_slot_writes_total"] == 5
    (info,) = [k for k in snap.gauges if k.startswith("tandem:lora_requests_info")]
    assert info == ('tandem:lora_requests_info{max_lora="4",running_lora_adapters="chat,sql",'
                    'waiting_lora_adapters="sql"}')


def test_a_worker_without_adapter_slots_exports_no_lora_info() -> None:
    prom, metrics = worker_metrics({}, max_loras=0)
    metrics.on_output(finished("a"), Stream("_INBOX.x", arrival=NOW - 1), NOW)
    snap = prom.snapshot("decode", "decode-a", "host")
    assert not any(k.startswith("tandem:lora_requests_info") for k in snap.gauges)
    assert snap.gauges["tandem:lora_slots"] == 0 and snap.gauges["tandem:lora_adapters_resident"] == 0
    assert snap.counters['tandem:lora_requests_total{adapter=""}'] == 1


def test_the_engine_stats_name_the_adapters_of_its_queues(tmp_path: Path, tiny) -> None:
    """One slot, two adapters and a base request: one adapter runs while the other waits for the slot."""
    hf_model = make_hf_checkpoint("llama3", tmp_path / "base")
    refs = [AdapterRef(name=name, version="1", path=str(make_peft_adapter(hf_model, tmp_path / name, 4, ALL_TARGETS,
                                                                          seed)))
            for name, seed in (("sql", 1), ("chat", 2))]
    engine = make_engine(load_model(str(tmp_path / "base")), max_loras=1, max_lora_rank=8)
    for i, ref in enumerate([*refs, None]):
        engine.add_request(make_request(f"r{i}", [1, 5, 9, 14], max_tokens=3, adapter=ref))
    engine.step()
    stats = engine.stats()
    assert (stats["adapters_running"], stats["adapters_waiting"]) == (["sql"], ["chat"])
    assert stats["adapters_resident"] == ["sql@1"] and stats["adapter_slot_writes"] == 1
    assert stats["adapter_loads"] >= 2
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert (stats["adapters_running"], stats["adapters_waiting"], stats["adapters_resident"]) == ([], [], ["chat@1"])
    assert stats["adapter_slot_writes"] == 2
    base = make_engine(tiny).stats()
    assert (base["adapter_loads"], base["adapters_resident"], base["adapters_running"]) == (0, [], [])

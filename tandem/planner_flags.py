"""Command-line flags of the planner, shared by ``tandem serve planner`` and ``tandem up --planner``.

Each flag sets the :class:`~tandem.shared.infra.config.Settings` field named in ``PLANNER_FLAGS`` (so
``TANDEM_PLANNER_TTFT_TARGET_MS=500`` works too). ``tandem up`` uses the minimum and maximum counts
itself (it never runs fewer or more workers) and hands every other given flag on to the planner.
"""

from __future__ import annotations

import argparse

# Settings field -> flag.
PLANNER_FLAGS = {
    "planner_ttft_target_ms": "--ttft-target-ms",
    "planner_tpot_target_ms": "--tpot-target-ms",
    "planner_kv_usage_target": "--kv-usage-target",
    "planner_interval_s": "--planner-interval-s",
    "planner_window_s": "--planner-window-s",
    "planner_cooldown_s": "--planner-cooldown-s",
    "planner_scale_down_margin": "--planner-scale-down-margin",
    "planner_prefill_tokens_per_s": "--planner-prefill-tokens-per-s",
    "planner_min_prefill": "--min-prefill",
    "planner_max_prefill": "--max-prefill",
    "planner_min_decode": "--min-decode",
    "planner_max_decode": "--max-decode",
}
LIMITS = ("planner_min_prefill", "planner_max_prefill", "planner_min_decode", "planner_max_decode")
HELP = {
    "planner_ttft_target_ms": "time-to-first-token target (default 1000)",
    "planner_tpot_target_ms": "time-per-output-token target (default 100)",
    "planner_kv_usage_target": "decode KV usage a worker may run at (default 0.8)",
    "planner_interval_s": "seconds between decisions (default 5)",
    "planner_window_s": "seconds of load each decision looks at (default 30)",
    "planner_cooldown_s": "no change sooner than this after the last (default 30)",
    "planner_scale_down_margin": "scale down below this share of the smaller count's capacity (default 0.6)",
    "planner_prefill_tokens_per_s": "a prefill worker's throughput until measured (default: unknown)",
    "planner_min_prefill": "fewest prefill workers (up: min(1, --prefill))",
    "planner_max_prefill": "most prefill workers (up: max(--prefill, 2))",
    "planner_min_decode": "fewest decode workers (up: 1)",
    "planner_max_decode": "most decode workers (up: max(--decode, 2))",
}


def add_planner_flags(p: argparse.ArgumentParser, switch: bool = False) -> None:
    """The planner's flags; ``switch`` adds ``--planner/--no-planner`` (``tandem up``)."""
    if switch:
        p.add_argument("--planner", action=argparse.BooleanOptionalAction, default=False,
                       help="run the planner and carry out its scaling decisions (default: off, counts stay as given)")
    for name, flag in PLANNER_FLAGS.items():
        kind = int if name in LIMITS else float
        p.add_argument(flag, dest=name, type=kind, help=HELP[name])


def planner_argv(args: argparse.Namespace) -> list[str]:
    """The given planner flags other than the limits, as arguments for ``tandem serve planner``."""
    argv = []
    for name, flag in PLANNER_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None and name not in LIMITS:
            argv += [flag, str(value)]
    return argv

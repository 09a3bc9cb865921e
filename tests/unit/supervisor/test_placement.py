"""Where ``tandem up`` puts prefill (tandem/cli/gpus.py ``plan_placement``, tandem/cli/up.py ``place``): on
one GPU no prefill worker unless asked, the decode workers prefilling themselves with the whole
memory share; asked for (``--prefill N``) there, they start and the router is told to use them;
with several GPUs or on CPU one prefill worker by default. What the children are handed follows.

Run: ``python3 -m pytest -q tests/unit/supervisor/test_placement.py``.
"""

from __future__ import annotations

import os

import pytest

from tandem.cli.flags import given, settings_from
from tandem.cli.gpus import PlacementError, memory_share, pick_gpus, plan_placement
from tandem.cli.main import parser
from tandem.cli.supervisor import Supervisor
from tandem.cli.up import place
from tandem.shared.infra.config import ENV_PREFIX


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("gpus", "prefill", "decode", "max_prefill", "want", "in_line"), [
    (1, None, 1, None, (0, False, 0), "1 GPU: the decode worker prefills itself"),
    (1, None, 3, None, (0, False, 0), "1 GPU: the decode workers prefill themselves"),
    (1, 0, 1, None, (0, False, 0), "a separate prefill process would share the device"),
    (1, 1, 1, None, (1, True, None), "prefill remote as asked (--prefill 1)"),
    (1, None, 1, 2, (0, True, 2), "as asked (--max-prefill 2)"),
    (2, None, 1, None, (1, False, None), "2 GPUs, each worker its own: 1 prefill worker and 1 decode worker"),
    (2, None, 3, None, (1, False, None), "but not on a prefill worker sharing the decode worker's GPU"),
    (0, None, 1, None, (1, False, None), "CPU"),
    (0, 0, 2, None, (0, False, None), "the decode workers prefill themselves"),
], ids=["1gpu", "1gpu-3-decode", "1gpu-prefill-0", "1gpu-asked", "1gpu-planner-asked", "2gpus", "2gpus-crowded",
        "cpu", "cpu-none"])
def test_the_placement_follows_the_devices(gpus, prefill, decode, max_prefill, want, in_line) -> None:
    placement = plan_placement(gpus, prefill, decode, max_prefill)
    got = (placement.prefill, placement.prefill_on_shared_device, placement.planner_max_prefill)
    assert got == want, placement
    assert placement.decode == decode and placement.line.startswith("placement: ") and in_line in placement.line, \
        placement.line


@pytest.mark.parametrize(("gpus", "prefill_ranks", "decode_ranks", "in_line"), [
    (4, 1, 2, "4 GPUs, each worker its own: 1 prefill worker and 1 decode worker of 2 GPUs each"),
    (4, 2, 2, "4 GPUs, each worker its own: 1 prefill worker of 2 GPUs each and 1 decode worker of 2 GPUs each"),
    (2, 1, 2, "2 GPUs for 3 ranks, some sharing one"),
    (0, 2, 2, "CPU"),
], ids=["1p1d-tp2-decode", "tp2-both", "crowded", "cpu"])
def test_tensor_parallel_workers_count_their_ranks(gpus, prefill_ranks, decode_ranks, in_line) -> None:
    placement = plan_placement(gpus, None, 1, None, prefill_ranks, decode_ranks)
    assert in_line in placement.line, placement.line
    assert (placement.prefill_ranks, placement.decode_ranks) == (prefill_ranks, decode_ranks)


@pytest.mark.parametrize(("gpus", "flag"), [(1, "decode"), (2, "prefill")])
def test_a_worker_wider_than_the_gpus_is_refused_in_one_line(gpus, flag) -> None:
    ranks = {"prefill_ranks": 1, "decode_ranks": 1, f"{flag}_ranks": 3}
    with pytest.raises(PlacementError, match=f"--{flag}-tensor-parallel-size 3: a {flag} worker would span 3 GPUs"):
        plan_placement(gpus, None, 1, None, **ranks)


@pytest.mark.parametrize(("occupancy", "service", "count", "want"), [
    ([0, 0, 0, 0], "decode", 2, [0, 1]),
    ([0, 0, 0, 0], "prefill", 2, [1, 2]),
    ([2, 2, 0, 0], "decode", 2, [2, 3]),
    ([1, 0, 0, 1], "prefill", 1, [1]),
    ([1, 1, 1, 0], "decode", 3, [0, 1, 3]),
], ids=["decode-first", "prefill-from-1", "least-occupied", "one", "three"])
def test_a_worker_gets_the_least_occupied_gpus(occupancy, service, count, want) -> None:
    assert pick_gpus(len(occupancy), occupancy, service, count) == want


def up_args(*flags: str):
    args = parser().parse_args(["up", *flags])
    return args, settings_from(args), given(args)


@pytest.mark.parametrize(("visible", "flags", "prefill", "router_flag"), [
    (["0"], [], 0, None),
    (["0"], ["--prefill", "1"], 1, True),
    (["0"], ["--prefill", "1", "--no-router-prefill-on-shared-device"], 1, False),
    (["0", "1"], [], 1, None),
    ([], ["--device", "cuda:0"], 0, None),
    ([], ["--device", "cpu"], 1, None),
], ids=["1gpu", "1gpu-asked", "1gpu-asked-router-told-no", "2gpus", "pinned-cuda-device", "cpu"])
def test_up_places_and_tells_the_router(monkeypatch, visible, flags, prefill, router_flag) -> None:
    monkeypatch.setattr("tandem.cli.gpus.visible_gpus", lambda device: list(visible))
    args, settings, overrides = up_args(*flags)
    gpus, placement = place(settings, args, overrides)
    assert gpus == visible and placement.prefill == prefill
    assert overrides.get("router_prefill_on_shared_device") is router_flag, overrides


@pytest.mark.parametrize(("flags", "decode_share", "router_on"), [
    ([], 0.85, False),
    (["--decode", "2"], 0.425, False),
    (["--prefill", "1"], 0.6375, True),
], ids=["alone", "two-decode", "prefill-asked"])
def test_children_on_one_gpu_split_its_memory_and_the_router_knows(monkeypatch, flags, decode_share,
                                                                   router_on) -> None:
    """The decode workers of a one-GPU placement take the whole share between them (no quarter is
    kept for a prefill worker that will not run); the router's child gets the flag as placed."""
    monkeypatch.setattr("tandem.cli.gpus.visible_gpus", lambda device: ["0"])
    args, settings, overrides = up_args(*flags)
    gpus, placement = place(settings, args, overrides)
    sup = Supervisor(settings, num_prefill=placement.prefill, num_decode=args.decode, overrides=overrides, gpus=gpus,
                     max_prefill=placement.planner_max_prefill)
    sup.url = "nats://127.0.0.1:4222"
    decode = settings_from(parser().parse_args(sup.command("decode", "decode-x")[3:]))
    router = settings_from(parser().parse_args(sup.command("router", "router-x")[3:]))
    assert decode.engine.gpu_memory_utilization == pytest.approx(decode_share, abs=1e-4)
    assert router.router.prefill_on_shared_device is router_on
    shares = [memory_share(0.85, s, 1, placement.prefill, args.decode) for s in ["decode"] * args.decode
              + ["prefill"] * placement.prefill]
    assert sum(shares) == pytest.approx(0.85), "the workers on the GPU share it, none sized as if alone"


def test_the_planner_adds_no_prefill_worker_to_a_one_gpu_placement(monkeypatch) -> None:
    monkeypatch.setattr("tandem.cli.gpus.visible_gpus", lambda device: ["0"])
    for flags, limits in (([], (0, 0)), (["--prefill", "1"], (1, 2)), (["--max-prefill", "3"], (0, 3))):
        args, settings, overrides = up_args("--planner", *flags)
        gpus, placement = place(settings, args, overrides)
        sup = Supervisor(settings, num_prefill=placement.prefill, num_decode=args.decode, overrides=overrides,
                         planner=True, gpus=gpus, max_prefill=placement.planner_max_prefill)
        assert sup.limits("prefill") == limits, flags


def test_a_cpu_worker_names_no_device() -> None:
    """CPU workers get disjoint thread pools, not one device: the router never takes them for sharing one."""
    import torch

    from tandem.services.common.worker import device_id

    assert device_id(torch.device("cpu")) == ""


@pytest.mark.gpu
def test_a_gpu_worker_names_its_gpu_by_uuid() -> None:
    """The heartbeat's ``device`` is the GPU's UUID, as nvidia-smi lists it: the same id whichever
    index the process sees the GPU under."""
    import subprocess

    import torch

    from tandem.services.common.worker import device_id

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    got = device_id(torch.device("cuda:0"))
    assert got.startswith("GPU-") and got == device_id(torch.device("cuda")), got
    listed = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                            text=True, check=True).stdout.split()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible or visible.isdigit():
        index = int(visible or 0)
        assert got == listed[index], (got, listed)
    else:
        assert got in listed, (got, listed)


def test_up_hands_each_kind_its_tensor_parallel_size(monkeypatch) -> None:
    """``--decode-tensor-parallel-size 2`` on four GPUs: the decode child gets ``--tensor-parallel-size
    2``, the prefill child 1, and with one worker per GPU each rank keeps the whole memory share."""
    monkeypatch.setattr("tandem.cli.gpus.visible_gpus", lambda device: ["0", "1", "2", "3"])
    args, settings, overrides = up_args("--decode-tensor-parallel-size", "2")
    gpus, placement = place(settings, args, overrides)
    sup = Supervisor(settings, num_prefill=placement.prefill, num_decode=args.decode, overrides=overrides, gpus=gpus,
                     prefill_ranks=placement.prefill_ranks, decode_ranks=placement.decode_ranks)
    sup.url = "nats://127.0.0.1:4222"
    decode = settings_from(parser().parse_args(sup.command("decode", "decode-x")[3:]))
    prefill = settings_from(parser().parse_args(sup.command("prefill", "prefill-x")[3:]))
    assert (decode.engine.tensor_parallel_size, prefill.engine.tensor_parallel_size) == (2, 1)
    assert decode.engine.gpu_memory_utilization == pytest.approx(0.85, abs=1e-4)


def test_up_refuses_a_layout_wider_than_the_gpus(monkeypatch) -> None:
    monkeypatch.setattr("tandem.cli.gpus.visible_gpus", lambda device: ["0", "1"])
    args, settings, overrides = up_args("--tensor-parallel-size", "4")
    with pytest.raises(PlacementError, match="--prefill-tensor-parallel-size 4"):
        place(settings, args, overrides)

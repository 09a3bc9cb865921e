"""The console against a real system: router, prefill, decode and a KV-store on the test nats-server.

Textual pilot tests drive the keys and read what each pane shows (the screen rendered as text).
The planner, trainer and metrics messages come from the test itself (the console codes against
their message contracts; those services may not run here), as does a stand-in planner answering
scale requests. Run: ``python3 -m pytest -q -m slow tests/e2e/test_console_live.py``.
"""

from __future__ import annotations

import asyncio
import io
import time

import nats
import pytest
from nats.js.api import StreamConfig
from rich.console import Console

from tandem.client import connect
from tandem.console.app import ConsoleApp
from tandem.console.screens.modals import ConfirmScreen, HelpScreen, ScaleScreen
from tandem.console.source import NatsSource
from tandem.console.state import LATENCY_METRICS
from tandem.services.common.service_metrics import ITL_BUCKETS, TTFT_BUCKETS
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import HistogramSnapshot, MetricsSnapshot, ScaleRequest, ScalingDecision
from tandem.shared.protocol.training import TimelineOp, TrainTimeline

pytestmark = pytest.mark.slow  # the console against a live system, screen by screen

SIZE = (150, 45)
PROMPT = "def walk(tree):\n    for child in tree.children:\n"  # 48 tokens: 3 full blocks
LIVE_PROMPT = PROMPT + "        yield from walk(child)\n"  # 79 tokens: 5 blocks, the last partial


def screen_text(app: ConsoleApp) -> str:
    """What the terminal shows now, as plain text."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def wait_for(pilot, predicate, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{screen_text(pilot.app)}"
        await pilot.pause(0.1)


async def shows(pilot, text: str, timeout_s: float = 15.0) -> None:
    await wait_for(pilot, lambda: text in screen_text(pilot.app), timeout_s, f"{text!r} on screen")


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(prefill=1, decode=1, kvstore=1)


async def test_unreachable_server_is_reported_and_every_pane_survives():
    app = ConsoleApp(NatsSource("nats://127.0.0.1:1"))
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, "NATS unreachable at nats://127.0.0.1:1")
        for key in "12345":
            await pilot.press(key)
            await shows(pilot, "not connected to NATS")
        await pilot.press("q")


async def test_no_url_says_how_to_start_one():
    app = ConsoleApp(NatsSource(None))
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, "no running `tandem up` found")


async def test_services_pane_lists_every_instance_and_filters(system):
    app = ConsoleApp(NatsSource(system.url))
    async with app.run_test(size=SIZE) as pilot:
        for name in system.processes:
            await shows(pilot, name)
        text = screen_text(app)
        assert "● connected" in text and "absent" not in text, text
        await pilot.press("slash", *"decode")
        await wait_for(pilot, lambda: system.instance("router") not in screen_text(app), what="filter hides the router")
        assert system.instance("decode") in screen_text(app)
        await pilot.press("escape")
        await shows(pilot, system.instance("router"))
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        assert "pause / resume" in screen_text(app)
        await pilot.press("escape")
        await pilot.press("p")
        await shows(pilot, "PAUSED")
        version = app.screen.seen_version
        app.state.changed()
        await pilot.pause(1.2)
        assert app.screen.seen_version == version, "a paused pane redrew"
        await pilot.press("p")
        await wait_for(pilot, lambda: "PAUSED" not in screen_text(app), what="resume")


async def test_absent_planner_and_trainer_are_named(system):
    app = ConsoleApp(NatsSource(system.url))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.state.discovered, what="discovery")
        await pilot.press("4")
        await shows(pilot, "no planner answered discovery")
        await pilot.press("3")
        await shows(pilot, "no trainer found")


async def test_block_table_routing_and_transfer_of_a_live_request(system):
    """A request handed from prefill to decode: its block table there, its routing decision, its hand-off."""
    decode_id, prefill_id = system.instance("decode"), system.instance("prefill")
    app = ConsoleApp(NatsSource(system.url))
    async with app.run_test(size=SIZE) as pilot, connect(system.url) as client:
        await client.complete(PROMPT, max_tokens=2, temperature=0, request_id="warm-0001")  # leaves cached blocks
        await pilot.press("2")
        await wait_for(pilot, lambda: app.state.selected_worker == ("decode", decode_id), what="decode chosen")
        stream = client.generate(LIVE_PROMPT, max_tokens=1900, temperature=0, ignore_eos=True, request_id="live-0001")
        first = asyncio.ensure_future(stream.__anext__())
        await shows(pilot, "live-0001")
        # the prompt's 5 blocks: 3 from the decode worker's own prefix cache (the warm-up's), 2 handed off
        await shows(pilot, "■ prefix cache 3   ■ hand-off 2   ■ here")
        assert f"{decode_id}: " in screen_text(app)
        assert "kvstore-" in screen_text(app) and "hit rate" in screen_text(app)
        await first
        await stream.aclose()  # cancels the request
        await pilot.press("5")
        await shows(pilot, "live-0001")
        assert decode_id in screen_text(app) and prefill_id in screen_text(app)
        await pilot.press("3")
        await wait_for(pilot, lambda: any(e.request_id == "live-0001" for e in app.state.transfers),
                       what="hand-off event")
        event = next(e for e in app.state.transfers if e.request_id == "live-0001")
        assert (event.source, event.dest, event.path) == (prefill_id, decode_id, "ring")
        assert event.blocks == 5 and event.end >= event.start
        store = system.instance("kvstore")  # the prompt's new full blocks were offered to the store
        await wait_for(pilot, lambda: any(e.path == "store" and e.dest == store for e in app.state.transfers),
                       what="a store transfer")
        await shows(pilot, "KV transfers (last")


@pytest.fixture
async def planner_stream(system):
    """The planner's stream, made here when no planner made it (removed again afterwards)."""
    nc = await nats.connect(system.url)
    js = nc.jetstream()
    try:
        await js.stream_info(subjects.PLANNER_STREAM)
        made = False
    except Exception:
        await js.add_stream(StreamConfig(name=subjects.PLANNER_STREAM, subjects=[subjects.PLANNER_DECISIONS]))
        made = True
    yield nc, js
    if made:
        await js.delete_stream(subjects.PLANNER_STREAM)
    await nc.close()


def histogram(fast: int, slow: int, bounds: tuple[float, ...]) -> HistogramSnapshot:
    """``fast`` observations of 30 ms and ``slow`` of 300 ms, in the services' own buckets (so they
    merge with the real workers' snapshots of the same metric)."""
    counts = [0] * (len(bounds) + 1)
    counts[next(i for i, b in enumerate(bounds) if b >= 0.03)] += fast
    counts[next(i for i, b in enumerate(bounds) if b >= 0.3)] += slow
    return HistogramSnapshot(bounds=list(bounds), counts=counts, sum=fast * 0.03 + slow * 0.3, count=fast + slow)


async def test_scaling_overlap_panes_and_a_confirmed_scale_request(system, planner_stream):
    nc, js = planner_stream
    base = 1_767_225_600.0
    for i, reason in enumerate(["history: TTFT p99 over target, add a prefill worker", "history: within targets"]):
        await js.publish(subjects.PLANNER_DECISIONS, encode(ScalingDecision(
            time=base + i, prefill_current=1, decode_current=1, prefill_wanted=1 + (i == 0), decode_wanted=1,
            reason=reason, inputs={"ttft_target_s": 0.5, "tpot_target_s": 0.05})))
    asked: list[ScaleRequest] = []

    async def stand_in_planner(msg) -> None:
        asked.append(decode(msg.data, ScaleRequest))
        await msg.respond(encode(Ack()))

    await nc.subscribe(subjects.PLANNER_SCALE, cb=stand_in_planner)
    app = ConsoleApp(NatsSource(system.url))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4")
        await shows(pilot, "history: TTFT p99 over target")
        await js.publish(subjects.PLANNER_DECISIONS, encode(ScalingDecision(
            time=base + 2, prefill_current=1, decode_current=1, prefill_wanted=1, decode_wanted=3,
            reason="live: add decode")))
        await shows(pilot, "live: add decode")
        for n in (1, 2, 3):  # cumulative histograms: each 2 s window adds a sparkline point
            await nc.publish(subjects.metrics("router", "test"), encode(MetricsSnapshot(
                service="router", instance_id="test", host="h", time=base + n,
                histograms={LATENCY_METRICS["ttft"]: histogram(10 * n, n, TTFT_BUCKETS),  # the services' names
                            LATENCY_METRICS["tpot"]: histogram(50 * n, 0, ITL_BUCKETS)})))
            await wait_for(pilot, lambda n=n: len(app.state.latency["ttft"].p50) >= n - 1, what=f"sample {n}")
        await shows(pilot, "TTFT p50 ")
        await shows(pilot, "target 500 ms")
        await pilot.press("s")
        await wait_for(pilot, lambda: isinstance(app.screen, ScaleScreen), what="scale form")
        app.screen.query_one("#decode").value = "2"
        await pilot.click("#next")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="confirmation")
        await pilot.press("y")
        await wait_for(pilot, lambda: bool(asked), what="the scale request")
        assert (asked[0].prefill, asked[0].decode) == (1, 2), asked
        await nc.publish(subjects.trainer_timeline("job1"), encode(TrainTimeline(job_id="job1", step=7, ops=[
            TimelineOp(lane="h2d", layer=0, phase="fwd", start_s=0.0, end_s=0.01, bytes=1 << 20),
            TimelineOp(lane="compute", layer=0, phase="fwd", start_s=0.005, end_s=0.02)], hidden_fraction=0.5)))
        await pilot.press("3")
        await shows(pilot, "hidden under compute 50%")
        await shows(pilot, "job job1 step 7")
        await pilot.press("plus")
        await shows(pilot, "zoom ×2")


async def test_drain_asks_first_and_a_no_keeps_the_worker(system):
    decode_id = system.instance("decode")
    app = ConsoleApp(NatsSource(system.url))
    async with app.run_test(size=SIZE) as pilot:
        await shows(pilot, decode_id)
        table = app.screen.query_one("#services")
        row = next(i for i in range(table.row_count) if table.get_row_at(i)[1] == decode_id)
        table.move_cursor(row=row)
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="confirmation")
        assert f"Drain decode worker {decode_id}?" in screen_text(app)
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmScreen), what="dialog closed")
        await pilot.pause(0.5)
        system.check_alive()

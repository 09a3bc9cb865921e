"""Pane 1, Services: every live instance found by ``$SRV.STATS`` discovery (every 2 s).

Columns: service, instance id, host, uptime, requests, errors, mean latency, LoRA adapters and last
error (the console's own polls left out; the front end's HTTP answers, from its metrics snapshots,
count too). A worker's LoRA column, from its heartbeats, reads ``used/slots`` and the names of the
adapters in its device slots, most recently used first ("-": no slots, ``--max-loras`` 0); below,
the highlighted instance's adapters in slots and in host memory and its ``metrics()`` figures. ``d``
drains the highlighted prefill or decode worker after a confirmation; Enter opens its block table.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.widget import Widget
from textual.widgets import DataTable, Static

from tandem.console.screens.base import PaneScreen, uptime
from tandem.console.screens.modals import ConfirmScreen
from tandem.console.state import WORKER_SERVICES, ConsoleState, ServiceRow

COLUMNS = ("service", "instance", "host", "uptime", "requests", "errors", "mean latency", "LoRA", "last error")
LORA_WIDTH = 20  # the LoRA column's most characters: the rest of the names are in the detail below


class ServicesScreen(PaneScreen):
    CSS_PATH = "services.tcss"
    SUB_TITLE = "1 Services"
    BINDINGS = [Binding("d", "drain", "Drain worker")]

    def compose_body(self) -> Iterable[Widget]:
        table = DataTable(id="services", cursor_type="row", zebra_stripes=True)
        table.add_columns(*COLUMNS)
        yield table
        yield Static(id="detail")

    def rows(self, state: ConsoleState) -> list[ServiceRow]:
        return [r for r in state.services if r.matches(self.filter_text)] if self.filter_text else state.services

    def notice(self, state: ConsoleState) -> str:
        if not state.services:
            return "no tandem service answered $SRV.STATS: start some (`tandem up`, `docker compose up`)"
        missing = [s for s in ("router", "prefill", "decode") if not state.has(s)]
        return f"absent: {', '.join(missing)} (no instance answered discovery)" if missing else ""

    def show(self, state: ConsoleState) -> None:
        table = self.query_one("#services", DataTable)
        selected = self.selected_row()
        table.clear()
        rows = self.rows(state)
        for row in rows:
            errors = Text(str(row.errors), "bold red" if row.errors else "")
            adapters = state.adapters.get(row.instance_id)
            lora = adapters.summary() if adapters is not None else "-"
            lora = lora if len(lora) <= LORA_WIDTH else lora[:LORA_WIDTH - 1] + "…"
            table.add_row(row.service, row.instance_id, row.host, uptime(state.now - row.started), str(row.requests),
                          errors, f"{row.mean_latency_s * 1e3:.1f} ms" if row.requests else "-", lora,
                          Text(row.last_error[:60], "red"), key=row.instance_id)
        keys = [r.instance_id for r in rows]
        if selected is not None and selected.instance_id in keys:
            table.move_cursor(row=keys.index(selected.instance_id), animate=False)
        self.show_detail()

    def selected_row(self) -> ServiceRow | None:
        table = self.query_one("#services", DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next((r for r in self.state.services if r.instance_id == key), None)

    @on(DataTable.RowHighlighted, "#services")
    def show_detail(self) -> None:
        row = self.selected_row()
        detail = self.query_one("#detail", Static)
        if row is None:
            detail.update("")
            return
        text = Text.assemble((f"{row.service} {row.instance_id}", "bold"), f"  version {row.version}  ")
        if row.service in WORKER_SERVICES:
            text.append("d drains it · Enter shows its block table", "grey50")
        text.append("\n")
        adapters = self.state.adapters.get(row.instance_id)
        if adapters is not None and adapters.slots:
            text.append("LoRA slots ", "grey50").append(f"{len(adapters.resident)}/{adapters.slots}   ")
            text.append("in slots ", "grey50").append(", ".join(reversed(adapters.resident)) or "-")
            text.append("   in host ", "grey50").append(", ".join(reversed(adapters.in_host)) or "-").append("\n")
        for name, value in sorted(row.data.items()):
            if name.startswith("adapters_"):  # names as the engine keeps them: shown above
                continue
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            text.append(f"{name} ", "grey50").append(f"{shown[:40]}   ")
        detail.update(text)

    @on(DataTable.RowSelected, "#services")
    def action_blocks(self) -> None:
        row = self.selected_row()
        if row is not None and row.service in WORKER_SERVICES:
            self.state.selected_worker = (row.service, row.instance_id)
            self.state.changed()
            self.app.switch_mode("blocks")

    @work(exclusive=True)
    async def action_drain(self) -> None:
        row = self.selected_row()
        if row is None or row.service not in WORKER_SERVICES:
            self.notify("pick a prefill or decode worker to drain", severity="warning")
            return
        question = (f"Drain {row.service} worker {row.instance_id}? It stops taking new requests, finishes the "
                    "ones it holds, then exits.")
        if not await self.app.push_screen_wait(ConfirmScreen(question)):
            self.notify("drain cancelled")
            return
        result = await self.app.source.drain(row.service, row.instance_id)
        self.notify(result, title="drain")

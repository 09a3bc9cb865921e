"""``tandem serve frontend``: the OpenAI-compatible HTTP API as one more service on the bus.

It registers with ``$SRV`` like every service (its ``http_url`` in the metadata), runs uvicorn on the
service's own event loop, and reaches the router through :class:`tandem.client.Client` over the
service's NATS connection, exactly as a library user does. It loads the model's tokenizer and chat
template (no weights, no torch) to turn chat messages into prompt tokens; the router tokenizes
completion prompts itself. Routes: :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import socket
import time

import uvicorn

from tandem.client import Client
from tandem.client.discovery import service_infos
from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.services.frontend.app import Frontend, ServedModel, build_app
from tandem.services.frontend.limits import HTTPLimits
from tandem.services.frontend.metrics import FrontendMetrics
from tandem.shared.infra.adapter_registry import AdapterRegistry
from tandem.shared.infra.config import Settings
from tandem.shared.model.meta import load_model_meta
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.text.chat_template import NO_TEMPLATE, ChatTemplateError, chat_template_for

ROUTER_MODELS_TTL_S = 2.0  # /v1/models asks the routers at most this often
STOP_TIMEOUT_S = 5.0


class QuietServer(uvicorn.Server):
    """uvicorn on a loop it does not own: the service's runtime handles SIGINT/SIGTERM (uvicorn would
    take them over and re-raise them after its own shutdown)."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    def capture_signals(self):  # uvicorn >= 0.29
        import contextlib

        return contextlib.nullcontext()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the service registers, so its URL (port 0: a free one) is
    known; a port in use ends the process with one line naming the flag."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: an SSE event is one small write, which Nagle would hold back
    # until the client acknowledges the previous one (a delayed ACK away).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"tandem serve frontend: cannot listen on {host}:{port} ({exc.strerror}); "
                         "pick another --http-port or --http-host") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class FrontendService(ServiceRuntime):
    name = "frontend"
    description = "tandem's OpenAI-compatible HTTP API"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.meta = load_model_meta(settings.model, data_dir=settings.data_dir)
        try:
            template, template_error = chat_template_for(self.meta.checkpoint, self.meta.name), ""
        except ChatTemplateError as exc:
            # A load error names server paths: clients get the gist, the log gets the detail.
            template = None
            template_error = NO_TEMPLATE if str(exc) == NO_TEMPLATE else (
                "this model's chat template does not load (the frontend's log says why); use /v1/completions")
            self.log.warning("chat: %s", exc)
        frontend_settings = settings.frontend
        self.model = ServedModel(frontend_settings.served_model_name or self.meta.name, self.meta.name,
                                 self.meta.tokenizer, template, template_error, spec=str(settings.model))
        self.sock = bind(frontend_settings.host, frontend_settings.port)
        host, port = self.sock.getsockname()[:2]
        shown = frontend_settings.host if frontend_settings.host not in ("0.0.0.0", "::") else socket.gethostname()
        self.http_url = f"http://{shown if ':' not in shown else f'[{shown}]'}:{port}"
        self.server: QuietServer | None = None
        self.server_task: asyncio.Task | None = None
        self.context: dict[str, int] = {}  # bus model -> max_model_len, from decode workers' heartbeats
        self._router_models: tuple[float, dict[str, int | None]] = (0.0, {})
        self.adapters = AdapterRegistry()

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "http_url": self.http_url, "model": self.meta.name,
                "served_model_name": self.model.served_name}

    def metrics(self) -> dict:
        return {"running": self.frontend.running if self.server else 0}

    async def setup(self) -> None:
        bus = self.settings.bus
        # router_restart_wait_s 0: with no router an HTTP client gets its 503 at once and retries by
        # itself (as OpenAI's clients do), while /health says unhealthy, instead of holding the request.
        client = Client(self.nc, request_timeout_s=bus.request_timeout_s, worker_timeout_s=bus.worker_timeout_s,
                        url=bus.nats_url or "", router_restart_wait_s=0.0)
        self.frontend = Frontend(client=client, model=self.model, api_key=self.settings.frontend.api_key,
                                 max_concurrent_requests=self.settings.frontend.max_concurrent_requests,
                                 router_models=self.router_models, max_model_len=self.context.get,
                                 router_alive=self.router_alive, limits=HTTPLimits.of(self.settings.frontend),
                                 metrics_page=self.prom.text, log=self.log, adapters=self.adapters,
                                 allow_runtime_lora_updating=self.settings.frontend.allow_runtime_lora_updating)
        self.frontend.metrics = FrontendMetrics(self.prom, lambda: self.frontend.running)
        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.on_beat)
        await self.adapters.follow(self.nc)
        config = uvicorn.Config(build_app(self.frontend), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = QuietServer(config)
        self.server_task = self.spawn(self.server.serve(sockets=[self.sock]), "HTTP server")
        self.log.info("HTTP API at %s (model %s as %r%s)", self.http_url, self.meta.name, self.model.served_name,
                      ", API key required" if self.settings.frontend.api_key else "")

    async def teardown(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self.server_task), STOP_TIMEOUT_S)
            except (TimeoutError, asyncio.CancelledError):
                self.server.force_exit = True
        await self.frontend.client.cancel_open()

    async def on_beat(self, msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except Exception:
            return
        if beat.service == "decode" and beat.max_model_len:
            self.context[beat.model] = beat.max_model_len

    async def router_models(self) -> dict[str, int | None]:
        """The models the running routers serve and their vocabulary sizes (from the routers'
        ``$SRV.INFO`` metadata), asked at most every ``ROUTER_MODELS_TTL_S``."""
        asked_at, models = self._router_models
        if time.monotonic() - asked_at > ROUTER_MODELS_TTL_S:
            models = {}
            for info in await service_infos(self.nc, wait_s=0.2, name="tandem-router"):
                meta = info.get("metadata", {})
                if meta.get("model"):
                    vocab = meta.get("vocab_size", "")
                    models[meta["model"]] = int(vocab) if vocab.isdigit() else None
            models = dict(sorted(models.items()))
            self._router_models = (time.monotonic(), models)
        return models

    async def router_alive(self) -> bool:
        try:
            await self.nc.request("$SRV.PING.tandem-router", b"", timeout=1.0)
        except Exception:
            return False
        return True


def main(settings: Settings) -> None:
    run_service(FrontendService(settings))

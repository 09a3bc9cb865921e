"""LoRA adapters over HTTP: vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

An adapter is asked for by its name in a request's ``model``; ``/v1/models`` lists each with the base
model as its ``parent``. Loading and unloading go to the routers on the bus (they check the adapter
against the served model and publish it to the fleet's registry), so every front end and router
serves the same adapters. As in vLLM, runtime loading is off unless the front end is started with
``--allow-runtime-lora-updating``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.services.frontend.errors import APIError, bad_request
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import AdapterRecord, LoadAdapter, UnloadAdapter
from tandem.shared.protocol.base import ErrorCode, ErrorReply, first_error
from tandem.shared.protocol.codec import decode, encode

ADAPTER_CONTROL_TIMEOUT_S = 30.0  # the router reads the adapter's header and waits for JetStream's ack


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's lora_int_id and the like: not needed here
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


def add_adapter_routes(app: FastAPI, frontend) -> None:  # noqa: ANN001 - app.Frontend
    def check_allowed() -> None:
        if not frontend.allow_runtime_lora_updating:
            raise APIError(404, "loading LoRA adapters at run time is off: start the front end with "
                                "--allow-runtime-lora-updating", "invalid_request_error", None, "not_found")

    async def ask_router(message: LoadAdapter | UnloadAdapter) -> AdapterRecord:
        try:
            reply = await frontend.client.nc.request(subjects.ADAPTERS_CONTROL, encode(message),
                                                     timeout=ADAPTER_CONTROL_TIMEOUT_S)
        except Exception as exc:
            raise APIError(503, f"no router answered ({type(exc).__name__}): is the router running?",
                           "service_unavailable_error", None, "no_workers") from None
        answer = decode(reply.data, (AdapterRecord, ErrorReply))
        if isinstance(answer, ErrorReply):
            status = 404 if answer.code is ErrorCode.UNKNOWN_MODEL else 400
            raise APIError(status, answer.message, "invalid_request_error", answer.param,
                           "model_not_found" if status == 404 else answer.code.value)
        if frontend.adapters is not None:
            frontend.adapters.apply(answer)  # served here at once; the registry stream says so later too
        return answer

    def checked(kind: type[BaseModel], body: dict, make):  # noqa: ANN001, ANN202
        try:
            return make(kind.model_validate(body))
        except ValidationError as exc:
            raise bad_request(first_error(exc), str(exc.errors()[0]["loc"][0])) from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: dict) -> PlainTextResponse:
        check_allowed()
        message = checked(LoadLoraAdapterRequest, body,
                          lambda b: LoadAdapter(name=b.lora_name, path=b.lora_path, source="api"))
        record = await ask_router(message)
        return PlainTextResponse(f"Success: LoRA adapter '{record.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: dict) -> PlainTextResponse:
        check_allowed()
        message = checked(UnloadLoraAdapterRequest, body, lambda b: UnloadAdapter(name=b.lora_name))
        record = await ask_router(message)
        return PlainTextResponse(f"Success: LoRA adapter '{record.name}' removed successfully.")

"""vLLM's routes that load and unload LoRA adapters while serving: `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`, only with `--lora-root` and only for paths under
it (`serve.lora.slots.AdapterSlots.register`). Requests already submitted with an unloaded adapter finish with
it."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from serve.http.protocol import ERROR_RESPONSES, STRICT, APIError
from serve.lora.slots import UnknownAdapter


class LoadLoRARequest(BaseModel):
    model_config = STRICT
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = STRICT
    lora_name: str


def lora_router(service, dependencies: list) -> APIRouter:
    """The two routes for `service` (the app's `serve.http.routes.Service`, whose `lora` has a root), with
    `dependencies` (the API key check)."""
    router = APIRouter(dependencies=dependencies, responses=ERROR_RESPONSES)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest):
        if body.lora_name == service.model_name or not body.lora_name:
            raise APIError(400, f"{body.lora_name!r} cannot name a LoRA adapter", param="lora_name")
        try:
            await service.off_loop(service.lora.register, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest):
        try:
            service.lora.unregister(body.lora_name)
        except UnknownAdapter:
            raise APIError(404, f"no LoRA adapter {body.lora_name!r} is served", param="lora_name",
                           code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router

"""LoRA adapters behind the server: the served adapters (selected by a request's ``model`` field,
listed by ``/v1/models`` with ``parent``), ``--lora-modules`` loaded at start-up, and
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (vLLM's routes and messages;
registered only with ``--allow-runtime-lora-updating`` or
``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` / vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any, Optional

from fastapi import APIRouter
from fastapi.responses import Response

from pagedllm.entrypoints.openai.cli_args import LoRAModulePath
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelPermission
from pagedllm.entrypoints.openai.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger("pagedllm.entrypoints.openai")

RUNTIME_ENV_VARS = ("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(args: Any) -> bool:
    """``--allow-runtime-lora-updating``, or one of ``RUNTIME_ENV_VARS`` set to true / 1."""
    if getattr(args, "allow_runtime_lora_updating", False):
        return True
    return any((os.environ.get(v) or "").strip().lower() in ("1", "true", "yes") for v in RUNTIME_ENV_VARS)


class LoRARegistry:
    """The adapters the server serves, by name (vLLM's ``OpenAIServingModels.lora_requests``).

    Each load gets a new ``lora_int_id`` (a reloaded adapter never reuses one: the engine's
    caches and prefix-cache hashes key on it). Loads and unloads are serialised.

    Args:
        engine: the engine (``add_lora`` / ``remove_lora``).
        base_model_names: the served base names (an adapter may not take one; the first is
            every adapter's default ``parent``).
        static_modules: ``--lora-modules``, loaded by ``init_static_loras``.
    """

    def __init__(self, engine: Any, base_model_names: list[str],
                 static_modules: Optional[list[LoRAModulePath]] = None) -> None:
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.static_modules = list(static_modules or [])
        self.lora_requests: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def get(self, name: Optional[str]) -> Any:
        """The ``LoRARequest`` served as ``name``, or None."""
        return self.lora_requests.get(name) if name else None

    def cards(self) -> list[ModelCard]:
        """``/v1/models`` entries of the adapters."""
        return [ModelCard(id=lr.lora_name, root=lr.lora_path,
                          parent=lr.base_model_name or self.base_model_names[0], permission=[ModelPermission()])
                for lr in self.lora_requests.values()]

    async def init_static_loras(self) -> None:
        """Load every ``--lora-modules`` adapter.

        Raises:
            ValueError: one cannot be loaded (the server does not start).
        """
        for m in self.static_modules:
            try:
                await self.load(LoadLoRAAdapterRequest(lora_name=m.name, lora_path=m.path), m.base_model_name)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from None

    async def load(self, request: LoadLoRAAdapterRequest, base_model_name: Optional[str] = None) -> str:
        """Load and serve an adapter; returns vLLM's success message.

        Raises:
            OpenAIError: 400 for a missing name/path, a name in use, or an adapter that cannot be
                loaded (404 when nothing is found at the path).
        """
        from pagedllm.lora.request import LoRARequest

        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", 400, None, "InvalidUserInput")
        async with self._lock:
            if name in self.lora_requests:
                raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name",
                                  "InvalidUserInput")
            if name in self.base_model_names:  # (requests naming it must keep meaning the base model)
                raise OpenAIError(f"The lora adapter name '{name}' is the served model's name; choose "
                                  "another name.", 400, "lora_name", "InvalidUserInput")
            lr = LoRARequest(name, next(self._ids), path,
                             base_model_name=base_model_name if base_model_name in self.base_model_names else None)
            try:
                await self.engine.add_lora(lr)
            except ValueError as e:
                found = "No adapter found" not in str(e)
                raise OpenAIError(str(e), 400 if found else 404, "lora_path") from None
            self.lora_requests[name] = lr
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter and unload it (requests already running with it finish with
        it); returns vLLM's success message.

        Raises:
            OpenAIError: 400 without a name or id, 404 for an adapter not served.
        """
        if not request.lora_name and not request.lora_int_id:
            raise OpenAIError("either 'lora_name' and 'lora_int_id' needs to be provided.", 400, None,
                              "InvalidUserInput")
        async with self._lock:
            lr = self.lora_requests.get(request.lora_name) if request.lora_name else next(
                (x for x in self.lora_requests.values() if x.lora_int_id == request.lora_int_id), None)
            if lr is None:
                raise OpenAIError(f"The lora adapter '{request.lora_name}' cannot be found.", 404, "lora_name")
            del self.lora_requests[lr.lora_name]
            await self.engine.remove_lora(lr.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", lr.lora_name)
        return f"Success: LoRA adapter '{lr.lora_name}' removed successfully."


def build_lora_router(loras: Optional[LoRARegistry], args: Any) -> APIRouter:
    """``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` when adapters are served
    (``loras``; None without --enable-lora) and runtime updates are allowed
    (``runtime_updating_allowed(args)``); else an empty router."""
    router = APIRouter()
    if loras is None or not runtime_updating_allowed(args):
        return router

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        return Response(content=await loras.load(request), status_code=200)

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        return Response(content=await loras.unload(request), status_code=200)

    return router

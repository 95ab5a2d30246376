"""Bodies of ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (vLLM's
``LoadLoRAAdapterRequest`` / ``UnloadLoRAAdapterRequest``)."""
from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None

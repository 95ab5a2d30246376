"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=False)
class LoRARequest:
    """A LoRA adapter, named for a request (``LLM.generate(..., lora_request=...)``).

    Attributes:
        lora_name: human-readable name (the server's ``model`` field selects an adapter by it).
        lora_int_id: globally unique integer id (>= 1) of this adapter: the engine's slot tables,
            CPU cache and prefix-cache hashes key on it, so two different adapters must never
            share an id (a reloaded adapter gets a new one).
        lora_path: directory in PEFT format (``adapter_config.json`` +
            ``adapter_model.safetensors`` or ``adapter_model.bin``).
        base_model_name: the served base model the adapter belongs to (``/v1/models`` lists it
            as the adapter's ``parent``); None = the first served name.

    Equality and hashing go by ``lora_name``, as vLLM's.

    Raises:
        ValueError: ``lora_int_id`` < 1, or an empty ``lora_name``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        self.lora_path = str(self.lora_path or "")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

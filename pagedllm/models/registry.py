"""HF ``architectures`` name -> model class."""
from __future__ import annotations

from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagedllm.models.granite import GraniteForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.olmoe import OlmoeForCausalLM
from pagedllm.models.olmo2 import Olmo2ForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def get_model_class(architectures: list[str]) -> type:
    """First supported class among ``architectures`` (a config's ``architectures`` list).

    Raises:
        ValueError: if none is supported; lists the supported names.
    """
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architectures {architectures}; supported: {sorted(MODEL_REGISTRY)}")

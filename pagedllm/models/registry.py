"""HF ``architectures`` name -> model class."""
from __future__ import annotations

from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagedllm.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from pagedllm.models.granite import GraniteForCausalLM
from pagedllm.models.idefics3 import Idefics3ForConditionalGeneration
from pagedllm.models.llava import LlavaForConditionalGeneration
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
from pagedllm.models.llava_next import LlavaNextForConditionalGeneration  # qwenvl
from pagedllm.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration  # qwenvl

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    # qwenvl
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
}


MODEL_IMPLS = ("auto", "pagedllm", "transformers")


def get_model_class(architectures: list[str], model_impl: str = "auto", config=None) -> type:
    """The model class for a config's ``architectures``.

    Args:
        architectures: the config's ``architectures`` list.
        model_impl: "auto" (the first native class, else the transformers fallback), "pagedllm" (native
            only) or "transformers" (``TransformersForCausalLM`` for any architecture transformers has).
        config: the config (needed to find transformers' class for the fallback).

    Raises:
        ValueError: an unknown ``model_impl``, or no class for the architectures (the message lists the
            native ones and says whether transformers knows the model).
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl: must be one of {list(MODEL_IMPLS)}, got {model_impl!r}")
    if model_impl != "transformers":
        for arch in architectures or []:
            if arch in MODEL_REGISTRY:
                return MODEL_REGISTRY[arch]
    fallback = None
    if model_impl != "pagedllm" and config is not None:
        from pagedllm.models.transformers_backend import TransformersForCausalLM, transformers_causal_lm_class

        if transformers_causal_lm_class(config) is not None:
            fallback = TransformersForCausalLM
    if fallback is not None:
        return fallback
    hint = ("" if model_impl == "pagedllm" else
            "; transformers has no causal-LM model for it either" if config is not None else "")
    raise ValueError(f"unsupported model architectures {architectures}; supported natively: "
                     f"{sorted(MODEL_REGISTRY)}{hint}")

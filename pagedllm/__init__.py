"""pagedllm: a paged-KV-cache LLM serving engine in PyTorch with vLLM's API.

``from pagedllm import LLM, SamplingParams``.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "PoolingRequestOutput", "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput",
           "EngineArgs", "RequestOutputKind", "PoolerConfig", "StructuredOutputsParams",
           "TextPrompt", "TokensPrompt", "PromptType", "LoRARequest", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]


def __getattr__(name: str):
    # Lazy imports keep `import pagedllm` (and the CLI's --help) fast.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM
        return LLM
    if name in ("SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "BeamSearchParams"):
        from pagedllm import sampling_params
        return getattr(sampling_params, name)
    if name in ("BeamSearchOutput", "BeamSearchSequence"):
        from pagedllm import beam_search
        return getattr(beam_search, name)
    if name == "PoolingParams":
        from pagedllm.pooling_params import PoolingParams
        return PoolingParams
    if name == "PoolerConfig":
        from pagedllm.pooling.config import PoolerConfig
        return PoolerConfig
    if name in ("RequestOutput", "CompletionOutput", "PoolingRequestOutput", "EmbeddingRequestOutput",
                "ClassificationRequestOutput", "ScoringRequestOutput"):
        from pagedllm import outputs
        return getattr(outputs, name)
    if name in ("TextPrompt", "TokensPrompt", "PromptType"):
        from pagedllm import inputs
        return getattr(inputs, name)
    if name == "LoRARequest":
        from pagedllm.lora.request import LoRARequest
        return LoRARequest
    if name == "EngineArgs":
        from pagedllm.config import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")

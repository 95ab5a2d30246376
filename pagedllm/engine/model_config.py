"""``ModelConfig``: the resolved model settings of a running engine, under vLLM's names.

vLLM users read ``llm.llm_engine.model_config`` (``max_model_len``, ``hf_config``, ``dtype``,
``get_vocab_size()``, ...); ``LLMEngine.model_config`` and ``AsyncLLM.model_config`` give the same
view here, built once after the engine has loaded the model and sized its KV cache. It is a
read-only record: changing a field changes nothing in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ModelConfig:
    """The model an engine serves, as loaded (vLLM's ``ModelConfig`` field names).

    Attributes:
        model: the model argument (path, GGUF file or known name) the engine was started with.
        tokenizer: the tokenizer argument (the model's own when not given).
        served_model_name: the first name the server answers to (``--served-model-name`` or the model).
        dtype: ``torch.dtype`` of the activations (``"auto"`` resolved).
        kv_cache_dtype: ``torch.dtype`` of the KV cache.
        max_model_len: most prompt + output tokens of one request (resolved: never None).
        hf_config: the model's ``transformers.PretrainedConfig`` (for a GGUF file, the one built
            from its metadata).
        quantization: the ``--quantization`` method, or None (a GGUF's blocks: "gguf").
        seed: the engine's sampling seed.
        runner_type: "generate" or "pooling".
        max_logprobs: most logprobs a request may ask for.
        tokenizer_revision / revision: as given (None when not).
        trust_remote_code: as given.
    """

    model: str
    tokenizer: Optional[str]
    served_model_name: str
    dtype: Any
    kv_cache_dtype: Any
    max_model_len: int
    hf_config: Any
    quantization: Optional[str]
    seed: Optional[int]
    runner_type: str
    max_logprobs: int
    revision: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    trust_remote_code: bool = False

    @property
    def hf_text_config(self) -> Any:
        """The language model's config: ``hf_config.text_config`` for an image-text model, else ``hf_config``."""
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    def _text(self, name: str, default: Any = None) -> Any:
        return getattr(self.hf_text_config, name, default)

    def get_vocab_size(self) -> int:
        """Rows of the embedding / LM head (``vocab_size`` of the text config)."""
        return int(self._text("vocab_size"))

    def get_hidden_size(self) -> int:
        """Width of the residual stream (``hidden_size``)."""
        return int(self._text("hidden_size"))

    def get_head_size(self) -> int:
        """Per-head width: ``head_dim`` when the config states it, else hidden_size / heads."""
        hd = self._text("head_dim")
        return int(hd) if hd else self.get_hidden_size() // int(self._text("num_attention_heads"))

    def get_num_layers(self, parallel_config: Any = None) -> int:
        """Decoder layers of the whole model (``parallel_config`` is accepted for vLLM's
        signature; with pipeline parallelism each stage holds a slice of these)."""
        return int(self._text("num_hidden_layers"))

    def get_total_num_kv_heads(self) -> int:
        """K/V heads of the model (``num_key_value_heads``, else the attention heads: MHA)."""
        return int(self._text("num_key_value_heads") or self._text("num_attention_heads"))

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        """Query heads per tensor-parallel rank (``num_attention_heads`` / tp size)."""
        return int(self._text("num_attention_heads")) // _tp(parallel_config)

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        """K/V heads per tensor-parallel rank (at least 1: replicated when tp > heads)."""
        return max(1, self.get_total_num_kv_heads() // _tp(parallel_config))

    def get_sliding_window(self) -> Optional[int]:
        """The sliding attention window in tokens, or None."""
        w = self._text("sliding_window")
        return int(w) if w else None

    @property
    def is_multimodal_model(self) -> bool:
        """Whether the config is an image-text model's (it has a ``vision_config``)."""
        return getattr(self.hf_config, "vision_config", None) is not None


def _tp(parallel_config: Any) -> int:
    return max(1, int(getattr(parallel_config, "tensor_parallel_size", 1) or 1))


def build_model_config(args: Any, core: Any) -> ModelConfig:
    """The ``ModelConfig`` of an ``EngineCore`` ``core`` started from ``EngineArgs`` ``args``
    (after ``core`` has loaded the model and sized its KV cache)."""
    names = args.served_model_name
    name = (names[0] if isinstance(names, (list, tuple)) and names else names) or args.model
    return ModelConfig(
        model=args.model, tokenizer=args.tokenizer, served_model_name=str(name), dtype=core.dtype,
        kv_cache_dtype=core.kv_cache_dtype, max_model_len=int(core.max_model_len), hf_config=core.hf_config,
        quantization=args.quantization, seed=args.seed, runner_type=args.runner, max_logprobs=args.max_logprobs,
        revision=args.revision, tokenizer_revision=args.tokenizer_revision, trust_remote_code=args.trust_remote_code)

"""A light model config for GGUF files: the attributes transformers' config class would have, without
importing transformers.

Why: `transformers.AutoConfig.for_model("llama", ...)` imports the model's configuration module, which (in
transformers 5.x) pulls in `transformers.activations` -> `core_model_loading` -> `torch.distributed.tensor`
-> `sympy`: about 1-1.5 s of a ~5 s start-up, for a handful of numbers read from the GGUF header.

`TextConfig(model_type, **kwargs)` takes the same keyword arguments as `AutoConfig.for_model(model_type,
**kwargs)` and ends up with the same instance attributes (names and values) as the transformers 5.24 config
classes `LlamaConfig`, `Gemma3TextConfig`, `Qwen2Config` and `Qwen3Config`:

- the class's field defaults (the tables below are those classes' dataclass fields);
- derived fields of their `__post_init__`: `head_dim` / `num_key_value_heads` defaults, Gemma 3's
  `layer_types` (every 6th layer full attention) and nested per-layer-type `rope_parameters`, Qwen's
  `sliding_window` (None unless `use_sliding_window`) and `layer_types`;
- `PreTrainedConfig`'s common attributes (`id2label` / `label2id` for 2 labels, `return_dict`, ...);
- the legacy `rope_theta` keyword moved into `rope_parameters` (`{"rope_type": "default", "rope_theta": ...}`);
- any other keyword set as an attribute (e.g. `unk_token_id`, or `head_dim` for Qwen2).

tests/loader/test_loader.py (`test_*config*`) checks this against transformers for both real GGUFs and
synthetic ones of each architecture. Anything transformers-specific beyond plain attributes (`to_dict()`, `save_pretrained`, a
transformers model built from the config) goes through `to_transformers()`, which builds the real config from
the same keyword arguments (importing transformers then).
"""

from __future__ import annotations

import copy
from typing import Any

# PreTrainedConfig (transformers 5.24) instance attributes common to every model.
_COMMON: dict[str, Any] = {
    "transformers_version": None,
    "architectures": None,
    "output_hidden_states": False,
    "return_dict": True,
    "dtype": None,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
    "id2label": {0: "LABEL_0", 1: "LABEL_1"},  # num_labels = 2 unless id2label is given
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "problem_type": None,
}

# Dataclass field defaults of each transformers config class (transformers 5.24, models/*/configuration_*.py).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
        "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
    },
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "initializer_range": 0.02,
        "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "layer_types": None, "attention_dropout": 0.0,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    },
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
        "attention_dropout": 0.0, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    },
}

SUPPORTED_MODEL_TYPES = frozenset(_DEFAULTS)

_DEFAULT_THETA = 10_000.0  # RotaryEmbeddingConfigMixin.default_theta
_GEMMA3_THETA = {"global": 1_000_000.0, "local": 10_000.0}  # Gemma3TextConfig.default_theta
_GEMMA3_SLIDING_PATTERN = 6  # Gemma3TextConfig: every 6th layer is full attention


def _standardize_rope(params: dict, max_position_embeddings: int) -> dict:
    """RotaryEmbeddingConfigMixin.standardize_rope_params on one (flat) rope dict, in place: `rope_type`
    (from a legacy `type`, else "default"), and `original_max_position_embeddings` for the scaled types."""
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    return params


class TextConfig:
    """Model config with transformers' attribute names and defaults, for GGUF models (see the module doc).

    Args:
        model_type: "llama", "gemma3_text", "qwen2" or "qwen3" (`SUPPORTED_MODEL_TYPES`).
        **kwargs: config fields as `AutoConfig.for_model(model_type, **kwargs)` takes them (`hidden_size`,
            `rope_theta`, `architectures`, `bos_token_id`, ...); unknown names become attributes as they are.

    Raises:
        ValueError: an unsupported model_type, or `hidden_size` not a multiple of `num_attention_heads`
            (Llama / Gemma 3, as transformers' `validate_architecture`).
    """

    def __init__(self, model_type: str, **kwargs: Any) -> None:
        if model_type not in _DEFAULTS:
            raise ValueError(f"TextConfig: model_type {model_type!r} not supported "
                             f"(supported: {sorted(_DEFAULTS)})")
        self._model_type = model_type
        self._init_kwargs = copy.deepcopy(kwargs)
        kwargs = dict(kwargs)
        fields = copy.deepcopy({**_COMMON, **_DEFAULTS[model_type]})
        for name in list(kwargs):
            if name in fields:
                fields[name] = kwargs.pop(name)
        self.__dict__.update(fields)
        if model_type == "gemma3_text":
            self._post_init_gemma3(kwargs)
        else:
            if model_type == "llama" and self.head_dim is None:
                self.head_dim = self.hidden_size // self.num_attention_heads
            if model_type in ("qwen2", "qwen3"):
                self.sliding_window = self.sliding_window if self.use_sliding_window else None
            if self.num_key_value_heads is None:
                self.num_key_value_heads = self.num_attention_heads
            if model_type in ("qwen2", "qwen3") and self.layer_types is None:
                self.layer_types = [
                    "sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
                    else "full_attention" for i in range(self.num_hidden_layers)]
            rope = kwargs.pop("rope_scaling", None) or self.rope_parameters
            rope = rope if rope is not None else {}
            rope.setdefault("rope_theta", kwargs.pop("rope_theta", _DEFAULT_THETA))
            partial = kwargs.pop("partial_rotary_factor", None)
            if partial is not None:
                rope.setdefault("partial_rotary_factor", partial)
                self.ignore_keys_at_rope_validation = {"partial_rotary_factor"}  # as transformers records it
            self.rope_parameters = _standardize_rope(rope, self.max_position_embeddings)
        if model_type in ("llama", "gemma3_text") and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({self.num_attention_heads}).")
        for name, value in kwargs.items():  # PreTrainedConfig: extra keywords become attributes
            setattr(self, name, value)

    def _post_init_gemma3(self, kwargs: dict) -> None:
        """Gemma3TextConfig.__post_init__ + convert_rope_params_to_dict; pops the rope keywords it uses
        (`sliding_window_pattern` stays, and becomes an attribute too, as in transformers)."""
        if self.use_bidirectional_attention:
            self.sliding_window = (self.sliding_window // 2) + 1
        self._sliding_window_pattern = kwargs.get("sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % self._sliding_window_pattern else "full_attention"
                for i in range(self.num_hidden_layers)]
        rope = self.rope_parameters
        if rope is None:
            rope = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
        rope_scaling = kwargs.pop("rope_scaling", None)
        if rope.get("full_attention") is None:
            rope["full_attention"] = {"rope_type": "default"}
        if rope_scaling is not None:  # transformers: scaling applies to the global (full-attention) layers
            rope["full_attention"].update(rope_scaling)
        rope["full_attention"].setdefault("rope_theta", kwargs.pop("rope_theta", _GEMMA3_THETA["global"]))
        if rope.get("sliding_attention") is None:
            rope["sliding_attention"] = {"rope_type": "default"}
        rope["sliding_attention"].setdefault("rope_theta",
                                             kwargs.pop("rope_local_base_freq", _GEMMA3_THETA["local"]))
        for layer_type in ("full_attention", "sliding_attention"):
            rope[layer_type] = _standardize_rope(rope[layer_type], self.max_position_embeddings)
        self.rope_parameters = rope

    @property
    def model_type(self) -> str:
        """transformers' model type, e.g. "llama", "gemma3_text"."""
        return self._model_type

    @property
    def rope_scaling(self) -> dict:
        """Legacy alias of `rope_parameters` (as transformers' read-only view of it)."""
        return self.rope_parameters

    @property
    def num_labels(self) -> int | None:
        """Number of classifier labels: `len(id2label)` (2 by default), None without id2label."""
        return len(self.id2label) if self.id2label is not None else None

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        # transformers' setter: a new count gets default names (LABEL_i) in id2label / label2id
        if self.id2label is None or len(self.id2label) != n:
            self.id2label = {i: f"LABEL_{i}" for i in range(int(n))}
            self.label2id = {f"LABEL_{i}": i for i in range(int(n))}

    @property
    def name_or_path(self) -> str:
        """Always "" (a config built from GGUF metadata, not loaded from a directory)."""
        return ""

    @property
    def output_attentions(self) -> bool:
        """Always False (transformers' default; pagedllm never returns attention maps)."""
        return False

    def to_transformers(self):
        """The equivalent transformers config (`AutoConfig.for_model(model_type, **kwargs)` with the keyword
        arguments this config was built from, `architectures` as currently set). Imports transformers."""
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(self._model_type, **copy.deepcopy(self._init_kwargs))
        cfg.architectures = copy.deepcopy(self.architectures)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """transformers' `to_dict()` of the equivalent config (config.json contents; imports transformers)."""
        return self.to_transformers().to_dict()

    def __repr__(self) -> str:
        public = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return f"TextConfig(model_type={self._model_type!r}, {public})"

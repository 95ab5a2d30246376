"""Request models of the Ollama-compatible API (``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``, ``/api/show``, ``/api/pull``).

Source: Ollama's API reference (``docs/api.md`` of github.com/ollama/ollama): field names,
``options`` (the Modelfile parameters), ``format`` ("json" or a JSON schema), ``keep_alive``,
``think``. Unknown fields are ignored with a logged warning naming them (``OpenAIBaseModel``).
"""
from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, ConfigDict, model_validator

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel

logger = logging.getLogger("pagedllm.entrypoints.openai")

# Ollama ``options`` this server maps to SamplingParams: option name -> SamplingParams-style name
# (ChatCompletionRequest field) it becomes.
MAPPED_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_predict": None,  # max_tokens, resolved against the prompt length (see OllamaOptions)
}

# Ollama options with no counterpart here (runner / llama.cpp settings, sampling methods this
# engine does not have): accepted and ignored, with one logged warning naming them.
IGNORED_OPTIONS = (
    "typical_p", "repeat_last_n", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta",
    "penalize_newline", "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram",
    "vocab_only", "use_mmap", "use_mlock", "num_thread", "logits_all", "embedding_only", "f16_kv",
)


class OllamaOptions(OpenAIBaseModel):
    """``options``: the Modelfile parameters a request may set (``MAPPED_OPTIONS`` are used,
    ``IGNORED_OPTIONS`` are accepted and ignored, others are ignored with a warning)."""

    model_config = ConfigDict(extra="allow")

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    num_predict: Optional[int] = None
    # prompt tokens kept from the start when a prompt over the context is truncated (Ollama's default 4)
    num_keep: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        # Known-but-unsupported options get their own warning, not the generic one.
        result = handler(data)
        if isinstance(data, dict):
            ignored = sorted(k for k in data if k in IGNORED_OPTIONS)
            unknown = sorted(k for k in data if k not in cls.model_fields and k not in IGNORED_OPTIONS)
            if ignored:
                logger.warning("Ollama options with no effect on this server (ignored): %s", ignored)
            if unknown:
                logger.warning("Unknown Ollama options (ignored): %s", unknown)
        return result

    def sampling_fields(self) -> dict[str, Any]:
        """The set options as ChatCompletionRequest sampling fields (num_predict excluded)."""
        out: dict[str, Any] = {}
        for name, target in MAPPED_OPTIONS.items():
            val = getattr(self, name)
            if target is not None and val is not None and name != "num_keep":
                out[target] = val
        return out


_GO_DURATION = re.compile(r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|\u00b5s|ms|s|m|h))+|[-+]?\d+(?:\.\d*)?")


def _check_keep_alive(v: Any) -> Any:
    """``keep_alive`` as Ollama reads it: a number of seconds (negative: forever) or a Go
    duration string ("5m", "1h30m", "-1", "0"); anything else is refused, as Ollama does."""
    if isinstance(v, str) and not _GO_DURATION.fullmatch(v.strip()):
        raise ValueError(f"invalid duration {v!r} (a number of seconds, or a duration such as \"5m\" or \"1h30m\")")
    return v


#: ``keep_alive`` of the Ollama routes (accepted; the model stays loaded either way).
KeepAlive = Annotated[Optional[Union[int, float, str]], AfterValidator(_check_keep_alive)]


class _OllamaBase(OpenAIBaseModel):
    """Shared by the generation routes: the model, ``options``, ``format``, ``keep_alive``."""

    model: str
    stream: Optional[bool] = True
    options: Optional[OllamaOptions] = None
    format: Optional[Union[str, dict[str, Any]]] = None
    keep_alive: KeepAlive = None
    think: Optional[Union[bool, str]] = None
    # a prompt over the context is cut to fit (older turns / the middle, as Ollama); false: a 400
    truncate: Optional[bool] = None
    shift: Optional[bool] = None  # accepted (no context shift here: the output stops at the context)
    # Newer Ollama fields: accepted; logprobs are not returned by these routes.
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    @model_validator(mode="after")
    def _check_format(self):
        if isinstance(self.format, str) and self.format not in ("", "json"):
            raise ValueError(f"format: must be \"json\" or a JSON schema object, got {self.format!r}")
        if isinstance(self.think, str) and self.think not in ("low", "medium", "high"):
            raise ValueError(f"think: must be true, false, \"low\", \"medium\" or \"high\", got {self.think!r}")
        return self


class OllamaMessage(OpenAIBaseModel):
    """One ``messages`` entry: role, content, and optionally thinking, images (refused: text
    only), tool_calls (``{"function": {"name", "arguments": {...}}}``) and tool_name."""

    role: str
    content: Optional[str] = ""
    thinking: Optional[str] = None
    images: Optional[list[Any]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None


class OllamaChatRequest(_OllamaBase):
    """``POST /api/chat``."""

    messages: Optional[list[OllamaMessage]] = None
    tools: Optional[list[dict[str, Any]]] = None


class OllamaGenerateRequest(_OllamaBase):
    """``POST /api/generate``."""

    prompt: Optional[str] = None
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = None
    raw: Optional[bool] = False
    images: Optional[list[Any]] = None


class OllamaEmbedRequest(OpenAIBaseModel):
    """``POST /api/embed``: ``input`` is a text or a list of texts."""

    model: str
    input: Union[str, list[str]]
    truncate: Optional[bool] = True
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None
    dimensions: Optional[int] = None


class OllamaEmbeddingsRequest(OpenAIBaseModel):
    """``POST /api/embeddings`` (legacy): one ``prompt``."""

    model: str
    prompt: str = ""
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None


class OllamaModelRequest(OpenAIBaseModel):
    """``POST /api/show`` / ``/api/pull``: ``model`` (or the older ``name``)."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: Optional[bool] = None
    stream: Optional[bool] = True
    insecure: Optional[bool] = None

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""

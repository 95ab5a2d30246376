"""Request/response models of the OpenAI-compatible API (OpenAI + vLLM field names)."""
from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pagedllm.inputs import InputValidationError

logger = logging.getLogger("pagedllm.entrypoints.openai")

# vLLM's fallbacks for sampling fields neither the request nor the model's generation config set.
_DEFAULT_SAMPLING_PARAMS = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}

# The most negative logprob the API reports (vLLM: -inf is reported as -9999.0).
MIN_LOGPROB = -9999.0


def clamp_logprob(x: Optional[float]) -> Optional[float]:
    """A logprob as strict-JSON-safe float (-inf / NaN -> -9999.0)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return MIN_LOGPROB
    return max(x, MIN_LOGPROB)


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI and vLLM do, with a logged warning
    # naming them (vLLM's OpenAIBaseModel.__log_extra_fields__), so a misspelt or unsupported
    # parameter is not dropped without a word.
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="null")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            known = set()
            for name, f in cls.model_fields.items():
                known.add(name)
                if f.alias:
                    known.add(f.alias)
            extra = sorted(str(k) for k in data if k not in known)
            if extra:
                logger.warning("The following fields were present in the request but ignored "
                               "(%s): %s", cls.__name__, extra)
        return result


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    """OpenAI ``stream_options``: a usage chunk is streamed only for ``include_usage: true``
    (absent = no usage, so ``stream_options: {}`` streams none); vLLM's
    ``continuous_usage_stats`` adds usage to every chunk, and only together with it."""

    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None

    @property
    def wants_usage(self) -> bool:
        return self.include_usage is True

    @property
    def wants_continuous_usage(self) -> bool:
        return self.include_usage is True and self.continuous_usage_stats is True


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """``response_format.json_schema`` (OpenAI): ``schema`` is the JSON schema itself."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: Optional[JsonSchemaResponseFormat] = None


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Sampling field handling common to completions and chat
# --------------------------------------------------------------------------------------------


# OpenAI's upper bound on `n`; a larger fan-out from one request could fill the queue.
MAX_N = 128


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    best_of: Optional[int] = None
    response_format: Optional[ResponseFormat] = None

    # vLLM structured outputs (see entrypoints/openai/structured_outputs.py)
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None

    # vLLM extra sampling fields
    use_beam_search: bool = False
    length_penalty: float = 1.0
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    cache_salt: Optional[str] = None
    request_id: Optional[str] = None
    # vLLM: disaggregated prefill/decode (P2pConnector; docs/kv_connector.md): to a prefiller
    # {"do_remote_decode": true}, to a decoder the prefill response's kv_transfer_params.
    kv_transfer_params: Optional[dict[str, Any]] = None
    echo: bool = False
    # vLLM: scheduling priority (lower runs first); nonzero needs --scheduling-policy priority.
    priority: int = 0

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` can only be defined when `stream=True`.")
        if self.stream and self.prompt_logprobs:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("`prompt_logprobs` must be a positive value.")
        if isinstance(self.n, int) and self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("`best_of` is not supported (must be unset or equal to `n`).")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError("`truncate_prompt_tokens` must be -1 or a non-negative integer.")
        return self

    def to_sampling_params(self, default_max_tokens: int, max_model_len: int,
                           default_sampling_params: Optional[dict] = None,
                           output_kind: Any = None) -> Any:
        """vLLM's ``CompletionRequest`` / ``ChatCompletionRequest.to_sampling_params``.

        Args:
            default_max_tokens: ``max_model_len - prompt_len``, used when max_tokens is null
                (capped by the generation config's ``max_tokens``).
            max_model_len: checks ``truncate_prompt_tokens``.
            default_sampling_params: the model's generation-config defaults.
            output_kind: a ``RequestOutputKind``; None = DELTA when streaming, else FINAL_ONLY.

        Raises:
            ValueError: a bad ``logit_bias`` key or ``truncate_prompt_tokens``.
        """
        max_tokens, logprobs, echo_logprobs = self._logprob_fields()
        defaults = default_sampling_params or {}
        if max_tokens is None:
            max_tokens = min(default_max_tokens, defaults.get("max_tokens", default_max_tokens))
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = echo_logprobs
        self.resolve_truncation(max_model_len)
        return self._build_sampling_params(
            max_tokens=self._engine_max_tokens(max_tokens),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            default_sampling_params=default_sampling_params,
            output_kind=output_kind,
        )

    def _logprob_fields(self) -> tuple[Optional[int], Optional[int], Optional[int]]:
        """The endpoint's ``(max_tokens as requested (None = unset), logprobs (top-k count or
        None), the prompt logprobs an echo asks for)``."""
        raise NotImplementedError

    def _engine_max_tokens(self, max_tokens: int) -> int:
        """The engine's max_tokens for the resolved ``max_tokens`` (the same, by default)."""
        return max_tokens

    def _build_sampling_params(self, *, max_tokens: int, logprobs: Optional[int],
                               prompt_logprobs: Optional[int],
                               default_sampling_params: Optional[dict],
                               output_kind: Any = None) -> Any:
        from pagedllm.sampling_params import RequestOutputKind, SamplingParams

        defaults = dict(default_sampling_params or {})
        kwargs: dict[str, Any] = {}
        # Fields the request may leave unset: the model's generation config, then vLLM defaults.
        for name, fallback in _DEFAULT_SAMPLING_PARAMS.items():
            val = getattr(self, name)
            if val is None:
                val = defaults.get(name, fallback)
            kwargs[name] = val
        logit_bias = None
        if self.logit_bias:
            logit_bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"Found token_id `{k}` in logit_bias but token_id must be an "
                                     "integer or string representing an integer") from None
                if math.isnan(float(v)):
                    raise InputValidationError(f"logit_bias: the bias of token {k} is NaN; biases are numbers "
                                               "from -100 to 100", "logit_bias")
                # OpenAI and vLLM clamp biases to [-100, 100].
                logit_bias[tok] = min(100.0, max(-100.0, float(v)))
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if output_kind is None:
            output_kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        kwargs.update(
            n=self.n,
            presence_penalty=self.presence_penalty if self.presence_penalty is not None else 0.0,
            frequency_penalty=self.frequency_penalty if self.frequency_penalty is not None else 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            output_kind=output_kind,
        )
        if logit_bias:
            kwargs["logit_bias"] = logit_bias
        if self.allowed_token_ids is not None:
            kwargs["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words:
            kwargs["bad_words"] = list(self.bad_words)
        if self.kv_transfer_params is not None:  # vLLM carries it the same way
            kwargs["extra_args"] = {"kv_transfer_params": dict(self.kv_transfer_params)}
        from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_from_request
        so = structured_outputs_from_request(self)
        if so is not None:
            kwargs["structured_outputs"] = so
        return SamplingParams(**kwargs)

    def resolve_truncation(self, max_model_len: int) -> Optional[int]:
        """Number of prompt tokens to keep (the last ones), or None for no truncation."""
        t = self.truncate_prompt_tokens
        if t is None:
            return None
        if t == -1:
            return max_model_len
        if t > max_model_len:
            raise ValueError(f"truncate_prompt_tokens value ({t}) is greater than max_model_len "
                             f"({max_model_len}). Please select a smaller truncation size.")
        return t


class _ResponseHead(OpenAIBaseModel):
    """The leading fields of a completions or chat response and of their stream chunks, in vLLM's
    order: each response class sets the ``id`` prefix, ``object`` and the ``choices`` type (a
    redeclared field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]


class _ResponseFields(_ResponseHead):
    """A whole (non-streamed) response."""

    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    kv_transfer_params: Optional[dict[str, Any]] = None  # vLLM: a prefill's hand-off to the decoder


class _StreamResponseFields(_ResponseHead):
    """A streamed chunk: ``usage`` only in the usage chunk or with continuous usage stats."""

    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    # vLLM: prompt may be left out when prompt_embeds are given (both: the embeddings prompts first).
    prompt: Optional[Union[str, list[str], list[int], list[list[int]]]] = None
    # base64 of torch.save(tensor (seq_len, hidden_size)), or a list of them (--enable-prompt-embeds).
    prompt_embeds: Optional[Union[str, list[str]]] = None
    echo: bool = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self):
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("`logprobs` must be a positive value.")
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("At least one of `prompt` or `prompt_embeds` must be set.")
        return self

    def _logprob_fields(self) -> tuple[Optional[int], Optional[int], Optional[int]]:
        return self.max_tokens, self.logprobs, self.logprobs

    def _engine_max_tokens(self, max_tokens: int) -> int:
        # NOTE: echo with max_tokens=0 still runs one step (the prompt's logprobs); the server
        # drops the generated token.
        return 1 if self.echo and max_tokens == 0 else max_tokens


class InfillExtraChunk(OpenAIBaseModel):
    """One ``input_extra`` context chunk of llama.cpp's ``/infill``."""

    filename: str = ""
    text: str = ""


class InfillRequest(OpenAIBaseModel):
    """llama.cpp server's ``POST /infill`` body: ``input_prefix`` <gap> ``input_suffix``, with
    ``input_extra`` context chunks and ``prompt`` (text already written after ``<FIM_MID>``);
    the sampling options are ``/completion``'s (``n_predict`` = max tokens, -1 = up to the
    context length)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillExtraChunk] = Field(default_factory=list)
    prompt: str = ""
    model: Optional[str] = None
    n_predict: int = -1
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    stream: bool = False
    return_tokens: bool = False

    @model_validator(mode="after")
    def _check_infill(self):
        if self.n_predict < -1:
            raise ValueError("n_predict must be -1 (no limit) or >= 0.")
        return self

    def to_completion_request(self, prompt_token_ids: list[int]) -> "CompletionRequest":
        """The equivalent ``/v1/completions`` request over the already laid-out FIM ids."""
        seed = None if self.seed is None or self.seed < 0 else self.seed  # llama.cpp: -1 = random
        return CompletionRequest(
            prompt=prompt_token_ids, model=self.model,
            max_tokens=None if self.n_predict < 0 else self.n_predict, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=seed, stop=self.stop, stream=self.stream, return_token_ids=True)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionResponse(_ResponseFields):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionStreamResponse(_StreamResponseFields):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    choices: list[CompletionResponseStreamChoice]


# --------------------------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------------------------


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    # An assistant turn's reasoning, as this server's responses carry it (both names, vLLM's):
    # a client may send a conversation back unchanged; templates see it under both names.
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    def text_content(self) -> Optional[str]:
        """The content as a string (text parts joined with newlines, as vLLM does)."""
        c = self.content
        if c is None or isinstance(c, str):
            return c
        texts = []
        for part in c:
            ptype = part.get("type")
            if ptype in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("A text content part must have a string `text` field.")
                texts.append(text)
            elif ptype == "refusal":
                texts.append(str(part.get("refusal", "")))
            elif ptype in ("image_url", "input_image", "image", "image_pil"):
                continue  # NOTE: images have no text (decoded when the chat is rendered)
            else:
                raise ValueError(f"Unsupported content part type in `messages`: {ptype!r} "
                                 "(this server accepts text only).")
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    max_tokens: Optional[int] = Field(default=None, description="Deprecated: use max_completion_tokens.")
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    # Checked by the server (tool_calling.py): it knows the tool-call parser. Unset with
    # tools = "auto" (vLLM); parallel_tool_calls=false keeps at most one call (OpenAI default true).
    tool_choice: Optional[Union[str, dict[str, Any]]] = "none"
    parallel_tool_calls: Optional[bool] = True
    include_reasoning: bool = True

    # vLLM chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError("`top_logprobs` must be a positive value.")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                             "to True.")
        if not self.messages:
            raise ValueError("`messages` must contain at least one message.")
        return self

    def _logprob_fields(self) -> tuple[Optional[int], Optional[int], Optional[int]]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return max_tokens, (self.top_logprobs or 0) if self.logprobs else None, self.top_logprobs


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None  # vLLM's newer name of reasoning_content (same text)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = MIN_LOGPROB
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(_ResponseFields):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None
    prompt_token_ids: Optional[list[int]] = None


class DeltaMessage(OpenAIBaseModel):
    """A stream chunk's ``delta``: serialized with only the fields it carries (``None`` and an
    empty ``tool_calls`` left out), as OpenAI and vLLM send them (``{"content": "Hi"}``)."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _only_present(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None and not (k == "tool_calls" and not v)}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionStreamResponse(_StreamResponseFields):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]


# --------------------------------------------------------------------------------------------
# /tokenize, /detokenize
# --------------------------------------------------------------------------------------------


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None

    @model_validator(mode="after")
    def _check(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                             "to True.")
        return self


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

"""Prompt -> token ids, and every check that must fail before a request reaches the core.

The one input path of the engine (vLLM v1's ``Processor``): the offline ``LLM``, ``AsyncLLM``
and the HTTP server all turn a prompt and its parameters into an ``EngineCoreRequest`` through
``InputProcessor.process_inputs``, so a prompt gets the same token ids, and a bad input the same
error, whichever way it came in. Errors are ``InputValidationError`` (a ValueError) naming the
field in ``param``; the server answers them with an OpenAI-style 400 carrying that ``param``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.engine.core_request import EngineCoreRequest
from pagedllm.inputs import InputValidationError as InputValidationError  # re-exported (chat, multimodal)


@dataclass
class ProcessedPrompt:
    """A validated prompt.

    Attributes:
        prompt: the text (None when given as token ids only; after truncation, the text of the
            kept ids).
        prompt_token_ids: token ids the engine computes (after truncation).
        cache_salt: optional prefix-cache salt.
        prompt_embeds: for a prompt given as embeddings, the checked ``[n, hidden]`` tensor in
            the model dtype (``prompt_token_ids`` are then ``n`` placeholder zeros), else None.
        prompt_embeds_hash: sha256 hex digest of ``prompt_embeds`` (dtype, shape and bytes).
        mm_features: the prompt's images (``pagedllm.multimodal.MultiModalFeature``), or None.
    """

    prompt: Optional[str]
    prompt_token_ids: list[int]
    cache_salt: Optional[str] = None
    prompt_embeds: Any = None
    prompt_embeds_hash: Optional[str] = None
    mm_features: Optional[list[Any]] = None


class InputProcessor:
    """Tokenizes and validates prompts and parameters.

    Args:
        tokenizer: a transformers tokenizer.
        max_model_len: max prompt + output tokens (int).
        vocab_size: model vocabulary size (token ids must be < this).
        max_logprobs: engine cap on ``logprobs`` / ``prompt_logprobs``.
        runner: "generate" or "pooling" (what the loaded model does).
        pooler: the model's Pooler (``prepare_params(params, task)``, ``task``), None for a
            generation model.
        eos_token_id: the tokenizer's EOS id, copied into every EngineCoreRequest.
        scheduling_policy: the engine's "fcfs" or "priority" (a nonzero ``priority`` needs the latter).
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, max_logprobs: int = 20, *,
                 runner: str = "generate", pooler: Any = None, eos_token_id: Optional[int] = None,
                 scheduling_policy: str = "fcfs") -> None:
        self.scheduling_policy = scheduling_policy
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.runner = runner
        self.pooler = pooler
        self.eos_token_id = eos_token_id
        # (hidden_size, model dtype) once ``enable_prompt_embeds`` was called, else None.
        self.prompt_embeds_spec: Optional[tuple[int, Any]] = None
        # ``pagedllm.multimodal.processing.ImageProcessor`` of an image-text model, else None.
        self.image_processor: Any = None

    def enable_prompt_embeds(self, hidden_size: int, dtype: Any) -> None:
        """Accept ``{"prompt_embeds": tensor}`` prompts of width ``hidden_size``, cast to ``dtype``
        (the engine's ``enable_prompt_embeds``)."""
        self.prompt_embeds_spec = (int(hidden_size), dtype)

    def check_prompt_embeds(self, embeds: Any) -> Any:
        """The checked embeddings of an embeddings prompt: a float tensor ``(seq_len, hidden_size)``
        (a leading batch dimension of 1 is dropped, a sparse tensor made dense), cast to the model
        dtype, on the CPU, contiguous.

        Raises:
            InputValidationError: param "prompt_embeds": prompt embeddings not enabled, not a
                tensor, wrong rank or width, not a floating dtype, empty, NaN or infinite values.
        """
        import torch

        if self.prompt_embeds_spec is None:
            raise InputValidationError("You must set `--enable-prompt-embeds` to input `prompt_embeds` "
                                       "(enable_prompt_embeds=True offline).", "prompt_embeds")
        hidden, dtype = self.prompt_embeds_spec
        if not isinstance(embeds, torch.Tensor):
            raise InputValidationError(f"prompt_embeds: must be a torch.Tensor of shape (seq_len, {hidden}), got "
                                       f"{type(embeds).__name__}", "prompt_embeds")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.dim() != 2:
            raise InputValidationError(f"prompt_embeds: must have shape (seq_len, {hidden}), got "
                                       f"{tuple(embeds.shape)}", "prompt_embeds")
        if embeds.shape[1] != hidden:
            raise InputValidationError(f"prompt_embeds: the model's hidden size is {hidden}, got embeddings of "
                                       f"width {embeds.shape[1]} (shape {tuple(embeds.shape)})", "prompt_embeds")
        if not embeds.dtype.is_floating_point:
            raise InputValidationError(f"prompt_embeds: must be a floating-point tensor (float32, bfloat16, "
                                       f"float16), got {embeds.dtype}", "prompt_embeds")
        if embeds.shape[0] == 0:
            raise InputValidationError("The prompt cannot be empty.", "prompt_embeds")
        if embeds.layout != torch.strided:
            embeds = embeds.to_dense()
        embeds = embeds.detach().to("cpu")
        if not bool(torch.isfinite(embeds).all()):
            raise InputValidationError("prompt_embeds: contains NaN or infinite values", "prompt_embeds")
        return embeds.to(dtype).contiguous()

    def _embeds_prompt(self, embeds: Any, truncate_prompt_tokens: Optional[int], strict_length: bool,
                       cache_salt: Optional[str]) -> ProcessedPrompt:
        import hashlib

        e = self.check_prompt_embeds(embeds)
        keep = self.resolve_truncation(truncate_prompt_tokens)
        if keep is not None and e.shape[0] > keep:
            e = e[-keep:].contiguous()
        try:
            self.check_prompt_length(int(e.shape[0]), strict_length)
        except InputValidationError as err:
            err.param = "prompt_embeds"
            raise
        h = hashlib.sha256(f"{e.dtype}{tuple(e.shape)}".encode())
        h.update(e.view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return ProcessedPrompt(None, [0] * int(e.shape[0]), cache_salt, e, h.hexdigest())

    # ------------------------------------------------------------------ prompts
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Raises:
            InputValidationError: text the tokenizer cannot encode (e.g. a lone UTF-16
                surrogate, which JSON allows but UTF-8 cannot encode); param "prompt".
        """
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, UnicodeError) as e:
            raise InputValidationError(f"The input text cannot be tokenized (invalid Unicode?): {e}",
                                       "prompt") from None

    def check_token_ids(self, ids: Any, field: str = "prompt_token_ids", param: str = "prompt") -> None:
        """Every id an int in ``[0, vocab_size)``.

        Raises:
            InputValidationError: naming ``field`` in the message and ``param`` as the field.
        """
        v = self.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise InputValidationError(f"{field}: must be a list of integers, got {t!r}", param)
            if t < 0 or t >= v:
                raise InputValidationError(
                    f"{field}: token id {t} is out of vocabulary (vocab size {v}; valid ids are 0..{v - 1})",
                    param)

    def resolve_truncation(self, truncate_prompt_tokens: Optional[int]) -> Optional[int]:
        """Prompt tokens to keep (the last ones), or None: ``-1`` means ``max_model_len``.

        Raises:
            InputValidationError: 0, below -1, or over ``max_model_len`` (vLLM's checks).
        """
        t = truncate_prompt_tokens
        if t is None:
            return None
        if isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1):
            raise InputValidationError(f"truncate_prompt_tokens must be >= 1 or -1, got {t}.",
                                       "truncate_prompt_tokens")
        if t == -1:
            return self.max_model_len
        if t > self.max_model_len:
            raise InputValidationError(
                f"truncate_prompt_tokens value ({t}) is greater than max_model_len ({self.max_model_len}). "
                "Please select a smaller truncation size.", "truncate_prompt_tokens")
        return t

    def check_prompt_length(self, n: int, strict_length: bool = False) -> None:
        """A prompt of ``n`` tokens fits: ``n <= max_model_len`` (``n < max_model_len`` with
        ``strict_length``, where output must fit too).

        Raises:
            InputValidationError: empty, or too long (the message gives both lengths); param "prompt".
        """
        mml = self.max_model_len
        if n == 0:
            raise InputValidationError("The prompt cannot be empty.", "prompt")
        if n > mml:
            raise InputValidationError(
                f"This model's maximum context length is {mml} tokens (max_model_len). However, your "
                f"request has {n} input tokens: the prompt is longer than the maximum model length. "
                "Please reduce the length of the input.", "prompt")
        if strict_length and n == mml:
            raise _no_room(n, mml)

    def process_prompt(self, prompt: Any, truncate_prompt_tokens: Optional[int] = None,
                       add_special_tokens: bool = True, *, strict_length: bool = False) -> ProcessedPrompt:
        """Accept a string, a ``TextPrompt`` (``{"prompt": str}``) or a ``TokensPrompt``
        (``{"prompt_token_ids": [...]}``), see ``pagedllm.inputs``.

        Args:
            truncate_prompt_tokens: keep only the last k tokens (-1 = max_model_len).
            add_special_tokens: tokenizer flag for text (False for chat-templated text).
            strict_length: the prompt must leave room for output (the HTTP server's rule).

        Raises:
            InputValidationError: wrong type, a dict key pagedllm does not take (e.g.
                ``multi_modal_data``), empty prompt, token id outside ``[0, vocab_size)``, a bad
                ``truncate_prompt_tokens``, or a prompt longer than ``max_model_len``.
        """
        cache_salt = None
        text: Optional[str] = None
        from_text = False
        images = getattr(prompt, "images", None)  # a chat prompt with image parts (engine.chat)
        if images:
            # NOTE: templated text carries its special tokens
            prompt, add_special_tokens = {"prompt": str(prompt), "multi_modal_data": {"image": images}}, False
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            return self._mm_prompt(prompt, truncate_prompt_tokens, add_special_tokens, strict_length)
        if isinstance(prompt, str):
            text, from_text = prompt, True
            ids = self.tokenize(prompt, add_special_tokens) if prompt else []
        elif isinstance(prompt, dict):
            from pagedllm.inputs import PROMPT_KEYS
            unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
            if unknown:
                raise InputValidationError(
                    f"prompt: unsupported key(s) {unknown} in a dict prompt; a TextPrompt / TokensPrompt "
                    f"takes {sorted(PROMPT_KEYS)}", "prompt")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None:
                check_cache_salt(cache_salt)
            if "prompt_embeds" in prompt:
                if "prompt_token_ids" in prompt:
                    raise InputValidationError("prompt: give prompt_embeds or prompt_token_ids, not both",
                                               "prompt_embeds")
                return self._embeds_prompt(prompt["prompt_embeds"], truncate_prompt_tokens, strict_length,
                                           cache_salt)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
                if not isinstance(ids, (list, tuple)):
                    raise InputValidationError("prompt_token_ids: must be a list of integers", "prompt")
                ids = list(ids)
                self.check_token_ids(ids)
            elif "prompt" in prompt:
                text, from_text = prompt["prompt"], True
                if not isinstance(text, str):
                    raise InputValidationError("prompt: must be a string", "prompt")
                ids = self.tokenize(text, add_special_tokens) if text else []
            else:
                raise InputValidationError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'",
                                           "prompt")
        else:
            raise InputValidationError(
                f"prompt: must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}", "prompt")
        if not ids:
            raise InputValidationError("The prompt cannot be empty.", "prompt")
        if from_text:
            # NOTE: a tokenizer may have added tokens past the model's vocabulary (embedding rows).
            self.check_token_ids(ids)
        keep = self.resolve_truncation(truncate_prompt_tokens)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            if text is not None:
                # NOTE: the text of what the model sees (echo, RequestOutput.prompt), not the input.
                text = self.tokenizer.decode(ids)
        self.check_prompt_length(len(ids), strict_length)
        return ProcessedPrompt(text, ids, cache_salt)

    def _mm_prompt(self, prompt: dict[str, Any], truncate: Optional[int], add_special_tokens: bool,
                   strict_length: bool) -> ProcessedPrompt:
        """A ``TextPrompt`` with ``multi_modal_data``: the HF processor expands each image's
        placeholder; the ids may not be truncated (an image run cannot be cut).

        Raises:
            InputValidationError: a text-only model, a modality other than "image", too many
                images, bad images, a prompt without text, or one over ``max_model_len``.
        """
        from pagedllm.inputs import PROMPT_KEYS

        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise InputValidationError(f"prompt: unsupported key(s) {unknown} in a dict prompt", "prompt")
        mmd = prompt["multi_modal_data"]
        if self.image_processor is None:
            raise InputValidationError("multi_modal_data: this model does not take images (a text-only model)",
                                       "multi_modal_data")
        if not isinstance(mmd, dict) or set(mmd) - {"image"}:
            raise InputValidationError("multi_modal_data: only the 'image' modality is supported, as "
                                       "{'image': PIL.Image or a list of them}", "multi_modal_data")
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt:
            raise InputValidationError("multi_modal_data: needs a text 'prompt' (not prompt_token_ids)", "prompt")
        cache_salt = prompt.get("cache_salt")
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        imgs = mmd.get("image")
        imgs = [] if imgs is None else list(imgs) if isinstance(imgs, (list, tuple)) else [imgs]
        kw = prompt.get("mm_processor_kwargs")
        if kw is not None and not isinstance(kw, dict):
            raise InputValidationError("mm_processor_kwargs: must be a dict", "mm_processor_kwargs")
        ids, feats = self.image_processor.process(text, imgs, add_special_tokens, kw)
        self.check_token_ids(ids)
        keep = self.resolve_truncation(truncate)
        if keep is not None and len(ids) > keep:
            raise InputValidationError("truncate_prompt_tokens: a prompt with images cannot be truncated",
                                       "truncate_prompt_tokens")
        self.check_prompt_length(len(ids), strict_length)
        return ProcessedPrompt(text, ids, cache_salt, mm_features=feats or None)

    # ------------------------------------------------------------------ parameters
    def process_sampling_params(self, params: Any, prompt_len: int, strict_length: bool = False) -> Any:
        """Validate ``params`` against the engine and fill ``max_tokens``.

        Args:
            params: SamplingParams (already self-validated on construction).
            prompt_len: tokens in the prompt.
            strict_length: True for the HTTP server: prompt + max_tokens over max_model_len is
                an error (as vLLM's OpenAI server); offline, generation stops at max_model_len.

        Returns:
            a clone of ``params`` with ``max_tokens`` set.

        Raises:
            InputValidationError / ValueError: logprobs over ``max_logprobs``, ids outside the
                vocabulary, or (strict) a request that cannot fit in ``max_model_len``.
        """
        params = params.clone()
        for name in ("logprobs", "prompt_logprobs"):
            val = getattr(params, name)
            if val is not None and val > self.max_logprobs:
                raise InputValidationError(
                    f"Requested {name} of {val}, which is greater than max allowed: {self.max_logprobs}.", name)
        params.verify_against_vocab(self.vocab_size)
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            if room < 1:
                raise _no_room(prompt_len, self.max_model_len)
            params.max_tokens = room
        elif strict_length and params.max_tokens > room:
            raise InputValidationError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} "
                f"in the completion). Please reduce the length of the messages or completion.", "max_tokens")
        if params.min_tokens and params.max_tokens is not None and params.min_tokens > params.max_tokens:
            raise InputValidationError(
                f"min_tokens: must be <= max_tokens={params.max_tokens}, got {params.min_tokens}", "min_tokens")
        if getattr(params, "bad_words", None):
            params.update_from_tokenizer(self.tokenizer)
        return params

    def default_pooling_task(self, params: Any = None) -> str:
        """``params.task`` if set, else the model's ("embed" or "classify")."""
        return getattr(params, "task", None) or (self.pooler.task if self.pooler is not None else "embed")

    def process_pooling_params(self, params: Any, task: Optional[str] = None) -> Any:
        """A verified PoolingParams clone for ``task`` (default: ``default_pooling_task``).

        Raises:
            InputValidationError / ValueError: a generation model, a task this model does not
                serve or a parameter the task does not take.
        """
        task = task or self.default_pooling_task(params)
        if self.pooler is None:
            raise InputValidationError(
                f"this model is not a pooling model (loaded with runner={self.runner!r}); {task} needs "
                "runner='pooling' (--runner pooling)", "model")
        return self.pooler.prepare_params(params, task)

    # ------------------------------------------------------------------ the one entry point
    def process_inputs(self, request_id: str, prompt: Any, params: Any, *, arrival_time: Optional[float] = None,
                       cache_salt: Optional[str] = None, lora_request: Any = None, priority: int = 0,
                       task: Optional[str] = None, add_special_tokens: bool = True,
                       strict_length: bool = False) -> EngineCoreRequest:
        """Validate one request and build its ``EngineCoreRequest``.

        Args:
            request_id: the request's id.
            prompt: a str, TextPrompt or TokensPrompt (``pagedllm.inputs``), or a
                ``ProcessedPrompt`` already checked by ``process_prompt``.
            params: SamplingParams (generation) or PoolingParams (pooling; None = defaults
                when ``task`` is given).
            arrival_time: ``time.time()`` seconds (default: now).
            cache_salt: prefix-cache salt (overrides the prompt dict's).
            lora_request: the LoRA adapter, passed through.
            priority: scheduling priority, an int (lower runs first); must be 0 unless
                ``scheduling_policy`` is "priority".
            task: pooling task ("embed", "classify", "score", "encode", "token_embed",
                "token_classify"); default ``params.task``, else the model's.
            add_special_tokens: tokenizer flag for text prompts.
            strict_length: prompt + max_tokens must fit in max_model_len (the HTTP server).

        Returns:
            the EngineCoreRequest (params cloned: ``max_tokens`` filled, or the pooling defaults).

        Raises:
            InputValidationError / ValueError: naming the offending field; nothing is added.
        """
        from pagedllm.pooling_params import PoolingParams

        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InputValidationError(f"priority: expected an integer, got {priority!r}", "priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InputValidationError(
                f"priority: got {priority}, but priority scheduling is not enabled (the scheduling policy "
                "is first-come-first-served; start the engine with --scheduling-policy priority, or "
                "leave priority at 0)", "priority")
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        pooling = isinstance(params, PoolingParams) or (params is None and task is not None)
        if pooling:
            pooling_params = self.process_pooling_params(params, task)
            pp = self._prompt(prompt, pooling_params.truncate_prompt_tokens, add_special_tokens, False)
            if pp.prompt_embeds is not None:
                raise InputValidationError("prompt_embeds: only for generation requests", "prompt_embeds")
            sampling_params = None
        else:
            if params is None:
                raise InputValidationError("sampling_params: needed for a generation request", "sampling_params")
            if self.runner == "pooling":
                raise InputValidationError(
                    "this model was loaded with runner='pooling' and does not generate text; use "
                    "embed/encode/classify/score, or load it with runner='generate'", "model")
            pp = self._prompt(prompt, getattr(params, "truncate_prompt_tokens", None), add_special_tokens,
                              strict_length)
            if pp.prompt_embeds is not None and getattr(params, "prompt_logprobs", None) is not None:
                raise InputValidationError("prompt_logprobs: not available for a prompt given as prompt_embeds "
                                           "(it has no token ids)", "prompt_logprobs")
            sampling_params = self.process_sampling_params(params, len(pp.prompt_token_ids), strict_length)
            pooling_params = None
        kw: dict[str, Any] = {} if arrival_time is None else {"arrival_time": arrival_time}
        return EngineCoreRequest(
            request_id=request_id, prompt_token_ids=list(pp.prompt_token_ids), sampling_params=sampling_params,
            pooling_params=pooling_params, eos_token_id=self.eos_token_id, prompt=pp.prompt,
            cache_salt=cache_salt if cache_salt is not None else pp.cache_salt, lora_request=lora_request,
            priority=priority, prompt_embeds=pp.prompt_embeds, prompt_embeds_hash=pp.prompt_embeds_hash,
            mm_features=pp.mm_features, **kw)

    def _prompt(self, prompt: Any, truncate: Optional[int], add_special_tokens: bool,
                strict_length: bool) -> ProcessedPrompt:
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        return self.process_prompt(prompt, truncate, add_special_tokens, strict_length=strict_length)


def check_cache_salt(salt: Any) -> None:
    """Raises InputValidationError unless ``salt`` is a non-empty string (vLLM's rule)."""
    if not isinstance(salt, str) or not salt:
        raise InputValidationError("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")


def _no_room(n: int, mml: int) -> InputValidationError:
    return InputValidationError(
        f"This model's maximum context length is {mml} tokens (max_model_len). However, your request "
        f"has {n} input tokens, which leave no room for output tokens. Please reduce the length of the "
        "input.", "prompt")

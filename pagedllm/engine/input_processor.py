"""Prompt -> token ids, and every check that must fail before a request reaches the core."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ProcessedPrompt:
    """A validated prompt.

    Attributes:
        prompt: the text (None when given as token ids only).
        prompt_token_ids: token ids the engine computes (after truncation).
        cache_salt: optional prefix-cache salt.
    """

    prompt: Optional[str]
    prompt_token_ids: list[int]
    cache_salt: Optional[str] = None


class InputProcessor:
    """Tokenizes and validates prompts and parameters.

    Args:
        tokenizer: a transformers tokenizer.
        max_model_len: max prompt + output tokens (int).
        vocab_size: model vocabulary size (token ids must be < this).
        max_logprobs: engine cap on ``logprobs`` / ``prompt_logprobs``.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def process_prompt(self, prompt: Any, truncate_prompt_tokens: Optional[int] = None,
                       add_special_tokens: bool = True) -> ProcessedPrompt:
        """Accept a string, a ``TextPrompt`` (``{"prompt": str}``) or a ``TokensPrompt``
        (``{"prompt_token_ids": [...]}``), see ``pagedllm.inputs``.

        Raises:
            ValueError: wrong type, a dict key pagedllm does not take (e.g. ``multi_modal_data``),
                empty prompt, token id outside ``[0, vocab_size)``, or a prompt longer than
                ``max_model_len`` (the message gives both lengths).
        """
        cache_salt = None
        text: Optional[str] = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt, add_special_tokens) if prompt else []
        elif isinstance(prompt, dict):
            from pagedllm.inputs import PROMPT_KEYS
            unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt: unsupported key(s) {unknown} in a dict prompt; a TextPrompt / "
                                 f"TokensPrompt takes {sorted(PROMPT_KEYS)}")
            cache_salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids: must be a list of integers")
                ids = list(ids)
            elif "prompt" in prompt:
                text = prompt["prompt"]
                if not isinstance(text, str):
                    raise ValueError("prompt: must be a string")
                ids = self.tokenize(text, add_special_tokens) if text else []
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            raise ValueError(f"prompt: must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: the prompt is empty (0 tokens); at least one token is required")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is out of vocabulary (valid ids are 0..{self.vocab_size - 1})")
        if truncate_prompt_tokens is not None and truncate_prompt_tokens != -1:
            if truncate_prompt_tokens < 1:
                raise ValueError(f"truncate_prompt_tokens: must be >= 1 or -1, got {truncate_prompt_tokens}")
            ids = ids[-truncate_prompt_tokens:]
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt: the prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{self.max_model_len} tokens (max_model_len)")
        return ProcessedPrompt(text, ids, cache_salt)

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
            ValueError: logprobs over ``max_logprobs``, ids outside the vocabulary, or (strict)
                a request that cannot fit in ``max_model_len``.
        """
        from pagedllm.sampling_params import validate_logprobs

        params = params.clone()
        validate_logprobs(params, self.max_logprobs)
        params.verify_against_vocab(self.vocab_size)
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            if room < 1:
                raise ValueError(
                    f"prompt: the prompt (length {prompt_len}) leaves no room for output tokens in "
                    f"max_model_len {self.max_model_len}")
            params.max_tokens = room
        elif strict_length and params.max_tokens > room:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the messages, {params.max_tokens} "
                f"in the completion). Please reduce the length of the messages or completion.")
        if params.min_tokens and params.max_tokens is not None and params.min_tokens > params.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens={params.max_tokens}, got {params.min_tokens}")
        if getattr(params, "bad_words", None):
            params.update_from_tokenizer(self.tokenizer)
        return params

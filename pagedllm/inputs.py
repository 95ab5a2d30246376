"""Prompt types of the offline API, with vLLM's names (``vllm.inputs``).

    from pagedllm.inputs import TextPrompt, TokensPrompt
    llm.embed([TokensPrompt(prompt_token_ids=[2, 651, 2134]), TextPrompt(prompt="Hello")])

They are ``TypedDict``s: a plain dict with the same keys is the same prompt. Every call that
takes a prompt (``LLM.generate``, ``encode``, ``embed``, ``classify``, ``score``, ``AsyncLLM``)
accepts a ``str``, a ``TextPrompt`` or a ``TokensPrompt``. Pure Python.
"""
from __future__ import annotations

from typing import Any, NotRequired, Optional, TypedDict, Union


class InputValidationError(ValueError):
    """A bad request input, raised where it is found (sampling params, prompts, ...).

    Attributes:
        param: the request field it is about ("prompt", "max_tokens", "logprobs", ...; the
            server may rename it for its endpoint: "messages" for chat, "input" for Responses);
            the server's 400 body names it as ``param``.
    """

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param

__all__ = ["TextPrompt", "TokensPrompt", "EmbedsPrompt", "SingletonPrompt", "PromptType", "PROMPT_KEYS"]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (with the tokenizer's special tokens).

    Keys:
        prompt: the text.
        cache_salt: optional string mixed into the first prefix-cache block hash, so only
            requests with the same salt share cached blocks.
        multi_modal_data: ``{"image": PIL.Image or list of them}`` for an image-text model (vLLM's
            key); the prompt marks each image with the processor's placeholder (Gemma 3:
            ``<start_of_image>``).
        mm_processor_kwargs: kwargs for the HF processor of this prompt.
    """

    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict]
    mm_processor_kwargs: NotRequired[dict]


class TokensPrompt(TypedDict):
    """A prompt given as token ids, used exactly as given (no special tokens added).

    Keys:
        prompt_token_ids: the token ids (ints in ``[0, vocab_size)``).
        prompt: optional text the ids came from (only reported back in outputs).
        cache_salt: as in ``TextPrompt``.
    """

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """A prompt given as embeddings (vLLM's ``EmbedsPrompt``), fed to the model in place of the
    token embeddings; needs ``enable_prompt_embeds=True`` (generation only).

    Keys:
        prompt_embeds: a float ``torch.Tensor`` of shape ``(seq_len, hidden_size)`` (a leading
            batch dimension of 1 is accepted), cast to the model dtype.
        cache_salt: as in ``TextPrompt``.
    """

    prompt_embeds: Any
    cache_salt: NotRequired[str]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt, EmbedsPrompt]
"""One prompt: a string (= ``TextPrompt(prompt=...)``), a TextPrompt, TokensPrompt or EmbedsPrompt."""

PromptType = SingletonPrompt
"""Anything the engine takes as one prompt (vLLM also has encoder-decoder prompts; pagedllm
serves decoder-only models)."""

# Keys a dict prompt may have (anything else, e.g. vLLM's multi_modal_data, is refused).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "prompt_embeds", "cache_salt", "multi_modal_data",
                         "mm_processor_kwargs"})

"""Chat templates through the tokenizer's own ``apply_chat_template`` (transformers)."""
from __future__ import annotations

from typing import Any, Optional


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Flatten OpenAI text-part content (``[{"type": "text", "text": ...}]``) into strings.

    Raises:
        ValueError: empty ``messages``, a message without a role, or a non-text part.
    """
    if not messages:
        raise ValueError("messages: must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: each message needs a 'role'")
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for p in c:
                if isinstance(p, dict) and p.get("type") == "text":
                    parts.append(p.get("text", ""))
                elif isinstance(p, str):
                    parts.append(p)
                else:
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
            m["content"] = "\n".join(parts)
        elif c is None:
            m["content"] = ""
        out.append(m)
    return out


def map_developer_role(messages: list[dict], template: Optional[str]) -> list[dict]:
    """OpenAI's ``developer`` role (what newer OpenAI models call the ``system`` message) as
    ``system`` when the chat template does not mention it.

    A template that does not know the role renders such a message as an unknown turn and, as
    it then sees no system message, adds its default system prompt too (SmolLM2: 41 prompt
    tokens for a developer message vs 19 for the same system message). Templates that name
    ``developer`` (e.g. gpt-oss / harmony ones) get the messages unchanged.

    Args:
        messages: chat messages (dicts with a ``role``); not modified.
        template: the Jinja source that will render them (None = unknown: no mapping).

    Returns:
        the messages, with ``developer`` roles replaced by ``system`` where needed.
    """
    if not template or "developer" in template:
        return messages
    return [dict(m, role="system") if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in messages]


def apply_chat_template(tokenizer: Any, messages: list[dict], chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: Optional[dict] = None) -> str:
    """Render ``messages`` with the model's (or the given) Jinja chat template.

    Returns:
        the prompt text (tokenize it without adding special tokens: the template has them).

    Raises:
        ValueError: no chat template, empty messages, or both ``add_generation_prompt`` and
            ``continue_final_message`` set (as vLLM).
    """
    messages = normalize_messages(messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "chat_template: this model's tokenizer has no chat template; pass chat_template= "
            "(or --chat-template) to use chat")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True")
    messages = map_developer_role(messages, template)
    kwargs = dict(chat_template_kwargs or {})
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **kwargs)

"""Chat templates through the tokenizer's own ``apply_chat_template`` (transformers).

The one place a conversation becomes prompt text, for ``LLM.chat`` and every chat-shaped HTTP
endpoint (chat completions, Responses, Anthropic messages, /tokenize), and the one loader of a
``--chat-template`` / ``EngineArgs.chat_template`` value. Errors are ``InputValidationError``
(a ValueError) with ``param`` "messages" or "chat_template".
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from pagedllm.engine.input_processor import InputValidationError

# Content parts rendered as text (OpenAI chat: "text"; Responses: "input_text" / "output_text").
_TEXT_PARTS = ("text", "input_text", "output_text")
# Image content parts (OpenAI chat: "image_url"; Responses: "input_image"; vLLM offline: "image_pil";
# HF templates' own: "image"), rendered as the template's image part ``{"type": "image"}``.
_IMAGE_PARTS = ("image_url", "input_image", "image_pil", "image")


class ChatPrompt(str):
    """A rendered chat prompt (a str) with the conversation's images, in order (``images``:
    RGB ``PIL.Image`` list); the input processor feeds them to the model's processor."""

    images: list[Any] = []


class ImageCollector:
    """Decodes a conversation's image parts (``pagedllm.multimodal.media.load_image_part``) under
    ``media`` (a ``MediaConnector``) and keeps them in order; passed to ``render_chat`` for a
    model that takes images."""

    def __init__(self, media: Any) -> None:
        self.media = media
        self.images: list[Any] = []

    def add(self, part: dict[str, Any], field: str) -> None:
        from pagedllm.multimodal.media import load_image_part

        self.images.append(load_image_part(part, self.media, field))


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """A ``--chat-template`` value: the path of a file holding a Jinja template, or the template
    itself (vLLM's ``load_chat_template``: a value with none of ``{``, ``}``, newline that is no
    readable file is a path that failed to open). A path that does not exist but whose file name
    is one of the templates shipped in ``pagedllm/entrypoints/openai/chat_templates/`` (with or
    without ``.jinja``) loads that one, so the README's
    ``--chat-template pagedllm/entrypoints/openai/chat_templates/NAME.jinja`` works from any
    directory (and ``--chat-template NAME`` too).

    Raises:
        ValueError: a value that looks like a path but cannot be read.
    """
    if value is None:
        return None
    try:
        if len(value) < 4096 and os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                return f.read()
        shipped = packaged_chat_template(value)
        if shipped is not None:
            with open(shipped, encoding="utf-8") as f:
                return f.read()
    except OSError:
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise InputValidationError(f"chat_template: {value!r} is neither a readable file nor a Jinja template "
                               "string.", "chat_template")


def packaged_chat_template(value: str) -> Optional[str]:
    """The path of the template shipped with pagedllm that ``value`` names (its file name, with or
    without ``.jinja``; a value with ``{``, ``}`` or a newline is a template, not a name), else None."""
    if not value or len(value) > 512 or any(c in value for c in "{}\n"):
        return None
    name = os.path.basename(value)
    if not name.endswith(".jinja"):
        name += ".jinja"
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints", "openai",
                        "chat_templates", name)
    return path if os.path.isfile(path) else None


def normalize_messages(messages: list[dict[str, Any]], images: Optional[ImageCollector] = None) -> list[dict[str, Any]]:
    """Copies of the messages with OpenAI content parts (``[{"type": "text", "text": ...}]``,
    also ``input_text`` / ``output_text`` / ``refusal``) joined into one string (newlines
    between parts, as vLLM) and ``None`` content as "". An assistant message's reasoning
    (``reasoning``, vLLM's newer name, or ``reasoning_content``) is set under both names, as
    vLLM does, so a template reading either sees it.

    A message with image parts keeps a list content (``{"type": "text", "text": ...}`` and
    ``{"type": "image"}`` parts, the layout HF chat templates read); the images go to ``images``
    (None: the model takes no images, and an image part is an error).

    Raises:
        InputValidationError: empty ``messages``, a message without a role, an unknown part, an
            image part for a text-only model, or an image that cannot be loaded.
    """
    if not messages:
        raise InputValidationError("messages: must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InputValidationError(f"messages[{i}]: each message needs a 'role'", "messages")
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            parts: list[Any] = []
            has_image = False
            for j, p in enumerate(c):
                ptype = p.get("type") if isinstance(p, dict) else None
                if ptype in _IMAGE_PARTS:
                    if images is None:
                        raise InputValidationError(
                            f"messages[{i}].content[{j}]: this model does not take images (a text-only model)",
                            "messages")
                    images.add(p, f"messages[{i}].content[{j}]")
                    parts.append({"type": "image"})
                    has_image = True
                elif isinstance(p, str):
                    parts.append(p)
                elif ptype in _TEXT_PARTS:
                    if not isinstance(p.get("text"), str):
                        raise InputValidationError(
                            f"messages[{i}].content: a text content part must have a string `text` field.",
                            "messages")
                    parts.append(p["text"])
                elif ptype == "refusal":
                    parts.append(str(p.get("refusal", "")))
                else:
                    raise InputValidationError(
                        f"messages[{i}].content: unsupported content part type {ptype!r} (only text parts "
                        "are supported)", "messages")
            if has_image:
                m["content"] = [q if isinstance(q, dict) else {"type": "text", "text": q} for q in parts]
            else:
                m["content"] = "\n".join(parts)
        elif c is None:
            if m.get("role") in ("user", "system", "developer", "tool"):  # (OpenAI, vLLM: required)
                raise InputValidationError(f"messages[{i}].content: a {m['role']} message needs `content` "
                                           "(a string or a list of content parts)", "messages")
            m["content"] = ""
        if m.get("role") == "assistant":
            reasoning = m.get("reasoning")
            if not isinstance(reasoning, str):
                reasoning = m.get("reasoning_content")
            if isinstance(reasoning, str):
                m["reasoning"] = m["reasoning_content"] = reasoning
        out.append(m)
    return out


def prepare_tool_history(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check the tool turns of a conversation (template-ready dicts, modified in place) and parse
    assistant ``tool_calls[].function.arguments`` JSON texts into objects (what chat templates
    expect, as vLLM does).

    Raises:
        InputValidationError: a ``tool`` message without ``tool_call_id``, a malformed
            ``tool_calls`` entry, or arguments that are not a JSON object (param "messages").
    """
    for i, m in enumerate(conv):
        role = m.get("role")
        if role == "tool" and not m.get("tool_call_id"):
            raise InputValidationError(f"messages[{i}]: a `tool` message must have a `tool_call_id` (the id "
                                       "of the assistant tool call it answers).", "messages")
        calls = m.get("tool_calls")
        if not calls:
            continue
        if role != "assistant":
            raise InputValidationError(f"messages[{i}]: only assistant messages may have `tool_calls`.",
                                       "messages")
        fixed = []
        for j, c in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InputValidationError(f"{where} must be {{\"id\", \"type\": \"function\", "
                                           "\"function\": {\"name\", \"arguments\"}}.", "messages")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise InputValidationError(f"{where}.function.arguments is not valid JSON: {e}",
                                               "messages") from None
            if not isinstance(args, dict):
                raise InputValidationError(f"{where}.function.arguments must be a JSON object.", "messages")
            c = dict(c)
            c["function"] = dict(fn, arguments=args)
            c.setdefault("type", "function")
            fixed.append(c)
        m["tool_calls"] = fixed
    return conv


def map_developer_role(messages: list[dict[str, Any]], template: Optional[str]) -> list[dict[str, Any]]:
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


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, chat_template: Optional[str] = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Optional[dict[str, Any]] = None, tools: Optional[list[dict[str, Any]]] = None,
                documents: Optional[list[dict[str, Any]]] = None, images: Optional[ImageCollector] = None) -> str:
    """Render a conversation with the given Jinja template, else the tokenizer's.

    ``images``: the collector of a model that takes images (see ``normalize_messages``); when the
    conversation has any, the result is a ``ChatPrompt`` carrying them.

    Steps: content parts joined (``normalize_messages``), tool turns checked and their
    arguments parsed (``prepare_tool_history``), ``developer`` mapped to ``system`` for
    templates without it; ``chat_template_kwargs`` override ``add_generation_prompt`` /
    ``continue_final_message`` (vLLM); ``tools`` (OpenAI function tools, already checked) and
    ``documents`` are passed to the template.

    Returns:
        the prompt text (tokenize it without adding special tokens: the template has them).

    Raises:
        InputValidationError: no chat template ("chat_template"); empty messages, both
            ``add_generation_prompt`` and ``continue_final_message``, ``continue_final_message``
            without a final assistant message, bad tool turns, or a template that fails to
            render ("messages").
    """
    conv = prepare_tool_history(normalize_messages(messages, images))
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputValidationError(
            "chat_template: this model's tokenizer has no chat template; pass chat_template= "
            "(or --chat-template) to use chat", "chat_template")
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message}
    kwargs.update(chat_template_kwargs or {})
    kwargs["tokenize"] = False
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise InputValidationError("continue_final_message: cannot be combined with add_generation_prompt=True",
                                   "messages")
    if kwargs["continue_final_message"] and conv[-1].get("role") != "assistant":
        raise InputValidationError("continue_final_message is set but the final message is not an "
                                   "assistant message.", "messages")
    conv = map_developer_role(conv, template if isinstance(template, str) else None)
    if tools:
        kwargs["tools"] = tools
    if documents:
        kwargs["documents"] = documents
    if chat_template:
        kwargs["chat_template"] = chat_template
    try:
        rendered = tokenizer.apply_chat_template(conv, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise InputValidationError(f"Could not apply the chat template: {e}", "messages") from e
    except Exception as e:  # jinja2 errors (TemplateError, UndefinedError, ...)
        raise InputValidationError(f"Could not apply the chat template: {e.__class__.__name__}: {e}",
                                   "messages") from e
    # (some tokenizers return a list for batched input)
    text: str = rendered if isinstance(rendered, str) else rendered[0]
    if images is not None and images.images:
        text = ChatPrompt(text)
        text.images = list(images.images)
    return text


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """``render_chat`` with positional arguments (the offline API's older helper).

    Raises:
        InputValidationError: see ``render_chat``.
    """
    return render_chat(tokenizer, messages, chat_template=chat_template,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message,
                       chat_template_kwargs=chat_template_kwargs)

"""The Ollama-compatible API, beside the OpenAI one (``app.include_router(build_ollama_router(...))``).

Routes (Ollama's ``docs/api.md`` shapes; durations in nanoseconds):
    POST /api/chat         messages (system / user / assistant / tool; assistant ``tool_calls``
                           with object ``arguments``; ``tool_name``), tools, think -> NDJSON
                           ``{"model", "created_at", "message": {"role", "content", "thinking"?,
                           "tool_calls"?}, "done": false}`` lines, then a final line with
                           ``done: true``, ``done_reason`` and the counts and durations
                           (``stream: false``: one JSON object, the whole message in it).
    POST /api/generate     prompt, system, template (Go-template subset: ``.System``, ``.Prompt``,
                           ``.Response``, ``if`` / ``else`` / ``end``), raw, context -> the same
                           with ``response`` instead of ``message`` (and ``thinking``); the final
                           object carries ``context`` (prompt + output token ids) unless raw.
    POST /api/embed        input (text or list), truncate (cut the end to fit), dimensions ->
                           ``{"model", "embeddings", "total_duration", "load_duration",
                           "prompt_eval_count"}`` (L2-normalised); a pooling model only.
    POST /api/embeddings   legacy: prompt -> ``{"embedding"}`` (not normalised, as Ollama).
    GET  /api/tags         the served model(s) as ``name:latest``, with details.
    POST /api/show         modelfile, parameters, template, details, model_info, capabilities.
    GET  /api/ps           the loaded model(s).
    GET  /api/version      ``{"version"}``: the Ollama API version these routes follow.
    POST /api/pull         success for the served model (nothing to download), 404 otherwise.
    HEAD /, GET / (non-browser)   "Ollama is running" (what Ollama clients probe; a browser's
                           ``GET /`` gets the web chat page instead, see ``pagedllm.entrypoints.web``).

Generation runs on the chat path (``OpenAIServingChat``: chat template, tools, reasoning parser,
structured outputs, the engine's input checks) as ``/v1/chat/completions`` does. ``options`` map
to SamplingParams: temperature, top_p, top_k, min_p, seed, stop, repeat_penalty
(repetition_penalty), presence_penalty, frequency_penalty, num_predict (max tokens: -1 / -2 /
unset = up to the context length; larger values are capped there too, ending with
``done_reason: "length"``). ``format: "json"`` constrains the output to a JSON object, a schema
to that schema. ``keep_alive`` is accepted (the model stays loaded). Model names: a served name,
with or without ``:latest``. Errors: ``{"error": "..."}`` with 400 (bad request), 404 (unknown
model or route), 501 (model management this server does not do).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import inspect
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.responses import StreamingResponse

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError, value_error_to_openai
from pagedllm.entrypoints.openai.output_parser import OutputDelta
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessageParam
from pagedllm.entrypoints.openai.protocol_ollama import (OllamaChatRequest, OllamaEmbeddingsRequest,
                                                         OllamaEmbedRequest, OllamaGenerateRequest,
                                                         OllamaMessage, OllamaModelRequest,
                                                         OllamaOptions)
from pagedllm.entrypoints.openai.serving_chat import (ChatToolSetup, OpenAIServingChat,
                                                      render_chat)
from pagedllm.entrypoints.openai.serving_engine import (ClientDisconnected, SSEResponse,
                                                        base_request_id, record_request_id)

logger = logging.getLogger("pagedllm.entrypoints.openai")

# The Ollama API version these routes follow (``GET /api/version``): clients gate features
# (structured outputs, ``think``) on it.
OLLAMA_API_VERSION = "0.9.0"
OLLAMA_RUNNING_TEXT = "Ollama is running"


# ------------------------------------------------------------------------------------ helpers
def now_rfc3339() -> str:
    """The current UTC time as Ollama writes ``created_at`` (RFC 3339, microseconds, ``Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _rfc3339(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ollama_error(message: str, status_code: int = 400) -> JSONResponse:
    """Ollama's error response: ``{"error": message}`` with ``status_code``."""
    return JSONResponse({"error": message}, status_code=status_code)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


async def read_body(raw_request: Request, model_cls: type) -> Any:
    """The request body (JSON, whatever the Content-Type: ``curl -d`` sends a form type) parsed
    into ``model_cls``.

    Raises:
        OpenAIError: 400 for a body that is not JSON, not an object, or does not validate.
    """
    raw = await raw_request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"invalid JSON in request body: {e}", 400) from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object", 400)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise OpenAIError(_validation_message(e), 400) from None


def _keep_alive_zero(v: Any) -> bool:
    if v is None:
        return False
    if isinstance(v, (int, float)):
        return v == 0
    return bool(re.fullmatch(r"\s*0+(\.0*)?\s*(ns|us|ms|s|m|h)?\s*", str(v)))


def _role(m: Any) -> Optional[str]:
    return m.get("role") if isinstance(m, dict) else getattr(m, "role", None)


def _done_reason(finish_reason: Optional[str]) -> str:
    # Ollama's done_reason values are "stop", "length" (and "load" / "unload"); "abort" (the
    # server shutting down) is passed on as is.
    return finish_reason or "stop"


def _ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


@dataclass
class _Timing:
    """A request's timestamps (seconds since the epoch) -> Ollama's duration fields."""

    start: float = field(default_factory=time.time)
    first_token: Optional[float] = None
    end: Optional[float] = None

    def observe(self, output: Any, has_tokens: bool) -> None:
        m = getattr(output, "metrics", None) or {}
        ft = m.get("first_token_time")
        if ft:
            self.first_token = float(ft)
        elif has_tokens and self.first_token is None:
            self.first_token = time.time()
        if m.get("finished_time"):
            self.end = float(m["finished_time"])

    def fields(self, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
        now = time.time()
        end = self.end or now
        first = self.first_token or end
        first = min(max(first, self.start), end)
        return {"total_duration": _ns(now - self.start), "load_duration": 0,
                "prompt_eval_count": int(prompt_tokens), "prompt_eval_duration": _ns(first - self.start),
                "eval_count": int(output_tokens),
                # at least 1 ns: clients divide by it (tokens per second)
                "eval_duration": max(1, _ns(end - first))}


# ------------------------------------------------------------------------- Go template subset
_GO_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_GO_VARS = ("System", "Prompt", "Response")


def render_go_template(template: str, system: str, prompt: str) -> str:
    """Render an Ollama (Go ``text/template``) prompt template for one turn: ``{{ .System }}``,
    ``{{ .Prompt }}``, ``{{ .Response }}``, ``{{ if .X }}...{{ else }}...{{ end }}`` and the
    ``{{-`` / ``-}}`` whitespace trims. As Ollama does for generation, the text from
    ``{{ .Response }}`` on is dropped (the model writes the response there).

    Raises:
        ValueError: any other construct (``range``, ``.Messages``, functions, ...), or
            unbalanced ``if`` / ``end`` (param "template").
    """
    values = {"System": system or "", "Prompt": prompt or "", "Response": "\x00RESPONSE\x00"}
    # Tokens: text pieces and actions, with the trims applied to the neighbouring text.
    pieces: list[tuple[str, str]] = []
    pos = 0
    for m in _GO_ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        pieces.append(("text", text))
        pieces.append(("action", m.group(2)))
        pos = m.end()
        if m.group(3):
            rest = template[pos:]
            pos += len(rest) - len(rest.lstrip())
    pieces.append(("text", template[pos:]))

    def unsupported(action: str) -> ValueError:
        from pagedllm.engine.input_processor import InputValidationError
        return InputValidationError(
            f"template: unsupported construct {{{{ {action} }}}} (this server renders .System, .Prompt, "
            ".Response and if/else/end; use the model's chat template by leaving `template` out, or "
            "`raw: true` with a fully formatted prompt)", "template")

    for kind, val in pieces:
        if kind == "text" and "{{" in val:  # Go: "unclosed action" (the action never ends)
            from pagedllm.engine.input_processor import InputValidationError
            raise InputValidationError(f"template: unclosed action at {val[val.index('{{'):][:40]!r}", "template")
    out: list[str] = []
    stack: list[list[bool]] = []  # per open `if`: [condition, in_else]
    for kind, val in pieces:
        active = all(c != e for c, e in stack)
        if kind == "text":
            if active:
                out.append(val)
            continue
        var = re.fullmatch(r"\.(\w+)", val)
        cond = re.fullmatch(r"if\s+\.(\w+)", val)
        if var and var.group(1) in _GO_VARS:
            if active:
                out.append(values[var.group(1)])
        elif cond and cond.group(1) in _GO_VARS:
            stack.append([bool(values[cond.group(1)]) if cond.group(1) != "Response" else False, False])
        elif val == "else" and stack:
            stack[-1][1] = True
        elif val == "end" and stack:
            stack.pop()
        elif val.startswith("/*") and val.endswith("*/"):
            continue  # a comment
        else:
            raise unsupported(val)
    if stack:
        raise unsupported("if (without end)")
    text = "".join(out)
    cut = text.find(values["Response"])
    return text if cut < 0 else text[:cut]


# ------------------------------------------------------------------------- model description
@dataclass
class ModelDescription:
    """What ``/api/tags``, ``/api/show`` and ``/api/ps`` say about the served model (best
    effort: read from the GGUF header or the checkpoint's config.json, never the weights)."""

    format: str = ""
    family: str = ""
    parameter_size: str = ""
    quantization_level: str = ""
    parameter_count: int = 0
    size: int = 0
    modified_at: str = ""
    digest: str = ""
    model_info: dict[str, Any] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        """Ollama's ``details`` object."""
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None,
                "parameter_size": self.parameter_size, "quantization_level": self.quantization_level}


def _size_label(n: int) -> str:
    if n <= 0:
        return ""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


def describe_model(model: str, max_model_len: int) -> ModelDescription:
    """Describe ``model`` (the engine's model argument: a known name, a GGUF file or a
    checkpoint directory; anything else gets only the name-based fields). Never raises."""
    d = ModelDescription(digest=hashlib.sha256(str(model).encode()).hexdigest(),
                         modified_at=now_rfc3339())
    path = None
    try:
        from pagedllm.loader.resolve import resolve_model_path
        if os.path.exists(model) or "/" not in str(model):
            path = resolve_model_path(str(model))
    except Exception:
        path = None
    try:
        if path and os.path.isfile(path) and path.lower().endswith(".gguf"):
            from gguf.constants import LlamaFileType

            from pagedllm.loader.gguf_file import GGUFFile
            g = GGUFFile(path)
            d.format, d.family = "gguf", g.architecture
            ft = g.get("general.file_type")
            if ft is not None:
                try:
                    d.quantization_level = LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
                except ValueError:
                    d.quantization_level = str(ft)
            d.parameter_count = int(sum(t.n_elements for t in g.tensors.values()))
            d.model_info = {k: (v if isinstance(v, (str, int, float, bool)) else None)
                            for k, v in g.metadata.items() if not k.startswith("tokenizer.")}
            d.model_info = {k: v for k, v in d.model_info.items() if v is not None}
            d.size = os.path.getsize(path)
            d.modified_at = _rfc3339(os.path.getmtime(path))
        elif path and os.path.isdir(path):
            d.format = "safetensors"
            cfg_path = os.path.join(path, "config.json")
            if os.path.isfile(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
                d.family = str(cfg.get("model_type", ""))
                d.model_info = {"general.architecture": d.family}
            d.size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                         if n.endswith((".safetensors", ".bin")))
            d.modified_at = _rfc3339(os.path.getmtime(path))
    except Exception:
        logger.debug("describing model %s failed", model, exc_info=True)
    d.parameter_size = _size_label(d.parameter_count)
    if d.family:
        d.model_info.setdefault("general.architecture", d.family)
        d.model_info[f"{d.family}.context_length"] = int(max_model_len)
    if d.parameter_count:
        d.model_info["general.parameter_count"] = d.parameter_count
    return d


# ------------------------------------------------------------------------- messages
def ollama_image_parts(images: list[Any], field: str, takes_images: bool = True) -> list[dict[str, Any]]:
    """Ollama ``images`` (base64 strings, no ``data:`` prefix) as decoded ``image_pil`` chat parts.

    ``takes_images``: False for a text-only model, whose request is refused before anything is
    decoded (a large image costs nothing to refuse).

    Raises:
        OpenAIError: 400 naming ``field`` for a text-only model, ``field[k]`` for an entry that is
            not a string.
        InputValidationError: (param ``field[k]``) not base64, or not a decodable image.
    """
    from pagedllm.multimodal.media import MediaConnector, decode_base64_image

    if images and not takes_images:
        raise OpenAIError(f"{field}: this model does not take images (a text-only model)", 400, field)
    parts = []
    for k, b64 in enumerate(images):
        if not isinstance(b64, str) or not b64:
            raise OpenAIError(f"{field}[{k}]: must be a base64-encoded image string", 400, f"{field}[{k}]")
        img = (MediaConnector().load_image_url(b64, f"{field}[{k}]") if b64.startswith("data:")
               else decode_base64_image(b64, f"{field}[{k}]"))
        parts.append({"type": "image_pil", "image_pil": img})
    return parts


def ollama_messages_to_chat(messages: list[OllamaMessage], takes_images: bool = True) -> list[dict[str, Any]]:
    """Ollama chat messages as Chat Completions messages: assistant ``tool_calls`` get ids and
    JSON-text arguments; a ``tool`` message answers the call its ``tool_call_id`` names, else
    the oldest unanswered call named ``tool_name``, else the oldest unanswered call.

    Raises:
        OpenAIError: 400 for images (text only), an unknown role or a malformed tool call.
    """
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (call id, function name) not answered yet
    for i, m in enumerate(messages):
        if m.images and m.role != "user":
            raise OpenAIError(f"messages[{i}].images: only user messages may carry images", 400,
                              f"messages[{i}].images")
        if m.role not in ("system", "user", "assistant", "tool"):
            raise OpenAIError(f"messages[{i}].role: must be system, user, assistant or tool, got "
                              f"{m.role!r}", 400)
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:
            d["content"] = ollama_image_parts(m.images, f"messages[{i}].images", takes_images) + [
                {"type": "text", "text": m.content or ""}]
        if m.role == "assistant":
            if m.thinking:
                d["reasoning_content"] = m.thinking
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise OpenAIError(f"messages[{i}].tool_calls[{j}]: must be {{\"function\": "
                                      "{\"name\", \"arguments\"}}", 400)
                args = fn.get("arguments", {})
                cid = str(c.get("id") or f"call_{i}_{j}")
                calls.append({"id": cid, "type": "function", "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
                pending.append((cid, fn["name"]))
            if calls:
                d["tool_calls"] = calls
        elif m.role == "tool":
            cid = m.tool_call_id
            if cid:
                pending = [p for p in pending if p[0] != cid]
            else:
                k = next((k for k, p in enumerate(pending) if p[1] == m.tool_name), 0 if pending else None)
                cid = pending.pop(k)[0] if k is not None else f"call_tool_{i}"
            d["tool_call_id"] = cid
            if m.tool_name:
                d["name"] = m.tool_name
        out.append(d)
    return out


def _ollama_tool_calls(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Parsed calls ``(name, JSON arguments text)`` as Ollama ``tool_calls`` (object arguments)."""
    out = []
    for k, (name, args) in enumerate(calls):
        try:
            parsed = json.loads(args) if args and args.strip() else {}
        except json.JSONDecodeError:
            parsed = {"__raw__": args}
        if not isinstance(parsed, dict):
            parsed = {"value": parsed}
        out.append({"function": {"index": k, "name": name, "arguments": parsed}})
    return out


# ------------------------------------------------------------------------- streaming response
class NDJSONResponse(SSEResponse):
    """A newline-delimited JSON stream (``application/x-ndjson``) with ``SSEResponse``'s
    disconnect handling: the body generator is closed (aborting its engine request) when the
    client goes away."""

    media_type = "application/x-ndjson"

    def __init__(self, content: AsyncIterator[str], headers: Optional[dict] = None):
        hdrs = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        hdrs.update(headers or {})
        StreamingResponse.__init__(self, content, media_type=self.media_type, headers=hdrs)


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


# ------------------------------------------------------------------------- the handler
@dataclass
class _Run:
    """One generation: what the response needs besides the engine's outputs."""

    kind: str  # "chat" or "generate"
    model: str  # the name the client used (echoed, as Ollama does)
    request_id: str
    prompt_ids: list[int]
    setup: ChatToolSetup
    timing: _Timing
    return_context: bool = False


class OllamaServing:
    """The Ollama routes' logic, on the chat path of ``chat`` (template, tools, reasoning,
    structured outputs) and the pooling handler for embeddings."""

    def __init__(self, engine: EngineClient, chat: OpenAIServingChat, served_model_names: list[str]):
        self.engine = engine
        self.chat = chat
        self.served = list(served_model_names)
        self._description: Optional[ModelDescription] = None

    # ---- names & metadata ----------------------------------------------------------------
    def resolve_model(self, name: Optional[str]) -> str:
        """The served name (or LoRA adapter) ``name`` means: exact, or without a ``:latest`` tag.

        Raises:
            OpenAIError: 400 without a name, 404 for one this server does not serve.
        """
        if not name:
            raise OpenAIError("model is required", 400)
        candidates = [name]
        if name.endswith(":latest"):
            candidates.append(name[: -len(":latest")])
        for c in candidates:
            if c in self.served or self.chat.lora_request(c) is not None:
                return c
        raise OpenAIError(f"model '{name}' not found (this server serves: "
                          f"{', '.join(self.tag_name(s) for s in self.served)})", 404)

    @staticmethod
    def tag_name(served: str) -> str:
        """``served`` as Ollama lists it: with a tag (``:latest`` unless it has one)."""
        tail = served.rsplit("/", 1)[-1]
        return served if ":" in tail else f"{served}:latest"

    @property
    def description(self) -> ModelDescription:
        if self._description is None:
            self._description = describe_model(str(self.engine.model_name), int(self.engine.max_model_len))
        return self._description

    def capabilities(self) -> list[str]:
        """Ollama ``capabilities``: completion / tools / thinking, or embedding."""
        if self.engine.runner != "generate":
            return ["embedding"]
        caps = ["completion"]
        if self.chat.enable_auto_tools and self.chat.tool_parser_cls is not None:
            caps.append("tools")
        if self.chat.reasoning_parser_cls is not None:
            caps.append("thinking")
        return caps

    def _model_entry(self, served: str) -> dict[str, Any]:
        d = self.description
        return {"name": self.tag_name(served), "model": self.tag_name(served), "modified_at": d.modified_at,
                "size": d.size, "digest": d.digest, "details": d.details()}

    def tags(self) -> dict[str, Any]:
        """``GET /api/tags``."""
        return {"models": [self._model_entry(s) for s in self.served]}

    def ps(self) -> dict[str, Any]:
        """``GET /api/ps``: the served models are always loaded (they never expire)."""
        models = []
        for s in self.served:
            e = self._model_entry(s)
            e.pop("modified_at")
            e.update(expires_at="2099-12-31T23:59:59Z", size_vram=0,
                     context_length=int(self.engine.max_model_len))
            models.append(e)
        return {"models": models}

    def show(self, req: OllamaModelRequest) -> dict[str, Any]:
        """``POST /api/show``."""
        name = self.resolve_model(req.model_name)
        d = self.description
        tok = self.engine.tokenizer
        template = self.chat.chat_template or getattr(tok, "chat_template", None) or ""
        if not isinstance(template, str):
            template = json.dumps(template)
        params = []
        for k, v in sorted((self.engine.default_sampling_params or {}).items()):
            ok = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}.get(k, k)
            params.append(f"{ok:<30} {v}")
        params.append(f"{'num_ctx':<30} {int(self.engine.max_model_len)}")
        modelfile = (f"# Modelfile generated by pagedllm (the model this server was started with)\n"
                     f"FROM {self.engine.model_name}\n"
                     + "".join(f"PARAMETER {p.split()[0]} {p.split(None, 1)[1]}\n" for p in params))
        return {"modelfile": modelfile, "parameters": "\n".join(params), "template": template,
                "details": d.details(), "model_info": dict(d.model_info),
                "capabilities": self.capabilities(), "modified_at": d.modified_at, "license": "",
                "model": self.tag_name(name)}

    # ---- generation ----------------------------------------------------------------------
    def _check_generate(self, model: str) -> None:
        if self.engine.runner != "generate":
            raise OpenAIError(f"\"{model}\" does not support generate (this server was started with "
                              f"--runner {self.engine.runner}: use /api/embed)", 400)

    def _chat_request(self, req: Any, messages: list[dict[str, Any]], model: str,
                      tools: Optional[list] = None) -> ChatCompletionRequest:
        """A ChatCompletionRequest carrying the Ollama request's sampling fields."""
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": req.stream is not False}
        opts: Optional[OllamaOptions] = req.options
        if opts is not None:
            body.update(opts.sampling_fields())
            if opts.num_predict is not None and opts.num_predict < -2:
                raise OpenAIError(f"options.num_predict: must be a number of tokens, or 0 / -1 / -2 (no limit "
                                  f"but the context length), got {opts.num_predict}", 400)
        if req.format == "json":
            body["structured_outputs"] = {"json_object": True}
        elif isinstance(req.format, dict):
            body["structured_outputs"] = {"json": req.format}
        kwargs: dict[str, Any] = {}
        if req.think not in (None, False) and "thinking" not in self.capabilities():
            # Ollama's answer for a model without the capability (``think: false`` is fine)
            raise OpenAIError(f"\"{model}\" does not support thinking (start the server with a "
                              "--reasoning-parser for a model that thinks)", 400, "think")
        if req.think is not None:
            kwargs["enable_thinking"] = req.think is not False
            if isinstance(req.think, str):
                kwargs["reasoning_effort"] = req.think
            body["include_reasoning"] = req.think is not False
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        if tools:
            body["tools"] = tools
        try:
            return ChatCompletionRequest(**body)
        except ValidationError as e:
            raise OpenAIError(_validation_message(e).replace("structured_outputs", "format"), 400) from None

    def _max_tokens(self, req: Any, prompt_len: int) -> int:
        room = int(self.engine.max_model_len) - prompt_len
        n = req.options.num_predict if req.options is not None else None
        if n is None or n <= 0:  # Ollama's runner limits only a positive num_predict
            return room
        return min(int(n), room)

    def _truncate(self, prompt: dict[str, Any], req: Any, request_id: str) -> dict[str, Any]:
        """A prompt over the context, cut as Ollama's runner cuts it: the first ``num_keep`` tokens
        (option; default 4) and the latest ones, ``max_model_len - 1`` in all (room for one
        generated token); a warning is logged. Shorter prompts are returned as they are."""
        ids = list(prompt["prompt_token_ids"])
        limit = int(self.engine.max_model_len) - 1
        if len(ids) <= limit or getattr(req, "truncate", None) is False:
            return prompt  # (over the context without truncation: process_prompt's 400)
        keep = getattr(req.options, "num_keep", None) if req.options is not None else None
        keep = max(0, min(4 if keep is None or keep < 0 else int(keep), limit - 1))
        new = ids[:keep] + ids[len(ids) - (limit - keep):]
        logger.warning("Ollama %s: truncating input prompt: limit=%d prompt=%d keep=%d new=%d", request_id,
                       limit + 1, len(ids), keep, len(new))
        return {"prompt_token_ids": new, "prompt": None}

    async def _start(self, run: _Run, chat_req: ChatCompletionRequest, prompt: dict[str, Any],
                     raw_request: Request, req: Any) -> Response:
        chat = self.chat
        rename = {"prompt": "messages" if run.kind == "chat" else "prompt",
                  "max_tokens": "options.num_predict"}
        if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
            prompt = self._truncate(prompt, req, run.request_id)
        pp = chat.process_prompt(prompt, add_special_tokens=False, rename=rename)
        run.prompt_ids = list(pp.prompt_token_ids)
        chat_req.max_tokens = self._max_tokens(req, len(run.prompt_ids))
        try:
            sp = chat_req.to_sampling_params(chat_req.max_tokens, chat.max_model_len, chat.default_sampling_params)
        except ValueError as e:
            raise self._options_error(e) from e
        chat.constrain_for_tools(sp, run.setup)
        engine_request = chat.process_inputs(run.request_id, pp, sp, lora_request=chat.lora_request(chat_req.model),
                                             rename=rename)
        chat.log_request(run.request_id, pp.prompt, run.prompt_ids, engine_request.sampling_params)
        try:
            merged = await chat.start([engine_request], prime=bool(chat_req.stream))
        except ValueError as e:
            raise self._options_error(e) from e
        if chat_req.stream:
            return NDJSONResponse(self._stream(run, merged))
        try:
            results = await chat.collect(merged, raw_request, [run.request_id])
        except ClientDisconnected:
            return Response(status_code=499)
        except ValueError as e:
            raise self._options_error(e) from e
        return JSONResponse(self._build(run, results[0]))

    @staticmethod
    def _options_error(e: ValueError) -> OpenAIError:
        err = value_error_to_openai(e)
        return OpenAIError(err.message.replace("structured_outputs", "format"), 400)

    def _head(self, run: _Run) -> dict[str, Any]:
        return {"model": run.model, "created_at": now_rfc3339()}

    def _piece(self, run: _Run, content: str, thinking: Optional[str] = None,
               tool_calls: Optional[list] = None) -> dict[str, Any]:
        obj = self._head(run)
        if run.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if tool_calls:
                msg["tool_calls"] = tool_calls
            obj["message"] = msg
        else:
            obj["response"] = content
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = False
        return obj

    def _final(self, run: _Run, obj: dict[str, Any], finish_reason: Optional[str], output_ids: list[int]
               ) -> dict[str, Any]:
        obj["done"] = True
        obj["done_reason"] = _done_reason(finish_reason)
        if run.kind == "generate" and run.return_context:
            obj["context"] = list(run.prompt_ids) + list(output_ids)
        obj.update(run.timing.fields(len(run.prompt_ids), len(output_ids)))
        return obj

    def _build(self, run: _Run, outs: list[Any]) -> dict[str, Any]:
        ro = outs[-1]
        run.timing.observe(ro, True)
        co = ro.outputs[0]
        parser = run.setup.new_parser()
        content, thinking, calls = co.text, None, []
        if parser.active:
            parsed = parser.parse(co.text)
            content, thinking = parsed.content or "", parsed.reasoning
            calls = [(c.function.name, c.function.arguments) for c in parsed.tool_calls]
        obj = self._piece(run, content, thinking, _ollama_tool_calls(calls) if calls else None)
        return self._final(run, obj, co.finish_reason, list(co.token_ids))

    async def _stream(self, run: _Run, merged: Any) -> AsyncIterator[str]:
        chat = self.chat
        parser = run.setup.new_parser()
        calls: dict[int, list[str]] = {}  # call index -> [name, arguments so far]
        output_ids: list[int] = []
        finish: Optional[str] = None
        try:
            async for _, res in merged:
                for co in res.outputs:
                    output_ids.extend(co.token_ids)
                    run.timing.observe(res, bool(co.token_ids))
                    final = co.finish_reason is not None
                    if final:
                        finish = co.finish_reason
                    d = parser.feed(co.text, final) if parser.active else OutputDelta(content=co.text)
                    for tc in d.tool_calls:
                        slot = calls.setdefault(tc.index, ["", ""])
                        if tc.function is not None:
                            slot[0] = tc.function.name or slot[0]
                            slot[1] += tc.function.arguments or ""
                    if d.content or d.reasoning:
                        yield _line(self._piece(run, d.content, d.reasoning or None))
            if calls:
                yield _line(self._piece(run, "", None, _ollama_tool_calls(
                    [tuple(calls[k]) for k in sorted(calls)])))
            if finish is None and merged._stopping:
                finish = "abort"
            yield _line(self._final(run, self._piece(run, ""), finish, output_ids))
        except Exception as e:
            if not isinstance(e, (ValueError, OpenAIError)):
                logger.exception("error in Ollama stream %s", run.request_id)
            msg = e.message if isinstance(e, OpenAIError) else str(e) or type(e).__name__
            yield _line({"error": msg})
        finally:
            await chat.finish(merged, [run.request_id])

    def _load_response(self, kind: str, model: str, keep_alive: Any) -> dict[str, Any]:
        # An empty prompt / message list loads (keep_alive 0: unloads) the model in Ollama; here
        # the model is always loaded, so both only answer.
        obj: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
        if kind == "chat":
            obj["message"] = {"role": "assistant", "content": ""}
        else:
            obj["response"] = ""
        obj.update(done=True, done_reason="unload" if _keep_alive_zero(keep_alive) else "load")
        return obj

    def _takes_images(self) -> bool:
        """Whether the served model has an image processor (else images are refused undecoded)."""
        return getattr(self.chat.input_processor, "image_processor", None) is not None

    def _run(self, kind: str, req: Any, raw_request: Request, chat_req: ChatCompletionRequest,
             timing: _Timing) -> _Run:
        rid = f"ollama-{kind}-{base_request_id(raw_request)}"
        record_request_id(raw_request, rid)
        setup = self.chat.setup_tools(chat_req)
        return _Run(kind=kind, model=req.model, request_id=rid, prompt_ids=[], setup=setup, timing=timing)

    async def chat_completion(self, req: OllamaChatRequest, raw_request: Request) -> Response:
        """``POST /api/chat``."""
        timing = _Timing()
        model = self.resolve_model(req.model)
        self._check_generate(req.model)
        if not req.messages:
            return JSONResponse(self._load_response("chat", req.model, req.keep_alive))
        messages = ollama_messages_to_chat(req.messages, self._takes_images())
        chat_req = self._chat_request(req, messages, model, tools=req.tools)
        run = self._run("chat", req, raw_request, chat_req, timing)
        # a final assistant message with text is a prefill the reply continues (as Ollama's templates)
        last = messages[-1]
        prefill = last["role"] == "assistant" and bool(last.get("content")) and not last.get("tool_calls")

        def render(msgs: list[Any]) -> Any:
            return render_chat(self.chat, msgs, add_generation_prompt=not prefill, continue_final_message=prefill,
                               chat_template=None, chat_template_kwargs=chat_req.chat_template_kwargs,
                               tools=run.setup.tools or None)

        msgs = list(chat_req.messages)
        prompt_text = render(msgs)
        if getattr(prompt_text, "images", None):  # the image processor tokenizes it
            return await self._start(run, chat_req, prompt_text, raw_request, req)
        ids = self.chat.encode(prompt_text, False)
        limit = int(self.engine.max_model_len) - 1  # room for one generated token at least
        if len(ids) > limit and req.truncate is not False:
            # Ollama's chatPrompt: keep the system messages and the longest run of the latest
            # messages that fits (the last one always); older turns are dropped
            system = [m for m in msgs[:-1] if _role(m) == "system"]
            rest = [m for m in msgs[:-1] if _role(m) != "system"]
            lo, hi = 0, len(rest)  # drop rest[:k]; find the smallest k that fits (monotone)
            best = None
            while lo <= hi:
                k = (lo + hi) // 2
                text = render(system + rest[k:] + msgs[-1:])
                n_ids = self.chat.encode(text, False)
                if len(n_ids) <= limit:
                    best, hi = (k, text, n_ids), k - 1
                else:
                    lo = k + 1
            if best is None:
                prompt_text = render(system + msgs[-1:])
                ids = self.chat.encode(prompt_text, False)
                dropped = len(rest)
            else:
                dropped, prompt_text, ids = best
            logger.warning("Ollama chat %s: %d message(s) dropped to fit the context of %d tokens", run.request_id,
                           dropped, limit + 1)
        return await self._start(run, chat_req, {"prompt_token_ids": ids, "prompt": prompt_text}, raw_request, req)

    async def generate(self, req: OllamaGenerateRequest, raw_request: Request) -> Response:
        """``POST /api/generate``."""
        timing = _Timing()
        model = self.resolve_model(req.model)
        self._check_generate(req.model)
        if req.images and (req.raw or req.template or req.suffix or req.context):
            raise OpenAIError("images: not available with raw, template, suffix or context", 400, "images")
        fim = None
        if req.suffix:
            from pagedllm.engine.fim import encode_fim, fim_tokens
            if fim_tokens(self.chat.tokenizer) is None:
                raise OpenAIError("suffix: this model does not support fill-in-the-middle (its tokenizer has no "
                                  "FIM tokens)", 400)
            fim = encode_fim(self.chat.tokenizer, req.prompt or "", req.suffix)
        if not req.prompt and not req.context:
            return JSONResponse(self._load_response("generate", req.model, req.keep_alive))
        prompt = req.prompt or ""
        user: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        if req.images:
            user[0]["content"] = ollama_image_parts(req.images, "images", self._takes_images()) + [{"type": "text", "text": prompt}]
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + user
        chat_req = self._chat_request(req, messages, model)
        run = self._run("generate", req, raw_request, chat_req, timing)
        run.return_context = not req.raw
        if fim is not None:  # the FIM layout replaces the template (Ollama's suffix)
            self.chat.check_token_ids(fim, "suffix")
            ids, text = fim, prompt
        elif req.raw:
            ids = self.chat.encode(prompt, True)
            text = prompt
        elif req.template:
            text = render_go_template(req.template, req.system or "", prompt)
            ids = self.chat.encode(text, True)
        else:
            text = render_chat(self.chat, [ChatMessageParam(**m) for m in messages], add_generation_prompt=True,
                               continue_final_message=False, chat_template=None,
                               chat_template_kwargs=chat_req.chat_template_kwargs)
            if getattr(text, "images", None):  # the processor tokenizes a prompt with images
                return await self._start(run, chat_req, text, raw_request, req)
            ids = self.chat.encode(text, False)
        if req.context:
            self.chat.check_token_ids(req.context, "context")
            ids = list(req.context) + ids
            text = None
        return await self._start(run, chat_req, {"prompt_token_ids": ids, "prompt": text}, raw_request, req)

    # ---- embeddings ----------------------------------------------------------------------
    async def embed(self, inputs: list[str], model_name: str, truncate: bool, dimensions: Optional[int],
                    use_activation: Optional[bool], raw_request: Request) -> tuple[list[list[float]], int]:
        """Embeddings of ``inputs`` (each cut to the context length from its end with
        ``truncate``) and the prompt tokens used, on the pooling path of ``/v1/embeddings``.

        Raises:
            OpenAIError: 400 for a generation model (the message ``/v1/embeddings`` gives), an
                empty input list, an over-long input without ``truncate``, a bad ``dimensions``.
        """
        from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
        from pagedllm.pooling_params import PoolingParams

        model = self.resolve_model(model_name)
        h = OpenAIServingPooling(self.engine, self.served)
        h.check(model, "embeddings")
        if not inputs:
            raise OpenAIError("input: the input list is empty; give at least one text", 400)
        rid = f"ollama-embed-{base_request_id(raw_request)}"
        record_request_id(raw_request, rid)
        prompts: list[Any] = []
        limit = int(self.engine.max_model_len)
        for text in inputs:
            if not isinstance(text, str):
                raise OpenAIError("input: must be a text or a list of texts", 400)
            if truncate:
                try:
                    ids = self.engine.input_processor.tokenize(text, True)
                except ValueError as e:
                    raise value_error_to_openai(e, "input") from None
                prompts.append({"prompt_token_ids": ids[:limit]})
            else:
                prompts.append(text)

        def params() -> Any:
            return PoolingParams(dimensions=dimensions, use_activation=use_activation)
        try:
            params()
        except ValueError as e:
            raise OpenAIError(str(e), 400) from None
        outs = await h.run(prompts, params, "embed", rid)
        return [o.outputs.data.float().reshape(-1).tolist() for o in outs], sum(len(o.prompt_token_ids) for o in outs)


# ------------------------------------------------------------------------- router
def build_ollama_router(engine: EngineClient, chat: OpenAIServingChat,
                        served_model_names: list[str]) -> APIRouter:
    """FastAPI router with the Ollama routes (see the module docstring), answering every error
    as ``{"error": "..."}``; ``chat`` is the server's ``OpenAIServingChat`` (its template, tool
    and reasoning parser settings apply here too)."""
    o = OllamaServing(engine, chat, served_model_names)
    router = APIRouter()

    async def guarded(fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
            if inspect.isawaitable(out):
                out = await out
        except OpenAIError as e:
            return ollama_error(e.message, e.status_code)
        except ValueError as e:
            return ollama_error(value_error_to_openai(e).message, 400)
        return JSONResponse(out) if isinstance(out, dict) else out

    @router.api_route("/", methods=["HEAD"], include_in_schema=False)
    async def root_head():
        return PlainTextResponse(OLLAMA_RUNNING_TEXT)

    @router.api_route("/api/version", methods=["GET", "HEAD"])
    async def version():
        return JSONResponse({"version": OLLAMA_API_VERSION})

    @router.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags():
        return await guarded(o.tags)

    @router.get("/api/ps")
    async def ps():
        return await guarded(o.ps)

    @router.post("/api/show")
    async def show(raw_request: Request):
        async def go():
            return o.show(await read_body(raw_request, OllamaModelRequest))
        return await guarded(go)

    @router.post("/api/chat")
    async def api_chat(raw_request: Request):
        async def go():
            return await o.chat_completion(await read_body(raw_request, OllamaChatRequest), raw_request)
        return await guarded(go)

    @router.post("/api/generate")
    async def api_generate(raw_request: Request):
        async def go():
            return await o.generate(await read_body(raw_request, OllamaGenerateRequest), raw_request)
        return await guarded(go)

    @router.post("/api/embed")
    async def api_embed(raw_request: Request):
        async def go():
            req = await read_body(raw_request, OllamaEmbedRequest)
            t0 = time.time()
            inputs = [req.input] if isinstance(req.input, str) else list(req.input)
            embs, n = await o.embed(inputs, req.model, req.truncate is not False, req.dimensions, None, raw_request)
            return {"model": req.model, "embeddings": embs, "total_duration": _ns(time.time() - t0),
                    "load_duration": 0, "prompt_eval_count": n}
        return await guarded(go)

    @router.post("/api/embeddings")
    async def api_embeddings(raw_request: Request):
        async def go():
            req = await read_body(raw_request, OllamaEmbeddingsRequest)
            if not req.prompt:  # Ollama answers an empty prompt with an empty embedding
                o.resolve_model(req.model)
                return {"embedding": []}
            embs, _ = await o.embed([req.prompt], req.model, True, None, False, raw_request)
            return {"embedding": embs[0]}
        return await guarded(go)

    @router.post("/api/pull")
    async def api_pull(raw_request: Request):
        async def go():
            req = await read_body(raw_request, OllamaModelRequest)
            try:
                o.resolve_model(req.model_name)
            except OpenAIError:
                raise OpenAIError(f"pull model manifest: model '{req.model_name}' is not available: this "
                                  "server serves only the model it was started with ("
                                  f"{', '.join(o.tag_name(s) for s in o.served)}); start `pagedllm serve "
                                  "MODEL` to serve another", 404) from None
            if req.stream is False:
                return {"status": "success"}
            return StreamingResponse(iter([_line({"status": "success"})]), media_type="application/x-ndjson")
        return await guarded(go)

    unsupported = {"create": "POST", "copy": "POST", "delete": "DELETE", "push": "POST"}

    @router.api_route("/api/{rest:path}", methods=["GET", "POST", "DELETE", "HEAD", "PUT"],
                      include_in_schema=False)
    async def api_other(rest: str):
        head = rest.split("/", 1)[0]
        if head in unsupported or head == "blobs":
            return ollama_error(f"/api/{head} is not supported: pagedllm serves the model it was started "
                                "with and does not manage models", 501)
        return ollama_error(f"404 page not found: /api/{rest}", 404)

    return router

"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}``
(vLLM's shape; ``type`` is "BadRequestError" for 400, "NotFoundError" for 404,
"AuthenticationError" for 401, "InternalServerError" for 500).
"""
from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagedllm.entrypoints.openai")

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error body."""

    def __init__(self, message: str, status_code: int = 400, param: Optional[str] = None,
                 err_type: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param
        self.err_type = err_type or _TYPE_BY_STATUS.get(self.status_code, HTTPStatus(self.status_code).phrase.replace(" ", "") + "Error")

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.param, self.err_type)

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code)


def error_body(message: str, status_code: int = 400, param: Optional[str] = None,
               err_type: Optional[str] = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPE_BY_STATUS.get(status_code, "BadRequestError"),
            "param": param,
            "code": status_code,
        }
    }


def error_response(message: str, status_code: int = 400, param: Optional[str] = None,
                   err_type: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param, err_type), status_code=status_code)


# Names of request fields that a ValueError message may name: the fallback for errors raised
# without a ``param`` (pydantic model validators of the request bodies, plain ValueErrors).
# SamplingParams and the input processor raise ``InputValidationError(param=...)`` at the source.
_KNOWN_PARAMS = (
    "max_completion_tokens", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "top_logprobs",
    "prompt_logprobs", "logprobs", "logit_bias", "stop_token_ids", "stop", "seed", "n",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "messages", "prompt", "best_of",
    "ignore_eos", "cache_salt", "stream_options", "tools", "tool_choice", "response_format",
    "chat_template", "chat_template_kwargs", "skip_special_tokens", "input",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag", "dimensions",
    "use_activation", "max_output_tokens", "background", "priority",
)
_PARAM_RE = re.compile(r"`?\b(" + "|".join(re.escape(p) for p in _KNOWN_PARAMS) + r")\b`?")


def guess_param(message: str) -> Optional[str]:
    """The request field a validation message is about (first known field name it mentions)."""
    if "maximum context length" in message or "context length" in message:
        # vLLM-style over-length message: about the prompt/messages + max_tokens.
        return None
    m = _PARAM_RE.search(message)
    return m.group(1) if m else None


def value_error_to_openai(e: BaseException, default_param: Optional[str] = None) -> OpenAIError:
    msg = str(e) or e.__class__.__name__
    param = getattr(e, "param", None) or guess_param(msg) or default_param
    return OpenAIError(msg, 400, param)


# pydantic names the member of a union a value failed in the error's location ("str",
# "list[dict[str,any]]", "function-after[...]"): type names, not request fields.
_UNION_TAG = re.compile(r"(str|int|float|bool|bytes|none|any|list|dict|set|tuple|[a-z-]+\[.*\])")


def format_validation_errors(errors: list[dict[str, Any]], skip: tuple[str, ...] = ("body",)
                             ) -> tuple[str, Optional[str]]:
    """One client message for pydantic's ``ValidationError.errors()``, and the field it names.

    Each error reads ``field.path: message`` (pydantic's "Value error, " prefix and the
    union-member names in the path dropped), errors joined with "; ", the messages of one path
    with " or ". An error without a location (a model validator's) is its message alone, so a
    message never starts with punctuation.

    Args:
        errors: ``ValidationError.errors()`` (or ``RequestValidationError.errors()``).
        skip: location parts that are not fields (FastAPI's "body").

    Returns:
        (message, param): param is the first location's first field, else the first known
        request field the message mentions (``guess_param``), else None.
    """
    parts: list[tuple[str, list[str]]] = []
    param = None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x not in skip and not _UNION_TAG.fullmatch(str(x))]
        msg = str(err.get("msg") or "invalid value").removeprefix("Value error, ")
        if param is None:
            param = loc[0] if loc else guess_param(msg)
        where = ".".join(loc)
        if parts and parts[-1][0] == where:
            if msg not in parts[-1][1]:  # (a union of several list types: "a valid list" once)
                parts[-1][1].append(msg)
        else:
            parts.append((where, [msg]))
    if not parts:
        return "Invalid request", None
    out = []
    for where, msgs in parts:
        text = msgs[0]
        for m in msgs[1:]:
            text += " or " + (m.removeprefix("Input should be ") if text.startswith("Input should be ") else m)
        out.append(f"{where}: {text}" if where else text)
    return "; ".join(out), param


def install_exception_handlers(app: FastAPI) -> None:
    """Map every error raised while handling a request to an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # vLLM answers 400 (not FastAPI's 422) to malformed or invalid request bodies.
        errs = exc.errors()
        if errs and errs[0].get("type") == "json_invalid":
            msg = "Invalid JSON in request body: " + str(errs[0].get("msg", ""))
            return error_response(msg, 400, None)
        # the body as a whole is missing or not an object (not a validator's error about fields)
        whole = [e for e in errs if tuple(e.get("loc", ())) == ("body",)
                 and e.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type")]
        if whole:
            ctype = request.headers.get("content-type", "")
            if whole[0].get("type") == "missing":
                return error_response("The request body is empty: expected a JSON object.", 400, None)
            if "json" not in ctype.lower():
                return error_response("The request body must be a JSON object sent with 'Content-Type: "
                                      f"application/json' (got {ctype or 'no Content-Type'!r}).", 400, None)
            return error_response("The request body must be a JSON object.", 400, None)
        msg, param = format_validation_errors(exc.errors())
        return error_response(msg, 400, param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError):
        return value_error_to_openai(exc).to_response()

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(_: Request, exc: json.JSONDecodeError):
        return error_response(f"Invalid JSON in request body: {exc}", 400, None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(error_body(detail, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    from pagedllm.worker.sleep import EngineSleepingError

    @app.exception_handler(EngineSleepingError)
    async def _sleeping(_: Request, exc: EngineSleepingError):
        # vLLM's answer to a generation request while the model sleeps.
        return error_response(str(exc), 503)

    @app.exception_handler(NotImplementedError)
    async def _not_implemented(_: Request, exc: NotImplementedError):
        return error_response(str(exc) or "Not implemented", 501)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("Internal server error")
        return error_response(f"Internal server error: {exc.__class__.__name__}: {exc}", 500)

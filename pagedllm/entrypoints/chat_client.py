"""``pagedllm chat`` / ``pagedllm complete``: talk to a RUNNING server, as ``vllm chat`` /
``vllm complete`` do.

Both take ``--url`` (default http://localhost:8000/v1), ``--model`` (default: the first model
the server's /v1/models lists), ``--api-key`` (default: ``$OPENAI_API_KEY``, else ``EMPTY``),
``--max-tokens`` and ``-q/--quick MESSAGE`` (one request, print the answer, exit). Without
``--quick`` they read stdin line by line until EOF or a line ``exit`` / ``quit``: ``chat``
keeps the conversation (the ``--system-prompt`` first, then every turn), ``complete`` sends each
line as its own prompt. Answers stream to stdout as they arrive.

The ``openai`` client is used when it is installed; otherwise the standard library's urllib
speaks the same HTTP + server-sent events (nothing to install).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Iterator, Optional

DEFAULT_URL = "http://localhost:8000/v1"


class ClientError(Exception):
    """The server could not be reached, or answered with an error (the message says which)."""


def add_client_args(p: argparse.ArgumentParser, *, chat: bool) -> None:
    """The flags ``pagedllm chat`` / ``complete`` share with ``vllm chat`` / ``vllm complete``."""
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"Base URL of the server's OpenAI API (default: {DEFAULT_URL}).")
    p.add_argument("--model", default=None,
                   help="Model name to send (default: the first model the server's /v1/models lists).")
    p.add_argument("--api-key", default=None,
                   help="API key sent as 'Authorization: Bearer' (default: $OPENAI_API_KEY, else 'EMPTY'; "
                        "a server started with --api-key needs it).")
    if chat:
        p.add_argument("--system-prompt", default=None,
                       help="A system message put first in the conversation (default: none).")
    p.add_argument("-q", "--quick", "--prompt", dest="quick", default=None, metavar="MESSAGE",
                   help="Send this one message, print the answer and exit (default: read messages "
                        "from stdin, one per line, until EOF or 'exit'). --prompt is an alias.")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens per answer (default: the server's, i.e. up to the context length).")
    p.add_argument("--temperature", type=float, default=None,
                   help="Sampling temperature (default: the server's / the model's generation config).")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """``pagedllm chat``'s flags (``add_client_args`` with ``chat=True``)."""
    add_client_args(p, chat=True)


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body.decode("utf-8", "replace"))
        if isinstance(err, dict):
            e = err.get("error", err)
            if isinstance(e, dict):
                return str(e.get("message") or e)
            return str(err.get("message") or e)
    except ValueError:
        pass
    return body.decode("utf-8", "replace").strip()[:300]


class _UrllibClient:
    """HTTP + SSE with the standard library (no dependency)."""

    def __init__(self, url: str, api_key: str, timeout: float = 600.0) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    def _open(self, path: str, body: Optional[dict] = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers,
                                     method="POST" if data is not None else "GET")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise ClientError(f"the server at {self.url} answered {e.code}: {_error_text(e.read())}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ClientError(f"cannot reach the server at {self.url} ({reason}); start one with "
                              f"'pagedllm serve' or pass --url") from None

    def models(self) -> list[str]:
        with self._open("/models") as r:
            return [m["id"] for m in json.load(r).get("data", [])]

    def stream(self, path: str, body: dict) -> Iterator[str]:
        with self._open(path, dict(body, stream=True)) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ClientError(f"the server at {self.url} failed: {_error_text(data.encode())}")
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    if text:
                        yield text


class _OpenAIClient:
    """The same calls through the ``openai`` package."""

    def __init__(self, url: str, api_key: str) -> None:
        import openai

        self._openai = openai
        self.url = url.rstrip("/")
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0)

    def _wrap(self, e: Exception) -> ClientError:
        if isinstance(e, self._openai.APIStatusError):
            body = getattr(e, "body", None)
            msg = _error_text(json.dumps(body).encode()) if body else (getattr(e, "message", None) or str(e))
            return ClientError(f"the server at {self.url} answered {e.status_code}: {msg}")
        return ClientError(f"cannot reach the server at {self.url} ({e}); start one with "
                           f"'pagedllm serve' or pass --url")

    def models(self) -> list[str]:
        try:
            return [m.id for m in self.client.models.list().data]
        except self._openai.APIError as e:
            raise self._wrap(e) from None

    def stream(self, path: str, body: dict) -> Iterator[str]:
        is_chat = path == "/chat/completions"
        create = self.client.chat.completions.create if is_chat else self.client.completions.create
        try:
            for chunk in create(stream=True, **body):
                for choice in chunk.choices or []:
                    text = choice.delta.content if is_chat else choice.text
                    if text:
                        yield text
        except self._openai.APIError as e:
            raise self._wrap(e) from None


def make_client(url: str, api_key: Optional[str]) -> Any:
    """The ``openai`` client when installed, else the urllib one; ``api_key`` None reads
    ``$OPENAI_API_KEY`` (else ``EMPTY``)."""
    key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    try:
        import openai  # noqa: F401
    except ImportError:
        return _UrllibClient(url, key)
    return _OpenAIClient(url, key)


def _messages_from_stdin(prompt_text: str) -> Iterator[str]:
    tty = sys.stdin.isatty()
    if tty:
        print(prompt_text, flush=True)
    while True:
        if tty:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF
            return
        line = line.rstrip("\r\n")
        if line.strip() in ("exit", "quit"):
            return
        if line.strip():
            yield line


def _print_stream(parts: Iterator[str]) -> str:
    out = []
    for text in parts:
        out.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(out)


def _request_fields(args: argparse.Namespace, model: str) -> dict:
    body: dict[str, Any] = {"model": model}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def run_client(args: argparse.Namespace, chat: bool) -> int:
    """``pagedllm chat`` (``chat=True``) or ``pagedllm complete`` against ``args.url``.

    Returns:
        0; 1 when the server cannot be reached or answers with an error (one line on stderr,
        ``pagedllm <cmd>: error: ...``); 130 on Ctrl-C.
    """
    prog = "pagedllm chat" if chat else "pagedllm complete"
    try:
        client = make_client(args.url, args.api_key)
        model = args.model
        if model is None:
            names = client.models()
            if not names:
                raise ClientError(f"the server at {args.url} lists no models; pass --model")
            model = names[0]
        fields = _request_fields(args, model)
        conversation: list[dict] = []
        if chat and getattr(args, "system_prompt", None):
            conversation.append({"role": "system", "content": args.system_prompt})
        messages = ([args.quick] if args.quick is not None else
                    _messages_from_stdin("Please enter a message for the chat model:" if chat
                                         else "Please enter a prompt to complete:"))
        for msg in messages:
            if chat:
                conversation.append({"role": "user", "content": msg})
                answer = _print_stream(client.stream("/chat/completions", dict(fields, messages=conversation)))
                conversation.append({"role": "assistant", "content": answer})
            else:
                _print_stream(client.stream("/completions", dict(fields, prompt=msg)))
    except ClientError as e:
        sys.stdout.flush()
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0

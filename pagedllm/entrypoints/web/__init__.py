"""The web chat page ``pagedllm serve`` serves at ``/``: plain HTML/CSS/JS in ``static/`` (no build
step, nothing fetched from elsewhere). The page streams answers from ``/v1/chat/completions``
(server-sent events), picks the model from ``/v1/models``, and sends the system prompt,
temperature and max tokens it is given; its stop button aborts the fetch, which makes the
server abort the request.

``GET /`` answers a browser (``Accept: text/html``) with the page and any other client with
``Ollama is running``, the text Ollama clients probe for; ``/ui/<file>`` serves the page's
script and style sheet.
"""
from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The files /ui/<name> serves (nothing else in or outside the directory).
_FILES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8",
          "index.html": "text/html; charset=utf-8"}


def wants_html(request: Request) -> bool:
    """Whether the client asked for HTML (a browser navigating to the page)."""
    return "text/html" in request.headers.get("accept", "")


def build_web_router() -> APIRouter:
    """FastAPI router with ``GET /`` (the page, or the Ollama probe text) and ``GET /ui/<file>``."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        if wants_html(request):
            return FileResponse(os.path.join(STATIC_DIR, "index.html"), media_type=_FILES["index.html"],
                                headers={"Cache-Control": "no-cache"})
        from pagedllm.entrypoints.openai.serving_ollama import OLLAMA_RUNNING_TEXT
        return PlainTextResponse(OLLAMA_RUNNING_TEXT)

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _FILES:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(os.path.join(STATIC_DIR, name), media_type=_FILES[name],
                            headers={"Cache-Control": "no-cache"})

    return router

"""``pagedllm run-batch``: run an OpenAI batch file through the server's request handlers, in
this process (vLLM's ``vllm run-batch`` / ``python -m vllm.entrypoints.openai.run_batch``).

Input (``-i``, a local path or an http(s) URL read with GET): one JSON object a line,
``{"custom_id": str, "method": "POST", "url": str, "body": {...}}`` (the OpenAI batch file
format), for ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/score``
(also ``/score``) and ``/rerank`` (``/v1/rerank``, ``/v2/rerank``). Output (``-o``, a local path,
or an http(s) URL the finished file is PUT to): one line per input line, in input order,

    {"id": "pagedllm-<hex>", "custom_id": str | null,
     "response": {"status_code": int, "request_id": "pagedllm-batch-<hex>", "body": {...} | null},
     "error": null | {"error": {"message", "type", "param", "code"}}}

a success carries the endpoint's JSON body (what the server answers) and ``error`` null; a
failure (a bad body, an unknown url, a streamed request, a line that is not JSON) carries the
error body the server would send and ``response.body`` null, as vLLM writes them; a bad line
never stops the batch. Every request of the file runs concurrently (at most
``2 * max_num_seqs`` in flight), each line is flushed as soon as it and all lines before it are
done, and a progress bar (tqdm, on stderr) counts them.

Resumption: with ``-o`` an existing local file, the lines already in it are kept (a torn last
line, from a run killed while writing, is dropped; so are 5xx records, to be retried) and only
the input lines whose ``custom_id`` has no record there run; when they are done the file is
rewritten in input order (while the run lasts, their records follow the kept ones). Input
lines are matched to the records in order: the k-th line with a ``custom_id`` to the k-th record
of it (a repeated ``custom_id`` is an error record: OpenAI requires them unique), lines without a
usable ``custom_id`` to the ``custom_id: null`` records.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import uuid
from typing import Any, Optional

logger = logging.getLogger("pagedllm.entrypoints.openai.run_batch")

# url -> (request model, route path of the server's handler)
_ROUTES = {
    "/v1/chat/completions": ("chat", "/v1/chat/completions"),
    "/v1/completions": ("completion", "/v1/completions"),
    "/v1/embeddings": ("embedding", "/v1/embeddings"),
    "/v1/score": ("score", "/v1/score"),
    "/score": ("score", "/score"),
    "/rerank": ("rerank", "/rerank"),
    "/v1/rerank": ("rerank", "/v1/rerank"),
    "/v2/rerank": ("rerank", "/v2/rerank"),
}
SUPPORTED = "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score, /rerank"


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """``run-batch``'s own flags (vLLM's names); the engine flags are ``pagedllm serve``'s."""
    g = parser.add_argument_group("Batch file")
    g.add_argument("-i", "--input-file", required=True,
                   help="The batch input file (OpenAI batch format, one request per line): a local path, or "
                        "an http(s) URL read with GET.")
    g.add_argument("-o", "--output-file", required=True,
                   help="The output file: a local path (an existing one is resumed: the requests already "
                        "in it are skipped), or an http(s) URL the finished file is uploaded to with PUT.")
    g.add_argument("--output-tmp-dir", default=None,
                   help="Directory for the output file before it is uploaded to an output URL.")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="Hide the progress bar.")


def _rid() -> str:
    return uuid.uuid4().hex


def _record(custom_id: Optional[str], status: int, body: Optional[dict], error: Optional[dict]) -> dict:
    return {"id": f"pagedllm-{_rid()}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"pagedllm-batch-{_rid()}", "body": body},
            "error": error}


def _error_record(custom_id: Optional[str], message: str, status: int = 400,
                  param: Optional[str] = None) -> dict:
    from pagedllm.entrypoints.openai.errors import error_body
    return _record(custom_id, status, None, error_body(message, status, param))


def read_existing_output(path: str) -> tuple[list[str], dict[str, int], int]:
    """The records of a half-written output file worth keeping, for resumption.

    Returns:
        (kept lines with their newline, custom_id -> records kept for it (a repeated custom_id
        has one per occurrence), number of kept ``custom_id: null`` records). A last line without a newline or that is not JSON (torn) is dropped, and so is
        every record with a 5xx status (retried).
    """
    if not os.path.exists(path):
        return [], {}, 0
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept, done, nulls = [], {}, 0
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                logger.info("dropping a torn last line of %s", path)
                continue
            raise ValueError(f"--output-file {path}: line {i + 1} is not JSON (not a batch output file?)") from None
        if not line.endswith("\n") or not isinstance(rec, dict) or "response" not in rec:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"--output-file {path}: line {i + 1} is not a batch output record")
        if int((rec.get("response") or {}).get("status_code", 200)) >= 500:
            continue
        kept.append(line)
        cid = rec.get("custom_id")
        if cid is None:
            nulls += 1
        else:
            done[cid] = done.get(cid, 0) + 1
    return kept, done, nulls


def _read_input(path_or_url: str) -> list[str]:
    if path_or_url.startswith(("http://", "https://")):
        import httpx
        r = httpx.get(path_or_url, timeout=300, follow_redirects=True)
        r.raise_for_status()
        text = r.text
    else:
        try:
            with open(path_or_url, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--input-file {path_or_url}: {e.strerror or e}") from None
    return [ln for ln in text.splitlines() if ln.strip()]


class _Handlers:
    """The server's handlers for each batch url, called in-process (no HTTP): the routes of
    ``build_app(engine, args)`` with the request models they take."""

    def __init__(self, engine: Any, args: argparse.Namespace) -> None:
        from fastapi.routing import APIRoute

        from pagedllm.entrypoints.openai import serving_pooling as sp
        from pagedllm.entrypoints.openai.api_server import build_app
        from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

        self.app = build_app(engine, args)
        self.models = {"chat": ChatCompletionRequest, "completion": CompletionRequest,
                       "embedding": sp.EmbeddingRequest, "score": sp.ScoreRequest, "rerank": sp.RerankRequest}
        self.endpoints: dict[str, Any] = {}

        def collect(routes: Any) -> None:
            for r in routes:
                if isinstance(r, APIRoute):
                    if "POST" in r.methods:
                        self.endpoints.setdefault(r.path, r.endpoint)
                else:  # an included router (FastAPI >= 0.120 keeps it as one entry)
                    inner = getattr(r, "original_router", None) or getattr(r, "router", None)
                    if inner is not None and hasattr(inner, "routes"):
                        collect(inner.routes)
        collect(self.app.routes)

    async def run(self, url: str, body: Any) -> tuple[int, Optional[dict], Optional[dict]]:
        """``(status, body or None, error body or None)`` of ``body`` posted to ``url``, as the server
        answers it (validation errors 400 naming the field, ``OpenAIError``s, 500 for a crash)."""
        from pydantic import ValidationError

        from pagedllm.entrypoints.openai.errors import (OpenAIError, error_body, format_validation_errors,
                                                        value_error_to_openai)
        from pagedllm.entrypoints.openai.serving_engine import SSEResponse

        kind, path = _ROUTES[url]
        try:
            if not isinstance(body, dict):
                raise OpenAIError("body: must be a JSON object", 400, "body")
            if body.get("stream"):
                raise OpenAIError("stream: a batch request must not be sent in stream mode", 400, "stream")
            try:
                request = self.models[kind].model_validate(body)
            except ValidationError as e:
                msg, param = format_validation_errors(e.errors(), skip=())
                raise OpenAIError(msg, 400, param) from None
            resp = await self.endpoints[path](request, None)
            if isinstance(resp, SSEResponse):  # pragma: no cover - stream refused above
                raise OpenAIError("stream: a batch request must not be sent in stream mode", 400, "stream")
            data = json.loads(resp.body) if resp.body else None
            if resp.status_code >= 400:
                return resp.status_code, None, data
            return resp.status_code, data, None
        except OpenAIError as e:
            return e.status_code, None, e.to_dict()
        except ValueError as e:
            err = value_error_to_openai(e)
            return err.status_code, None, err.to_dict()
        except Exception as e:  # the server's 500 (the batch goes on)
            logger.exception("batch request to %s failed", url)
            return 500, None, error_body(f"Internal server error: {e.__class__.__name__}: {e}", 500)


class _OrderedWriter:
    """Writes records in input order (line index), each flushed as soon as it and every line
    before it are done; memory bounded by how far results run out of order."""

    def __init__(self, f: Any, indices: list[int]) -> None:
        self.f = f
        self.order = indices  # input line indices to write, ascending
        self.pos = 0
        self.buffer: dict[int, dict] = {}
        self.written = 0

    def add(self, index: int, record: dict) -> None:
        self.buffer[index] = record
        while self.pos < len(self.order) and self.order[self.pos] in self.buffer:
            rec = self.buffer.pop(self.order[self.pos])
            self.f.write(json.dumps(rec, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n")
            self.f.flush()
            self.pos += 1
            self.written += 1


class _Ready:
    """A record known without running anything (a bad line)."""

    __slots__ = ("record",)

    def __init__(self, record: dict) -> None:
        self.record = record


def _plan(lines: list[str], done: dict[str, int], nulls_done: int) -> list[tuple[int, Optional[str], Any]]:
    """Per input line still to do: ``(index, custom_id, parsed line or an error record)``."""
    todo: list[tuple[int, Optional[str], Any]] = []
    seen: dict[str, int] = {}
    occurrence: dict[str, int] = {}
    nulls = 0
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
        except ValueError as e:
            obj, err = None, _error_record(None, f"line {i + 1}: not valid JSON ({e})", param=None)
        else:
            err = None
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        if not isinstance(cid, str) or not cid:
            nulls += 1
            if nulls <= nulls_done:
                continue
            todo.append((i, None, _Ready(err or _error_record(
                None, f"line {i + 1}: custom_id: a non-empty string is required", param="custom_id"))))
            continue
        occurrence[cid] = occurrence.get(cid, 0) + 1
        if occurrence[cid] <= done.get(cid, 0):  # its k-th record is there already
            seen.setdefault(cid, i)
            continue
        if cid in seen:
            todo.append((i, cid, _Ready(_error_record(cid, f"custom_id: {cid!r} repeats line {seen[cid] + 1} "
                                                    "(custom_ids must be unique)", param="custom_id"))))
            continue
        seen[cid] = i
        if obj.get("method", "POST") != "POST":
            todo.append((i, cid, _Ready(_error_record(cid, f"method: only POST is supported, got {obj.get('method')!r}",
                                               param="method"))))
        elif obj.get("url") not in _ROUTES:
            todo.append((i, cid, _Ready(_error_record(
                cid, f"URL {obj.get('url')!r} was used. Supported endpoints: {SUPPORTED}.", param="url"))))
        elif "body" not in obj:
            todo.append((i, cid, _Ready(_error_record(cid, "body: required", param="body"))))
        else:
            todo.append((i, cid, obj))
    return todo


def _line_custom_id(line: str) -> Optional[str]:
    """The usable ``custom_id`` of an input line (a non-empty string), else None."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


def _rewrite_in_input_order(path: str, lines: list[str]) -> None:
    """Rewrite the finished output file ``path`` with its records in the order of the input
    ``lines`` (after a resumed run the new records follow the kept ones). A record is matched to
    its line as the resumption matches them: the k-th record of a ``custom_id`` to the k-th
    input line with it, the k-th ``custom_id: null`` record to the k-th line without a usable
    one. Replaced atomically (a temporary file renamed over it)."""
    where: dict[Optional[str], list[int]] = {}
    for i, line in enumerate(lines):
        where.setdefault(_line_custom_id(line), []).append(i)
    used: dict[Optional[str], int] = {}
    keyed: list[tuple[int, int, str]] = []
    with open(path, encoding="utf-8") as f:
        for n, rec_line in enumerate(f):
            cid = json.loads(rec_line).get("custom_id")
            cid = cid if isinstance(cid, str) and cid else None
            k = used.get(cid, 0)
            used[cid] = k + 1
            slots = where.get(cid, [])
            keyed.append((slots[k] if k < len(slots) else len(lines) + n, n, rec_line))
    keyed.sort()
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line for _, _, line in keyed)
    os.replace(tmp, path)


async def run_batch(engine: Any, args: argparse.Namespace) -> dict[str, int]:
    """Run ``args.input_file`` into ``args.output_file`` on ``engine`` (an ``EngineClient``).

    Returns:
        ``{"total": input lines, "skipped": already in the output, "ok": 2xx written,
        "errors": error records written}``.

    Raises:
        ValueError: an unreadable input file, or an output file that is not a batch output.
    """
    from tqdm import tqdm

    lines = _read_input(args.input_file)
    out_url = args.output_file.startswith(("http://", "https://"))
    kept, done, nulls_done = ([], {}, 0) if out_url else read_existing_output(args.output_file)
    todo = _plan(lines, done, nulls_done)
    skipped = len(lines) - len(todo)
    if kept or done:
        logger.info("resuming %s: %d request(s) already done, %d to run", args.output_file, skipped, len(todo))
    handlers = _Handlers(engine, args)
    if out_url:
        fd, path = tempfile.mkstemp(prefix="batch_output_", suffix=".jsonl", dir=args.output_tmp_dir)
        os.close(fd)
    else:
        path = args.output_file
        if kept or os.path.exists(path):  # keep the good records only (torn line / 5xx dropped)
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)
    counts = {"total": len(lines), "skipped": skipped, "ok": 0, "errors": 0}
    from pagedllm.config import EngineArgs
    max_num_seqs = getattr(args, "max_num_seqs", None) or EngineArgs.__dataclass_fields__["max_num_seqs"].default
    limit = asyncio.Semaphore(2 * int(max_num_seqs))  # vLLM's bound on requests in flight
    with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), unit="req", desc="Running batch",
                                                      disable=not getattr(args, "progress", True),
                                                      file=sys.stderr) as bar:
        writer = _OrderedWriter(f, [i for i, _, _ in todo])

        async def one(i: int, cid: Optional[str], item: Any) -> None:
            if isinstance(item, _Ready):  # an error record already
                rec = item.record
            else:
                async with limit:
                    status, body, err = await handlers.run(item["url"], item["body"])
                rec = _record(cid, status, body, err)
            counts["ok" if rec["error"] is None else "errors"] += 1
            writer.add(i, rec)
            bar.update(1)

        await asyncio.gather(*(one(i, cid, item) for i, cid, item in todo))
    if kept and todo:  # resumed: the new records went after the kept ones; back to input order
        _rewrite_in_input_order(path, lines)
    if out_url:
        import httpx
        try:
            with open(path, "rb") as f:
                r = httpx.put(args.output_file, content=f.read(), timeout=1000)
            r.raise_for_status()
        finally:
            os.unlink(path)
    return counts


def run_batch_main(args: argparse.Namespace) -> int:
    """``pagedllm run-batch``: build the engine from the serve flags, run the file, print a
    summary line; returns 0 (per-line errors are records, not a failure), 2 for a user mistake."""
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.cli_utils import fail
    from pagedllm.entrypoints.openai.api_server import _setup_logging, engine_args_from_namespace

    _setup_logging()
    if not args.input_file.startswith(("http://", "https://")) and not os.path.isfile(args.input_file):
        return fail("pagedllm run-batch", f"--input-file {args.input_file}: no such file")
    if getattr(args, "reasoning_parser", None):
        cfg = dict(getattr(args, "structured_outputs_config", None) or {})
        cfg.setdefault("reasoning_parser", args.reasoning_parser)
        args.structured_outputs_config = cfg
    if not getattr(args, "enable_log_requests", False):
        args.disable_log_requests = True  # vLLM >= 0.10.2: requests are not logged by default
    try:
        engine = AsyncLLM.from_engine_args(engine_args_from_namespace(args))
    except ValueError as e:
        return fail("pagedllm run-batch", str(e))
    try:
        counts = asyncio.run(run_batch(engine, args))
    except ValueError as e:
        return fail("pagedllm run-batch", str(e))
    finally:
        engine.shutdown()
    print(f"pagedllm run-batch: {counts['ok'] + counts['errors']} request(s) written to {args.output_file} "
          f"({counts['ok']} ok, {counts['errors']} error(s)), {counts['skipped']} already there", flush=True)
    return 0

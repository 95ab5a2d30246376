"""Replay a trace against a running server (``pagedllm simulate replay``): the measurement the
simulator is validated against.

Each trace request is sent at its ``arrival_s`` (open loop, from the start of the run) as a streamed
``/v1/completions`` call with the prompt as token ids, ``max_tokens``, ``ignore_eos`` and greedy
sampling; TTFT is the time to the first streamed chunk with a choice, ITL the gaps between such
chunks, E2E the time to the end of the stream; output tokens are the server's ``usage`` counts.
The figures have the simulator's names (``output_throughput_tok_s`` = output tokens / the time from
the start to the last completion, as ``vllm bench serve``).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional, Sequence

from pagedllm.sim.simulator import _percentiles, _to_ms
from pagedllm.sim.trace import TraceRequest


async def _one(client: Any, url: str, model: str, tr: TraceRequest, t0: float, out: dict) -> None:
    await asyncio.sleep(max(0.0, t0 + tr.arrival_s - time.perf_counter()))
    body = {"model": model, "prompt": tr.prompt_token_ids, "max_tokens": tr.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times: list[float] = []
    n_out = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out["failed"].append(f"{tr.request_id}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                usage = chunk.get("usage")
                if usage:
                    n_out = int(usage.get("completion_tokens", 0))
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        out["failed"].append(f"{tr.request_id}: {type(e).__name__}: {e}")
        return
    end = time.perf_counter()
    if not times:
        out["failed"].append(f"{tr.request_id}: no streamed chunk")
        return
    out["ttft"].append(times[0] - sent)
    out["itl"].extend(b - a for a, b in zip(times, times[1:]))
    out["e2e"].append(end - sent)
    out["tokens"] += n_out or len(times)
    out["last_end"] = max(out["last_end"], end - t0)


async def _replay(trace: Sequence[TraceRequest], base_url: str, model: Optional[str], timeout_s: float) -> dict:
    import httpx

    base = base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=None)) as client:
        if model is None:
            r = await client.get(base + "/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        out: dict[str, Any] = {"ttft": [], "itl": [], "e2e": [], "tokens": 0, "failed": [], "last_end": 0.0}
        t0 = time.perf_counter()
        await asyncio.gather(*[_one(client, base + "/v1/completions", model, tr, t0, out) for tr in trace])
    dur = out["last_end"]
    return {
        "base_url": base_url, "model": model, "num_requests": len(trace), "num_completed": len(out["e2e"]),
        "num_failed": len(out["failed"]), "failures": out["failed"][:10], "num_output_tokens": out["tokens"],
        "duration_s": dur, "output_throughput_tok_s": out["tokens"] / dur if dur > 0 else 0.0,
        "request_throughput_req_s": len(out["e2e"]) / dur if dur > 0 else 0.0,
        "ttft_ms": _to_ms(_percentiles(out["ttft"])), "itl_ms": _to_ms(_percentiles(out["itl"])),
        "e2e_ms": _to_ms(_percentiles(out["e2e"]))}


def replay(trace: Sequence[TraceRequest], base_url: str, model: Optional[str] = None,
           timeout_s: float = 600.0) -> dict:
    """Send ``trace`` to the server at ``base_url`` (module docstring); returns the figures (ms,
    tok/s). Raises ``httpx.HTTPError`` / ``OSError`` when the server cannot be reached."""
    return asyncio.run(_replay(trace, base_url, model, timeout_s))

"""Arrival traces for the simulator (and the replay client): JSON Lines files and synthetic generators.

A trace is a list of :class:`TraceRequest`, sorted by ``arrival_s``. File format: one JSON object a
line (blank lines and lines starting with ``#`` are skipped)::

    {"arrival_s": 0.25, "prompt_token_ids": [101, 102, ...], "max_tokens": 64, "conversation_id": "c7"}
    {"arrival_s": 0.50, "prefix_id": "sys-0", "prefix_len": 256, "prompt_len": 400, "max_tokens": 32}

- ``arrival_s`` (number >= 0, required): seconds from the start of the run.
- the prompt, either ``prompt_token_ids`` (list of ints >= 0, non-empty), or ``prompt_len`` (int >= 1)
  with optional ``prefix_id`` (str) and ``prefix_len`` (int, 0..prompt_len): the first ``prefix_len``
  tokens are a fixed sequence named by ``prefix_id`` (equal ids, equal tokens: a shared system prompt
  or document), the rest are drawn for this line alone (from ``request_id``, or the line number).
- ``max_tokens`` (int >= 1, required): tokens generated (EOS is ignored, as ``ignore_eos``).
- optional: ``conversation_id`` (str; what the ``sticky`` policy keys on), ``request_id`` (str,
  unique; default ``req-<line>``), ``output_token_ids`` (list of ints: the tokens the simulator
  emits, e.g. a multi-turn conversation's assistant turns, so that the next turn's prompt, which
  contains them, hits the cache as in a real chat; default a filler token), ``think_time_s``
  (number >= 0: in a closed-loop run, the request is sent this long after the previous turn of its
  conversation finished).

Token ids are drawn from ``[TOKEN_LO, TOKEN_HI)`` (ordinary text tokens of SmolLM2's vocabulary), so
the same trace can be replayed against a real server (``pagedllm simulate replay``).

A malformed file raises :class:`TraceError` (a ``ValueError``) naming the line and the field.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

#: Token ids synthetic prompts use (SmolLM2's vocabulary is 49152; ids below 256 are bytes/specials).
TOKEN_LO, TOKEN_HI = 256, 49152
#: The token the simulator emits when a request has no ``output_token_ids``.
FILLER_TOKEN = 1000

SYNTHETIC_KINDS = ("poisson", "bursty", "multi-turn", "long-doc")


class TraceError(ValueError):
    """A malformed trace file or bad generator settings (the message names line and field)."""


@dataclass
class TraceRequest:
    """One request of a trace.

    Attributes:
        request_id: unique id.
        arrival_s: seconds from the start of the run (float).
        prompt_token_ids: the prompt (list[int]).
        max_tokens: tokens to generate (EOS ignored).
        conversation_id: a conversation / session key, or None.
        output_token_ids: what the simulator emits (len >= max_tokens is not required: it is
            padded with ``FILLER_TOKEN``), or None.
        think_time_s: closed-loop runs (``simulate(closed_loop=True)``): seconds between the end of
            the conversation's previous turn and this request; None: the gap between the two
            turns' ``arrival_s``.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    conversation_id: Optional[str] = None
    output_token_ids: Optional[list[int]] = field(default=None, repr=False)
    think_time_s: Optional[float] = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"request_id": self.request_id, "arrival_s": round(self.arrival_s, 6),
                             "prompt_token_ids": self.prompt_token_ids, "max_tokens": self.max_tokens}
        if self.conversation_id is not None:
            d["conversation_id"] = self.conversation_id
        if self.output_token_ids is not None:
            d["output_token_ids"] = self.output_token_ids
        if self.think_time_s is not None:
            d["think_time_s"] = round(self.think_time_s, 6)
        return d


def fixed_tokens(key: str, n: int) -> list[int]:
    """``n`` token ids in ``[TOKEN_LO, TOKEN_HI)`` determined by ``key`` alone (a named prefix)."""
    rng = random.Random(f"pagedllm-sim:{key}")
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def _err(where: str, msg: str) -> TraceError:
    return TraceError(f"{where}: {msg}")


def _int(obj: dict, name: str, where: str, lo: int, required: bool = True) -> Optional[int]:
    v = obj.get(name)
    if v is None:
        if required:
            raise _err(where, f"{name}: required")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _err(where, f"{name}: expected an integer >= {lo}, got {v!r}")
    return v


def _token_list(obj: dict, name: str, where: str) -> Optional[list[int]]:
    v = obj.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in v):
        raise _err(where, f"{name}: expected a non-empty list of integers >= 0")
    return v


def parse_trace_line(obj: Any, lineno: int) -> TraceRequest:
    """One trace record (a decoded JSON value) as a :class:`TraceRequest`; TraceError if malformed."""
    where = f"line {lineno}"
    if not isinstance(obj, dict):
        raise _err(where, f"expected a JSON object, got {type(obj).__name__}")
    t = obj.get("arrival_s")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise _err(where, f"arrival_s: expected a number >= 0, got {t!r}")
    rid = obj.get("request_id", f"req-{lineno}")
    if not isinstance(rid, str) or not rid:
        raise _err(where, f"request_id: expected a non-empty string, got {rid!r}")
    max_tokens = _int(obj, "max_tokens", where, 1)
    prompt = _token_list(obj, "prompt_token_ids", where)
    if prompt is None:
        plen = obj.get("prompt_len")
        if plen is None:
            raise _err(where, "prompt_token_ids or prompt_len: required")
        plen = _int(obj, "prompt_len", where, 1)
        assert plen is not None
        pid = obj.get("prefix_id")
        plen_prefix = _int(obj, "prefix_len", where, 0, required=False) or 0
        if plen_prefix > plen:
            raise _err(where, f"prefix_len: {plen_prefix} exceeds prompt_len {plen}")
        if pid is not None and not isinstance(pid, str):
            raise _err(where, f"prefix_id: expected a string, got {pid!r}")
        if pid is None and plen_prefix:
            raise _err(where, "prefix_len: needs a prefix_id")
        prompt = (fixed_tokens(f"prefix:{pid}", plen_prefix) if plen_prefix else []) + \
            fixed_tokens(f"req:{rid}", plen - plen_prefix)
    conv = obj.get("conversation_id")
    if conv is not None and not isinstance(conv, (str, int)):
        raise _err(where, f"conversation_id: expected a string, got {conv!r}")
    out = _token_list(obj, "output_token_ids", where)
    think = obj.get("think_time_s")
    if think is not None and (isinstance(think, bool) or not isinstance(think, (int, float))
                              or not math.isfinite(think) or think < 0):
        raise _err(where, f"think_time_s: expected a number >= 0, got {think!r}")
    assert max_tokens is not None
    return TraceRequest(rid, float(t), list(prompt), max_tokens, None if conv is None else str(conv), out,
                        None if think is None else float(think))


def load_trace(path: str) -> list[TraceRequest]:
    """Read a JSONL trace (module docstring), sorted by arrival (stable). Raises TraceError:
    unreadable file, bad JSON, a bad field, a duplicate request_id, or no requests."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"--trace: cannot read {path}: {e}") from None
    out: list[TraceRequest] = []
    seen: set[str] = set()
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise TraceError(f"--trace {path}: line {i}: not JSON ({e.msg})") from None
        try:
            req = parse_trace_line(obj, i)
        except TraceError as e:
            raise TraceError(f"--trace {path}: {e}") from None
        if req.request_id in seen:
            raise TraceError(f"--trace {path}: line {i}: request_id: duplicate {req.request_id!r}")
        seen.add(req.request_id)
        out.append(req)
    if not out:
        raise TraceError(f"--trace {path}: no requests")
    out.sort(key=lambda r: r.arrival_s)
    return out


def write_trace(path: str, trace: Iterable[TraceRequest]) -> None:
    """Write ``trace`` as JSONL (token ids spelled out: the file replays on its own)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


# ---- synthetic generators ---------------------------------------------------------------

def _arrivals(rng: random.Random, rate: float, duration_s: float, burstiness: float) -> list[float]:
    """Arrival times in ``[0, duration_s)``: gamma inter-arrivals of mean ``1/rate`` and shape
    ``burstiness`` (1 = Poisson; < 1 burstier; as ``vllm bench serve --burstiness``)."""
    out: list[float] = []
    t = 0.0
    theta = 1.0 / (rate * burstiness)
    while True:
        t += rng.gammavariate(burstiness, theta)
        if t >= duration_s:
            return out
        out.append(t)


def synthetic_trace(kind: str, *, rate: float, duration_s: float, seed: int = 0,
                    input_len: tuple[int, int] = (128, 512), output_len: tuple[int, int] = (16, 128),
                    num_turns: int = 8, num_system_prompts: int = 4, system_prompt_len: int = 256,
                    user_len: tuple[int, int] = (32, 96), think_time_s: float = 20.0,
                    num_documents: int = 16, doc_len: tuple[int, int] = (2048, 6144),
                    burstiness: float = 0.25) -> list[TraceRequest]:
    """A synthetic trace, deterministic for ``seed``.

    Args:
        kind: "poisson" (independent random prompts, Poisson arrivals), "bursty" (the same with gamma
            inter-arrivals of shape ``burstiness``), "multi-turn" (conversations, each ``num_turns``
            turns; a conversation starts with one of ``num_system_prompts`` shared system prompts of
            ``system_prompt_len`` tokens; turn k's prompt is the whole conversation so far, i.e. turn
            k-1's prompt and answer, plus new user text of ``user_len`` tokens; turns ``think_time_s``
            apart on average (exponential); ``rate`` is requests/s, so conversations start at
            ``rate / num_turns`` per second), "long-doc" (questions about ``num_documents`` shared
            documents of ``doc_len`` tokens, documents picked with Zipf-like weights 1/(i+1); a
            question is ``user_len`` tokens).
        rate: mean requests per second (whole fleet).
        duration_s: arrivals fall in ``[0, duration_s)`` (multi-turn: conversations *start* there).
        input_len, output_len: inclusive uniform ranges of prompt / output tokens (output for all
            kinds; input for poisson/bursty).

    Raises:
        TraceError: unknown kind or a non-positive rate/duration.
    """
    if kind not in SYNTHETIC_KINDS:
        raise TraceError(f"--synthetic: expected one of {list(SYNTHETIC_KINDS)}, got {kind!r}")
    if not rate > 0 or not duration_s > 0:
        raise TraceError(f"--rate and --duration-s: must be > 0, got {rate} and {duration_s}")
    rng = random.Random(seed)
    out: list[TraceRequest] = []

    def draw(lo_hi: tuple[int, int]) -> int:
        return rng.randint(lo_hi[0], lo_hi[1])

    def toks(n: int) -> list[int]:
        return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    if kind in ("poisson", "bursty"):
        for i, t in enumerate(_arrivals(rng, rate, duration_s, 1.0 if kind == "poisson" else burstiness)):
            out.append(TraceRequest(f"req-{i}", t, toks(draw(input_len)), draw(output_len)))
    elif kind == "multi-turn":
        systems = [fixed_tokens(f"system:{seed}:{j}", system_prompt_len) for j in range(num_system_prompts)]
        for c, t0 in enumerate(_arrivals(rng, rate / num_turns, duration_s, 1.0)):
            history = list(systems[rng.randrange(num_system_prompts)])
            t = t0
            think: Optional[float] = None
            for k in range(num_turns):
                prompt = history + toks(draw(user_len))
                n_out = draw(output_len)
                answer = toks(n_out)
                out.append(TraceRequest(f"conv-{c}-turn-{k}", t, prompt, n_out, f"conv-{c}", answer, think))
                history = prompt + answer
                think = rng.expovariate(1.0 / think_time_s)
                t += think
    else:  # long-doc
        docs = [fixed_tokens(f"doc:{seed}:{j}", draw(doc_len)) for j in range(num_documents)]
        weights = [1.0 / (j + 1) for j in range(num_documents)]
        for i, t in enumerate(_arrivals(rng, rate, duration_s, 1.0)):
            j = rng.choices(range(num_documents), weights)[0]
            out.append(TraceRequest(f"req-{i}", t, docs[j] + toks(draw(user_len)), draw(output_len), f"doc-{j}"))
    out.sort(key=lambda r: r.arrival_s)
    return out

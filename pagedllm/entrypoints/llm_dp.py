"""Offline data parallelism: ``LLM(model, data_parallel_size=N)`` runs N independent engines, one
per child process (``multiprocessing`` "spawn"), each an ``LLM`` with ``data_parallel_rank`` r.

``generate`` / ``chat`` / ``encode`` / ``embed`` / ``classify`` split their prompts into N contiguous
slices (sizes differ by at most one; per-prompt lists such as a list of SamplingParams,
LoRA requests or priorities are split the same way), run the slices at the same time and return
the outputs concatenated, i.e. in input order. Request ids are each replica's own. Other calls
(``reset_prefix_cache``, ``sleep``, ``wake_up``, ``add_lora``, ...) go to every replica and return
replica 0's answer; ``get_tokenizer`` / ``get_default_sampling_params`` ask replica 0.

Each replica's engine arguments are the caller's with ``data_parallel_size=1`` and its rank
(KV event endpoints get vLLM's per-rank port offset); ``num_threads`` is per replica.
"""
from __future__ import annotations

import inspect
import multiprocessing as mp
import traceback
from typing import Any, Optional

from pagedllm.entrypoints.llm import LLM

#: Methods whose first argument is a list of prompts (split across the replicas).
SPLIT = ("generate", "chat", "encode", "embed", "classify", "beam_search")
#: Keyword arguments that may hold one entry per prompt.
PER_PROMPT = ("sampling_params", "pooling_params", "lora_request", "priority")


def _child(conn: Any, model: str, kwargs: dict) -> None:
    try:
        llm = LLM(model, **kwargs)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        conn.send(("err", e, traceback.format_exc()))
        return
    conn.send(("ok", None, ""))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        name, args, kw = msg
        try:
            conn.send(("ok", getattr(llm, name)(*args, **kw), ""))
        except BaseException as e:  # noqa: BLE001
            conn.send(("err", e, traceback.format_exc()))
    llm.shutdown()


def _slices(n_items: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(n_items, n)
    out, start = [], 0
    for r in range(n):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def _split_method(name: str) -> Any:
    """``DataParallelLLM.<name>``: ``LLM.<name>`` over the replicas, its first argument (the
    prompts, or for ``chat`` one conversation or a list) split into one contiguous slice per
    replica (``_split_call``); the outputs, a list, in input order."""

    def call(self: DataParallelLLM, items: Any, *args: Any, **kwargs: Any) -> list:
        return self._split_call(name, items, args, kwargs)

    call.__name__ = name
    call.__qualname__ = f"DataParallelLLM.{name}"
    call.__doc__ = f"``LLM.{name}`` over the replicas; outputs in input order."
    return call


class DataParallelLLM(LLM):
    """``LLM`` over ``data_parallel_size`` replica processes (see the module docstring).

    Raises:
        ValueError / TypeError: what a replica's ``LLM(...)`` raised (every replica started is
            stopped).
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        n = int(kwargs.pop("data_parallel_size"))
        if n < 1:
            raise ValueError(f"data_parallel_size: must be >= 1, got {n}")
        self.data_parallel_size = n
        self.llm_engine = None  # type: ignore[assignment]
        ctx = mp.get_context("spawn")
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(child, model, dict(kwargs, data_parallel_rank=r)),
                            name=f"pagedllm-dp{r}", daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        errors = []
        for conn in self._conns:
            try:
                status, err, _ = conn.recv()
            except EOFError:
                status, err = "err", RuntimeError("a data-parallel replica process died at start-up")
            if status != "ok":
                errors.append(err)
        if errors:
            self.shutdown()
            raise errors[0]

    def _call_all(self, calls: list[Optional[tuple[str, tuple, dict]]]) -> list[Any]:
        for conn, call in zip(self._conns, calls):
            if call is not None:
                conn.send(call)
        results, first_err = [], None
        for conn, call in zip(self._conns, calls):
            if call is None:
                results.append(None)
                continue
            try:
                status, value, _ = conn.recv()
            except EOFError:
                status, value = "err", RuntimeError("a data-parallel replica process died")
            if status != "ok" and first_err is None:
                first_err = value
            results.append(value)
        if first_err is not None:
            raise first_err
        return results

    def _split_call(self, name: str, items: Any, args: tuple, kwargs: dict) -> list[Any]:
        single = isinstance(items, (str, dict)) or (name == "chat" and items and isinstance(items[0], dict))
        items = [items] if single else list(items)
        # Positional arguments by name (so a per-prompt list given positionally is split too).
        params = list(inspect.signature(getattr(LLM, name)).parameters)[2:]
        kwargs = dict(kwargs, **dict(zip(params, args)))
        args = ()
        calls: list[Optional[tuple[str, tuple, dict]]] = []
        for lo, hi in _slices(len(items), self.data_parallel_size):
            if lo == hi:
                calls.append(None)
                continue
            kw = dict(kwargs)
            if name != "beam_search":
                kw["use_tqdm"] = False
            for key in PER_PROMPT:
                v = kw.get(key)
                if isinstance(v, (list, tuple)) and len(v) == len(items):
                    kw[key] = list(v[lo:hi])
            calls.append((name, (items[lo:hi], *args), kw))
        out: list[Any] = []
        for part in self._call_all(calls):
            out.extend(part or [])
        return out

    # The SPLIT methods: LLM.<name> over the replicas, outputs in input order.
    generate = _split_method("generate")
    chat = _split_method("chat")  # one conversation or a list
    encode = _split_method("encode")
    embed = _split_method("embed")
    classify = _split_method("classify")
    beam_search = _split_method("beam_search")

    def score(self, *args: Any, **kwargs: Any) -> list:  # type: ignore[override]
        """``LLM.score`` on replica 0 (not split)."""
        return self._first("score", *args, **kwargs)

    def _broadcast(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call_all([(name, args, kwargs)] * self.data_parallel_size)[0]

    def _first(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call_all([(name, args, kwargs)] + [None] * (self.data_parallel_size - 1))[0]

    def get_tokenizer(self):
        return self._first("get_tokenizer")

    def get_default_sampling_params(self):
        return self._first("get_default_sampling_params")

    def reset_prefix_cache(self) -> bool:
        return bool(all(self._call_all([("reset_prefix_cache", (), {})] * self.data_parallel_size)))

    def sleep(self, level: int = 1) -> None:
        self._broadcast("sleep", level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self._broadcast("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self._first("is_sleeping"))

    def add_lora(self, lora_request: Any) -> bool:
        return bool(all(self._call_all([("add_lora", (lora_request,), {})] * self.data_parallel_size)))

    def remove_lora(self, lora_int_id: int) -> bool:
        return bool(all(self._call_all([("remove_lora", (lora_int_id,), {})] * self.data_parallel_size)))

    def list_loras(self) -> set[int]:
        return set(self._first("list_loras"))

    def shutdown(self) -> None:
        """Stop the replica processes (idempotent)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._conns, self._procs = [], []

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

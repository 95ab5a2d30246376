"""The cyclic garbage collector while an engine serves (issue 35: host time per step).

Every engine step allocates a few container objects per request (outputs, lists), so Python's
generation-0 collection runs every few steps and, every hundred or so of those, a full
collection walks every tracked object of the process: the model's modules, the tokenizer's
tables, the request states. At 1,024 requests that walk was a visible, growing share of a step.

Two settings, applied once per process by the first engine that starts (as vLLM marks the
start-up heap static after its engine core starts):

* ``gc.freeze()`` after start-up (``PAGEDLLM_GC_FREEZE``, default on): after one full
  collection, everything alive then (weights' modules, tokenizer, configs) moves to the
  permanent generation, which no later collection walks. The engine that froze the heap
  unfreezes it when it shuts down (``LLMEngine.shutdown``) or is freed (a ``weakref.finalize``:
  an engine dropped without a shutdown is freed by reference counting), so a process that
  creates engine after engine (tests) holds at most one live engine's start-up heap out of the
  collector.
* a larger generation-0 threshold (``PAGEDLLM_GC_THRESHOLD``, default 10,000 allocations; 0
  leaves Python's): young collections, and with them full ones, run ~14x less often. Applied
  only while the thresholds are Python's defaults (a process that set its own keeps them), and
  restored with the unfreeze.

Start-up itself (``LLMEngine.__init__``) runs with automatic collections off
(:func:`collector_paused`): loading allocates millions of objects that stay alive, and the
automatic young and full collections over them (~0.25 s per start, SmolLM2, Zen 4) found nothing;
peak and settled RSS were unchanged (614 MiB peak either way). The in-process worker's explicit
full collection after loading still runs; the freeze then collects only the young generations.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Iterator
from typing import Optional

from pagedllm import envs

logger = logging.getLogger("pagedllm")

#: Python's default thresholds (CPython 3.8-3.13).
_PY_DEFAULT_THRESHOLD = (700, 10, 10)

# The engine (id) that froze the heap and the thresholds it replaced; None when none did.
_owner: Optional[int] = None
_saved_threshold: Optional[tuple[int, int, int]] = None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collections off for the ``with`` body (an engine's construction), restored
    after it, also on an exception; explicit ``gc.collect()`` calls still run. Nests: an inner
    pause leaves the collector as the outer one set it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def full_collections() -> int:
    """How many full (generation-2) collections this process has run so far; pass it to
    :func:`freeze_startup_heap` as ``full_collections_before``."""
    return int(gc.get_stats()[2]["collections"])


def freeze_startup_heap(owner: object, full_collections_before: Optional[int] = None) -> bool:
    """Collect, then freeze the heap and raise the generation-0 threshold (see the module
    docstring); a no-op when an earlier engine of this process already did, or when
    ``PAGEDLLM_GC_FREEZE`` is off.

    Args:
        owner: the engine; only its :func:`release_startup_heap` undoes this.
        full_collections_before: :func:`full_collections` when the engine's construction
            began. When a full collection has run since (the in-process worker collects after
            loading: ``Worker.release_idle_memory``), only the young generations are collected
            here: a second walk of the whole start-up heap (~0.14 s with torch and transformers
            imported) would find nothing the first one missed but the few objects made since.

    Returns:
        True when this call froze the heap.
    """
    global _owner, _saved_threshold
    if _owner is not None or not envs.get("PAGEDLLM_GC_FREEZE"):
        return False
    if full_collections_before is not None and full_collections() > full_collections_before:
        gc.collect(1)
    else:
        gc.collect()
    gc.freeze()
    _owner = id(owner)
    weakref.finalize(owner, _release_id, _owner)
    th = int(envs.get("PAGEDLLM_GC_THRESHOLD") or 0)
    if th > 0 and gc.get_threshold() == _PY_DEFAULT_THRESHOLD:
        _saved_threshold = gc.get_threshold()
        gc.set_threshold(th, *_saved_threshold[1:])
    logger.debug("pagedllm: gc: froze %d start-up objects; thresholds %s", gc.get_freeze_count(),
                 gc.get_threshold())
    return True


def release_startup_heap(owner: object) -> bool:
    """Undo :func:`freeze_startup_heap` if ``owner`` did it: unfreeze (the objects return to
    the oldest generation, collectable again) and restore the thresholds it replaced.

    Returns:
        True when something was undone.
    """
    return _release_id(id(owner))


def _release_id(owner_id: int) -> bool:
    global _owner, _saved_threshold
    if _owner is None or _owner != owner_id:
        return False
    gc.unfreeze()
    if _saved_threshold is not None and gc.get_threshold()[0] == int(envs.get("PAGEDLLM_GC_THRESHOLD") or 0):
        gc.set_threshold(*_saved_threshold)
    _owner = None
    _saved_threshold = None
    return True


def is_frozen_by(owner: object) -> bool:
    """True when ``owner`` froze this process's start-up heap (and has not released it)."""
    return _owner is not None and _owner == id(owner)

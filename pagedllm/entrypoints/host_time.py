"""Host time per engine step, by phase (``pagedllm bench throughput --null-model``).

:class:`HostTimeProfiler` wraps, on one in-process ``LLM``'s objects (nothing global except
the detokenizer's two methods, restored by :meth:`HostTimeProfiler.close`), the calls that make
up a step and sums their wall time over the *decode steps* (steps in which every scheduled
request computes exactly one token):

============================ ==========================================================
phase                        what is timed
============================ ==========================================================
``schedule``                 ``EngineCore._schedule`` (scheduler + grammar bitmask)
``prepare_inputs``           ``InputBatch.update`` / ``update_cached`` + ``ModelRunner._prepare``
                             / ``_prepare_flat`` (input ids,
                             positions, block tables, slot mapping, attention metadata)
``forward``                  the model's ``forward`` (~0 with the null model)
``sample``                   ``ModelRunner._sample`` (logits, sampling metadata, sampler,
                             copies of the sampled ids / logprobs to Python)
``update``                   ``Scheduler.update_from_output`` (append tokens, stop checks)
``output_processing``        ``OutputProcessor.process_outputs`` minus ``detokenize``
``detokenize``               ``IncrementalDetokenizer.add_tokens`` / ``flush``
``other``                    the rest of ``LLMEngine.step`` (executor, runner bookkeeping,
                             per-request stats)
============================ ==========================================================

With ``phases=False`` only the step and the scheduler are wrapped (two timer pairs per step,
none per request): use that pass for the total (:attr:`step_s`) and a ``phases=True`` pass
for the split, whose per-request detokenizer timers add a little of their own.
"""
from __future__ import annotations

import time
from typing import Any, Callable

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "update", "output_processing",
          "detokenize", "other")


class HostTimeProfiler:
    """Times the phases of ``llm``'s engine steps (see the module docstring).

    Args:
        llm: a ``pagedllm.LLM`` whose workers run in this process (``"uni"`` executor).
        phases: also time the phases (else only whole steps).

    Attributes:
        num_steps: engine steps that scheduled something.
        num_decode_steps: of those, decode steps (the ones summed).
        decode_batch_sizes: requests in each decode step.
        step_s: wall seconds of the decode steps (``LLMEngine.step``).
        step_cpu_s: CPU seconds of this thread in them (``time.thread_time``: less sensitive to
            other processes on the machine than wall time).
        phase_s: phase -> wall seconds over the decode steps (``other`` filled by :meth:`report`).

    Raises:
        AttributeError: the engine's workers run in other processes.
    """

    def __init__(self, llm: Any, phases: bool = True) -> None:
        eng = llm.llm_engine
        core = eng.core
        runner = core.runner  # raises for multi-process executors
        self.num_steps = 0
        self.num_decode_steps = 0
        self.decode_batch_sizes: list[int] = []
        self.step_s = 0.0
        self.step_cpu_s = 0.0
        self.phase_s = {p: 0.0 for p in PHASES}
        self._cur = {p: 0.0 for p in PHASES}
        self._is_decode = False
        self._restore: list[tuple[Any, str, Any, bool]] = []
        perf = time.perf_counter
        cpu = time.thread_time

        def on_schedule(fn: Callable) -> Callable:
            def wrapped(*a, **k):
                t = perf()
                so = fn(*a, **k)
                self._cur["schedule"] += perf() - t
                n = so.num_reqs  # (the flat form: decodes without drafts, nothing to build)
                self._is_decode = n > 0 and so.total_num_scheduled_tokens == n and (so.is_flat or not any(
                    s.spec_token_ids for s in so.scheduled))
                if n:
                    self.num_steps += 1
                    if self._is_decode:
                        self.decode_batch_sizes.append(n)
                return so
            return wrapped

        def on_step(fn: Callable) -> Callable:
            def wrapped(*a, **k):
                self._is_decode = False
                for p in PHASES:
                    self._cur[p] = 0.0
                c = cpu()
                t = perf()
                out = fn(*a, **k)
                dt = perf() - t
                dc = cpu() - c
                if self._is_decode:
                    self.num_decode_steps += 1
                    self.step_s += dt
                    self.step_cpu_s += dc
                    for p in PHASES:
                        self.phase_s[p] += self._cur[p]
                return out
            return wrapped

        self._wrap(core, "_schedule", on_schedule)
        self._wrap(eng, "step", on_step)
        if phases:
            self._wrap(runner.input_batch, "update", self._timer("prepare_inputs"))
            self._wrap(runner, "_prepare", self._timer("prepare_inputs"))
            self._wrap(runner.input_batch, "update_cached", self._timer("prepare_inputs"))
            self._wrap(runner, "_prepare_flat", self._timer("prepare_inputs"))
            self._wrap(runner.model, "forward", self._timer("forward"))
            self._wrap(runner, "_sample", self._timer("sample"))
            self._wrap(core.scheduler, "update_from_output", self._timer("update"))
            self._wrap(eng.output_processor, "process_outputs", self._timer("output_processing"))
            from pagedllm.engine.detokenizer import IncrementalDetokenizer
            self._wrap(IncrementalDetokenizer, "add_tokens", self._timer("detokenize"), cls=True)
            self._wrap(IncrementalDetokenizer, "flush", self._timer("detokenize"), cls=True)

    def _timer(self, phase: str) -> Callable[[Callable], Callable]:
        cur = self._cur
        perf = time.perf_counter

        def deco(fn: Callable) -> Callable:
            def wrapped(*a, **k):
                t = perf()
                try:
                    return fn(*a, **k)
                finally:
                    cur[phase] += perf() - t
            return wrapped
        return deco

    def _wrap(self, obj: Any, name: str, deco: Callable[[Callable], Callable], cls: bool = False) -> None:
        orig = obj.__dict__.get(name) if cls else getattr(obj, name)
        had_own = cls or name in getattr(obj, "__dict__", {})
        self._restore.append((obj, name, orig, had_own))
        setattr(obj, name, deco(orig))

    def close(self) -> None:
        """Undo every wrapper (idempotent)."""
        while self._restore:
            obj, name, orig, had_own = self._restore.pop()
            if had_own:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)

    def report(self) -> dict:
        """Milliseconds per decode step: ``host_ms_per_decode_step`` (the whole step, wall),
        ``host_cpu_ms_per_decode_step`` (this thread's CPU time in it) and
        ``phases`` (each phase; ``output_processing`` excludes ``detokenize``; ``other`` is the
        step minus the timed phases), with the step counts and the mean decode batch."""
        n = max(self.num_decode_steps, 1)
        ps = dict(self.phase_s)
        ps["output_processing"] = max(0.0, ps["output_processing"] - ps["detokenize"])
        timed = sum(v for k, v in ps.items() if k != "other")
        ps["other"] = max(0.0, self.step_s - timed) if timed > 0 else 0.0
        sizes = self.decode_batch_sizes
        return {
            "host_ms_per_decode_step": 1e3 * self.step_s / n,
            "host_cpu_ms_per_decode_step": 1e3 * self.step_cpu_s / n,
            "phases_ms_per_decode_step": {k: 1e3 * v / n for k, v in ps.items()},
            "num_steps": self.num_steps,
            "num_decode_steps": self.num_decode_steps,
            "mean_decode_batch_size": (sum(sizes) / len(sizes)) if sizes else 0.0,
        }

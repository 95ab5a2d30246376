"""``pagedllm simulate fit``: time the real engine's steps over a grid of batch shapes and fit the
simulator's :class:`~pagedllm.sim.step_model.StepModel`.

The engine (``LLM``, in process, prefix caching off so every prompt token is computed) is driven
one ``EngineCore.step()`` at a time; each step's wall time (``time.perf_counter``) is paired with its
batch's features (``step_features`` of the ``SchedulerOutput``). The grid: single prompts of
``--prefills`` tokens (prefill steps, then a few decodes), and ``--rows`` requests of ``--contexts``
tokens each decoding together (chunked prefill steps, then decode steps of that many rows), plus a
staggered mix (decodes and prefill chunks in one step). ``--repeats`` passes; the first pass's
first steps warm the model up and are dropped.
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

from pagedllm.sim.step_model import StepModel, fit_step_model, step_features


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def fit_on_engine(args: argparse.Namespace) -> StepModel:
    """Run the grid on ``args.model`` and return the fitted model (``meta``: the samples, host)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import parse_bytes
    from pagedllm.core.request import Request

    rows = [int(x) for x in args.rows.split(",") if x]
    ctxs = [int(x) for x in args.contexts.split(",") if x]
    prefills = [int(x) for x in args.prefills.split(",") if x]
    kv = parse_bytes(args.kv_cache_memory)
    llm = LLM(args.model, num_threads=args.num_threads, seed=0, kv_cache_memory=kv, enable_prefix_caching=False,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len)
    core = llm.llm_engine.core
    sched = core.scheduler
    orig = sched.schedule
    feats: list[Any] = []

    def schedule() -> Any:
        so = orig()
        feats.append(step_features(so.scheduled))
        return so

    sched.schedule = schedule  # type: ignore[method-assign]
    V = int(core.vocab_size)
    counter = [0]

    def add(n_prompt: int, max_tokens: int) -> None:
        counter[0] += 1
        k = counter[0]
        prompt = [256 + (7919 * k + 31 * j) % (V - 512) for j in range(n_prompt)]
        core.add_request(Request(f"fit-{k}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True), eos_token_id=None))

    samples: list[tuple[int, int, float, float, float]] = []

    def run(keep: bool, stagger: int = 0, pending: Any = ()) -> None:
        pending = list(pending)
        i = 0
        while core.has_unfinished_requests() or pending:
            if pending and (stagger == 0 or i % stagger == 0):
                add(*pending.pop(0))
            t0 = time.perf_counter()
            feats.clear()
            core.step()
            dt = time.perf_counter() - t0
            i += 1
            if keep and feats and (feats[0][0] or feats[0][1]):
                samples.append((*feats[0], dt))

    for rep in range(args.repeats):
        if rep == 0:
            add(64, 8)
            run(False)  # warm-up
        for n in prefills:
            if n + 4 <= args.max_model_len:
                add(n, 4)
                run(True)
        for c in ctxs:
            for m in rows:
                if m * c > args.max_grid_tokens or c + 12 > args.max_model_len:
                    continue
                for _ in range(m):
                    add(c, 12)
                run(True)
        run(True, stagger=3, pending=[(ctxs[len(ctxs) // 2], 16)] * 8)
    model = fit_step_model(samples, engine={
        "num_blocks": int(core.num_blocks), "block_size": int(core.block_size),
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": int(core.max_model_len), "kv_cache_memory": args.kv_cache_memory})
    model.meta.update({
        "model": args.model, "num_threads": args.num_threads, "cpu": _cpu_model(),
        "loadavg_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "samples": [[p, r, round(c, 3), round(k, 3), round(t, 6)] for p, r, c, k, t in samples]})
    return model

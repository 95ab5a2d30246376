"""A fake engine whose output is a given text (a "script"), for testing how the server parses
tool calls and reasoning out of model output without a model.

``ScriptedAsyncLLM(scripts)``: sample k of each request generates the tokens of the next
script (``scripts`` is a list used in turn, or a callable ``(prompt_text) -> str``), one token
per step, then finishes with "stop" (EOS), or "length" at ``max_tokens``. It records every
request's (prompt, SamplingParams, request id) in ``received``.
"""
from __future__ import annotations

import asyncio
import os
import sys
from typing import Any, AsyncIterator, Callable, Optional, Union

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeAsyncLLM  # noqa: E402

from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402


class ScriptedAsyncLLM(FakeAsyncLLM):
    def __init__(self, scripts: Union[list[str], Callable[[str], str]] = (), **kw: Any):
        super().__init__(**kw)
        self.scripts = scripts
        self._next = 0
        self.num_cached_tokens = 0  # prompt tokens each output reports as read from the prefix cache

    def _script(self, prompt_text: str) -> str:
        if callable(self.scripts):
            return self.scripts(prompt_text)
        s = self.scripts[self._next % len(self.scripts)]
        self._next += 1
        return s

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        req = self.engine_request(prompt, sampling_params, request_id, add_special_tokens)
        sp = req.sampling_params
        ids = list(req.prompt_token_ids)
        ptext = req.prompt or self.tokenizer.decode(ids)
        self.record(req)
        self.running.add(request_id)
        n = sp.n
        toks = [self.tokenizer.encode(self._script(ptext), add_special_tokens=False)
                for _ in range(n)]
        max_tokens = sp.max_tokens if sp.max_tokens is not None else 10**9
        sent_text = [""] * n
        sent = [0] * n
        finish: list[Optional[str]] = [None] * n
        gen: list[list[int]] = [[] for _ in range(n)]
        step = 0
        done = False
        try:
            while not done:
                await asyncio.sleep(self.step_delay or 0)
                step += 1
                for k in range(n):
                    if finish[k] is None:
                        gen[k] = toks[k][:step]
                        if step >= len(toks[k]):
                            finish[k] = "stop"
                        elif step >= max_tokens:
                            finish[k] = "length"
                done = all(f is not None for f in finish)
                if sp.output_kind == RequestOutputKind.FINAL_ONLY and not done:
                    continue
                outs = []
                for k in range(n):
                    text = self.tokenizer.decode(gen[k], skip_special_tokens=sp.skip_special_tokens)
                    if sp.output_kind == RequestOutputKind.DELTA:
                        if sent[k] == len(gen[k]) and sent_text[k] == text and step > 1:
                            continue
                        outs.append(CompletionOutput(k, text[len(sent_text[k]):], gen[k][sent[k]:],
                                                     None, None, finish[k], None))
                        sent_text[k], sent[k] = text, len(gen[k])
                    else:
                        outs.append(CompletionOutput(k, text, list(gen[k]), None, None, finish[k],
                                                     None))
                yield RequestOutput(request_id, ptext, ids, None, outs, done,
                                    num_cached_tokens=self.num_cached_tokens)
            self.finished_ids.append(request_id)
        finally:
            if not done:
                self.aborted.append(request_id)
            self.running.discard(request_id)

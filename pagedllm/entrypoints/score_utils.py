"""Pair scoring of a pooling model, shared by ``LLM.score`` and the server's ``/score`` and
``/rerank`` (vLLM's ``entrypoints/score_utils.py``).

An embed model scores a pair ``(a, b)`` by the cosine similarity of the two embeddings (each
distinct input embedded once); a classify model (a cross-encoder) encodes the pair as one input
(``tokenizer(a, b)``; token-id inputs concatenated) and runs it as the "score" task. The caller
runs the pooling (synchronously for ``LLM``, on the async engine for the server)::

    plan = PairScoring(pooler.task, q, d, tokenizer)
    outs = pool(plan.inputs, task=plan.task)      # one PoolingRequestOutput per plan.inputs
    results = plan.results(outs)                  # one PoolingRequestOutput per pair
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


def broadcast_pairs(q: Sequence[Any], d: Sequence[Any]) -> Optional[tuple[list, list]]:
    """The pairs of ``q`` (one or ``len(d)`` items) and ``d`` (non-empty): one ``q`` is repeated
    for every ``d``; None when the lengths do not match (the caller words the error)."""
    q, d = list(q), list(d)
    if len(q) == 1:
        return q * len(d), d
    if len(q) != len(d):
        return None
    return q, d


def pair_prompt(tokenizer: Any, a: Any, b: Any) -> dict:
    """One cross-encoder input from a pair: two texts (or TextPrompts) through the tokenizer's
    pair encoding (``{"prompt_token_ids": ids, "prompt": None}``); anything with token ids: the
    ids of ``a`` then ``b`` (texts encoded without special tokens).

    Raises:
        ValueError: an input that is neither a string, a TextPrompt nor a TokensPrompt.
    """
    if isinstance(a, str) and isinstance(b, str):
        return {"prompt_token_ids": list(tokenizer(a, b)["input_ids"]), "prompt": None}
    a = a["prompt"] if isinstance(a, dict) and "prompt_token_ids" not in a and "prompt" in a else a
    b = b["prompt"] if isinstance(b, dict) and "prompt_token_ids" not in b and "prompt" in b else b
    if isinstance(a, str) and isinstance(b, str):  # TextPrompts: the same pair encoding
        return pair_prompt(tokenizer, a, b)
    ids: list[int] = []
    for x in (a, b):
        if isinstance(x, dict) and "prompt_token_ids" in x:
            ids.extend(x["prompt_token_ids"])
        elif isinstance(x, str):
            ids.extend(tokenizer.encode(x, add_special_tokens=False))
        else:
            raise ValueError(f"score: inputs must be strings, TextPrompts or TokensPrompts, got {x!r}")
    return {"prompt_token_ids": ids}


class PairScoring:
    """What to pool to score the pairs ``(q[i], d[i])`` and how the outputs become scores.

    Attributes:
        task: the pooling task to run ``inputs`` with: "embed" (embed models) or "score".
        inputs: the prompts to pool: the distinct items of ``q + d`` (embed) or one pair input
            per pair (``pair_prompt``).
    """

    def __init__(self, pooler_task: str, q: Sequence[Any], d: Sequence[Any], tokenizer: Any) -> None:
        self.q, self.d = list(q), list(d)
        self.inputs: list[Any] = []
        if pooler_task == "embed":
            self.task = "embed"
            self._index: dict[str, int] = {}
            for x in self.q + self.d:
                key = repr(x)
                if key not in self._index:
                    self._index[key] = len(self.inputs)
                    self.inputs.append(x)
        else:
            self.task = "score"
            self.inputs = [pair_prompt(tokenizer, a, b) for a, b in zip(self.q, self.d)]

    def results(self, outs: Sequence[Any]) -> list:
        """One PoolingRequestOutput per pair from the outputs of ``inputs``: for embed models a
        new one (id ``score-{i}``, ``outputs.data`` the ``[1]`` float32 cosine similarity,
        ``prompt_token_ids`` those of both sides); for cross-encoders ``outs`` as they are."""
        if self.task != "embed":
            return list(outs)
        import torch

        from pagedllm.outputs import PoolingOutput, PoolingRequestOutput

        results = []
        for i, (a, b) in enumerate(zip(self.q, self.d)):
            ea, eb = outs[self._index[repr(a)]], outs[self._index[repr(b)]]
            s = torch.nn.functional.cosine_similarity(ea.outputs.data.float(), eb.outputs.data.float(), dim=-1)
            results.append(PoolingRequestOutput(request_id=f"score-{i}", outputs=PoolingOutput(s.reshape(1)),
                                                prompt_token_ids=ea.prompt_token_ids + eb.prompt_token_ids))
        return results

    @staticmethod
    def prompt_tokens(outs: Sequence[Any]) -> int:
        """The prompt tokens the pooled ``outs`` used (each distinct input counted once)."""
        return sum(len(o.prompt_token_ids) for o in outs)

"""The reasoning-parser interface, its registry and the streaming driver.

A reasoning parser splits a model's output into ``reasoning`` (the thinking text, reported
as ``reasoning_content`` / ``reasoning``) and ``content`` (the answer). The formats here use
a ``<think>`` ... ``</think>`` block at the start of the output:

- :meth:`ReasoningParser.parse` ``(text, final) -> (reasoning, content)``: with
  ``final=False`` (a prefix of a stream) only text that cannot change role is returned (a
  suffix that may be the start of ``</think>`` is held back); ``None`` means "none (yet)".
- :class:`ReasoningStreamer` diffs successive parses into deltas.

Registry: ``ReasoningParserManager.register_module("name")``; ``--reasoning-parser NAME``
(vLLM's names). Nothing here imports from the engine or the server, so the structured-output
code may use :meth:`ReasoningParser.is_reasoning_end`.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from pagedllm.class_registry import ClassRegistry

logger = logging.getLogger("pagedllm.reasoning")


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """``<think>`` ... ``</think>`` reasoning at the start of the output.

    Class attributes:
        start_token / end_token: the block's markers.
        start_optional: the output may begin inside the block without ``start_token`` (the
            chat template opened it in the prompt, as DeepSeek-R1's does); then everything up
            to ``end_token`` is reasoning, and an output without ``end_token`` is all
            reasoning. When False, an output that does not start with ``start_token`` has no
            reasoning.
    """

    start_token = "<think>"
    end_token = "</think>"
    start_optional = False

    def __init__(self, tokenizer: Any):
        self.model_tokenizer = tokenizer
        self.start_token_id = _single_token_id(tokenizer, self.start_token)
        self.end_token_id = _single_token_id(tokenizer, self.end_token)

    def parse(self, text: str, final: bool) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of ``text``; see the module docstring."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_token):
            body = stripped[len(self.start_token):]
        elif not final and self.start_token.startswith(stripped):
            return None, None  # empty, whitespace or a partial <think>: undecided
        elif self.start_optional:
            body = text
        else:
            return None, text or None
        e = body.find(self.end_token)
        if e >= 0:
            return body[:e] or None, body[e + len(self.end_token):] or None
        if not final:
            body = body[: len(body) - _held(body, self.end_token)]
        return body or None, None

    # ---- vLLM's method names ---------------------------------------------------------------
    def extract_reasoning_content(self, model_output: str, request: Any = None
                                  ) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a complete output."""
        return self.parse(model_output, final=True)

    extract_reasoning = extract_reasoning_content

    def extract_reasoning_content_streaming(self, previous_text: str, current_text: str,
                                            delta_text: str, *args: Any, **kwargs: Any
                                            ) -> Optional[dict[str, str]]:
        """The delta ``{"reasoning_content"?, "content"?}`` for the output so far."""
        if getattr(self, "_streamer", None) is None:
            self._streamer = ReasoningStreamer(self)
        r, c = self._streamer.update(current_text, final=False)
        d = {}
        if r:
            d["reasoning_content"] = r
        if c:
            d["content"] = c
        return d or None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over in a token sequence (prompt + output so far): the
        last ``end_token`` comes after the last ``start_token``; with neither, only formats
        whose output may start inside the block (``start_optional``) are still reasoning."""
        ids = list(input_ids)
        if self.end_token_id is not None:
            last_end = max((i for i, t in enumerate(ids) if t == self.end_token_id), default=-1)
            last_start = (max((i for i, t in enumerate(ids) if t == self.start_token_id),
                              default=-1) if self.start_token_id is not None else -1)
        else:
            text = self.model_tokenizer.decode(ids)
            last_end, last_start = text.rfind(self.end_token), text.rfind(self.start_token)
        if last_end < 0 and last_start < 0:
            return not self.start_optional
        return last_end > last_start

    def reasoning_end_in(self, previous_ids: Sequence[int], new_ids: Sequence[int]
                         ) -> Optional[int]:
        """How many of ``new_ids`` it takes to complete ``end_token`` (the tokens after them
        are the answer), or None when ``new_ids`` do not end the reasoning. ``previous_ids``
        (the tokens before, while still reasoning) give the context a marker split over
        several tokens needs; only their last 16 are decoded, so each call costs
        O(len(new_ids)) decodes of short sequences."""
        if self.end_token_id is not None:
            for k, t in enumerate(new_ids):
                if t == self.end_token_id:
                    return k + 1
            return None
        ctx = list(previous_ids[-16:])
        before = self.model_tokenizer.decode(ctx).count(self.end_token)
        for k in range(1, len(new_ids) + 1):
            if self.model_tokenizer.decode(ctx + list(new_ids[:k])).count(self.end_token) > before:
                return k
        return None

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The output ids after the end of the reasoning (all of them without reasoning)."""
        ids = list(input_ids)
        if self.end_token_id is not None and self.end_token_id in ids:
            return ids[len(ids) - ids[::-1].index(self.end_token_id):]
        return [] if self.start_optional else ids


def _single_token_id(tokenizer: Any, token: str) -> Optional[int]:
    """The id of ``token`` when the vocabulary has it as one token, else None."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    tid = vocab.get(token)
    return int(tid) if tid is not None else None


class ReasoningStreamer:
    """Turns the growing output of one choice into reasoning and content deltas.

    ``update(text, final)`` takes the whole output so far and returns
    (reasoning delta, content delta); :attr:`content` is the content so far (what a tool
    parser then reads).
    """

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.reasoning = ""
        self.content = ""

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        try:
            r, c = self.parser.parse(text, final)
        except Exception:
            logger.debug("reasoning parser failed", exc_info=True)
            if not final:
                return "", ""
            r, c = None, text
        r, c = r or "", c or ""
        dr = dc = ""
        if len(r) > len(self.reasoning) and r.startswith(self.reasoning):
            dr, self.reasoning = r[len(self.reasoning):], r
        if len(c) > len(self.content) and c.startswith(self.content):
            dc, self.content = c[len(self.content):], c
        return dr, dc


class ReasoningParserManager(ClassRegistry, base=ReasoningParser, kind="reasoning parser"):
    """Name -> ReasoningParser class (vLLM's ``ReasoningParserManager``; ``ClassRegistry`` methods)."""

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type:
        """Raises: KeyError naming the registered parsers."""
        return cls.get(name)

"""What a one-choice event stream (``/v1/messages``, ``/v1/responses``) keeps across engine results."""
from __future__ import annotations

from typing import Any, Iterator, Optional

from pagedllm.entrypoints.openai.output_parser import OutputDelta, OutputParser


class OutputTally:
    """Output tokens so far, the prompt's cached tokens and the finished output of a stream.

    Attributes:
        parser: the request's ``OutputParser`` (reasoning / tool calls / plain text).
        num_tokens: output tokens streamed so far.
        cached: the prompt tokens served from the prefix cache (the latest result's count).
        last: the ``CompletionOutput`` that carried a ``finish_reason``; None while unfinished.
    """

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.num_tokens = 0
        self.cached = 0
        self.last: Any = None

    @property
    def finish_reason(self) -> Optional[str]:
        """The finished output's ``finish_reason``; None while unfinished."""
        return None if self.last is None else self.last.finish_reason

    def feed(self, res: Any) -> Iterator[OutputDelta]:
        """The parser's delta for each output of ``res`` (a ``RequestOutput`` delta), counting it
        first (so a finish is visible to whoever handles that output's delta)."""
        self.cached = int(getattr(res, "num_cached_tokens", 0) or 0)
        for co in res.outputs:
            self.num_tokens += len(co.token_ids)
            if co.finish_reason is not None:
                self.last = co
            yield self.parser.feed_output(co)

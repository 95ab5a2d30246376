"""Public result types, with vLLM's names (``vllm.outputs``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Self


@dataclass
class Logprob:
    """One candidate token at one position.

    Attributes:
        logprob: natural-log probability (float, <= 0).
        rank: 1-based rank of the token in the distribution the logprob comes from.
        decoded_token: the token's text, or None when detokenization is off.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob (the sampled/prompt token always present).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample (of ``n``) of a generation request.

    Attributes:
        index: 0..n-1.
        text: generated text (cumulative, or the new delta with ``output_kind=DELTA``).
        token_ids: generated token ids (same cumulative/delta rule).
        cumulative_logprob: sum of the sampled tokens' logprobs, or None if logprobs were
            not requested.
        logprobs: per generated position a ``{token_id: Logprob}``, or None.
        finish_reason: "stop", "length", "abort" or None while running.
        stop_reason: the stop string (str) or stop token id (int) that ended the sample,
            None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as returned by ``LLM.generate`` or streamed by the engine.

    Attributes:
        request_id: the request's id.
        prompt: prompt text (None when given as token ids only).
        prompt_token_ids: prompt token ids.
        prompt_logprobs: per prompt position a ``{token_id: Logprob}``; the first is None.
        outputs: one CompletionOutput per sample.
        finished: True once every sample finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: optional timing info (arrival, first token, finish), seconds since epoch.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[dict[str, Any]] = None


@dataclass
class PoolingOutput:
    """Pooled result of one input.

    Attributes:
        data: float32 tensor: ``[hidden]`` (or ``[dimensions]``) for embed, ``[num_labels]``
            for classify, ``[T, hidden]`` for ALL pooling.
    """

    data: Any

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        d = self.data
        return float(d.reshape(-1)[0]) if d.numel() >= 1 else float("nan")

    @property
    def hidden_size(self) -> int:
        """Length of the embedding (vLLM's ``EmbeddingOutput.hidden_size``)."""
        return int(self.data.shape[-1])

    @property
    def num_classes(self) -> int:
        """Number of class probabilities (vLLM's ``ClassificationOutput.num_classes``)."""
        return int(self.data.shape[-1])


@dataclass
class PoolingRequestOutput:
    """Result of a pooling request (``LLM.embed/encode/classify/score``).

    Attributes:
        request_id: the request's id.
        outputs: the PoolingOutput.
        prompt_token_ids: input token ids.
        finished: always True when returned by the offline API.
    """

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True

    @classmethod
    def from_base(cls, base: "PoolingRequestOutput") -> Self:
        """``base``'s result as this class (vLLM's ``EmbeddingRequestOutput.from_base`` and its
        siblings): the same fields, nothing copied."""
        return cls(base.request_id, base.outputs, base.prompt_token_ids, base.finished)



class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s result (vLLM's name): ``outputs.embedding`` is the vector."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """``LLM.classify``'s result (vLLM's name): ``outputs.probs`` are the class probabilities."""


class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s result (vLLM's name): ``outputs.score`` is the pair's score."""

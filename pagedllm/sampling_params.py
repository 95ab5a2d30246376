"""Per-request generation parameters, with vLLM's names, defaults and checks
(``vllm.sampling_params``).

Pure Python (no torch). Everything that depends on the model (vocabulary size, the
engine-wide ``max_logprobs`` cap, the tokenizer) is checked by separate methods the
engine calls once it knows those values: :meth:`SamplingParams.verify_against_vocab`,
:func:`validate_logprobs`, :meth:`SamplingParams.update_from_tokenizer`.
"""
from __future__ import annotations

import copy
import enum
import functools
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from pagedllm.inputs import InputValidationError
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (argmax) sampling (vLLM ``_SAMPLING_EPS``).
_SAMPLING_EPS = 1e-5
# Positive temperatures below this are raised to it to avoid inf/nan (vLLM ``_MAX_TEMP``).
_MAX_TEMP = 1e-2
# OpenAI clamps logit_bias values to this range.
_LOGIT_BIAS_LIMIT = 100.0

# Generation-config keys that supply defaults (vLLM ``ModelConfig.get_diff_sampling_param``),
# mapped to SamplingParams field names.
_GEN_CONFIG_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


class SamplingType(enum.IntEnum):
    """How a request picks its next token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each streamed ``RequestOutput`` carries (vLLM values)."""

    # Every output holds all tokens/text generated so far.
    CUMULATIVE = 0
    # Every output holds only what is new since the previous one.
    DELTA = 1
    # Only the final output is returned.
    FINAL_ONLY = 2


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling parameters of one generation request (vLLM semantics).

    Attributes:
        n: number of samples returned for the prompt (>= 1).
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already
            present in the OUTPUT (> 0 favours new tokens).
        frequency_penalty: in [-2, 2]; times the token's count in the OUTPUT is
            subtracted from its logit.
        repetition_penalty: > 0; tokens seen in prompt or output have positive logits
            divided by it and negative ones multiplied by it (1 = off).
        temperature: >= 0; below 1e-5 means greedy (argmax); positive values below 1e-2
            are raised to 1e-2 (as vLLM) to avoid numerical problems.
        top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability
            sums to at least top_p (1 = off).
        top_k: 0 (or -1, normalized to 0) = off, else >= 1: keep the k most likely tokens.
        min_p: in [0, 1]; drop tokens whose probability is below min_p times the most
            likely token's probability (0 = off).
        seed: optional int; a seeded request samples the same tokens whatever else is in
            the batch. -1 means no seed.
        stop: stop strings (str or list -> list). The output stops before them unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that stop generation (the stop token is kept in the output
            unless it is a special token).
        bad_words: words that must never be generated (see :meth:`update_from_tokenizer`).
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating after EOS.
        max_tokens: maximum tokens to generate (>= 1), or None = up to max_model_len.
        min_tokens: EOS and stop_token_ids are masked until this many tokens exist.
        logprobs: number of top logprobs returned per generated token (>= 0) besides the
            sampled token's own, or None for none.
        prompt_logprobs: same for each prompt token, or None.
        detokenize: produce text (stop strings need it).
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: put spaces between special tokens in the text.
        truncate_prompt_tokens: keep only the last k prompt tokens (>= 1), -1 = up to
            max_model_len, None = no truncation.
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY.
        logit_bias: {token_id: bias} added to the logits; str keys (JSON) become int and
            values are clamped to [-100, 100].
        allowed_token_ids: if set (non-empty), only these tokens can be sampled.
        structured_outputs: a StructuredOutputsParams (or its dict): the output is constrained
            to a JSON schema, regex, choice or grammar (see ``pagedllm.structured_output``).
        extra_args: free-form dict for extensions, not interpreted.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[str | list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    extra_args: Optional[dict[str, Any]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    # Derived state (not constructor arguments).
    output_text_buffer_length: int = field(default=0, init=False, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    _explicit_fields: frozenset = field(default=frozenset(), init=False, repr=False,
                                        compare=False)

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        self._apply_greedy()
        self._all_stop_token_ids = set(self.stop_token_ids)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build from keyword arguments, treating None as "use the default"
        (as the OpenAI server does for request fields left out)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def _normalize(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if _is_number(self.temperature) and 0 < self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors; "
                "raised to %s.", self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = _MAX_TEMP

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) for x in self.stop):
            self.stop = list(self.stop)
        else:
            raise InputValidationError(
                "stop must be a string or a list of strings.", "stop")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set)) and all(_is_int(t) for t in self.stop_token_ids):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise InputValidationError("stop_token_ids must be a list of token ids (integers).", "stop_token_ids")
        if isinstance(self.bad_words, str):  # (a word, not its letters)
            self.bad_words = [self.bad_words]
        self.bad_words = [] if self.bad_words is None else list(self.bad_words)

        # logprobs=True means 1 (vLLM).
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1

        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                pass  # reported by _verify_args

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InputValidationError(
                    f"logit_bias must be a dict of token id -> bias, got "
                    f"{type(self.logit_bias).__name__}.", "logit_bias")
            bias: dict[int, float] = {}
            for tok, val in self.logit_bias.items():
                try:
                    tok_id = int(tok)
                    val_f = float(val)
                except (TypeError, ValueError):
                    raise InputValidationError(
                        f"logit_bias must map integer token ids to numbers, got "
                        f"{tok!r}: {val!r}.", "logit_bias") from None
                if val_f != val_f:  # NaN
                    raise InputValidationError(f"logit_bias value for token {tok_id} is NaN.", "logit_bias")
                bias[tok_id] = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, val_f))
            self.logit_bias = bias

        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, list):
            try:
                self.allowed_token_ids = list(self.allowed_token_ids)
            except TypeError:
                raise InputValidationError("allowed_token_ids must be a list of token ids.", "allowed_token_ids") from None

        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

        # Characters held back from streaming so a stop string is never half-shown.
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.output_text_buffer_length = 0

    def _verify_args(self) -> None:
        if not _is_int(self.n):
            raise InputValidationError(f"n must be an int, got {type(self.n).__name__}.", "n")
        if self.n < 1:
            raise InputValidationError(f"n must be at least 1, got {self.n}.", "n")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            if not _is_number(getattr(self, name)):
                raise InputValidationError(
                    f"{name} must be a number, got {type(getattr(self, name)).__name__}.", name)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InputValidationError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InputValidationError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InputValidationError(
                f"repetition_penalty must be a finite number greater than zero, got {self.repetition_penalty}.",
                "repetition_penalty")
        if not self.temperature >= 0.0:
            raise InputValidationError(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if self.temperature == math.inf:
            raise InputValidationError("temperature must be a finite number, got inf.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InputValidationError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if not _is_int(self.top_k):
            raise InputValidationError(f"top_k must be an int, got {type(self.top_k).__name__}.", "top_k")
        if self.top_k < 0:
            raise InputValidationError(
                f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputValidationError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.seed is not None and not _is_int(self.seed):
            raise InputValidationError(f"seed must be an int or None, got {type(self.seed).__name__}.", "seed")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InputValidationError(f"seed must be a 64-bit integer, got {self.seed}.", "seed")
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise InputValidationError(
                    f"max_tokens must be an int or None, got {type(self.max_tokens).__name__}.", "max_tokens")
            if self.max_tokens < 1:
                raise InputValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if not _is_int(self.min_tokens):
            raise InputValidationError(
                f"min_tokens must be an int, got {type(self.min_tokens).__name__}.", "min_tokens")
        if self.min_tokens < 0:
            raise InputValidationError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InputValidationError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            val = getattr(self, name)
            if val is not None:
                if not _is_int(val):
                    raise InputValidationError(
                        f"{name} must be an int or None, got {type(val).__name__}.", name)
                if val < 0:
                    raise InputValidationError(f"{name} must be non-negative, got {val}.", name)
        if self.truncate_prompt_tokens is not None:
            if not _is_int(self.truncate_prompt_tokens) or not (
                    self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1):
                raise InputValidationError(
                    f"truncate_prompt_tokens must be >= 1 or -1, got "
                    f"{self.truncate_prompt_tokens}.", "truncate_prompt_tokens")
        if not all(isinstance(s, str) for s in self.stop):
            raise InputValidationError("stop must be a string or a list of strings.", "stop")
        if any(not s for s in self.stop):
            raise InputValidationError("stop cannot contain an empty string.", "stop")
        if self.stop and not self.detokenize:
            raise InputValidationError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop.", "stop")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InputValidationError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}.", "stop_token_ids")
        if not all(isinstance(w, str) for w in self.bad_words):
            raise InputValidationError("bad_words must be a list of strings.", "bad_words")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise InputValidationError("allowed_token_ids is not None and empty!", "allowed_token_ids")
            if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise InputValidationError("allowed_token_ids must be non-negative ints.", "allowed_token_ids")
        if self.logit_bias is not None and any(t < 0 for t in self.logit_bias):
            raise InputValidationError("logit_bias keys must be non-negative token ids.", "logit_bias")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError("extra_args must be a dict or None.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise InputValidationError("structured_outputs must be a StructuredOutputsParams, a dict or None.", "structured_outputs")

    def _apply_greedy(self) -> None:
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect (vLLM resets them).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    # ------------------------------------------------------------------ properties
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the EOS ids added by :meth:`update_from_generation_config`
        (what ``min_tokens`` masks)."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    # ------------------------------------------------------------------ engine hooks
    def update_from_generation_config(
        self,
        generation_config: Optional[dict[str, Any]],
        model_eos_token_id: Optional[int] = None,
        *,
        eos_token_id: Optional[int] = None,
    ) -> None:
        """Apply the model's ``generation_config`` (vLLM semantics).

        ``eos_token_id`` is accepted as an alias of ``model_eos_token_id``.

        * Sampling defaults: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
          ``repetition_penalty`` and ``max_new_tokens`` (-> ``max_tokens``) from the
          generation config replace the class defaults for fields the caller did not pass
          explicitly to the constructor.
        * EOS: ``model_eos_token_id`` joins ``all_stop_token_ids`` (so ``min_tokens`` masks
          it); extra ``eos_token_id`` values of the generation config (int or list) also do,
          and become ``stop_token_ids`` unless ``ignore_eos``.
        """
        if model_eos_token_id is None:
            model_eos_token_id = eos_token_id
        gen = dict(generation_config or {})
        changed = False
        for key, name in _GEN_CONFIG_KEYS.items():
            val = gen.get(key)
            if val is None or name in self._explicit_fields:
                continue
            if name == "max_tokens" and self.max_tokens is not None and val < self.min_tokens:
                continue
            setattr(self, name, val)
            changed = True
        if changed:
            self._normalize()
            self._verify_args()
            self._apply_greedy()

        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = gen.get("eos_token_id")
        if eos_ids is not None:
            eos_set = {eos_ids} if _is_int(eos_ids) else set(eos_ids)
            if model_eos_token_id is not None:
                # The primary EOS is handled separately for stopping.
                eos_set.discard(model_eos_token_id)
            if eos_set:
                self._all_stop_token_ids.update(eos_set)
                if not self.ignore_eos:
                    eos_set.update(self.stop_token_ids)
                    self.stop_token_ids = sorted(eos_set)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Turn ``bad_words`` into token-id sequences (``_bad_words_token_ids``).

        As vLLM, each word is encoded without special tokens twice: as written (minus
        leading spaces) and with one leading space; the spaced form is kept only when its
        first token differs and it has the same length as the bare form (i.e. the space
        produced a distinct word-start token). Raises ValueError if a token id is outside
        the tokenizer's vocabulary.
        """
        if not self.bad_words:
            return
        self._bad_words_token_ids = []
        for word in self.bad_words:
            base = word.lstrip()
            prev: Optional[list[int]] = None
            for add_space in (False, True):
                text = (" " if add_space else "") + base
                ids = _encode(tokenizer, text)
                if not ids:
                    continue
                if not add_space:
                    self._bad_words_token_ids.append(ids)
                    prev = ids
                elif prev is None or (ids[0] != prev[0] and len(ids) == len(prev)):
                    self._bad_words_token_ids.append(ids)
        max_id = _max_token_id(tokenizer)
        if max_id is not None:
            bad = [t for seq in self._bad_words_token_ids for t in seq
                   if t < 0 or t > max_id]
            if bad:
                raise ValueError(
                    f"The model vocabulary size is {max_id + 1}, but the following tokens "
                    f"were specified as bad: {bad}. All token id values should be integers "
                    f"satisfying: 0 <= token_id <= {max_id}.")

    def verify_against_vocab(self, vocab_size: int) -> None:
        """Check token ids in ``allowed_token_ids``, ``logit_bias`` and ``stop_token_ids``
        against the model's vocabulary. Raises ValueError naming the field."""
        if self.allowed_token_ids is not None:
            bad = [t for t in self.allowed_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InputValidationError(
                    f"allowed_token_ids contains out-of-vocab token ids {bad} "
                    f"(vocab_size={vocab_size}).", "allowed_token_ids")
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InputValidationError(
                    f"logit_bias contains out-of-vocab token ids {bad} "
                    f"(vocab_size={vocab_size}).", "logit_bias")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InputValidationError(
                f"stop_token_ids contains out-of-vocab token ids {bad} "
                f"(vocab_size={vocab_size}).", "stop_token_ids")
        bad = [t for seq in self._bad_words_token_ids for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise InputValidationError(
                f"bad_words contain out-of-vocab token ids {bad} (vocab_size={vocab_size}).", "bad_words")

    # ------------------------------------------------------------------ misc
    def clone(self) -> "SamplingParams":
        """Deep copy (for the ``n`` child requests of a parent)."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"SamplingParams(n={self.n}, "
            f"presence_penalty={self.presence_penalty}, "
            f"frequency_penalty={self.frequency_penalty}, "
            f"repetition_penalty={self.repetition_penalty}, "
            f"temperature={self.temperature}, "
            f"top_p={self.top_p}, "
            f"top_k={self.top_k}, "
            f"min_p={self.min_p}, "
            f"seed={self.seed}, "
            f"stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, "
            f"bad_words={self.bad_words}, "
            f"include_stop_str_in_output={self.include_stop_str_in_output}, "
            f"ignore_eos={self.ignore_eos}, "
            f"max_tokens={self.max_tokens}, "
            f"min_tokens={self.min_tokens}, "
            f"logprobs={self.logprobs}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"skip_special_tokens={self.skip_special_tokens}, "
            f"spaces_between_special_tokens={self.spaces_between_special_tokens}, "
            f"truncate_prompt_tokens={self.truncate_prompt_tokens}, "
            f"output_kind={self.output_kind.name}, "
            f"logit_bias={self.logit_bias}, "
            f"allowed_token_ids={self.allowed_token_ids}, "
            f"extra_args={self.extra_args}, "
            f"structured_outputs={self.structured_outputs})")


# Record which constructor arguments were passed explicitly, so that
# update_from_generation_config only fills in the ones left at their defaults.
_INIT_FIELD_NAMES = [f.name for f in fields(SamplingParams) if f.init]
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init_recording_explicit(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    _dataclass_init(self, *args, **kwargs)
    self._explicit_fields = frozenset(_INIT_FIELD_NAMES[:len(args)]) | frozenset(kwargs)


SamplingParams.__init__ = _init_recording_explicit  # type: ignore[method-assign]


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    if hasattr(ids, "ids"):  # tokenizers.Encoding
        ids = ids.ids
    return [int(t) for t in ids]


def _max_token_id(tokenizer: Any) -> Optional[int]:
    max_id = getattr(tokenizer, "max_token_id", None)
    if _is_int(max_id):
        return max_id
    try:
        return len(tokenizer) - 1
    except TypeError:
        return None


def validate_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """Engine-level cap (vLLM ``max_logprobs``, default 20): raise ValueError naming the
    field when ``logprobs`` or ``prompt_logprobs`` asks for more."""
    for name in ("logprobs", "prompt_logprobs"):
        val = getattr(params, name)
        if val is not None and val > max_logprobs:
            raise InputValidationError(
                f"Requested {name} of {val}, which is greater than max allowed: "
                f"{max_logprobs}.", name)


@dataclass
class BeamSearchParams:
    """Beam search parameters (vLLM's ``BeamSearchParams``; ``LLM.beam_search`` and
    ``use_beam_search`` on the server, where ``n`` is the beam width).

    Attributes:
        beam_width: beams kept per prompt, and sequences returned (>= 1).
        max_tokens: tokens generated per beam at most (>= 1; capped by ``max_model_len``).
        ignore_eos: EOS is an ordinary token (no beam finishes early).
        temperature: for each step's one sampled token, which joins the ``2 * beam_width`` most
            likely ones as a candidate (0 = greedy: adds nothing). Scores use raw logprobs.
        length_penalty: final ranking by ``cumulative_logprob / len(tokens) ** length_penalty``
            (``tokens``: prompt + generated, without a final EOS; vLLM's definition).
        include_stop_str_in_output: keep the EOS token in a finished beam's server output.

    Raises:
        ValueError: an out-of-range value (the message names the field).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InputValidationError(f"max_tokens must be at least 1, got {self.max_tokens!r}.", "max_tokens")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InputValidationError(f"temperature must be non-negative, got {self.temperature!r}.", "temperature")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")

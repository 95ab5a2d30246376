"""Incremental (streaming) detokenization and stop-string matching.

The detokenizer uses the prefix/read-offset algorithm of HF TGI and vLLM: it keeps two
offsets into the token list, ``prefix_offset`` (start of a small context window) and
``read_offset`` (end of the tokens whose text was already emitted). Each step it decodes
``tokens[prefix_offset:]`` and ``tokens[prefix_offset:read_offset]``; the difference is
the new text, emitted only when it does not end with U+FFFD (a UTF-8 character split
across byte-level BPE tokens is held back until its last byte arrives). Because the
window always starts on a character boundary reached earlier, the concatenation of the
deltas equals ``tokenizer.decode(all_ids)`` for byte-level tokenizers.

Fast tokenizers take a fast path for the common step (one new token): the ``tokenizers``
library's ``DecodeStream`` runs the same algorithm in Rust (one call a token instead of two
decodes and the slicing here; vLLM's ``FastIncrementalDetokenizer`` uses it too). The offsets are
mirrored here, so a multi-token step, ``flush`` and a stream error (``DecodeStream`` refuses a
text that does not extend its prefix) take the Python path over the same state, and the stream is
rebuilt once the offsets again allow it: the deltas are the same either way.

Byte-level tokenizers (a ``ByteLevel`` decoder, as GPT-2, Llama 3, Qwen 2 and SmolLM2 use) take a
faster path still, with no call into the tokenizer at all: the decoder concatenates the tokens'
bytes and decodes them as UTF-8, so when the window is one token whose bytes are valid UTF-8 on
their own (the last step emitted exactly that token) and the new token's bytes are too, the new
text is the new token's own text (:func:`clean_token_texts`: a per-tokenizer table, one entry per
token id seen, bounded by the vocabulary). The offsets move as the algorithm moves them, and the
stream is rebuilt from them when a token that is not clean arrives.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

_DecodeStream: Any
try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the Python path only
    _DecodeStream = None

# Prompt tokens kept as left context so the first output tokens decode as they would
# inside the full sequence (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_INITIAL_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def clean_token_texts(tokenizer: Any) -> Optional[dict[int, str]]:
    """The shared table of *clean* token texts of a byte-level fast tokenizer, or None.

    Only for a fast tokenizer whose decoder is ``ByteLevel`` (decoding is: concatenate the
    tokens' bytes, decode as UTF-8). Maps token id -> its text when the token is not an added
    token and its bytes are valid UTF-8 on their own (non-empty, no U+FFFD), else "". Filled
    lazily by :meth:`IncrementalDetokenizer.add_tokens`; at most one entry per vocabulary id.
    Stored on the tokenizer object (attribute ``_pagedllm_clean_texts``), so every request of a
    tokenizer shares it.
    """
    table = getattr(tokenizer, "_pagedllm_clean_texts", None)
    if table is not None:
        return table or None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    ok = False
    added: set[int] = set()
    if backend is not None:
        try:
            ok = type(backend.decoder).__name__ == "ByteLevel"
            added = set(backend.get_added_tokens_decoder())
        except Exception:  # pragma: no cover - an older tokenizers
            ok = False
    # NOTE: an empty dict marks "no fast path" (a dict either way, so the attribute is set once).
    table = {i: "" for i in added} if ok else {}
    if ok and not table:
        table[-1] = ""  # (non-empty: "usable"; -1 is never a token id)
    try:
        tokenizer._pagedllm_clean_texts = table
    except Exception:  # pragma: no cover - a tokenizer object without attributes
        return None
    return table or None


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of text deltas.

    Attributes:
        token_ids: the output token ids added so far (prompt context excluded).
        output_text: all text emitted so far (concatenation of ``add_tokens`` results).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Optional[Sequence[int]] = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Fast tokenizers: call the Rust tokenizer directly (no Python-side post-processing;
        # same result as ``tokenizer.decode`` with clean_up_tokenization_spaces=False).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        ctx = list(prompt_token_ids[-_INITIAL_CONTEXT:]) if prompt_token_ids else []
        self._num_ctx = len(ctx)
        self._ids: list[int] = ctx  # context + output ids
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.output_text = ""
        self._token_text_cache: dict[int, str] = {}
        # The Rust incremental decoder over ``_ids[prefix_offset:]`` with its read offset at the end
        # (built lazily; None while the offsets do not allow it or without a fast tokenizer).
        self._stream: Any = None
        self._stream_ok = self._backend is not None and _DecodeStream is not None
        # Byte-level tokenizers: token id -> text of a clean token ("" = not clean), shared.
        self._clean: Optional[dict[int, str]] = clean_token_texts(tokenizer) if self._stream_ok else None

    @property
    def can_defer(self) -> bool:
        """Whether :meth:`defer_tokens` may be used (a fast tokenizer: the deferred text is one
        ``decode`` of the window, as the Python path computes every delta)."""
        return self._backend is not None

    def defer_tokens(self, token_ids: Sequence[int]) -> None:
        """Append output token ids without decoding them (for a request whose text is read only
        at its end: offline ``LLM.generate``, non-streamed API requests without stop strings or
        logprobs). The offsets stay where they are, so the next :meth:`add_tokens` or
        :meth:`flush` decodes the whole window ``_ids[prefix_offset:]`` at once: the text equals
        the sum of the per-token deltas (the window algorithm's result does not depend on how the
        ids were grouped into steps), for one decode per request instead of one per token."""
        self._ids.extend(token_ids)
        self._stream = None

    def _clean_text(self, tok: int) -> str:
        """The clean text of ``tok`` ("" when it is not clean; see :func:`clean_token_texts`)."""
        table = self._clean
        backend = self._backend
        assert table is not None and backend is not None
        text = table.get(tok)
        if text is None:
            text = ""
            if 0 <= tok:
                try:
                    text = backend.decode([tok], skip_special_tokens=False)
                except Exception:  # out of the vocabulary: not clean
                    text = ""
                if _REPLACEMENT in text:
                    text = ""
            table[tok] = text
        return text

    def _new_stream(self) -> Any:
        """A ``DecodeStream`` in the state of the offsets (window ``_ids[prefix_offset:]``, read
        offset at its end), or None when ``read_offset`` is not at the end of the ids."""
        if self.read_offset != len(self._ids):
            return None
        try:
            return _DecodeStream(ids=self._ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        except Exception:  # pragma: no cover - a tokenizers without the ids argument
            self._stream_ok = False
            return None

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str
        if self._backend is not None:
            text = self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
            return text
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_ctx:]

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_ctx

    def _step(self, force: bool) -> str:
        ids = self._ids
        read_offset = self.read_offset
        if read_offset >= len(ids) and not force:
            return ""
        prefix_offset = self.prefix_offset
        prefix_ids = ids[prefix_offset:read_offset]
        new_ids = ids[prefix_offset:]
        backend = self._backend
        if backend is not None:  # (= _decode, inlined: this runs for every request every step)
            skip = self.skip_special_tokens
            prefix_text = backend.decode(prefix_ids, skip_special_tokens=skip) if prefix_ids else ""
            new_text = backend.decode(new_ids, skip_special_tokens=skip) if new_ids else ""
        else:
            prefix_text = self._decode(prefix_ids)
            new_text = self._decode(new_ids)
        if len(new_text) > len(prefix_text) and (force or not new_text.endswith(_REPLACEMENT)):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = read_offset
            self.read_offset = len(ids)
            self.output_text += delta
            return delta
        if force:
            self.prefix_offset = read_offset
            self.read_offset = len(ids)
        return ""

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append ``new_token_ids``; return the newly decodable text ("" if none yet).

        Text ending in an incomplete UTF-8 character is held back until it completes.
        """
        if not new_token_ids:
            return ""
        if type(new_token_ids) is list and len(new_token_ids) == 1 and type(new_token_ids[0]) is int:
            tok = new_token_ids[0]  # (the common case: one int per step)
            if self._stream_ok:
                ids = self._ids
                n = len(ids)
                clean = self._clean
                if clean is not None and self.read_offset == n and self.prefix_offset == n - 1:
                    # Window = one token; both clean: the delta is the new token's own text.
                    prev = clean.get(ids[-1])
                    text = clean.get(tok)
                    if prev is None:
                        prev = self._clean_text(ids[-1])
                    if text is None:
                        text = self._clean_text(tok)
                    if prev and text:
                        ids.append(tok)
                        self.prefix_offset = n
                        self.read_offset = n + 1
                        self.output_text += text
                        self._stream = None  # (behind the offsets now: rebuilt when needed)
                        return text
                st = self._stream
                if st is None:
                    st = self._stream = self._new_stream()
                if st is not None:
                    ids = self._ids
                    ids.append(tok)
                    try:
                        delta: Optional[str] = st.step(self._backend, tok)
                    except Exception:  # e.g. the text does not extend the prefix: the Python path
                        self._stream = None
                        return self._step(force=False)
                    if delta is None:  # held back (a split character): offsets unchanged, as the stream's
                        return ""
                    self.prefix_offset = self.read_offset
                    self.read_offset = len(ids)
                    self.output_text += delta
                    return delta
            self._ids.append(tok)
        else:
            self._stream = None
            self._ids.extend(map(int, new_token_ids))
        return self._step(force=False)

    def flush(self) -> str:
        """Emit what is still held back when the sequence ends. Call at the end.

        A dangling partial UTF-8 character (generation stopped in the middle of one) is
        dropped rather than emitted as U+FFFD, as vLLM's detokenizer does, so no client ever
        sees a replacement character for a split character.
        """
        self._stream = None
        delta = self._step(force=True)
        stripped = delta.rstrip(_REPLACEMENT)
        if len(stripped) != len(delta):
            self.output_text = self.output_text[: len(self.output_text) - (len(delta) - len(stripped))]
        return stripped

    def get_token_text(self, token_id: int) -> str:
        """Text of a single token (for ``Logprob.decoded_token``), as vLLM computes it:
        ``convert_tokens_to_string([convert_ids_to_tokens(id)])``; may be a partial
        character (U+FFFD) for byte-level pieces."""
        token_id = int(token_id)
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = decode_token_text(self.tokenizer, token_id)
            self._token_text_cache[token_id] = text
        return text


def decode_token_text(tokenizer: Any, token_id: int) -> str:
    """Single-token text via ``convert_ids_to_tokens`` + ``convert_tokens_to_string``."""
    tok = tokenizer.convert_ids_to_tokens(int(token_id))
    if tok is None:
        return ""
    text: str
    try:
        text = tokenizer.convert_tokens_to_string([tok])
    except Exception:  # pragma: no cover - tokenizer without the method
        text = tokenizer.decode([int(token_id)])
    return text


# ---------------------------------------------------------------------- stop strings
def normalize_stop(stop: Any) -> list[str]:
    """``SamplingParams.stop`` (None, str or list) -> list of non-empty strings."""
    if not stop:
        return []
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop if s]


def find_stop_string(
    text: str, prev_len: int, stop: Sequence[str]
) -> Optional[tuple[str, int]]:
    """Find the earliest stop string in ``text`` that ends after ``prev_len``.

    ``text[:prev_len]`` was already checked (contains no complete stop string), so only
    matches ending in the new part are possible. "Earliest" means the one that completes
    first (smallest end position; ties: the longer one), which is the stop the generation
    would hit when streaming one character at a time, independent of tokenization.

    Returns ``(stop_str, start_index)`` or None.
    """
    best: Optional[tuple[int, int, str]] = None  # (end, start, s)
    for s in stop:
        start = text.find(s, max(0, prev_len - len(s) + 1))
        if start < 0:
            continue
        end = start + len(s)
        if best is None or end < best[0] or (end == best[0] and start < best[1]):
            best = (end, start, s)
    if best is None:
        return None
    return best[2], best[1]


def stop_holdback(text: str, stop: Sequence[str]) -> int:
    """Number of trailing chars of ``text`` that could still start a stop string: the
    longest suffix of ``text`` that is a proper prefix of some stop string. Bounded by
    ``len(longest stop) - 1``; never makes the releasable length shrink as text grows."""
    hold = 0
    n = len(text)
    for s in stop:
        for k in range(min(len(s) - 1, n), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold

"""IncrementalDetokenizer and stop-string helpers, on the real SmolLM2 tokenizer."""
import random

import pytest

from pagedllm.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    normalize_stop,
    stop_holdback,
)

TEXTS = [
    "Hello 😀 world",
    "世界你好，这是一个测试。",
    "naïve café — déjà vu ✓",
    "emoji soup 🤖🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷!",
    "日本語のテキスト and ελληνικά and русский текст",
    "math: ∑∫√∞ ≠ ≤ ≥ ±",
    "  leading spaces\n\ttabs\nand newlines  ",
]


@pytest.fixture(scope="module")
def tok(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


def _stream(tok, ids, chunks, prompt=None, skip=True):
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = []
    i = 0
    for c in chunks:
        deltas.append(det.add_tokens(ids[i:i + c]))
        i += c
    assert i == len(ids)
    deltas.append(det.flush())
    assert det.token_ids == ids
    return deltas, det


@pytest.mark.parametrize("text", TEXTS)
def test_utf8_safe_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    # The tokenization really splits multi-byte characters for most of these texts.
    deltas, det = _stream(tok, ids, [1] * len(ids))
    for d in deltas:
        assert "\ufffd" not in d
    assert "".join(deltas) == tok.decode(ids) == text
    assert det.output_text == text


def test_some_text_splits_characters(tok):
    # Sanity check that the test above is meaningful: a single token decodes to U+FFFD.
    ids = tok.encode("😀")
    assert len(ids) > 1
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_utf8_safe_with_prompt_context_and_random_chunks(tok):
    rng = random.Random(0)
    prompt = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(30):
        text = "".join(rng.choice(TEXTS) for _ in range(3))
        ids = tok.encode(text)
        chunks = []
        left = len(ids)
        while left:
            c = min(left, rng.randint(1, 4))
            chunks.append(c)
            left -= c
        deltas, _ = _stream(tok, ids, chunks, prompt=prompt)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids) == text


def test_random_token_sequences_match_full_decode(tok):
    rng = random.Random(1)
    vocab = len(tok)
    # Token pool biased towards multi-byte pieces (taken from the encodings of TEXTS).
    pool = sorted({t for s in TEXTS for t in tok.encode(s)})
    special = [tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens]
    for trial in range(200):
        n = rng.randint(1, 40)
        ids = [
            rng.choice(pool) if rng.random() < 0.6
            else rng.choice(special) if rng.random() < 0.05
            else rng.randrange(vocab)
            for _ in range(n)
        ]
        skip = trial % 2 == 0
        chunks = []
        left = n
        while left:
            c = min(left, rng.randint(1, 3))
            chunks.append(c)
            left -= c
        deltas, _ = _stream(tok, ids, chunks, skip=skip)
        # A partial character left dangling at the end is dropped (vLLM), never sent as U+FFFD.
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd"), (ids, skip)


def test_valid_random_concatenations_never_emit_replacement(tok):
    rng = random.Random(2)
    pieces = [tok.encode(ch) for ch in "😀世界ïé✓🤖Ωж∑"]
    for _ in range(100):
        ids = [t for _ in range(rng.randint(1, 15)) for t in rng.choice(pieces)]
        deltas, _ = _stream(tok, ids, [1] * len(ids))
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids)


def test_special_tokens_skip_and_keep(tok):
    ids = tok.encode("Hi<|im_end|> there")
    deltas, _ = _stream(tok, ids, [1] * len(ids), skip=True)
    assert "".join(deltas) == "Hi there"
    deltas, _ = _stream(tok, ids, [1] * len(ids), skip=False)
    assert "".join(deltas) == "Hi<|im_end|> there"


def test_flush_drops_dangling_partial_character(tok):
    ids = tok.encode("ok 😀")[:-1]  # cut the emoji's last piece
    det = IncrementalDetokenizer(tok, None)
    text = det.add_tokens(ids)
    assert "\ufffd" not in text
    text += det.flush()
    assert tok.decode(ids).endswith("\ufffd")
    assert text == tok.decode(ids).rstrip("\ufffd") and not text.endswith("\ufffd")


def test_get_token_text(tok):
    det = IncrementalDetokenizer(tok, None)
    for t in tok.encode("Hello world 😀"):
        expect = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(t)])
        assert det.get_token_text(t) == expect
    assert det.get_token_text(tok.encode(" world")[0]) == " world"


def test_find_stop_string_and_holdback():
    assert normalize_stop(None) == [] and normalize_stop("x") == ["x"]
    assert normalize_stop(["a", ""]) == ["a"]
    # Only matches ending after prev_len are considered; earliest completion wins.
    assert find_stop_string("Hello world", 0, ["world", "Hello"]) == ("Hello", 0)
    assert find_stop_string("abcd", 0, ["bcd", "c"]) == ("c", 2)
    assert find_stop_string("xabc", 0, ["abc", "bc"]) == ("abc", 1)  # same end: longer
    assert find_stop_string("abc STOP", 5, ["STOP"]) == ("STOP", 4)
    assert find_stop_string("abc", 1, ["z"]) is None
    assert stop_holdback("the end", ["endless"]) == 3
    assert stop_holdback("the end", ["xyz"]) == 0
    assert stop_holdback("aaa", ["aab", "b"]) == 2
    assert stop_holdback("", ["ab"]) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_stream_fast_path_equals_python_path(tok, seed):
    """The DecodeStream fast path gives the same delta at every step as the Python prefix/read-
    offset path: random byte-level text, random prompt context, steps of 1 token mixed with
    multi-token steps (drafts), special tokens, then flush."""
    import pagedllm.engine.detokenizer as detok_mod

    if detok_mod._DecodeStream is None:
        pytest.skip("tokenizers without DecodeStream")
    rng = random.Random(seed)
    text = "".join(rng.choice(TEXTS) for _ in range(6))
    ids = tok.encode(text) + [rng.randrange(tok.vocab_size) for _ in range(40)]
    ids.insert(rng.randrange(len(ids)), tok.eos_token_id)
    prompt = tok.encode(rng.choice(TEXTS))
    chunks, n = [], 0
    while n < len(ids):
        c = min(len(ids) - n, 1 if rng.random() < 0.8 else rng.randint(2, 4))
        chunks.append(c)
        n += c
    for skip in (True, False):
        fast, det = _stream(tok, ids, chunks, prompt, skip)
        assert det._stream_ok, "the fast path was not taken"
        slow_det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        slow_det._stream_ok = False
        slow, i = [], 0
        for c in chunks:
            slow.append(slow_det.add_tokens(ids[i:i + c]))
            i += c
        slow.append(slow_det.flush())
        assert fast == slow
        assert det.output_text == slow_det.output_text
        assert (det.prefix_offset, det.read_offset) == (slow_det.prefix_offset, slow_det.read_offset)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_token_fast_path_equals_stream_and_python_paths(tok, seed):
    """Byte-level tokenizers: the clean-token path (no tokenizer call when the window is one clean
    token and the new one is clean) gives the same delta at every step, the same offsets and text as
    the DecodeStream-only path and the Python path: split characters, special tokens, random ids,
    multi-token steps, flush."""
    import pagedllm.engine.detokenizer as detok_mod

    table = detok_mod.clean_token_texts(tok)
    if table is None or detok_mod._DecodeStream is None:
        pytest.skip("not a byte-level fast tokenizer")
    rng = random.Random(100 + seed)
    text = "".join(rng.choice(TEXTS) for _ in range(8)) + " plain ascii words " * 5
    ids = tok.encode(text) + [rng.randrange(tok.vocab_size) for _ in range(60)]
    for _ in range(3):
        ids.insert(rng.randrange(len(ids)), tok.eos_token_id)
    prompt = tok.encode(rng.choice(TEXTS))
    chunks, n = [], 0
    while n < len(ids):
        c = min(len(ids) - n, 1 if rng.random() < 0.9 else rng.randint(2, 3))
        chunks.append(c)
        n += c
    for skip in (True, False):
        dets = []
        for mode in ("clean", "stream", "python"):
            d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            if mode != "clean":
                d._clean = None
            if mode == "python":
                d._stream_ok = False
            dets.append(d)
        i = 0
        taken = 0
        for c in chunks:
            outs = [d.add_tokens(ids[i:i + c]) for d in dets]
            taken += c == 1 and dets[0]._stream is None  # (the stream path leaves a stream)
            i += c
            assert outs[0] == outs[1] == outs[2], (i, outs)
            assert len({(d.prefix_offset, d.read_offset) for d in dets}) == 1
        outs = [d.flush() for d in dets]
        assert outs[0] == outs[1] == outs[2]
        assert dets[0].output_text == dets[1].output_text == dets[2].output_text
        assert taken > 10, "the clean path was not taken"
    # Bounded: one entry per token id seen (plus the added tokens), never past the vocabulary.
    assert len(table) <= len(tok) + 1
    assert table[tok.eos_token_id] == ""  # an added token is never clean


def _deferred_vs_incremental(tok, ids, prompt, skip, stop_last):
    """(incremental text, deferred text): every id through add_tokens one at a time, vs all
    through defer_tokens and then the end as the output processor does it (the last id through
    add_tokens, or dropped as a stop token that is not part of the text, then flush)."""
    inc = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    body = ids[:-1] if stop_last else ids
    text = "".join(inc.add_tokens([t]) for t in body) + inc.flush()
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert d.can_defer
    d.defer_tokens(ids[:len(ids) // 2])
    d.defer_tokens(ids[len(ids) // 2:-1])
    deferred = ("" if stop_last else d.add_tokens([ids[-1]])) + d.flush()
    assert d.output_text == deferred or deferred == d.output_text.rstrip("\ufffd")
    return text, deferred


# Gemma 3's tokenizer (262k entries, transformers' fast tokenizer built from its GGUF) takes ~15 s to
# load: a real-model test, so in the slow tier
@pytest.mark.parametrize("which", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_deferred_text_equals_the_incremental_deltas(which, request):
    """A request whose text is read only at its end (offline ``LLM.generate``) appends its tokens
    with ``defer_tokens`` and decodes them once when it finishes: the same text as the sum of the
    per-token deltas, for a byte-level (SmolLM2) and a SentencePiece (Gemma 3) tokenizer, with
    split characters, special tokens, random ids, a prompt context or none, and a final stop token
    that is or is not part of the text."""
    if which == "smollm2":
        tok = request.getfixturevalue("smollm2_hf_tokenizer")
    else:  # (the session's shared transformers reference: its tokenizer)
        tok = request.getfixturevalue("hf_gemma3")[1]
    rng = random.Random(7)
    special = [tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens]
    checked = 0
    for trial in range(40):
        text = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 3)))
        ids = tok.encode(text, add_special_tokens=False)
        ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 6))]
        if trial % 3 == 0:
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
        prompt = tok.encode(rng.choice(TEXTS)) if trial % 2 else None
        skip = trial % 4 < 2
        incremental, deferred = _deferred_vs_incremental(tok, ids, prompt, skip, stop_last=trial % 5 == 0)
        assert deferred == incremental, (trial, ids)
        checked += bool(incremental)
    assert checked >= 30

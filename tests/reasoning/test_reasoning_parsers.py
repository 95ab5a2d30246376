"""Reasoning parsers on synthetic ``<think>`` outputs, whole and streamed in random chunk sizes
(including streams that end inside the reasoning), and ``is_reasoning_end`` on token ids."""
from __future__ import annotations

import random

import pytest

from pagedllm.reasoning import ReasoningParserManager, ReasoningStreamer

R1, QWEN3, THINK = "deepseek_r1", "qwen3", "think"

# (parser, output, reasoning, content)
CASES = [
    (R1, "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    # R1's template opens <think> in the prompt: the output starts inside the reasoning
    (R1, "Okay, 2+2 = 4.</think>The answer is **4**.", "Okay, 2+2 = 4.", "The answer is **4**."),
    (R1, "Hmm, let me think about <this> and </thin", "Hmm, let me think about <this> and </thin",
     None),  # ended inside the reasoning: all reasoning
    (R1, "<think></think>Direct answer.", None, "Direct answer."),
    (QWEN3, "<think>\nhi → greet back\n</think>\n\nHello! 😀", "\nhi → greet back\n",
     "\n\nHello! 😀"),
    (QWEN3, "Hello! No thinking here (enable_thinking=false).", None,
     "Hello! No thinking here (enable_thinking=false)."),
    (QWEN3, "<think>\nStill going when max_tokens hit", "\nStill going when max_tokens hit", None),
    (QWEN3, "Text first <think>not reasoning</think> after", None,
     "Text first <think>not reasoning</think> after"),
    (THINK, "  <think>a</think>b", "a", "b"),
    (THINK, "<", None, "<"),
    (THINK, "<think>x</think>", "x", None),
]


def make(name):
    return ReasoningParserManager.get_reasoning_parser(name)(None)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_extract(name, text, reasoning, content):
    assert make(name).extract_reasoning_content(text) == (reasoning, content)
    assert make(name).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_stream_rebuilds_the_whole_parse(name, text, reasoning, content):
    for seed in range(8):
        rng = random.Random(seed)
        st = ReasoningStreamer(make(name))
        acc = r_out = c_out = ""
        i = 0
        pieces = []
        while i < len(text):
            k = rng.randint(1, 1 + seed)
            pieces.append(text[i:i + k])
            i += k
        for j, p in enumerate(pieces):
            acc += p
            dr, dc = st.update(acc, final=j == len(pieces) - 1)
            r_out += dr
            c_out += dc
        assert (r_out or None, c_out or None) == (reasoning, content), (seed, pieces)


def test_stream_ends_inside_reasoning_without_final_flush_loses_only_a_held_marker():
    st = ReasoningStreamer(make(R1))
    r = st.update("<think>step one </thi")[0]
    assert r == "step one "  # "</thi" may be the end marker: held back
    r2, c2 = st.update("<think>step one </thi", final=True)
    assert (r2, c2) == ("</thi", "")


def test_no_reasoning_text_reaches_content_before_the_end_marker():
    st = ReasoningStreamer(make(QWEN3))
    text = "<think>\nI might answer {\"a\": 1} here</think>{\"a\": 2}"
    emitted = ""
    for cut in range(1, len(text) + 1):
        emitted += st.update(text[:cut])[1]
        if "</think>" not in text[:cut]:
            assert emitted == ""
        assert '{"a": 2}'.startswith(emitted)
    assert emitted == st.content == '{"a": 2}'
    assert st.reasoning == '\nI might answer {"a": 1} here'


class _Tok:
    """A stand-in tokenizer with <think> / </think> as single tokens (ids 5 and 6)."""

    def get_vocab(self):
        return {"a": 1, "b": 2, "<think>": 5, "</think>": 6}

    def decode(self, ids):
        inv = {v: k for k, v in self.get_vocab().items()}
        return "".join(inv[i] for i in ids)


def test_is_reasoning_end_and_content_ids():
    for name in (R1, QWEN3, THINK):
        p = ReasoningParserManager.get_reasoning_parser(name)(_Tok())
        assert p.start_token_id == 5 and p.end_token_id == 6
        assert p.is_reasoning_end([1, 5, 2, 6, 1]) is True
        assert p.is_reasoning_end([1, 5, 2]) is False
        assert p.is_reasoning_end([5, 6, 1, 5]) is False  # a new block was opened
        assert p.extract_content_ids([5, 2, 6, 1, 2]) == [1, 2]
    # without any marker: R1 is still inside the block (the prompt opened it); qwen3 never
    # started one
    assert ReasoningParserManager.get_reasoning_parser(R1)(_Tok()).is_reasoning_end([1, 2]) is False
    assert ReasoningParserManager.get_reasoning_parser(QWEN3)(_Tok()).is_reasoning_end([1, 2])


def test_registry():
    assert {"deepseek_r1", "qwen3", "think"} <= set(ReasoningParserManager.list_registered())
    with pytest.raises(KeyError, match="available"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_reasoning_end_in_new_tokens():
    p = ReasoningParserManager.get_reasoning_parser(R1)(_Tok())
    assert p.reasoning_end_in([1, 2], [1, 6, 2, 1]) == 2  # the single end token
    assert p.reasoning_end_in([1, 2], [1, 2]) is None


class _CharTok:
    """A tokenizer without a </think> token: one id per character."""

    def get_vocab(self):
        return {}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_reasoning_end_split_over_tokens():
    p = ReasoningParserManager.get_reasoning_parser(R1)(_CharTok())
    assert p.end_token_id is None
    ids = [ord(c) for c in "thinking</th"]
    assert p.reasoning_end_in([], ids) is None
    new = [ord(c) for c in "ink>{\"a\""]
    assert p.reasoning_end_in(ids, new) == 4  # "ink>" completes the marker

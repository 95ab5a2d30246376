"""OutputProcessor: stop strings, output kinds, n>1 fan-in, logprobs (real SmolLM2 tokenizer)."""
import math

import pytest

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.output_processor import (
    OutputProcessor,
    ParentRequest,
    convert_logprobs_entry,
)
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

CUM, DELTA, FINAL = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                     RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def tok(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def _new(tok, params, rid="r", prompt=PROMPT, **kw):
    op = OutputProcessor()
    op.add_request(rid, prompt, tok.encode(prompt), params, tokenizer=tok, **kw)
    return op


def _feed_one_by_one(op, rid, ids, finish=("length", None)):
    """Feed ids one per step, the last step finishing. Returns [(outputs, aborts)]."""
    steps = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        eco = EngineCoreOutput(rid, [t], finish_reason=finish[0] if last else None,
                               stop_reason=finish[1] if last else None)
        steps.append(op.process_outputs([eco]))
    return steps


def test_output_kinds_single(tok):
    text = "one two three four"
    ids = tok.encode(text)
    # CUMULATIVE: every step the whole state.
    op = _new(tok, SamplingParams(output_kind=CUM))
    steps = _feed_one_by_one(op, "r", ids)
    outs = [o for s, _ in steps for o in s]
    assert len(outs) == len(ids)
    for k, o in enumerate(outs):
        assert o.outputs[0].token_ids == ids[:k + 1]
        assert o.outputs[0].text == tok.decode(ids[:k + 1])
        assert o.finished == (k == len(ids) - 1)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].prompt == PROMPT and outs[-1].prompt_token_ids == tok.encode(PROMPT)
    assert outs[-1].outputs[0].cumulative_logprob is None
    assert outs[-1].outputs[0].logprobs is None
    assert not op.has_unfinished_requests()
    # DELTA: only the news.
    op = _new(tok, SamplingParams(output_kind=DELTA))
    outs = [o for s, _ in _feed_one_by_one(op, "r", ids) for o in s]
    assert [o.outputs[0].token_ids for o in outs] == [[t] for t in ids]
    assert "".join(o.outputs[0].text for o in outs) == text
    assert [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    # FINAL_ONLY: once.
    op = _new(tok, SamplingParams(output_kind=FINAL))
    outs = [o for s, _ in _feed_one_by_one(op, "r", ids) for o in s]
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == text and outs[0].outputs[0].token_ids == ids


def test_utf8_stream_through_processor(tok):
    text = "Hi 😀 there 世界"
    ids = tok.encode(text)
    op = _new(tok, SamplingParams(output_kind=DELTA))
    outs = [o for s, _ in _feed_one_by_one(op, "r", ids) for o in s]
    assert all("\ufffd" not in o.outputs[0].text for o in outs)
    assert "".join(o.outputs[0].text for o in outs) == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "The answer is STOP here"
    ids = tok.encode(text)
    assert tok.decode(ids[3:4]) == " ST"  # "STOP" really spans two tokens
    op = _new(tok, SamplingParams(output_kind=DELTA, stop=["STOP"],
                                  include_stop_str_in_output=include))
    streamed = ""
    streamed_ids = []
    aborts_seen = []
    finished_out = None
    for t in ids:
        outs, aborts = op.process_outputs([EngineCoreOutput("r", [t])])
        aborts_seen += aborts
        for o in outs:
            streamed += o.outputs[0].text
            streamed_ids += o.outputs[0].token_ids
            if not include:
                # Nothing of the stop string ever reaches the client.
                assert "S" not in streamed
            if o.finished:
                finished_out = o
    expect = "The answer is STOP" if include else "The answer is "
    assert streamed == expect
    assert aborts_seen == ["r"]
    co = finished_out.outputs[0]
    assert co.finish_reason == "stop" and co.stop_reason == "STOP"
    assert streamed_ids == ids[:5]  # tokens up to the one completing the stop string
    # Later outputs for the aborted request are ignored.
    assert op.process_outputs([EngineCoreOutput("r", [ids[-1]])]) == ([], [])
    assert not op.has_unfinished_requests()


@pytest.mark.parametrize("include,expect", [(False, "Hel"), (True, "Hello w")])
def test_stop_string_starting_mid_token(tok, include, expect):
    ids = tok.encode("Hello world and more")
    op = _new(tok, SamplingParams(output_kind=CUM, stop=["lo w"],
                                  include_stop_str_in_output=include))
    seen = []
    for t in ids:
        outs, aborts = op.process_outputs([EngineCoreOutput("r", [t])])
        seen += [o.outputs[0].text for o in outs]
        if aborts:
            assert aborts == ["r"]
            break
    assert seen[-1] == expect
    if include:
        # Nothing held back when the stop string may be shown (vLLM).
        assert seen == ["Hello", "Hello w"]
    else:
        # "lo" might start the stop string: held back, never shown.
        assert seen == ["Hel", "Hel"]


def test_stop_string_inside_one_token_with_trailing_text(tok):
    ids = tok.encode("Hello world")
    op = _new(tok, SamplingParams(output_kind=FINAL, stop=["ell"]))
    outs, aborts = op.process_outputs([EngineCoreOutput("r", ids)])
    assert aborts == ["r"]
    assert outs[0].outputs[0].text == "H" and outs[0].outputs[0].stop_reason == "ell"


def test_earliest_of_multiple_stop_strings_wins(tok):
    ids = tok.encode("one two three four")
    for chunk in (1, len(ids)):
        op = _new(tok, SamplingParams(output_kind=CUM, stop=["four", "three", "two t"]))
        last = None
        for i in range(0, len(ids), chunk):
            outs, aborts = op.process_outputs([EngineCoreOutput("r", ids[i:i + chunk])])
            last = outs[-1] if outs else last
            if aborts:
                break
        assert last.finished
        assert last.outputs[0].stop_reason == "two t"
        assert last.outputs[0].text == "one "


def test_held_back_text_flushed_at_length_finish(tok):
    ids = tok.encode("I said xy")
    op = _new(tok, SamplingParams(output_kind=CUM, stop=["xyz"]))
    steps = _feed_one_by_one(op, "r", ids, finish=("length", None))
    texts = [s[0][0].outputs[0].text for s in steps]
    assert texts[:-1] == ["I", "I said"]
    assert texts[-1] == "I said xy"
    assert steps[-1][0][0].outputs[0].finish_reason == "length"
    assert all(a == [] for _, a in steps)
    # DELTA: the flushed tail arrives in the final delta.
    op = _new(tok, SamplingParams(output_kind=DELTA, stop=["xyz"]))
    steps = _feed_one_by_one(op, "r", ids, finish=("length", None))
    deltas = [s[0][0].outputs[0].text for s in steps]
    assert deltas == ["I", " said", " xy"]


def test_stop_token_finish_not_detokenized(tok):
    ids = tok.encode("Hello world")
    stop_tok = tok.encode(" and")[0]
    op = _new(tok, SamplingParams(output_kind=FINAL, skip_special_tokens=True))
    outs, _ = op.process_outputs(
        [EngineCoreOutput("r", ids + [stop_tok], finish_reason="stop", stop_reason=stop_tok)])
    co = outs[0].outputs[0]
    assert co.text == "Hello world" and co.token_ids == ids + [stop_tok]
    assert co.finish_reason == "stop" and co.stop_reason == stop_tok
    op = _new(tok, SamplingParams(output_kind=FINAL, include_stop_str_in_output=True))
    outs, _ = op.process_outputs(
        [EngineCoreOutput("r", ids + [stop_tok], finish_reason="stop", stop_reason=stop_tok)])
    assert outs[0].outputs[0].text == "Hello world and"


def test_logprob_entry_conversion(tok):
    hello, world, comma = tok.encode("Hello")[0], tok.encode(" world")[0], tok.encode(",")[0]
    # Sampled token not in the top-2: rank from sampled_rank, kept first.
    d = convert_logprobs_entry(([world, hello, comma], [-3.0, -0.5, -1.0], 7),
                               lambda t: tok.decode([t]))
    assert list(d) == [world, hello, comma]
    assert d[world] == Logprob(-3.0, 7, " world")
    assert d[hello] == Logprob(-0.5, 1, "Hello")
    assert d[comma] == Logprob(-1.0, 2, ",")
    # Sampled token also in the top-k: one entry, first.
    d = convert_logprobs_entry(([hello, hello, comma], [-0.5, -0.5, -1.0], 1))
    assert list(d) == [hello, comma]
    assert d[hello].rank == 1 and d[comma].rank == 2 and d[hello].decoded_token is None
    assert convert_logprobs_entry(None) is None


def test_logprobs_through_processor(tok):
    ids = tok.encode("Hello world")
    alt = tok.encode(",")[0]
    entries = [([ids[0], alt], [-0.25, -1.5], 2), ([ids[1], ids[1]], [-0.5, -0.5], 1)]
    for kind in (CUM, DELTA):
        op = _new(tok, SamplingParams(output_kind=kind, logprobs=1))
        o1, _ = op.process_outputs([EngineCoreOutput("r", [ids[0]], new_logprobs=entries[:1])])
        o2, _ = op.process_outputs([EngineCoreOutput("r", [ids[1]], new_logprobs=entries[1:],
                                                     finish_reason="length")])
        c1, c2 = o1[0].outputs[0], o2[0].outputs[0]
        assert math.isclose(c1.cumulative_logprob, -0.25)
        assert math.isclose(c2.cumulative_logprob, -0.75)
        assert c1.logprobs == [{ids[0]: Logprob(-0.25, 2, "Hello"),
                                alt: Logprob(-1.5, 1, ",")}]
        second = {ids[1]: Logprob(-0.5, 1, " world")}
        if kind == CUM:
            assert c2.logprobs == c1.logprobs + [second]
        else:
            assert c2.logprobs == [second]


def test_prompt_logprobs_in_chunks(tok):
    p_ids = tok.encode(PROMPT)
    n = len(p_ids)
    ent = [([p_ids[i], 5], [-1.0 * i, -0.1], 3) for i in range(n)]
    out_id = tok.encode("Hi")[0]
    for kind in (CUM, DELTA):
        op = _new(tok, SamplingParams(output_kind=kind, prompt_logprobs=1))
        # Chunk 1 (runner sends None for position 0), no token yet: no output.
        outs, _ = op.process_outputs(
            [EngineCoreOutput("r", [], new_prompt_logprobs=[None] + ent[1:4])])
        assert outs == []
        outs, _ = op.process_outputs([EngineCoreOutput("r", [out_id],
                                                       new_prompt_logprobs=ent[4:])])
        pl = outs[0].prompt_logprobs
        assert len(pl) == n and pl[0] is None
        assert pl[1] == {p_ids[1]: Logprob(-1.0, 3, tok.decode([p_ids[1]])),
                         5: Logprob(-0.1, 1, tok.decode([5]))}
        outs, _ = op.process_outputs([EngineCoreOutput("r", [out_id], finish_reason="length")])
        if kind == CUM:
            assert outs[0].prompt_logprobs == pl
        else:
            assert outs[0].prompt_logprobs is None
    # Without a leading None from the runner, position 0 gets one anyway.
    op = _new(tok, SamplingParams(output_kind=FINAL, prompt_logprobs=0))
    op.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=ent[1:])])
    outs, _ = op.process_outputs([EngineCoreOutput("r", [out_id], finish_reason="length")])
    assert len(outs[0].prompt_logprobs) == n and outs[0].prompt_logprobs[0] is None


def _add_parent(op, tok, params, pid="p", queue=None):
    parent = ParentRequest(pid, params)
    child_ids = []
    for i in range(params.n):
        cid, cparams = parent.get_child_info(i)
        assert cid == f"{i}_{pid}" and cparams.n == 1
        op.add_request(cid, PROMPT, tok.encode(PROMPT), cparams, parent=parent, index=i,
                       tokenizer=tok, queue=queue)
        child_ids.append(cid)
    return parent, child_ids


@pytest.mark.parametrize("kind", [CUM, DELTA, FINAL])
def test_n2_fan_in(tok, kind):
    a, b = tok.encode("one two three"), tok.encode("Hello world")
    op = OutputProcessor(tokenizer=tok)
    parent, (c0, c1) = _add_parent(op, tok, SamplingParams(n=2, seed=5, output_kind=kind))
    assert op.request_states[c1].params.seed == 6
    steps = [
        [EngineCoreOutput(c1, b[:1]), EngineCoreOutput(c0, a[:1])],
        [EngineCoreOutput(c0, a[1:2])],
        [EngineCoreOutput(c0, a[2:], finish_reason="length"), EngineCoreOutput(c1, b[1:])],
        [EngineCoreOutput(c1, [], finish_reason="length")],
    ]
    results = []
    for s in steps:
        outs, aborts = op.process_outputs(s)
        assert aborts == [] and len(outs) <= 1
        results.append(outs)
    assert not op.has_unfinished_requests() and not op.parent_requests
    if kind == FINAL:
        assert [len(r) for r in results] == [0, 0, 0, 1]
    else:
        assert all(len(r) == 1 for r in results)
    final = results[-1][0]
    assert final.request_id == "p" and final.finished
    assert [r[0].finished for r in results if r] == [False] * (len([r for r in results if r]) - 1) + [True]
    if kind == DELTA:
        idx = [[c.index for c in r[0].outputs] for r in results]
        assert idx == [[0, 1], [0], [0, 1], [1]]
        text0 = "".join(c.text for r in results for c in r[0].outputs if c.index == 0)
        text1 = "".join(c.text for r in results for c in r[0].outputs if c.index == 1)
        assert (text0, text1) == ("one two three", "Hello world")
    else:
        assert [c.index for c in final.outputs] == [0, 1]
        assert final.outputs[0].text == "one two three" and final.outputs[0].token_ids == a
        assert final.outputs[1].text == "Hello world" and final.outputs[1].token_ids == b
        assert all(c.finish_reason == "length" for c in final.outputs)
        if kind == CUM:
            mid = results[1][0]
            assert [c.token_ids for c in mid.outputs] == [a[:2], b[:1]]


def test_n2_stop_string_aborts_only_that_child(tok):
    op = OutputProcessor(tokenizer=tok)
    parent, (c0, c1) = _add_parent(op, tok, SamplingParams(n=2, stop=["two"], output_kind=CUM))
    a, b = tok.encode("one two three"), tok.encode("Hello world")
    outs, aborts = op.process_outputs([EngineCoreOutput(c0, a[:2]), EngineCoreOutput(c1, b[:1])])
    assert aborts == [c0]
    assert outs[0].outputs[0].text == "one " and outs[0].outputs[0].finish_reason == "stop"
    assert not outs[0].finished and op.has_unfinished_requests()
    outs, aborts = op.process_outputs([EngineCoreOutput(c1, b[1:], finish_reason="length")])
    assert outs[0].finished and [c.text for c in outs[0].outputs] == ["one ", "Hello world"]


def test_queue_and_abort(tok):
    class Q:
        def __init__(self):
            self.items = []

        def put_nowait(self, x):
            self.items.append(x)

    ids = tok.encode("Hello world")
    q = Q()
    op = _new(tok, SamplingParams(output_kind=DELTA), queue=q)
    op.add_request("other", None, [1, 2], SamplingParams(), tokenizer=tok)
    outs, _ = op.process_outputs([EngineCoreOutput("r", ids[:1]), EngineCoreOutput("other", [5])])
    assert [o.request_id for o in outs] == ["other"] and outs[0].prompt is None
    assert len(q.items) == 1 and q.items[0].outputs[0].text == "Hello"
    assert op.get_num_unfinished_requests() == 2
    assert op.abort_requests(["r", "missing"]) == ["r"]
    assert op.process_outputs([EngineCoreOutput("r", ids[1:])]) == ([], [])
    # Parent ids expand to their children; the queue is the parent's.
    q2 = Q()
    _add_parent(op, tok, SamplingParams(n=2, output_kind=CUM), pid="p", queue=q2)
    op.process_outputs([EngineCoreOutput("1_p", ids[:1])])
    assert len(q2.items) == 1 and len(q2.items[0].outputs) == 2
    assert sorted(op.abort_requests(["p"])) == ["0_p", "1_p"]
    assert op.abort_requests(["other"]) == ["other"]
    assert not op.has_unfinished_requests() and not op.parent_requests


def test_num_cached_tokens_and_no_detokenize(tok):
    ids = tok.encode("Hello world")
    op = _new(tok, SamplingParams(output_kind=FINAL, detokenize=False))
    outs, _ = op.process_outputs(
        [EngineCoreOutput("r", ids, finish_reason="length", num_cached_tokens=16)])
    assert outs[0].num_cached_tokens == 16
    assert outs[0].outputs[0].text == "" and outs[0].outputs[0].token_ids == ids


def test_pooling_requests_go_through_the_output_processor(tok):
    """A pooling request registered with its PoolingParams becomes a PoolingRequestOutput when its
    last prefill chunk finishes (nothing before), returned or queued like a generation output; a
    generation request in the same step is unaffected, and finished ids are forgotten."""
    import torch

    from pagedllm.outputs import PoolingRequestOutput, RequestOutput
    from pagedllm.pooling_params import PoolingParams

    class Q(list):
        put_nowait = list.append

    op = OutputProcessor(tok)
    vec = torch.arange(4, dtype=torch.float32)
    op.add_request("emb", "Hi", [1, 2, 3], PoolingParams())
    queued = Q()
    op.add_request("emb-q", None, [4, 5], PoolingParams(), queue=queued)
    op.add_request("gen", PROMPT, tok.encode(PROMPT), SamplingParams(max_tokens=2, output_kind=FINAL))
    assert op.get_num_unfinished_requests() == 3
    # a prefill chunk that is not the last: no output
    outs, aborts = op.process_outputs([EngineCoreOutput("emb", [])])
    assert outs == [] and aborts == []
    outs, _ = op.process_outputs([
        EngineCoreOutput("emb", [], finish_reason="stop", pooled=vec),
        EngineCoreOutput("emb-q", [], finish_reason="stop", pooled=vec * 2),
        EngineCoreOutput("gen", [tok.encode(" Hello", add_special_tokens=False)[0]]),
    ])
    (o,) = outs
    assert isinstance(o, PoolingRequestOutput) and o.request_id == "emb" and o.finished
    assert o.prompt_token_ids == [1, 2, 3] and torch.equal(o.outputs.data, vec)
    (q,) = queued
    assert isinstance(q, PoolingRequestOutput) and torch.equal(q.outputs.data, vec * 2)
    assert set(op.request_states) == {"gen"}
    # a pooling request that ends without a pooled tensor is an error (its queue hears it)
    op.add_request("bad", None, [1], PoolingParams(), queue=queued)
    op.process_outputs([EngineCoreOutput("bad", [], finish_reason="stop")])
    assert isinstance(queued[-1], RuntimeError) and "bad" in str(queued[-1])
    op.add_request("bad2", None, [1], PoolingParams())
    with pytest.raises(RuntimeError, match="without a pooled output"):
        op.process_outputs([EngineCoreOutput("bad2", [], finish_reason="stop")])
    outs, _ = op.process_outputs([EngineCoreOutput("gen", [7], finish_reason="length")])
    assert isinstance(outs[0], RequestOutput) and op.get_num_unfinished_requests() == 0
    op.add_request("x", None, [1], PoolingParams())
    with pytest.raises(ValueError, match="already in use"):
        op.add_request("x", None, [1], PoolingParams())

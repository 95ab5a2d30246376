"""SamplingParams / PoolingParams: defaults, normalization, validation, engine hooks."""
import pytest

from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    validate_logprobs,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.logit_bias is None and p.allowed_token_ids is None and p.extra_args is None
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, seed=-1,
                       logit_bias={"7": 250, 8: -1000.0, "9": 1.5})
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 6]
    assert p.top_k == 0
    assert p.seed is None
    assert p.logit_bias == {7: 100.0, 8: -100.0, 9: 1.5}
    assert p.output_text_buffer_length == 2
    assert p.all_stop_token_ids == {5, 6}


def test_greedy_and_temperature_floor():
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.is_greedy and g.sampling_type == SamplingType.GREEDY
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    # Positive temperatures below 1e-2 are raised to 1e-2 (vLLM _MAX_TEMP), not greedy.
    t = SamplingParams(temperature=1e-4)
    assert t.temperature == pytest.approx(1e-2) and not t.is_greedy
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED


INVALID = [
    ("n", 0), ("n", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.1),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -1), ("prompt_logprobs", -2),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
    ("stop", ""), ("stop", ["ok", ""]),
    ("allowed_token_ids", []),
    ("output_kind", 7),
    ("seed", 1.5),
    ("stop_token_ids", [-1]),
    ("logit_bias", {"abc": 1.0}),
]


@pytest.mark.parametrize("name,value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_values_raise_naming_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    SamplingParams(min_tokens=10, max_tokens=None)


def test_stop_requires_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_valid_edge_values():
    p = SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=5.0,
                       top_p=1.0, top_k=1, min_p=1.0, max_tokens=None, logprobs=0,
                       prompt_logprobs=0, truncate_prompt_tokens=-1, output_kind=1)
    assert p.output_kind is RequestOutputKind.DELTA


def test_validate_logprobs_cap():
    validate_logprobs(SamplingParams(logprobs=20, prompt_logprobs=20), 20)
    with pytest.raises(ValueError, match="logprobs"):
        validate_logprobs(SamplingParams(logprobs=21), 20)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        validate_logprobs(SamplingParams(prompt_logprobs=30), 20)


def test_verify_against_vocab():
    SamplingParams(allowed_token_ids=[0, 9], logit_bias={9: 1.0}).verify_against_vocab(10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 10]).verify_against_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"12": 1.0}).verify_against_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[11]).verify_against_vocab(10)


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0}, seed=4)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")
    c.logit_bias[2] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}
    assert "SamplingParams(" in repr(p) and "seed=4" in repr(p)


def test_update_from_generation_config_defaults_and_eos():
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64,
           "repetition_penalty": 1.1, "eos_token_id": [2, 7]}
    p = SamplingParams(temperature=1.0)  # explicit: kept
    p.update_from_generation_config(gen, model_eos_token_id=2)
    assert p.temperature == 1.0
    assert (p.top_p, p.top_k, p.max_tokens, p.repetition_penalty) == (0.9, 20, 64, 1.1)
    assert p.stop_token_ids == [7]
    assert p.all_stop_token_ids == {2, 7}

    q = SamplingParams(ignore_eos=True, max_tokens=5)
    q.update_from_generation_config(gen, model_eos_token_id=2)
    assert q.temperature == 0.6 and q.max_tokens == 5
    assert q.stop_token_ids == []  # ignore_eos: extra EOS ids don't stop
    assert q.all_stop_token_ids == {2, 7}  # ...but min_tokens still masks them

    # Greedy after the update resets the random-only knobs.
    r = SamplingParams()
    r.update_from_generation_config({"temperature": 0.0, "top_p": 0.5})
    assert r.is_greedy and r.top_p == 1.0


class _ToyTokenizer:
    """Word-level: 'foo' -> [10], ' foo' -> [11], 'bar baz' -> [20, 21], ' bar baz' -> [22, 21]."""

    vocab = {"foo": 10, " foo": 11, "bar": 20, " bar": 22, " baz": 21}
    max_token_id = 30

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        ids, first = [], True
        for w in text.split(" "):
            if w == "":
                continue
            key = w if (first and not text.startswith(" ")) else " " + w
            ids.append(self.vocab[key])
            first = False
        return ids


def test_update_from_tokenizer_bad_words():
    p = SamplingParams(bad_words=["foo", " bar baz"])
    p.update_from_tokenizer(_ToyTokenizer())
    assert p._bad_words_token_ids == [[10], [11], [20, 21], [22, 21]]
    with pytest.raises(ValueError, match="bad_words"):
        p.verify_against_vocab(21)


# ---------------------------------------------------------------------- PoolingParams
def test_pooling_params():
    p = PoolingParams()
    assert (p.dimensions, p.normalize, p.use_activation, p.truncate_prompt_tokens,
            p.task) == (None, None, None, None, None)
    a = PoolingParams(activation=False)
    assert a.use_activation is False and a.activation is False
    e = PoolingParams(dimensions=8)
    e.verify("embed", hidden_size=16)
    assert e.task == "embed" and e.normalize is True
    c = PoolingParams()
    c.verify("classify")
    assert c.use_activation is True
    assert PoolingParams(dimensions=4).clone() == PoolingParams(dimensions=4)


@pytest.mark.parametrize("kwargs,field", [
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": -3}, "dimensions"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"task": "nope"}, "task"),
    ({"normalize": "yes"}, "normalize"),
])
def test_pooling_params_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoolingParams(**kwargs)


def test_pooling_params_verify_errors():
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=32).verify("embed", hidden_size=16)
    with pytest.raises(ValueError, match="use_activation"):  # encode is raw: nothing to switch
        PoolingParams(use_activation=True).verify("encode")
    with pytest.raises(ValueError, match="matryoshka"):
        PoolingParams(dimensions=4).verify("embed", is_matryoshka=False)
    with pytest.raises(ValueError, match=r"only supports \[8, 16\]"):
        PoolingParams(dimensions=4).verify("embed", is_matryoshka=True, matryoshka_dimensions=[8, 16])
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=4).verify("classify")

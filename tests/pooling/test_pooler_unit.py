"""Pooler math over chunks, configs, params and helpers (no model)."""
from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.pooling.adapters import pooling_architectures, split_head_weights
from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling.pooler import Pooler
from pagedllm.pooling_params import PoolingParams


def _run_chunks(pooler, hidden, chunks, params):
    state, start, res = {}, 0, None
    for i, n in enumerate(chunks):
        r = SimpleNamespace(req_id="r", start_pos=start, is_last_chunk=i == len(chunks) - 1, pooling_params=params)
        res = pooler.accumulate(state, r, hidden[start:start + n])
        assert (res is None) == (i < len(chunks) - 1)
        start += n
    assert state == {}
    return res


@pytest.mark.parametrize("chunks", [[10], [3, 3, 4], [1, 8, 1]])
def test_pooling_types_over_chunks(chunks):
    torch.manual_seed(0)
    h = torch.randn(10, 8)
    ref = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0], "ALL": h}
    for pt, want in ref.items():
        p = Pooler(PoolerConfig(pooling_type=pt, normalize=False), "embed", hidden_size=8)
        params = p.prepare_params(None, "embed")
        torch.testing.assert_close(_run_chunks(p, h, chunks, params), want)
        # default normalize=True, Matryoshka dims
        p = Pooler(PoolerConfig(pooling_type=pt), "embed", hidden_size=8)
        params = p.prepare_params(PoolingParams(dimensions=4), "embed")
        torch.testing.assert_close(_run_chunks(p, h, chunks, params), F.normalize(want[..., :4], dim=-1))


def test_classifier_head_and_activation():
    torch.manual_seed(0)
    h = torch.randn(5, 8)
    w3, b3 = torch.randn(3, 8), torch.randn(3)
    p = Pooler(PoolerConfig(), "classify", w3, b3, hidden_size=8)
    logits = h[-1] @ w3.T + b3
    torch.testing.assert_close(_run_chunks(p, h, [2, 3], p.prepare_params(None, "classify")), logits.softmax(-1))
    raw = p.prepare_params(PoolingParams(use_activation=False), "classify")
    torch.testing.assert_close(_run_chunks(p, h, [5], raw), logits)
    torch.testing.assert_close(_run_chunks(p, h, [5], p.prepare_params(None, "encode")), logits)
    with pytest.raises(ValueError, match="num_labels=3"):
        p.prepare_params(None, "score")
    with pytest.raises(ValueError, match="does not support embeddings"):
        p.prepare_params(None, "embed")
    p1 = Pooler(PoolerConfig(use_activation=False), "classify", w3[:1], None, hidden_size=8)
    torch.testing.assert_close(_run_chunks(p1, h, [5], p1.prepare_params(None, "score")), h[-1] @ w3[:1].T)
    p1 = Pooler(PoolerConfig(), "classify", w3[:1], None, hidden_size=8)
    torch.testing.assert_close(_run_chunks(p1, h, [5], p1.prepare_params(None, "score")),
                               torch.sigmoid(h[-1] @ w3[:1].T))


def test_embed_params_errors():
    p = Pooler(PoolerConfig(), "embed", hidden_size=8)
    with pytest.raises(ValueError, match="dimensions"):
        p.prepare_params(PoolingParams(dimensions=9), "embed")
    with pytest.raises(ValueError, match="does not support classification"):
        p.prepare_params(None, "classify")
    with pytest.raises(ValueError, match="does not support"):  # encode is raw: no activation switch
        p.prepare_params(PoolingParams(use_activation=True), "encode")
    with pytest.raises(ValueError, match="classifier head"):
        Pooler(PoolerConfig(), "classify", None)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig(pooling_type="MAX")
    assert PoolerConfig.from_any('{"pooling_type": "last", "use_activation": false}') == \
        PoolerConfig(pooling_type="LAST", use_activation=False)


def test_architectures_and_head_split():
    assert pooling_architectures(["LlamaForSequenceClassification"])[0] == "LlamaForCausalLM"
    assert pooling_architectures(["Gemma3TextModel"])[0] == "Gemma3ForCausalLM"
    assert pooling_architectures(["Gemma3ForCausalLM"]) == ["Gemma3ForCausalLM"]
    sink = {}
    ws = [("model.norm.weight", torch.ones(2)), ("score.weight", torch.ones(3, 2)), ("score.bias", torch.zeros(3))]
    assert [n for n, _ in split_head_weights(ws, sink)] == ["model.norm.weight"]
    assert sink["weight"].shape == (3, 2) and sink["bias"].shape == (3,)


def test_base64_is_little_endian_float32():
    from pagedllm.entrypoints.openai.serving_pooling import encode_base64, to_prompts

    v = torch.tensor([1.5, -2.25, 3.0e-8])
    got = np.frombuffer(base64.b64decode(encode_base64(v)), dtype="<f4")
    np.testing.assert_array_equal(got, v.numpy())
    assert to_prompts("a") == ["a"]
    assert to_prompts([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert to_prompts([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]
    from pagedllm.entrypoints.openai.errors import OpenAIError
    with pytest.raises(OpenAIError, match="empty"):
        to_prompts([])


# ---------------------------------------------------------------- vLLM's use_activation semantics
@pytest.fixture
def fresh_alias_warnings(monkeypatch):
    """Deprecated-alias warnings are logged once per process; start each test with none logged."""
    import pagedllm.pooling_params as pp
    monkeypatch.setattr(pp, "_warned_aliases", set())


def _deprecation_logged(caplog, name):
    return any(f"`{name}` is deprecated" in r.getMessage() for r in caplog.records)


def test_use_activation_is_the_embed_normalisation(fresh_alias_warnings, caplog):
    """vLLM >= 0.11: for embed / token_embed the activation *is* the L2 normalisation, so
    ``use_activation=False`` (config or request) returns the raw hidden state."""
    torch.manual_seed(0)
    h = 3.0 * torch.randn(6, 8)
    raw = Pooler(PoolerConfig(pooling_type="LAST", use_activation=False), "embed", hidden_size=8)
    for task, want in (("embed", h[-1]), ("token_embed", h)):
        got = _run_chunks(raw, h, [2, 4], raw.prepare_params(None, task))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert float(want.norm(dim=-1).max()) > 2  # really not normalised
        # the request's own use_activation wins over the config's
        got = _run_chunks(raw, h, [6], raw.prepare_params(PoolingParams(use_activation=True), task))
        torch.testing.assert_close(got, F.normalize(want, dim=-1))
    dflt = Pooler(PoolerConfig(pooling_type="LAST"), "embed", hidden_size=8)  # default: activation on
    torch.testing.assert_close(_run_chunks(dflt, h, [6], dflt.prepare_params(None, "embed")), F.normalize(h[-1], dim=0))
    got = _run_chunks(dflt, h, [6], dflt.prepare_params(PoolingParams(use_activation=False), "token_embed"))
    torch.testing.assert_close(got, h, rtol=0, atol=0)
    # Matryoshka truncation happens before the normalisation, and stays without it
    p = dflt.prepare_params(PoolingParams(dimensions=4, use_activation=False), "embed")
    torch.testing.assert_close(_run_chunks(dflt, h, [6], p), h[-1, :4], rtol=0, atol=0)
    # encode stays the raw pooled state and takes no switch
    torch.testing.assert_close(_run_chunks(dflt, h, [6], dflt.prepare_params(None, "encode")), h[-1])
    assert not caplog.records  # no deprecated name used so far
    # the deprecated alias `normalize` means use_activation, config and request alike, with a warning
    with caplog.at_level("WARNING", logger="pagedllm"):
        old = Pooler(PoolerConfig(pooling_type="LAST", normalize=False), "embed", hidden_size=8)
    assert old.config.use_activation is False and old.config.normalize is None
    assert _deprecation_logged(caplog, "normalize")
    torch.testing.assert_close(_run_chunks(old, h, [6], old.prepare_params(None, "embed")), h[-1], rtol=0, atol=0)
    p = dflt.prepare_params(PoolingParams(normalize=False), "embed")
    assert p.use_activation is False
    torch.testing.assert_close(_run_chunks(dflt, h, [6], p), h[-1], rtol=0, atol=0)


def test_use_activation_is_the_classifier_activation(fresh_alias_warnings, caplog):
    torch.manual_seed(1)
    h = torch.randn(5, 8)
    w3, w1 = torch.randn(3, 8), torch.randn(1, 8)
    p3 = Pooler(PoolerConfig(use_activation=False), "classify", w3, None, hidden_size=8)
    logits = h @ w3.T
    torch.testing.assert_close(_run_chunks(p3, h, [5], p3.prepare_params(None, "classify")), logits[-1])
    torch.testing.assert_close(_run_chunks(p3, h, [2, 3], p3.prepare_params(None, "token_classify")), logits)
    on = PoolingParams(use_activation=True)
    torch.testing.assert_close(_run_chunks(p3, h, [5], p3.prepare_params(on, "token_classify")), logits.softmax(-1))
    p1 = Pooler(PoolerConfig(), "classify", w1, None, hidden_size=8)
    torch.testing.assert_close(_run_chunks(p1, h, [5], p1.prepare_params(None, "score")), torch.sigmoid(h[-1] @ w1.T))
    torch.testing.assert_close(_run_chunks(p1, h, [5], p1.prepare_params(PoolingParams(use_activation=False), "score")),
                               h[-1] @ w1.T)
    # deprecated aliases softmax / activation, per request and in the config, each warned about
    with caplog.at_level("WARNING", logger="pagedllm"):
        raw = p1.prepare_params(PoolingParams(softmax=False), "classify")
        assert raw.use_activation is False
        assert PoolerConfig(activation=False).use_activation is False
    assert _deprecation_logged(caplog, "softmax") and _deprecation_logged(caplog, "activation")
    torch.testing.assert_close(_run_chunks(p1, h, [5], raw), h[-1] @ w1.T)
    # contradicting values are an error naming both, not a silent pick
    with pytest.raises(ValueError, match="conflicting values use_activation=True, softmax=False"):
        PoolingParams(use_activation=True, softmax=False)
    with pytest.raises(ValueError, match="pooler_config.normalize"):
        PoolerConfig(use_activation=True, normalize=False)
    assert PoolerConfig.from_any('{"pooling_type": "LAST", "use_activation": false}').use_activation is False


def test_dimensions_need_a_matryoshka_model():
    """vLLM: ``dimensions`` on a model whose config has neither ``is_matryoshka`` nor
    ``matryoshka_dimensions`` is refused (it would return a truncated, meaningless vector)."""
    from pagedllm.pooling.pooler import build_pooler

    args = SimpleNamespace(pooler_config=None, convert="embed", served_model_name=None, model="m")
    plain = build_pooler(args, SimpleNamespace(hidden_size=8), None)
    assert plain.is_matryoshka is False
    with pytest.raises(ValueError, match='model "m" does not support matryoshka'):
        plain.prepare_params(PoolingParams(dimensions=4), "embed")
    plain.prepare_params(None, "embed")  # no dimensions: fine
    flag = build_pooler(args, SimpleNamespace(hidden_size=8, is_matryoshka=True), None)
    assert flag.prepare_params(PoolingParams(dimensions=3), "embed").dimensions == 3
    listed = build_pooler(args, SimpleNamespace(hidden_size=8, matryoshka_dimensions=[4, 8]), None)
    assert listed.prepare_params(PoolingParams(dimensions=4), "token_embed").dimensions == 4
    with pytest.raises(ValueError, match=r"only supports \[4, 8\] matryoshka dimensions"):
        listed.prepare_params(PoolingParams(dimensions=6), "embed")

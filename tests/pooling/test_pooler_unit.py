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
    with pytest.raises(ValueError, match="does not support"):
        p.prepare_params(PoolingParams(use_activation=True), "embed")
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

"""Tiny random Gemma 3 image-text model (tests/arch_cases.py "gemma3-mm") vs transformers on the same
weights and pixels: image embeddings, prefill logits with the bidirectional image mask, decode steps,
and a prefill split before the image run (the image run inside one chunk)."""

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests")
from arch_cases import CASES, build_hf  # noqa: E402

from pagedllm.attention.backend import ForwardContext, set_forward_context  # noqa: E402
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata  # noqa: E402
from pagedllm.models.registry import get_model_class  # noqa: E402

BS = 4
IMG = 255  # image_token_id of the case


@pytest.fixture(scope="module")
def pair():
    cls, factory = CASES["gemma3-mm"]
    hf = build_hf(factory(), cls)
    ours = get_model_class([cls])(hf.config, torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def _prompt():
    # text, <boi>, 4 image tokens, <eoi>, text, then a second image
    return [1, 5, 17, 254] + [IMG] * 4 + [253, 9, 61, 254] + [IMG] * 4 + [253, 23, 7]


def _runs(ids):
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == IMG:
            j = i
            while j < len(ids) and ids[j] == IMG:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def _ours(model, ids, pixels, chunks):
    """Run ``ids`` in prefill chunks of the given sizes; image rows take the image embeddings."""
    emb = model.embed_images(pixels).reshape(-1, model.config.hidden_size)
    n_layers, hkv, d = model.get_kv_cache_spec()
    caches = [torch.zeros(32, 2, BS, hkv, d) for _ in range(n_layers)]
    blocks = list(range(31, 31 - (len(ids) + BS) // BS - 1, -1))
    runs = _runs(ids)
    img_rows = [p for a, b in runs for p in range(a, b)]
    out, start = [], 0
    for n in chunks:
        meta = build_metadata([(start, n, blocks)], BS)
        meta.bidirectional_ranges = [runs]
        rows = [p - start for p in img_rows if start <= p < start + n]
        vals = [img_rows.index(p + start) for p in rows]
        mm = (torch.tensor(rows), emb[vals]) if rows else None
        ctx = ForwardContext(meta, caches, TorchPagedAttention(use_cpu_kernel=False), mm_embeds=mm)
        with torch.no_grad(), set_forward_context(ctx):
            h = model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n))
        out.append(model.compute_logits(h))
        start += n
    return torch.cat(out)


def test_image_embeddings_match(pair):
    hf, ours = pair
    px = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        ref = hf.model.get_image_features(px).pooler_output
    torch.testing.assert_close(ours.embed_images(px), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[19], [3, 16], [8, 11]])
def test_prefill_logits_match(pair, chunks):
    hf, ours = pair
    ids = _prompt()
    px = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    tt = torch.tensor([[1 if t == IMG else 0 for t in ids]])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=px, token_type_ids=tt).logits[0]
    got = _ours(ours, ids, px, chunks)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    # the bidirectional mask matters: a causal-only run differs on the image rows
    causal = hf(input_ids=torch.tensor([ids]), pixel_values=px).logits[0]
    assert (causal - ref).abs().max() > 1e-3

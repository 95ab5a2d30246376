"""bf16 linears packed for oneDNN (``prepack_cpu_linears``) compute exactly what ``F.linear`` does."""
from __future__ import annotations

import copy

import pytest
import torch

from pagedllm.kernels.onednn import OneDNNPackedLinearMethod, prepack_cpu_linears
from pagedllm.models.layers import Linear

torch.set_num_threads(1)

from pagedllm.kernels.onednn import pack_bf16_weight

# oneDNN packs bf16 weights only on CPUs with avx512bw/vl/dq or avx_ne_convert (not on AVX2-only
# machines, where prepack_cpu_linears leaves the dense weights and F.linear in place).
pytestmark = pytest.mark.skipif(pack_bf16_weight(torch.zeros(16, 16, dtype=torch.bfloat16)) is None,
                                reason="oneDNN cannot pack bf16 weights on this CPU")


def _logits(model, ids):
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention
    with torch.inference_mode(), set_forward_context(ForwardContext(None, [], TorchPagedAttention())):
        return model.compute_logits(model(ids, torch.arange(len(ids))))


@pytest.mark.parametrize("tie", [True, False])
def test_prepacked_model_is_bit_identical(tie, tiny_llama):
    model = tiny_llama(tie, torch.bfloat16, 0.05)
    ids = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    packed = copy.deepcopy(model)
    nbytes = prepack_cpu_linears(packed)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant_method, OneDNNPackedLinearMethod) and m.weight.numel() == 0
                           for m in linears)
    dense = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, Linear))
    head = model.model.embed_tokens.weight.numel() * 2 if tie else 0
    assert nbytes == dense + head
    lp = packed.logits_processor
    assert isinstance(lp.quant_method, OneDNNPackedLinearMethod) == tie and lp.tied_head is None
    if tie:  # a packed copy beside the dense table, which stays for lookups
        assert packed.model.embed_tokens.onednn_weight is not None and packed.model.embed_tokens.weight.numel() > 0
    got = _logits(packed, ids)
    assert torch.equal(got, ref)


def test_float32_models_are_left_alone_unless_asked(tiny_llama):
    model = tiny_llama(True)
    assert prepack_cpu_linears(model, float32=False) == 0
    assert all(m.quant_method is None and m.weight.numel() > 0 for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("tie", [True, False])
def test_float32_prepacked_model_matches_f_linear(tie, tiny_llama):
    """float32 packing (``float32=True``; the default where ``float32_packing_wanted``): every
    linear and a tied head packed, logits equal to the dense model's up to float32 rounding (oneDNN's
    GEMM sums in another order than MKL's sgemm), and a bf16 model's float32 packing is a no-op."""
    model = tiny_llama(tie, torch.float32, 0.05)
    ids = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, ids)
    packed = copy.deepcopy(model)
    nbytes = prepack_cpu_linears(packed, float32=True)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant_method, OneDNNPackedLinearMethod) and m.weight.numel() == 0
                           and m.onednn_weight.dtype == torch.float32 for m in linears)
    dense = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, Linear))
    assert nbytes == dense + (model.model.embed_tokens.weight.numel() * 4 if tie else 0)
    got = _logits(packed, ids)
    assert got.dtype == torch.float32 and not torch.equal(got, torch.zeros_like(got))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_float32_packing_default_skips_small_models(tiny_llama, monkeypatch):
    """With float32 packing wanted (``PAGEDLLM_ONEDNN_FLOAT32=1``), the default packs a float32 model
    only when every linear has >= ``FLOAT32_PACK_MIN_ELEMENTS`` weights (all or none); ``=0`` never."""
    from pagedllm.kernels import onednn

    monkeypatch.setenv("PAGEDLLM_ONEDNN_FLOAT32", "1")
    assert onednn.float32_packing_wanted()
    small = tiny_llama(True)  # 64-wide linears
    assert max(m.weight.numel() for m in small.modules() if isinstance(m, Linear)) < onednn.FLOAT32_PACK_MIN_ELEMENTS
    assert prepack_cpu_linears(small) == 0
    monkeypatch.setattr(onednn, "FLOAT32_PACK_MIN_ELEMENTS", 1)
    assert prepack_cpu_linears(small) > 0
    assert all(isinstance(m.quant_method, OneDNNPackedLinearMethod) for m in small.modules() if isinstance(m, Linear))
    monkeypatch.setenv("PAGEDLLM_ONEDNN_FLOAT32", "0")
    assert not onednn.float32_packing_wanted()
    assert prepack_cpu_linears(tiny_llama(True)) == 0


def test_no_head_copy_on_a_pipeline_stage_without_logits(tiny_llama):
    """A tied model on a pipeline stage before the last (``logits_processor.emits_logits`` False)
    gets its linears packed but no packed copy of the embedding table, which it never multiplies."""
    model = tiny_llama(True, torch.bfloat16, 0.05)
    model.logits_processor.emits_logits = False
    nbytes = prepack_cpu_linears(model)
    assert nbytes == sum(m.onednn_weight.to_dense().numel() * 2 for m in model.modules() if isinstance(m, Linear))
    assert getattr(model.model.embed_tokens, "onednn_weight", None) is None
    assert model.logits_processor.quant_method is None

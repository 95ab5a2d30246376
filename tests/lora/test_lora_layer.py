"""``LoRALinear`` around every kind of base projection (float, weight-only int8/int4, W8A8 with a
float or a pre-quantized input): its output is the base output plus the row-by-row LoRA deltas;
the W8A8 gate/up fusion (the base's quantization method, bound to it) is offered only to steps
without adapter rows; the fused decode step
still runs the steps without adapter rows and never the ones with them."""
from __future__ import annotations

import pytest
import torch

import pagedllm.kernels.cpu_ops as cpu_ops
from lora_helpers import LoRAStepDriver, ours_from_hf, peft_logits
from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.lora import LoRARequest
from pagedllm.lora.layer import LoRALinear
from pagedllm.lora.model_manager import LoRAMapping, LoRAModelManager
from pagedllm.lora.ops import lora_reference
from pagedllm.lora.peft_loader import LoRATarget
from pagedllm.models.layers import Linear

IN, OUT, T = 64, 96, 9


def _weights(seed, k, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, IN, generator=g).to(dtype) * 0.1, torch.randn(k, OUT, generator=g).to(dtype) * 0.1)


def _base(kind):
    torch.manual_seed(0)
    lin = Linear(IN, OUT, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.1)
        lin.bias.normal_(0, 0.1)
    if kind == "float":
        return lin
    from pagedllm.quantization import W8A8Linear, WeightOnlyInt4Linear, WeightOnlyInt8Linear
    if kind == "int8":
        return WeightOnlyInt8Linear(lin.weight, lin.bias)
    if kind == "int4":
        return WeightOnlyInt4Linear(lin.weight, lin.bias)
    return W8A8Linear(lin.weight, lin.bias)


def _ctx(mapping):
    return ForwardContext(None, [], None, lora_mapping=mapping)


@pytest.mark.parametrize("kind", ["float", "int8", "int4", "w8a8", "w8a8-quantized-input"])
def test_wrapper_adds_row_deltas_to_any_base(kind):
    base = _base(kind.split("-")[0])
    layer = LoRALinear(base, LoRATarget("p", IN, OUT, {None: (0, OUT)}), max_loras=3)
    layer.slot_weights[0] = _weights(1, 8)
    layer.slot_weights[2] = _weights(2, 4)
    x = torch.randn(T, IN)
    inp = x
    if kind == "w8a8-quantized-input":
        from pagedllm.quantization.w8a8 import quantize_rows
        inp = quantize_rows(x)
        x = inp.q.float() * inp.scale[:, None]  # the activation the base GEMM and the deltas see
    token_slots = [0, 0, 0, -1, 2, 2, 1, 1, -1]  # slot 1 has no weights for this layer
    mapping = LoRAMapping(((0, 3, 0), (4, 6, 2), (6, 8, 1)), ())
    with torch.no_grad():
        want = base(inp).float() + lora_reference(x, layer.slot_weights, token_slots)
        with set_forward_context(_ctx(mapping)):
            got = layer(inp)
        plain = layer(inp)  # outside a forward context: the base layer alone
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(plain, base(inp))


def test_w8a8_gate_up_fusion_only_without_adapter_rows():
    """The wrapper's ``quant_method`` (what ``GatedMLP`` asks for the fused act-and-mul) is the
    base layer's, bound to it: the same int8 rows without adapter rows, None (no fusion: the MLP
    then calls the wrapper, which adds the deltas) in a step with them."""
    import torch.nn.functional as F

    base = _base("w8a8")
    base.bias = None
    layer = LoRALinear(base, LoRATarget("p", IN, OUT, {0: (0, OUT // 2), 1: (OUT // 2, OUT // 2)}), 1)
    x = torch.randn(T, IN)
    with torch.no_grad():
        want = base.quant_method.apply_act_and_mul(base, x, F.silu)
        got = layer.quant_method.apply_act_and_mul(layer, x, F.silu)
        assert want is not None and torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
        assert torch.equal(layer.quant_method.apply(layer, x), base(x))
        with set_forward_context(_ctx(LoRAMapping(((0, 1, 0),), (0,)))):
            assert layer.quant_method.apply_act_and_mul(layer, x, F.silu) is None
        with set_forward_context(_ctx(None)):
            assert layer.quant_method.apply_act_and_mul(layer, x, F.silu) is not None
    assert layer.quant_method is layer.quant_method  # one object: the fused decode plan keys on it
    plain = LoRALinear(_base("float"), LoRATarget("p", IN, OUT, {None: (0, OUT)}), 1)
    assert plain.quant_method is None


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_quantized_model_with_adapter_stays_close_to_peft(hf_tiny, tiny_adapters, method):
    """A quantized base with an fp32 adapter: the adapter's effect on the logits (vs the same
    quantized base without it) matches peft's on the float model to quantization accuracy."""
    from pagedllm.quantization import quantize_model

    model = ours_from_hf(hf_tiny)
    quantize_model(model, method)
    mgr = LoRAModelManager(model, 2, 8, 2, torch.float32, torch.device("cpu"))
    drv = LoRAStepDriver(model, mgr)
    prompt = [5, 17, 3, 88, 42, 9, 61, 23]
    lr = LoRARequest("all", 1, tiny_adapters["all"])
    out = drv.step([("a", prompt, lr), ("b", prompt, None)])
    delta = out["a"] - out["b"]
    ref_delta = peft_logits(hf_tiny, tiny_adapters["all"], prompt) - peft_logits(hf_tiny, None, prompt)
    assert ref_delta.abs().max() > 0.1
    err = (delta - ref_delta).abs().max() / ref_delta.abs().max()
    assert err < 0.1, err


OPS = cpu_ops.get_ops()


@pytest.mark.skipif(OPS is None or not hasattr(OPS, "llama_decode_dense"), reason="needs the C++ fused decode kernels")
def test_fused_decode_runs_base_steps_and_skips_adapter_steps(hf_tiny, tiny_adapters, monkeypatch):
    from pagedllm.worker.fused_decode import FusedDecode

    model = ours_from_hf(hf_tiny)
    mgr = LoRAModelManager(model, 2, 8, 2, torch.float32, torch.device("cpu"))
    plan = FusedDecode.build(model.model)
    assert isinstance(plan, FusedDecode)  # the wrappers are seen through
    ran = []
    real = plan.forward

    def spy(model, input_ids, positions):  # the runner's entry (decode_step calls it every step)
        out = real(model, input_ids, positions)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(plan, "forward", spy)
    drv = LoRAStepDriver(model, mgr)
    drv.accelerator = plan
    lr = LoRARequest("qv", 1, tiny_adapters["qv"])
    prompt = [5, 17, 3, 88, 42, 9]
    drv.step([("a", prompt, None), ("b", prompt, lr)])
    base_dec = drv.step([("a", [7], None)])["a"]
    assert ran[-1] is True
    lora_dec = drv.step([("a", [8], None), ("b", [7], lr)])
    assert ran[-1] is False
    torch.testing.assert_close(base_dec[0], peft_logits(hf_tiny, None, prompt + [7])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lora_dec["b"][0], peft_logits(hf_tiny, lr.lora_path, prompt + [7])[-1],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lora_dec["a"][0], peft_logits(hf_tiny, None, prompt + [7, 8])[-1],
                               atol=1e-4, rtol=1e-4)

"""A new quantization method is one class pair plus a registration: a test-only "int8 per-tensor"
weight format (one scale per linear, dequantized in ``apply``) registered under a test name loads
a checkpoint through the engine's model build (``loader.model_loader``) and generates the tokens
transformers gives with the same fake-quantized weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.quantization.base import (
    _REGISTRY,
    LinearMethodBase,
    QuantizationConfig,
    register_quantization_config,
)

NAME = "test-int8-per-tensor"


def fake_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` float -> (int8 codes, float32 scale): symmetric, one scale for the tensor."""
    scale = w.detach().float().abs().max().clamp(min=1e-8) / 127
    return (w.detach().float() / scale).round().clamp(-127, 127).to(torch.int8), scale


class Int8PerTensorMethod(LinearMethodBase):
    """int8 codes ``qweight [N, K]`` and one float32 ``w_scale``; ``apply`` dequantizes."""

    def process_weights_after_loading(self, layer):
        q, scale = fake_quant(layer.weight)
        del layer.weight
        layer.qweight = nn.Parameter(q, requires_grad=False)
        layer.w_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x, bias=None):
        return F.linear(x, (layer.qweight.float() * layer.w_scale).to(x.dtype), bias)

    def dequantize(self, layer):
        return layer.qweight.float() * layer.w_scale


class Int8PerTensorConfig(QuantizationConfig):
    """``quantization=NAME``: every linear (and an untied head) quantized at load."""

    on_the_fly = True

    @classmethod
    def from_config(cls, config):
        raise ValueError(f"{NAME!r} quantizes float weights at load")

    def get_quant_method(self, layer, prefix):
        return Int8PerTensorMethod() if isinstance(layer, nn.Linear) else None


@pytest.fixture(scope="module")
def registered():
    register_quantization_config(NAME)(Int8PerTensorConfig)
    yield NAME
    _REGISTRY.pop(NAME, None)  # NOTE: other modules see the built-in registry only


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A random 2-layer transformers Llama (untied head) with a word-level tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = str(tmp_path_factory.mktemp("custom_quant"))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(d)
    torch.manual_seed(3)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                         eos_token_id=2)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # spread logits: no near ties between the two implementations
    hf.save_pretrained(d)
    return d, hf


def _fake_quantized_hf(hf):
    """transformers' model with each of *our* linears fake-quantized: q/k/v and gate/up share a
    scale, since the engine fuses them into one linear (``qkv_proj``, ``gate_up_proj``)."""
    import copy

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in ref.model.layers:
            for group in ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                          [layer.self_attn.o_proj], [layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj]):
                _, scale = fake_quant(torch.cat([m.weight for m in group]))
                for m in group:
                    m.weight.copy_((m.weight / scale).round().clamp(-127, 127) * scale)
        q, scale = fake_quant(ref.lm_head.weight)
        ref.lm_head.weight.copy_(q.float() * scale)
    return ref


def test_registered_method_loads_and_generates(registered, tiny_ckpt):
    from pagedllm import LLM, SamplingParams
    from pagedllm.models.layers import Linear

    d, hf = tiny_ckpt
    llm = LLM(d, dtype="float32", quantization=registered, kv_cache_memory=16 * 1024**2, max_model_len=128, seed=0)
    model = llm.llm_engine.core.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 + 1
    assert all(isinstance(m.quant_method, Int8PerTensorMethod) and m.qweight.dtype == torch.int8 for m in linears)
    prompt = [1, 17, 40, 99, 5, 63]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    ref_model, ref = _fake_quantized_hf(hf), []
    with torch.no_grad():  # NOTE: plain greedy argmax (generate's EOS handling differs from ignore_eos)
        for _ in range(10):
            ref.append(int(ref_model(torch.tensor([prompt + ref])).logits[0, -1].argmax()))
    assert got == ref
    plain = LLM(d, dtype="float32", kv_cache_memory=16 * 1024**2, max_model_len=128, seed=0)
    assert all(m.quant_method is None for m in plain.llm_engine.core.model.modules() if isinstance(m, Linear))


def test_unregistered_name_is_refused(tiny_ckpt):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="is not supported"):
        LLM(tiny_ckpt[0], quantization="test-not-registered", kv_cache_memory=16 * 1024**2)


def test_registered_method_is_a_cli_choice(registered):
    """``--quantization`` choices are read from the registry: a method registered after the CLI
    modules were imported is accepted by ``pagedllm serve`` / ``complete --offline`` / ``bench``."""
    from pagedllm.config import QUANTIZATION_CHOICES
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    assert registered in QUANTIZATION_CHOICES and "none" in QUANTIZATION_CHOICES
    assert {"int8", "int4", "w8a8", "gguf", "gptq", "awq", "compressed-tensors", "fp8"} <= set(QUANTIZATION_CHOICES)
    assert make_arg_parser().parse_args(["m", "--quantization", registered]).quantization == registered
    assert build_parser().parse_args(["complete", "--offline", "--quantization", registered]).quantization == registered
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["m", "--quantization", "test-not-registered"])

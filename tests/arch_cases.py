"""Tiny random checkpoints for every native architecture, built with transformers from its config class.

``CASES[name]()`` returns the transformers config of one table row; ``make_checkpoint(name, dir)`` builds
the transformers model with fixed random weights, saves it as safetensors (``save_pretrained``, i.e. the
Hub's own names and layout) beside a word-level tokenizer, and returns the model in eval mode.
Shared by tests/models (logit and greedy parity) and tests/loader (GGUF, Hub resolution).
"""
from __future__ import annotations

import os

import torch
import transformers as tf

VOCAB = 256
PROMPT = [5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 2]
# Three prompts sharing 8 tokens (two 4-token blocks) so the later ones hit the prefix cache.
PROMPTS = [PROMPT, PROMPT[:8] + [200, 14, 150], PROMPT[:9] + [33, 44, 55, 66, 77]]
NEW = 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gemma3_mm():
    text = tf.Gemma3TextConfig(**COMMON, num_key_value_heads=1, head_dim=32, sliding_window=5,
                               query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                           image_token_id=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)


def _llama(rope: dict):
    return lambda: tf.LlamaConfig(**COMMON, num_key_value_heads=2, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_theta": 500.0, **rope})


# row name -> (transformers class, config factory)
CASES = {
    "llama": ("LlamaForCausalLM", _llama({"rope_type": "default"})),
    "llama-linear": ("LlamaForCausalLM", _llama({"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic": ("LlamaForCausalLM", _llama({"rope_type": "dynamic", "factor": 2.0})),
    "llama-yarn": ("LlamaForCausalLM", _llama({"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16})),
    "llama-llama3": ("LlamaForCausalLM", _llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "mistral": ("MistralForCausalLM", lambda: tf.MistralConfig(**COMMON, num_key_value_heads=2, head_dim=32,
                                                               sliding_window=7)),
    "phi3": ("Phi3ForCausalLM", lambda: tf.Phi3Config(
        **COMMON, num_key_value_heads=2, partial_rotary_factor=0.5, original_max_position_embeddings=8,
        rope_parameters={"rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0, 1.3, 1.7, 2.0],
                         "long_factor": [1.5, 2.5, 4.0, 6.0]})),
    "gemma2": ("Gemma2ForCausalLM", lambda: tf.Gemma2Config(
        **COMMON, num_key_value_heads=1, head_dim=32, sliding_window=5, query_pre_attn_scalar=24,
        attn_logit_softcapping=20.0, final_logit_softcapping=10.0)),
    "gemma3": ("Gemma3ForCausalLM", lambda: tf.Gemma3TextConfig(
        **COMMON, num_key_value_heads=1, head_dim=32, sliding_window=4, query_pre_attn_scalar=24,
        final_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"])),
    "gemma3-mm": ("Gemma3ForConditionalGeneration", _gemma3_mm),
    "granite": ("GraniteForCausalLM", lambda: tf.GraniteConfig(
        **COMMON, num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=4.0)),
    "olmo2": ("Olmo2ForCausalLM", lambda: tf.Olmo2Config(**COMMON, num_key_value_heads=2)),
    "mixtral": ("MixtralForCausalLM", lambda: tf.MixtralConfig(
        **COMMON, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, sliding_window=9)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda: tf.Qwen2MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
        norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: tf.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeForCausalLM", lambda: tf.OlmoeConfig(
        **COMMON, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, clip_qkv=1.5, norm_topk_prob=False)),
    # No native implementation: these run through the transformers fallback (models/transformers_backend.py).
    "cohere": ("CohereForCausalLM", lambda: tf.CohereConfig(**COMMON, num_key_value_heads=2, logit_scale=0.5)),
    "starcoder2": ("Starcoder2ForCausalLM", lambda: tf.Starcoder2Config(**COMMON, num_key_value_heads=2,
                                                                         sliding_window=5)),
}
FALLBACK_CASES = ("cohere", "starcoder2")


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level fast tokenizer with ``vocab`` entries: ``<unk> <s> </s> w3 w4 ...``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_hf(config, class_name: str, seed: int = 0, std: float = 0.15):
    """The transformers model of ``config`` with N(0, std) weights (Llama-style norm weights 1 + N(0, std),
    Gemma's (1 + w) ones N(0, std); big enough that attention, norms and routing matter), float32,
    eval mode, eager attention."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = getattr(tf, class_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, std)
            if name.endswith("norm.weight") and "Gemma" not in class_name:
                p.add_(1.0)
    return model


def make_checkpoint(case: str, path: str, seed: int = 0):
    """Save the tiny ``case`` model to ``path`` (safetensors via ``save_pretrained`` + config + a
    ``VOCAB``-word tokenizer); returns the transformers model."""
    class_name, factory = CASES[case]
    model = build_hf(factory(), class_name, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


def hf_greedy(hf, ids, n=NEW):
    """transformers' greedy continuation of ``ids`` (its KV cache, one token per step; EOS does not stop
    it) and the log-softmax of each chosen token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(ids):].tolist()
    logps = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, toks)]
    return toks, logps

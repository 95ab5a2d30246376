"""Gemma 2: Gemma 3's layout (scaled embedding, (1 + w) RMSNorms, 4 norms per layer, gelu-tanh,
sliding layers per ``config.layer_types``) without the q/k norms, with attention logits soft-capped
by ``config.attn_logit_softcapping`` and one rope for all layers."""
from pagedllm.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    qk_norm = False
    attn_soft_cap = True

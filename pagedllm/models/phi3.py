"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama with checkpoint-fused ``qkv_proj`` / ``gate_up_proj``, longrope
scaling, partial rotary (``partial_rotary_factor``) and ``config.sliding_window`` on every layer.

The fused checkpoint tensors are split into their q/k/v and gate/up parts on the way in, so they load
through the same per-shard loaders as every other model (and a tensor-parallel split of them applies)."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    sliding_per_layer_type = False

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q, kv, inter = c.num_attention_heads * d, c.num_key_value_heads * d, c.intermediate_size
        for name, t in weights:
            if ".qkv_proj." in name:
                for part, rows in (("q_proj", t[:q]), ("k_proj", t[q:q + kv]), ("v_proj", t[q + kv:])):
                    yield name.replace(".qkv_proj.", f".{part}."), rows
            elif ".gate_up_proj." in name:
                yield name.replace(".gate_up_proj.", ".gate_proj."), t[:inter]
                yield name.replace(".gate_up_proj.", ".up_proj."), t[inter:]
            else:
                yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``LlamaForCausalLM.load_weights`` after splitting ``qkv_proj`` (rows q, k, v) and
        ``gate_up_proj`` (rows gate, up) into HF's unfused names."""
        return super().load_weights(self._split_fused(weights))

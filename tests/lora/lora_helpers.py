"""Helpers of the LoRA tests: tiny random Llama pairs (transformers and ours, same weights), PEFT
adapters made on them with ``peft`` (random init, nonzero B), and a step driver."""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch

torch.set_num_threads(1)

BS = 4  # KV block size of the step driver
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf_llama(seed: int = 0):
    """A random transformers Llama (vocab 96, hidden 64, 2 layers, 4 query / 2 KV heads), eager."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
    cfg._attn_implementation = "eager"
    hf = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15)
    return hf


def ours_from_hf(hf, dtype=torch.float32):
    """Our LlamaForCausalLM with ``hf``'s weights."""
    from pagedllm.models.llama import LlamaForCausalLM

    m = LlamaForCausalLM(hf.config, dtype)
    m.load_weights(hf.state_dict().items())
    return m.eval()


def make_peft_adapter(hf, out_dir: str, r: int = 8, alpha: float = 16, targets=None, seed: int = 1,
                      b_std: float = 0.1, **config_kw) -> str:
    """Save a peft LoRA adapter for ``hf`` (left untouched) in ``out_dir``: default init for A,
    B random normal(0, ``b_std``) so the adapter changes the outputs. Returns ``out_dir``."""
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(hf)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                     **config_kw)
    torch.manual_seed(seed)
    pm = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, b_std)
    pm.save_pretrained(out_dir)
    return out_dir


def peft_logits(hf, adapter_dir: Optional[str], ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(ids), V]`` of transformers (+ peft with ``adapter_dir``)."""
    from peft import PeftModel

    model = hf if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@dataclass
class Req:
    """What ``LoRAModelManager.prepare_step`` reads of a ``ScheduledRequest``."""

    rid: str
    num_tokens: int
    lora_request: object = None


class LoRAStepDriver:
    """Runs steps of several requests through our model with a paged cache and a LoRA manager.

    ``step([(rid, tokens, lora_request or None), ...])`` (any order) -> {rid: float32 logits of
    its new tokens}.
    """

    def __init__(self, model, manager, num_blocks: int = 64):
        n_layers, hkv, d = model.get_kv_cache_spec()
        self.model, self.manager = model, manager
        self.caches = [torch.zeros(num_blocks, 2, BS, hkv, d, dtype=model.dtype) for _ in range(n_layers)]
        self.free = list(range(1, num_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.pos: dict[str, int] = {}
        self.last_mapping = None
        self.accelerator = None  # a decode accelerator (``worker.fused_decode``), as the runner holds one

    def step(self, chunks):
        from pagedllm.attention.backend import ForwardContext, set_forward_context
        from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

        toks = {rid: t for rid, t, _ in chunks}
        reqs = sorted((Req(rid, len(t), lr) for rid, t, lr in chunks), key=lambda r: r.num_tokens != 1)
        reqs, mapping = self.manager.prepare_step(reqs) if self.manager is not None else (reqs, None)
        self.last_mapping = mapping
        meta_reqs, ids, positions = [], [], []
        for r in reqs:
            start = self.pos.get(r.rid, 0)
            blocks = self.blocks.setdefault(r.rid, [])
            while len(blocks) * BS < start + r.num_tokens:
                blocks.append(self.free.pop())
            meta_reqs.append((start, r.num_tokens, list(blocks)))
            ids += toks[r.rid]
            positions += range(start, start + r.num_tokens)
            self.pos[r.rid] = start + r.num_tokens
        ctx = ForwardContext(build_metadata(meta_reqs, BS), self.caches, TorchPagedAttention(), lora_mapping=mapping)
        from pagedllm.worker.fused_decode import decode_step
        with torch.no_grad(), set_forward_context(ctx):
            hidden = decode_step(self.accelerator, self.model, torch.tensor(ids), torch.tensor(positions))
        logits = self.model.compute_logits(hidden).float()
        out, off = {}, 0
        for r in reqs:
            out[r.rid] = logits[off:off + r.num_tokens]
            off += r.num_tokens
        return out


def word_tokenizer():
    """A word-level tokenizer over ``<unk> <s> </s> w0 .. w252`` (ids 0..255)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_tiny_checkpoint(path: str, seed: int = 0):
    """A random transformers Llama checkpoint (vocab 256, hidden 64, 3 layers, 4 query / 2 KV
    heads, untied head) with a word-level tokenizer in ``path``; returns the model (eager, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=1,
                         eos_token_id=2)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # spread logits: stable greedy picks
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
        hf.lm_head.weight.mul_(8.0)
    hf.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    hf.config._attn_implementation = "eager"
    return hf


def peft_greedy(hf, adapter_dir: Optional[str], ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy ``n`` tokens of transformers (+ peft) after ``ids`` (no EOS stop), with each
    token's log-probability: ``(token ids, logprobs)``."""
    from peft import PeftModel

    model = hf if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(hf), adapter_dir).eval()
    seq, lps = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seq.append(tok)
    return seq[len(ids):], lps

"""The fused C++ decode step is a fast path plugged into the models from outside
(``pagedllm.worker.fused_decode`` sets ``LlamaModel.fused_decode_builder``): a model built alone
has none, and the engine's worker plugs it in. Each case runs in a fresh interpreter, since the
plug is process-wide once imported."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.kernels.cpu_ops import get_ops

_OPS = get_ops()
pytestmark = pytest.mark.skipif(_OPS is None or not hasattr(_OPS, "llama_decode_dense"),
                                reason="needs the C++ kernels with the fused dense decode step")

_TINY = """
import torch, transformers as tf
from pagedllm.models.llama import LlamaForCausalLM
cfg = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     architectures=["LlamaForCausalLM"])
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_model_alone_has_no_fast_path_until_the_worker_module_plugs_it():
    got = _run(_TINY + """
m = LlamaForCausalLM(cfg, torch.float32).eval()
before = m.model._fused_decode()
import pagedllm.worker.fused_decode as fd
m2 = LlamaForCausalLM(cfg, torch.float32).eval()
print(before is None, type(m2.model._fused_decode()).__name__)
""")
    assert got == "True FusedDecode"


def test_the_engine_worker_plugs_it_in(tmp_path):
    got = _run(_TINY + f"""
from pagedllm.loader import load_model
tok = load_model("SmolLM2-135M-Instruct").tokenizer
cfg.vocab_size = len(tok)
torch.manual_seed(0)
tf.LlamaForCausalLM(cfg).float().save_pretrained({str(tmp_path)!r})
tok.save_pretrained({str(tmp_path)!r})
from pagedllm import LLM
llm = LLM({str(tmp_path)!r}, dtype="float32", kv_cache_memory=8 * 1024**2, max_model_len=128)
print(type(llm.llm_engine.core.model.model._fused_decode()).__name__)
""")
    assert got == "FusedDecode"

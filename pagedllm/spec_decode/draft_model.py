"""Draft-model proposer: a smaller model with the target's tokenizer (or the target's own
checkpoint quantized, a *self-draft*) drafts ``k`` tokens greedily.

KV cache: the draft keeps its own per-layer KV tensors with the target's block count and block
size and **shares the target's block tables** (vLLM v1 does the same): a token at position p of
a request has the same slot in both caches, so the scheduler's allocation, preemption and
rollback cover the draft too. The scheduler allocates ``k`` lookahead slots past a decoding
request's scheduled tokens, where the draft writes the K/V of its own drafts.

Every step, after the target's forward and sampling, for each request that drafts this step:

* one draft forward over its committed tokens the draft cache lacks (normally those from the
  step's ``start_pos``: the last committed token and the accepted drafts; after steps without
  drafting, e.g. the prompt, everything since the draft last ran) plus the token(s) sampled this
  step; the logits at the last token give draft 1;
* then ``k - 1`` one-token draft decodes.

Steps where speculation is switched off (large batches) skip the draft entirely; it catches up
the next time the request drafts.

Drafts are the draft model's argmax (a one-hot draft distribution: lossless for greedy and
random requests alike; see ``pagedllm.sample.rejection_sampler``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, ForwardContext, set_forward_context
from pagedllm.spec_decode.proposer import PagedModelProposer, Proposal, ProposeBatch


def paged_metadata(starts: list[int], lens: list[int], block_ids: list[list[int]],
                   block_size: int) -> tuple[AttentionMetadata, np.ndarray]:
    """Attention metadata for requests computing ``lens[i]`` tokens from position ``starts[i]``
    (one-token requests first), vectorised over tokens.

    Returns:
        ``(meta, positions int64 [T])``.
    """
    B = len(starts)
    width = max((len(b) for b in block_ids), default=1) or 1
    tables = np.zeros((B, width), dtype=np.int64)
    for i, b in enumerate(block_ids):
        tables[i, :len(b)] = b
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    T = int(qsl[-1])
    req_idx = np.repeat(np.arange(B), lens)
    pos = np.arange(T, dtype=np.int64) + (np.asarray(starts, dtype=np.int64) - qsl[:-1])[req_idx]
    slots = tables[req_idx, pos // block_size] * block_size + pos % block_size
    num_decodes = 0
    while num_decodes < B and lens[num_decodes] == 1:
        num_decodes += 1
    seq_lens = [s + n for s, n in zip(starts, lens)]
    meta = AttentionMetadata(
        num_reqs=B, num_decodes=num_decodes, num_decode_tokens=num_decodes,
        query_start_loc=torch.from_numpy(qsl), query_lens=list(lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_list=seq_lens,
        block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
        block_size=block_size, max_seq_len=max(seq_lens))
    return meta, pos


class DraftModelProposer(PagedModelProposer):
    """Greedy drafts from a draft model sharing the target's block tables (see module doc).

    Args:
        num_speculative_tokens: ``k``.
        model: the draft model (pagedllm model: ``forward(ids, positions)``, ``compute_logits``,
            ``get_kv_cache_spec``), weights loaded.
        num_blocks / block_size: the target's KV cache geometry.
        kv_cache_dtype: the draft cache's dtype.
        device: torch device.
        attn_impl: the attention backend.
    """

    needs_hidden = False

    def __init__(self, num_speculative_tokens: int, model: Any, num_blocks: int, block_size: int,
                 kv_cache_dtype: torch.dtype, device: torch.device, attn_impl: Any) -> None:
        super().__init__(num_speculative_tokens, model.get_kv_cache_spec(), num_blocks, block_size, kv_cache_dtype,
                         device, attn_impl)
        self.model = model
        # req_id -> positions below which the draft cache holds the request's committed tokens.
        self._valid: dict[str, int] = {}
        self.decode_accelerator: Any = None  # the draft's fused CPU decode step (set by the worker)

    def remove(self, req_id: str, finished: bool = True) -> None:
        self._valid.pop(req_id, None)

    def _forward(self, ids: np.ndarray, starts: list[int], lens: list[int],
                 block_ids: list[list[int]]) -> torch.Tensor:
        meta, pos = paged_metadata(starts, lens, block_ids, self.block_size)
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches, impl=self.attn_impl)
        from pagedllm.worker.fused_decode import decode_step
        with set_forward_context(ctx):
            return decode_step(self.decode_accelerator, self.model, torch.from_numpy(ids).to(self.device),
                               torch.from_numpy(pos).to(self.device))

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Proposal:
        bs = self.block_size
        valid = self._valid
        # (req, tokens to compute, start position), one-token ones first.
        items: list[tuple[Any, list[int], int]] = []
        for r in batch.reqs:
            if r.is_new:
                # NOTE: (re)admitted: blocks before start_pos are prefix-cache hits, whose draft
                # K/V was written by whichever request computed them (if it drafted).
                valid[r.req_id] = r.start_pos
            new = batch.sampled.get(r.req_id)
            if not new or r.req_id not in batch.want:
                continue
            start = min(valid.get(r.req_id, 0), r.start_pos)
            toks = list(r.token_ids[start:]) + list(new)
            if len(toks) > len(r.block_ids) * bs - start:
                continue  # no slot for the new token (max_model_len reached)
            items.append((r, toks, start))
            valid[r.req_id] = start + len(toks)
        out = Proposal()
        if not items:
            return out
        items.sort(key=lambda it: len(it[1]) != 1)
        ids = np.fromiter((t for it in items for t in it[1]), dtype=np.int64)
        lens = [len(it[1]) for it in items]
        hidden = self._forward(ids, [it[2] for it in items], lens, [it[0].block_ids for it in items])
        last = np.cumsum(lens) - 1
        sel = list(range(len(items)))
        h = hidden[torch.from_numpy(last[sel])]
        tok = self.model.compute_logits(h).argmax(dim=-1).cpu()
        reqs = [items[j][0] for j in sel]
        caps = [min(self.k, batch.max_drafts.get(r.req_id, self.k)) for r in reqs]
        pos = [items[j][2] + lens[j] for j in sel]  # position of draft 1
        drafts = [[int(t)] for t in tok.tolist()]
        for step in range(1, max(caps)):
            live = [i for i, c in enumerate(caps) if c > step and pos[i] + step - 1 < len(reqs[i].block_ids) * bs]
            if not live:
                break
            ids = np.array([drafts[i][-1] for i in live], dtype=np.int64)
            hidden = self._forward(ids, [pos[i] + step - 1 for i in live], [1] * len(live),
                                   [reqs[i].block_ids for i in live])
            nxt = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, t in zip(live, nxt):
                drafts[i].append(int(t))
        for r, d, c in zip(reqs, drafts, caps):
            out.token_ids[r.req_id] = d[:c]
        return out

"""Turns a SchedulerOutput into one forward pass: inputs, KV cache, model, sampler, pooler.

The runner owns the KV cache tensors (one per layer, ``[num_blocks, 2, block_size,
num_kv_heads, head_dim]``; on CPU committed on first write, ``pagedllm.worker.kv_memory``) and per-request state that must outlive a step (seeded
generators, MEAN-pooling partial sums, and the persistent :class:`InputBatch`: block tables
and sampling parameters kept from step to step so a step's inputs and sampling metadata are
a few numpy gathers instead of per-request conversions).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, ForwardContext, set_forward_context
from pagedllm.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

#: encoder-cache bound (tokens of image embeddings) unless ``encoder_cache_size`` sets it
DEFAULT_ENCODER_CACHE_TOKENS = 8192


class ModelRunner:
    """Runs the model for the scheduler's batch.

    Args:
        model: a pagedllm model (``forward(input_ids [T], positions [T]) -> [T, hidden]``,
            ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32``).
        num_blocks: KV cache blocks per layer.
        block_size: tokens per block.
        kv_spec: ``(num_layers, num_kv_heads, head_dim)``.
        dtype: compute dtype.
        kv_cache_dtype: KV cache dtype (None = ``dtype``; ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2`` for an 8-bit cache).
        vocab_size: logits width.
        device: torch device.
        attn_impl: an ``AttentionImpl`` (defaults to the CPU torch backend).
        pooler: optional pooler for the pooling runner (``pagedllm.pooling``).
        spec_decoder: a ``pagedllm.worker.spec_decoder.SpecDecoder`` (speculative decoding:
            verifies scheduled drafts, proposes the next ones), or None.
        max_model_len: the engine's limit (caps draft lengths), or None.
        lora_manager: the worker's ``LoRAModelManager`` (``enable_lora``) or None: it orders
            each step's requests by adapter and gives the forward its ``LoRAMapping``.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 kv_spec: tuple[int, int, int], dtype: torch.dtype, vocab_size: int,
                 device: torch.device = torch.device("cpu"), attn_impl: Any = None,
                 pooler: Any = None, eos_token_id: Optional[int] = None,
                 kv_cache_dtype: Optional[torch.dtype] = None, spec_decoder: Any = None,
                 max_model_len: Optional[int] = None, lora_manager: Any = None) -> None:
        from pagedllm.sample.sampler import Sampler

        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        num_layers, num_kv_heads, head_dim = kv_spec
        from pagedllm.worker.kv_memory import new_kv_cache
        # NOTE: on CPU the pages are committed on first write (kv_memory.py): start-up touches none.
        self.kv_caches = [
            new_kv_cache((num_blocks, 2, block_size, num_kv_heads, head_dim), kv_cache_dtype or dtype, device)
            for _ in range(num_layers)
        ]
        if attn_impl is None:
            from pagedllm.attention.torch_paged import TorchPagedAttention
            attn_impl = TorchPagedAttention()
        self.attn_impl = attn_impl
        self.sampler = Sampler()
        self.pooler = pooler
        self.generators: dict[str, torch.Generator] = {}
        self.pool_state: dict[str, Any] = {}
        # Per-request state kept across steps (block tables, sampling parameters).
        self.input_batch = InputBatch(vocab_size)
        self.cuda_graphs = None
        # The fused CPU decode step (``worker.fused_decode.FusedDecode``), set by the worker once
        # the model is finished; None = every step runs the model's forward.
        self.decode_accelerator: Any = None
        self.spec_decoder = spec_decoder
        self.max_model_len = max_model_len
        self.lora_manager = lora_manager
        # Image-text models: encoder outputs by image hash (``pagedllm.multimodal.encoder_cache``).
        self.encoder_cache = None
        if getattr(model, "supports_images", False):
            from pagedllm.multimodal.encoder_cache import EncoderCache
            self.encoder_cache = EncoderCache(DEFAULT_ENCODER_CACHE_TOKENS)
            from pagedllm.attention.torch_paged import TorchPagedAttention
            if getattr(model, "mm_bidirectional", False) and not isinstance(attn_impl, TorchPagedAttention):
                logger.warning("pagedllm: the %s attention backend has no bidirectional image mask: image tokens "
                               "attend causally (outputs differ from transformers); use the torch backend",
                               type(attn_impl).__name__)

        # M-RoPE models (Qwen2.5-VL): [3, T] positions from the requests' image grids (multimodal.mrope).
        self.mrope = None
        if getattr(model, "uses_mrope", False):
            from pagedllm.multimodal.mrope import MRopePositions
            self.mrope = MRopePositions(getattr(model, "spatial_merge_size", 2))

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Capture decode-only CUDA graphs (CUDA + Triton backend only); returns seconds spent."""
        from pagedllm.attention.triton_paged import TritonPagedAttention
        from pagedllm.worker.cuda_graphs import CudaGraphRunner

        if self.device.type != "cuda" or not isinstance(self.attn_impl, TritonPagedAttention):
            return 0.0
        self.cuda_graphs = CudaGraphRunner(
            self.model, self.attn_impl, self.kv_caches, max_num_seqs,
            -(-max_model_len // self.block_size), self.block_size, self.device)
        return self.cuda_graphs.capture()

    # ------------------------------------------------------------------ inputs
    def _prepare(self, reqs: list[ScheduledRequest], rows: Optional[np.ndarray] = None,
                 max_blocks: Optional[int] = None):
        """Build flat input ids, positions and attention metadata (decodes must come first).

        Args:
            reqs: the step's requests, decodes (one token) first.
            rows: each request's row in ``self.input_batch`` (after ``InputBatch.update``);
                None updates the batch here.
            max_blocks: the longest block table among ``reqs`` (returned by the update).

        Returns:
            ``(input_ids int64 [T], positions int64 [T], AttentionMetadata, query_start_loc
            int64 numpy [B + 1])``, tensors on the CPU.
        """
        if rows is None or max_blocks is None:
            rows, max_blocks = self.input_batch.update(reqs, self._generator_for)
        bs = self.block_size
        B = len(reqs)
        query_lens = [r.num_tokens for r in reqs]
        starts = [r.start_pos for r in reqs]
        total = sum(query_lens)
        block_tables = self.input_batch.block_tables(rows, max_blocks)
        if total == B:
            # Decode-only step (every request computes one token): no per-token expansion.
            return self._decode_inputs([r.token_ids[r.start_pos] for r in reqs], starts, block_tables)
        else:
            num_decodes = 0
            for q in query_lens:
                if q != 1:
                    break
                num_decodes += 1
            flat: list[int] = []
            for r in reqs:
                s = r.start_pos
                flat.extend(r.token_ids[s:s + r.num_tokens])
                if r.spec_token_ids:  # draft tokens follow the committed ones
                    flat.extend(r.spec_token_ids)
            ids = np.array(flat, dtype=np.int64)
            qsl = np.zeros(B + 1, dtype=np.int64)
            np.cumsum(query_lens, out=qsl[1:])
            # Token t of request i sits at position start_i + (t - qsl_i).
            req_idx = np.repeat(np.arange(B), query_lens)
            pos = np.arange(total, dtype=np.int64) + (np.array(starts, dtype=np.int64) - qsl[:-1])[req_idx]
            seq_lens = [s + n for s, n in zip(starts, query_lens)]
            blk = block_tables[req_idx, pos // bs]
        slots = blk * bs + pos % bs
        if total != B and (self.spec_decoder is not None or any(r.spec_token_ids for r in reqs)):
            return self._prepare_verify(reqs, ids, pos, slots, block_tables, qsl)
        meta = AttentionMetadata(
            num_reqs=B, num_decodes=num_decodes, num_decode_tokens=num_decodes,
            query_start_loc=torch.from_numpy(qsl), query_lens=query_lens,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_list=seq_lens,
            block_tables=torch.from_numpy(block_tables), slot_mapping=torch.from_numpy(slots),
            block_size=bs, max_seq_len=max(seq_lens),
        )
        return torch.from_numpy(ids), torch.from_numpy(pos), meta, qsl

    def _decode_inputs(self, tokens: list[int], starts: list[int], block_tables: np.ndarray):
        """``_prepare``'s result for a decode-only step: request i computes ``tokens[i]`` at
        position ``starts[i]`` over block table row ``block_tables[i]``."""
        bs = self.block_size
        B = len(tokens)
        ids = np.array(tokens, dtype=np.int64)
        pos = np.array(starts, dtype=np.int64)
        seq_lens = [s + 1 for s in starts]
        qsl = np.arange(B + 1, dtype=np.int64)
        slots = block_tables[np.arange(B), pos // bs] * bs + pos % bs
        meta = AttentionMetadata(
            num_reqs=B, num_decodes=B, num_decode_tokens=B,
            query_start_loc=torch.from_numpy(qsl), query_lens=[1] * B,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_list=seq_lens,
            block_tables=torch.from_numpy(block_tables), slot_mapping=torch.from_numpy(slots),
            block_size=bs, max_seq_len=max(seq_lens),
        )
        return torch.from_numpy(ids), torch.from_numpy(pos), meta, qsl

    def _prepare_verify(self, reqs: list[ScheduledRequest], ids: np.ndarray, pos: np.ndarray,
                        slots: np.ndarray, block_tables: np.ndarray, qsl: np.ndarray):
        """``_prepare``'s metadata when some requests verify drafts: each token of such a request
        is its own one-token attention row (seeing its request's cache up to its own position),
        so a step of decodes and verifications is decode-only for the attention backend (and the
        fused decode path): the same kernels and numerics as decoding those tokens one by one.
        The token layout and the returned request-level ``qsl`` are unchanged."""
        B = len(reqs)
        q = np.diff(qsl)
        spec = np.array([bool(r.spec_token_ids) for r in reqs])
        row_len = np.where(spec, 1, q)
        rows_per_req = np.where(spec, q, 1)
        row_req = np.repeat(np.arange(B), rows_per_req)
        n_rows = len(row_req)
        row_qsl = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(np.repeat(row_len, rows_per_req), out=row_qsl[1:])
        # A row's last token position + 1 is its context length.
        seq_lens = (pos[row_qsl[1:] - 1] + 1).tolist()
        row_lens = np.repeat(row_len, rows_per_req).tolist()
        num_decodes = 0
        for n in row_lens:
            if n != 1:
                break
            num_decodes += 1
        meta = AttentionMetadata(
            num_reqs=n_rows, num_decodes=num_decodes, num_decode_tokens=num_decodes,
            query_start_loc=torch.from_numpy(row_qsl), query_lens=row_lens,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_list=seq_lens,
            block_tables=torch.from_numpy(block_tables[row_req]), slot_mapping=torch.from_numpy(slots),
            block_size=self.block_size, max_seq_len=max(seq_lens),
        )
        return torch.from_numpy(ids), torch.from_numpy(pos), meta, qsl

    @property
    def _draft_verifier(self) -> Any:
        """A verification-only ``SpecDecoder`` (jump-forward drafts, no speculative method)."""
        v = getattr(self, "_jf_verifier", None)
        if v is None:
            from pagedllm.worker.spec_decoder import SpecDecoder
            v = self._jf_verifier = SpecDecoder(None, None)
        return v

    def _generator_for(self, r: ScheduledRequest) -> Optional[torch.Generator]:
        sp = r.sampling_params
        if sp is None or sp.seed is None:
            return None
        g = self.generators.get(r.req_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(sp.seed) & 0xFFFF_FFFF_FFFF_FFFF)  # negative seeds too
            self.generators[r.req_id] = g
        return g

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step.

        Returns:
            ModelRunnerOutput with one sampled token per request whose chunk reached the end
            of its tokens, logprobs where requested, and pooled vectors for finished pooling
            requests.
        """
        batch = self.input_batch
        sd = self.spec_decoder
        for rid in so.finished_req_ids:
            self.generators.pop(rid, None)
            self.pool_state.pop(rid, None)
            batch.remove(rid)
            if sd is not None:
                sd.remove(rid, finished=True)
        if self.encoder_cache is not None:
            for rid in so.finished_req_ids | so.preempted_req_ids:
                self.encoder_cache.release_request(rid)
        if self.mrope is not None:
            for rid in so.finished_req_ids:
                self.mrope.release(rid)
        for rid in so.preempted_req_ids:
            self.pool_state.pop(rid, None)
            batch.remove(rid)
            if sd is not None:
                sd.remove(rid, finished=False)
        out = ModelRunnerOutput()
        if so.is_empty:
            return out
        if (so.is_flat and self.lora_manager is None and sd is None and self.mrope is None
                and self.encoder_cache is None and self.pooler is None):
            # The flat form (unchanged decodes): rows, tokens and positions from the lists, no
            # ScheduledRequest; rows whose sampling needs per-request state take the general path.
            got = batch.update_cached(so.cached_req_ids, so.cached_new_block_ids)
            if got is not None and batch.simple[got[0]].all():
                rows, max_blocks = got
                input_ids, positions, meta, qsl = self._prepare_flat(so, rows, max_blocks)
                hidden = self._forward(input_ids, positions, meta, None, None, None)
                self._sample(None, None, rows, hidden, qsl, out, req_ids=so.cached_req_ids)
                return out
        # (A step of one token per request is decodes only: already in order.)
        reqs = so.scheduled if so.total_num_scheduled_tokens == len(so.scheduled) else _decodes_first(so.scheduled)
        lora_mapping = None
        if self.lora_manager is not None:
            reqs, lora_mapping = self.lora_manager.prepare_step(reqs)  # one adapter's rows contiguous
        if self.pool_state:
            for r in reqs:
                if r.is_new:
                    self.pool_state.pop(r.req_id, None)
        rows, max_blocks = batch.update(reqs, self._generator_for)
        input_ids, positions, meta, qsl = self._prepare(reqs, rows, max_blocks)
        if self.mrope is not None:
            positions = self.mrope.positions(reqs, positions, qsl)
        inputs_embeds = _prompt_embeds_rows(reqs, qsl)
        mm_embeds = None
        if self.encoder_cache is not None and any(r.mm_features for r in reqs):
            mm_embeds = self._mm_embeds(reqs, qsl)
            if getattr(self.model, "mm_bidirectional", False):
                meta.bidirectional_ranges = [
                    [(f.offset, f.offset + f.length) for f in r.mm_features if f.bidirectional]
                    if r.mm_features else None for r in reqs]
        hidden = self._forward(input_ids, positions, meta, lora_mapping, inputs_embeds, mm_embeds)

        gen_rows = [i for i, r in enumerate(reqs) if r.sampling_params is not None and r.is_last_chunk]
        grammar = (so.structured_output_request_ids, so.grammar_bitmask)
        verifier = sd
        if verifier is None and so.structured_output_request_ids and any(r.spec_token_ids for r in reqs):
            # Jump-forward drafts (a grammar's forced tokens) without a speculative method.
            verifier = self._draft_verifier
        if verifier is not None:
            # Requests with drafts: verified (rejection sampler); the rest sample below.
            rest = verifier.verify(self, reqs, gen_rows, rows, hidden, qsl, out, grammar) if gen_rows else []
            if rest:
                self._sample(reqs, rest, rows, hidden, qsl, out, grammar=grammar)
            if sd is not None:
                sd.propose(reqs, hidden, qsl, out, self.max_model_len)
        elif gen_rows:
            self._sample(reqs, gen_rows, rows, hidden, qsl, out, grammar=grammar)
        if batch.wants_prompt_logprobs[rows].any():
            for i, r in enumerate(reqs):
                sp = r.sampling_params
                if sp is not None and sp.prompt_logprobs is not None and r.start_pos < r.prompt_len:
                    self._prompt_logprobs(r, hidden[qsl[i]:qsl[i + 1]], out)
        if self.pooler is not None:
            for i, r in enumerate(reqs):
                if r.pooling_params is not None:
                    res = self.pooler.accumulate(self.pool_state, r, hidden[qsl[i]:qsl[i + 1]])
                    if r.is_last_chunk:
                        out.pooler_output[r.req_id] = res
                        self.pool_state.pop(r.req_id, None)
        return out

    def _prepare_flat(self, so: SchedulerOutput, rows: np.ndarray, max_blocks: int):
        """``_prepare`` for a step in ``SchedulerOutput``'s flat form (rows from
        ``InputBatch.update_cached``)."""
        return self._decode_inputs(so.cached_token_ids, so.cached_start_pos,
                                   self.input_batch.block_tables(rows, max_blocks))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 lora_mapping: Any, inputs_embeds: Any, mm_embeds: Any) -> torch.Tensor:
        """The model over the step's flat tokens: ``[T, hidden]`` hidden states (CUDA graphs when
        they apply, else the eager forward under the step's ``ForwardContext``)."""
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches, impl=self.attn_impl,
                             lora_mapping=lora_mapping, inputs_embeds=inputs_embeds, mm_embeds=mm_embeds)
        if (self.cuda_graphs is not None and lora_mapping is None and inputs_embeds is None
                and mm_embeds is None
                and self.cuda_graphs.can_run(meta)):
            return self.cuda_graphs.run(input_ids.to(self.device, non_blocking=True),
                                        positions.to(self.device, non_blocking=True), meta)
        from pagedllm.worker.fused_decode import decode_step
        with set_forward_context(ctx):
            return decode_step(self.decode_accelerator, self.model, input_ids.to(self.device),
                               positions.to(self.device))

    def _mm_embeds(self, reqs: list[ScheduledRequest], qsl: np.ndarray
                   ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``ForwardContext.mm_embeds`` of a step: for each image whose placeholder run overlaps a
        request's chunk, the overlapping slice of its encoder output (from the encoder cache, else
        encoded now and cached) at the chunk's flat rows. A request keeps its reference on an image
        until the chunk that computes the run's last placeholder."""
        cache = self.encoder_cache
        rows, vals = [], []
        for i, r in enumerate(reqs):
            if not r.mm_features:
                continue
            s, e = r.start_pos, r.start_pos + r.num_tokens
            for f in r.mm_features:
                a, b = max(s, f.offset), min(e, f.offset + f.length)
                if a >= b:
                    continue
                out = cache.get(f.identifier)
                if out is None:
                    embed = getattr(self.model, "embed_feature", None)  # a feature with more than pixels (a grid)
                    out = embed(f) if embed is not None else self.model.embed_images(f.data.to(self.device))[0]
                    if out.shape[0] != f.length:
                        raise ValueError(f"image encoder gave {out.shape[0]} embeddings for {f.length} placeholders")
                    cache.put(f.identifier, out)
                if f.offset + f.length <= e:
                    cache.unref(f.identifier, r.req_id)
                else:
                    cache.ref(f.identifier, r.req_id)
                rows.append(torch.arange(int(qsl[i]) + a - s, int(qsl[i]) + b - s, dtype=torch.int64))
                vals.append(out[a - f.offset:b - f.offset])
        if not rows:
            return None
        return torch.cat(rows), torch.cat(vals)

    def _sample(self, reqs: Optional[list[ScheduledRequest]], sel_idx: Optional[list[int]], rows: np.ndarray,
                hidden: torch.Tensor, qsl: np.ndarray, out: ModelRunnerOutput,
                grammar: Optional[tuple[dict[str, int], Any]] = None,
                req_ids: Optional[list[str]] = None) -> None:
        """Sample one token for each ``reqs[i]``, ``i`` in ``sel_idx``, into ``out``.

        Args:
            reqs: the step's requests (batch order); None with ``req_ids`` (flat form).
            sel_idx: indices into ``reqs`` of the requests that sample this step; None: every
                request, one token each (flat form: ``reqs`` None, every row simple).
            rows: int64 ``[B]`` input-batch row of every request.
            hidden: ``[T, hidden]`` hidden states of the step's tokens.
            qsl: int64 ``[B + 1]`` query start offsets (token ``qsl[i + 1] - 1`` is request i's last).
            grammar: ``(SchedulerOutput.structured_output_request_ids, .grammar_bitmask)``.
            req_ids: with ``sel_idx`` None, the ids of the rows (batch order).
        """
        if sel_idx is None:
            h = hidden if hidden.is_contiguous() else hidden.contiguous()
        elif len(sel_idx) == hidden.shape[0] and hidden.is_contiguous():
            # Every token is the last of a sampling request (decode-only step): no gather.
            h = hidden
        else:
            h = hidden[torch.from_numpy(qsl[1:][sel_idx] - 1)]
        logits = self.model.compute_logits(h)
        if logits is None:  # NOTE: a tensor/pipeline-parallel rank that does not sample
            return
        logits = logits.float()
        if sel_idx is None:
            assert req_ids is not None, "the flat form names its rows"
            sel: list[ScheduledRequest] = []
            sel_ids = req_ids
            meta = self.input_batch.sampling_metadata(rows, self.device)
            assert meta is not None, "flat form: simple rows only (execute checks)"
        else:
            assert reqs is not None
            sel = [reqs[i] for i in sel_idx]
            sel_ids = [r.req_id for r in sel]
            meta = self.input_batch.sampling_metadata(rows[sel_idx], self.device)
        if meta is None:
            meta = SamplingMetadata.from_requests(
                params=[r.sampling_params for r in sel],
                prompt_token_ids=[_prompt_if_needed(r) for r in sel],
                output_token_ids=[_output_if_needed(r) for r in sel],
                generators=[self._generator_for(r) for r in sel],
                vocab_size=self.vocab_size,
                eos_token_ids=[self.eos_token_id] * len(sel),
                device=self.device,
            )
        if grammar is not None and grammar[1] is not None:
            meta.grammar_bitmask = _grammar_rows(sel, grammar[0], grammar[1], self.device)
        so = self.sampler(logits, meta)
        sampled = so.sampled_token_ids.tolist()
        out.sampled_token_ids.update(zip(sel_ids, [[t] for t in sampled]))
        if so.logprob_token_ids is None:
            return
        lp_ids = so.logprob_token_ids.tolist()
        lps = so.logprobs.tolist()
        ranks = so.sampled_ranks.tolist()
        for j, k in enumerate(meta.num_logprobs):
            if k is not None:
                n = 1 + k
                out.logprobs[sel_ids[j]] = [(lp_ids[j][:n], lps[j][:n], ranks[j])]

    def _prompt_logprobs(self, r: ScheduledRequest, h: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Prompt logprobs for tokens ``start_pos+1 .. min(end, prompt_len-1)`` of this chunk.

        Logits at position p predict the token at p+1 (vLLM semantics; position 0 has None).
        """
        from pagedllm.sample.sampler import compute_prompt_logprobs

        s, e, P = r.start_pos, r.start_pos + r.num_tokens, r.prompt_len
        n_rows = min(e, P - 1) - s
        entries: list[Any] = [None] if s == 0 else []
        if n_rows > 0:
            logits = self.model.compute_logits(h[:n_rows])
            if logits is None:  # a rank that does not sample
                return
            logits = logits.float()
            targets = torch.as_tensor(r.token_ids[s + 1:s + 1 + n_rows], dtype=torch.int64)
            k = r.sampling_params.prompt_logprobs
            ids, lps, ranks = compute_prompt_logprobs(logits, targets, k)
            ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
            for j in range(n_rows):
                entries.append((ids[j][:1 + k], lps[j][:1 + k], ranks[j]))
        if entries:
            out.prompt_logprobs[r.req_id] = entries


def _prompt_embeds_rows(reqs: list[ScheduledRequest], qsl: np.ndarray
                        ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``ForwardContext.inputs_embeds`` of a step: for each request with ``prompt_embeds`` whose
    chunk covers prompt positions ``s .. e - 1``, flat rows ``qsl[i] .. qsl[i] + e - s`` take
    ``prompt_embeds[s:e]``; None when no request of the step has any."""
    rows, vals = [], []
    for i, r in enumerate(reqs):
        pe = r.prompt_embeds
        if pe is None or r.start_pos >= r.prompt_len:
            continue
        s, e = r.start_pos, min(r.start_pos + r.num_tokens, r.prompt_len)
        rows.append(torch.arange(int(qsl[i]), int(qsl[i]) + e - s, dtype=torch.int64))
        vals.append(pe[s:e])
    if not rows:
        return None
    return torch.cat(rows), torch.cat(vals)


def _decodes_first(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The requests with one new token (or verifying drafts: one-token attention rows each) first,
    otherwise in order (the attention metadata's order); the list itself when it already is."""
    seen_prefill = False
    for r in scheduled:
        if r.num_tokens != 1 and not r.spec_token_ids:
            seen_prefill = True
        elif seen_prefill:
            return sorted(scheduled, key=lambda r: r.num_tokens != 1 and not r.spec_token_ids)
    return scheduled


def _grammar_rows(sel: list[ScheduledRequest], row_of: dict[str, int], bitmask: torch.Tensor,
                  device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``SamplingMetadata.grammar_bitmask`` for the sampled requests ``sel`` (logits row j =
    ``sel[j]``) from the step's bitmask (row ``row_of[req_id]``), or None when none is
    constrained."""
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    for j, r in enumerate(sel):
        k = row_of.get(r.req_id)
        if k is not None:
            logit_rows.append(j)
            mask_rows.append(k)
    if not logit_rows:
        return None
    if mask_rows != list(range(bitmask.shape[0])):
        bitmask = bitmask[torch.tensor(mask_rows, dtype=torch.int64)]
    return (torch.tensor(logit_rows, dtype=torch.int64, device=device),
            bitmask.to(device, non_blocking=True))


def _prompt_if_needed(r: ScheduledRequest) -> list[int]:
    """The prompt ids, copied only for a repetition penalty (the one reader); else ``[]``.

    NOTE: slicing every request's token list every step would copy whole prompts per token.
    """
    return r.token_ids[:r.prompt_len] if r.sampling_params.repetition_penalty != 1.0 else []


def _output_if_needed(r: ScheduledRequest) -> list[int]:
    """The generated ids, copied only when penalties, ``min_tokens`` or ``bad_words`` read them."""
    sp = r.sampling_params
    if (sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty
            or sp.min_tokens or sp.bad_words):
        return r.token_ids[r.prompt_len:]
    return []

"""The worker's side of speculative decoding: verify last step's drafts, propose the next ones.

The model runner hands it every step's sampling requests. Requests with scheduled drafts
(``ScheduledRequest.spec_token_ids``) were scored at ``k + 1`` positions in the same forward;
their ``k + 1`` logits rows go through the :class:`RejectionSampler` (one call for the batch)
and the emitted tokens (accepted drafts + one) are returned like sampled ones. After sampling,
the proposer drafts the next step's tokens for every request that sampled, unless the step's
batch is too large for speculation to pay (``disable_by_batch_size``).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from pagedllm.core.sched_output import ModelRunnerOutput, ScheduledRequest
from pagedllm.sample.rejection_sampler import RejectionSampler, build_verification_metadata
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposal, ProposeBatch, Proposer
from pagedllm.spec_decode.registry import ProposerContext, get_proposer_kind

logger = logging.getLogger("pagedllm")

# Batch size from which speculation is switched off when ``disable_by_batch_size`` is None.
# NOTE: measured on SmolLM2 (docs/speculative_decoding.md): on CPU a step's cost grows with its
# token count once a batch is compute-bound (about 16 tokens fp32), so verifying k drafts per
# request stops paying at a handful of requests unless acceptance is very high.
AUTO_DISABLE_BATCH_SIZE = 8


def build_proposer(cfg: SpeculativeConfig, ctx: Optional[ProposerContext] = None) -> Proposer:
    """The proposer registered for ``cfg.method`` (``spec_decode.registry``), built from ``ctx``
    (the loaded draft, the target, the KV geometry; token-only proposers need none).

    Raises:
        ValueError: an unregistered method.
    """
    return get_proposer_kind(cfg.method).build(cfg, ctx if ctx is not None else ProposerContext())


class SpecDecoder:
    """Verification and proposal for one runner.

    Args:
        config: the SpeculativeConfig; None: verification only (jump-forward structured decoding
            without a speculative method; ``propose`` is not called).
        proposer: its proposer (``build_proposer``); None with ``config`` None.

    Jump-forward drafts (a grammar's forced tokens, proposed by the scheduler) are verified here
    too, with the step's grammar bitmask row for each position, and by sampling each position as
    the plain sampler would (``RejectionSampler``'s ``match_sampling``).
    """

    def __init__(self, config: Optional[SpeculativeConfig], proposer: Optional[Proposer]) -> None:
        self.config = config
        self.proposer = proposer  # type: ignore[assignment]
        self.k = config.num_speculative_tokens if config is not None else 0
        d = config.disable_by_batch_size if config is not None else 0
        self.disable_batch_size = AUTO_DISABLE_BATCH_SIZE if d is None else d
        self.rejection_sampler = RejectionSampler()
        self._logged_grammar = False
        # req_id -> draft distributions of the drafts proposed last step (sampling proposers).
        self._draft_probs: dict[str, torch.Tensor] = {}

    def remove(self, req_id: str, finished: bool) -> None:
        self._draft_probs.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.remove(req_id, finished)

    # ------------------------------------------------------------------ verify
    def verify(self, runner: Any, reqs: list[ScheduledRequest], gen_idx: list[int], rows: np.ndarray,
               hidden: torch.Tensor, qsl: np.ndarray, out: ModelRunnerOutput,
               grammar: Optional[tuple[dict[str, int], Any]] = None) -> list[int]:
        """Verify the drafts of the requests in ``gen_idx`` that have some; returns the indices
        left for the plain sampler.

        ``grammar``: ``(SchedulerOutput.structured_output_request_ids, .grammar_bitmask)``; a
        constrained request with ``k`` drafts has ``k + 1`` consecutive bitmask rows from its
        first one (the allowed tokens after each accepted draft)."""
        spec_idx = [i for i in gen_idx if reqs[i].spec_token_ids]
        if not spec_idx:
            return gen_idx
        rest = [i for i in gen_idx if not reqs[i].spec_token_ids]
        sel = [reqs[i] for i in spec_idx]
        drafts = [r.spec_token_ids for r in sel]
        # Rows: the last k + 1 tokens of each request (the last committed token and its drafts).
        tok_rows = np.concatenate([np.arange(qsl[i + 1] - len(r.spec_token_ids) - 1, qsl[i + 1])
                                   for i, r in zip(spec_idx, sel)])
        logits = runner.model.compute_logits(hidden[torch.from_numpy(tok_rows)]).float()
        batch = runner.input_batch
        sel_rows = rows[spec_idx]
        meta = None
        if batch.simple[sel_rows].all():
            meta = batch.sampling_metadata(np.repeat(sel_rows, [len(d) + 1 for d in drafts]), runner.device)
        if meta is None:
            from pagedllm.worker.model_runner import _output_if_needed, _prompt_if_needed
            meta = build_verification_metadata(
                [r.sampling_params for r in sel], [_prompt_if_needed(r) for r in sel],
                [_output_if_needed(r) for r in sel], drafts, runner.vocab_size,
                [runner.eos_token_id] * len(sel), runner.device)
        match = None
        if grammar is not None and grammar[1] is not None and grammar[0]:
            row_of, bitmask = grammar
            logit_rows, mask_rows, match = [], [], []
            off = 0
            for r, d in zip(sel, drafts):
                g0 = row_of.get(r.req_id)
                match.append(g0 is not None)
                if g0 is not None:
                    logit_rows.extend(range(off, off + len(d) + 1))
                    mask_rows.extend(range(g0, g0 + len(d) + 1))
                off += len(d) + 1
            if logit_rows:
                meta.grammar_bitmask = (
                    torch.tensor(logit_rows, dtype=torch.int64, device=runner.device),
                    bitmask[torch.tensor(mask_rows, dtype=torch.int64)].to(runner.device))
        gens = {}
        for j, r in enumerate(sel):
            g = runner._generator_for(r)
            if g is not None:
                gens[j] = g
        probs = None
        if self._draft_probs:
            probs = self._stack_draft_probs(sel, logits.shape[1])
        res = self.rejection_sampler(logits, meta, drafts, generators=gens, draft_probs=probs,
                                     match_sampling=match)
        for r, toks in zip(sel, res.output_token_ids):
            out.sampled_token_ids[r.req_id] = toks
        if res.logprob_token_ids is not None:
            ids, lps, ranks = res.logprob_token_ids.tolist(), res.logprobs.tolist(), res.sampled_ranks.tolist()
            row = 0
            for r, toks in zip(sel, res.output_token_ids):
                k = r.sampling_params.logprobs
                if k is not None:
                    n = 1 + k
                    out.logprobs[r.req_id] = [(ids[row + j][:n], lps[row + j][:n], ranks[row + j])
                                              for j in range(len(toks))]
                row += len(r.spec_token_ids) + 1
        return rest

    def _stack_draft_probs(self, sel: list[ScheduledRequest], vocab: int) -> Optional[torch.Tensor]:
        """``[sum k, V]`` draft distributions in request order; one-hot rows where a request's
        drafts came without probabilities (exact: a deterministic draft has a one-hot q)."""
        parts = []
        any_probs = False
        for r in sel:
            p = self._draft_probs.pop(r.req_id, None)
            k = len(r.spec_token_ids)
            if p is not None and p.shape[0] >= k:
                parts.append(p[:k].float())
                any_probs = True
            else:
                oh = torch.zeros(k, vocab)
                oh[torch.arange(k), torch.tensor(r.spec_token_ids)] = 1.0
                parts.append(oh)
        return torch.cat(parts) if any_probs else None

    # ------------------------------------------------------------------ propose
    def propose(self, reqs: list[ScheduledRequest], hidden: Optional[torch.Tensor], qsl: np.ndarray,
                out: ModelRunnerOutput, max_model_len: Optional[int] = None) -> None:
        """Draft the next step's tokens into ``out.spec_token_ids``."""
        n_gen = sum(1 for r in reqs if r.sampling_params is not None)
        speculate = not (self.disable_batch_size and n_gen >= self.disable_batch_size)
        want: set[str] = set()
        caps: dict[str, int] = {}
        if speculate:
            for r in reqs:
                new = out.sampled_token_ids.get(r.req_id)
                sp = r.sampling_params
                # NOTE: grammar-constrained requests do not speculate (see the scheduler).
                if not new or sp is None:
                    continue
                if getattr(sp, "structured_outputs", None) is not None:
                    if not self._logged_grammar:
                        self._logged_grammar = True
                        logger.info("pagedllm: speculative decoding (%s) is off for requests with structured "
                                    "outputs (drafts are not masked by the grammar)", self.config.method)
                    continue
                cap = self.k
                if sp.max_tokens is not None:
                    cap = min(cap, sp.max_tokens - (len(r.token_ids) - r.prompt_len + len(new)) - 1)
                if max_model_len is not None:
                    cap = min(cap, max_model_len - (len(r.token_ids) + len(new)))
                if cap > 0:
                    want.add(r.req_id)
                    caps[r.req_id] = cap
        for rid in want:
            self._draft_probs.pop(rid, None)
        if not want and not self.proposer.needs_hidden:
            return
        prop: Proposal = self.proposer.propose(ProposeBatch(
            reqs=reqs, sampled=out.sampled_token_ids, want=want,
            hidden=hidden if self.proposer.needs_hidden else None, qsl=qsl, max_drafts=caps))
        for rid, toks in prop.token_ids.items():
            if toks and rid in want:
                out.spec_token_ids[rid] = toks[:caps[rid]]
                p = prop.probs.get(rid)
                if p is not None:
                    self._draft_probs[rid] = p

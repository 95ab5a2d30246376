"""Lossless verification of speculative (draft) tokens: the rejection sampler.

Request ``i`` of a verification batch proposed ``k_i >= 0`` draft tokens ``d_1..d_k``; the
target model scored ``k_i + 1`` positions in one forward, so the target logits hold
``k_i + 1`` consecutive rows for it (row ``j`` predicts the token after ``d_j``, row 0 the
token after the last committed one). Rows of all requests are concatenated: ``T = sum(k_i + 1)``
rows. The sampling metadata has one row per logits row, built as if the drafts before that row
had been accepted (penalties, ``min_tokens`` and bad words see ``output + d_1..d_j``; see
:func:`build_verification_metadata`).

Each row goes through the plain sampler's own stages (``Sampler.apply_logits_processors``:
grammar bitmask, allowed tokens, bad words, min_tokens, logit bias, penalties; then
``Sampler.compute_probs``: temperature, min-p, top-k, top-p), so the distribution ``p_j`` a
draft is checked against is exactly the one the plain sampler would sample from there.

* Greedy rows: draft ``d_j`` is accepted while it equals the argmax of row ``j - 1``; the first
  mismatching row (or row ``k`` when all match) emits its argmax. The output is the plain greedy
  output token for token.
* Random rows: standard speculative sampling (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): draft ``d_j`` drawn
  from the draft's ``q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
  first rejection a *recovered* token is drawn from ``norm(max(0, p_j - q_j))``; when all ``k``
  are accepted a bonus token is drawn from ``p_k``. Every emitted token then has exactly the
  target's distribution. Drafts from a deterministic proposer (n-gram, suffix, greedy draft
  heads) pass ``draft_probs=None``: ``q_j`` is one-hot on ``d_j``, so acceptance is ``p_j(d_j)``
  and the recovered distribution is ``p_j`` without ``d_j``, renormalized.

* Match sampling (``match_sampling``, for point-mass drafts: jump-forward's grammar-forced
  tokens): row ``j`` samples a token exactly as the plain sampler does (one uniform, from the
  request's generator when seeded); draft ``d_{j+1}`` is accepted iff that token equals it, and
  the first token that differs (or row ``k``'s) is emitted. For a one-hot ``q`` this is the rule
  above (accept with probability ``p_j(d)``; a rejection emits ``p_j`` without ``d``), and it
  draws one uniform per emitted token in order, so a seeded request emits exactly the tokens
  it would emit one step at a time.

Seeded rows draw their uniforms from the request's own generator (``k_i`` acceptance draws, then
one for the emitted token), so a seeded request's output does not depend on the batch.
Logprobs are those of the RAW target distribution at each emitted token's row (vLLM's default
``logprobs_mode="raw_logprobs"``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pagedllm.sample.logprobs import gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, random_sample

__all__ = ["RejectionSampler", "RejectionSamplerOutput", "build_verification_metadata"]


@dataclass
class RejectionSamplerOutput:
    """Result of verifying one batch.

    Attributes:
        output_token_ids: per request the emitted tokens: its accepted drafts, then one
            recovered or bonus token (``1 <= len <= k_i + 1``).
        num_accepted: per request how many drafts were accepted (``len(output) - 1``).
        logprob_token_ids: int64 ``[T, 1 + max_k]`` per logits row, the token emitted at that
            row first, then the top tokens (rows past a request's emitted tokens hold
            placeholders); None when no row asked for logprobs.
        logprobs: float32 ``[T, 1 + max_k]`` RAW-distribution logprobs matching them, or None.
        sampled_ranks: int64 ``[T]`` rank of the emitted token, or None.
    """

    output_token_ids: list[list[int]]
    num_accepted: list[int]
    logprob_token_ids: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    sampled_ranks: Optional[torch.Tensor] = None


def build_verification_metadata(
    params: Sequence[Any],
    prompt_token_ids: Sequence[list[int]],
    output_token_ids: Sequence[list[int]],
    draft_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    eos_token_ids: Optional[Sequence[Optional[int]]] = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """SamplingMetadata with one row per logits row of a verification batch.

    Request i contributes ``len(draft_token_ids[i]) + 1`` rows; row ``j`` sees the output
    ``output_token_ids[i] + draft_token_ids[i][:j]`` (what the plain sampler would see there
    if the first ``j`` drafts are accepted), so penalties, ``min_tokens`` and bad words are
    exact. Generators are left out (the rejection sampler takes them per request).

    Args:
        params: per request its SamplingParams.
        prompt_token_ids / output_token_ids: per request (see ``SamplingMetadata.from_requests``).
        draft_token_ids: per request its drafts.
        vocab_size / eos_token_ids / device: as ``SamplingMetadata.from_requests``.
    """
    rp: list[Any] = []
    rprompt: list[list[int]] = []
    rout: list[list[int]] = []
    reos: list[Optional[int]] = []
    for i, (sp, d) in enumerate(zip(params, draft_token_ids)):
        out = list(output_token_ids[i])
        for j in range(len(d) + 1):
            rp.append(sp)
            rprompt.append(prompt_token_ids[i])
            rout.append(out + list(d[:j]) if j else out)
            reos.append(eos_token_ids[i] if eos_token_ids is not None else None)
    return SamplingMetadata.from_requests(rp, rprompt, rout, [None] * len(rp), vocab_size,
                                          reos if eos_token_ids is not None else None, device)


class RejectionSampler:
    """Verifies draft tokens against the target's logits; see the module docstring.

    Stateless; uses a :class:`~pagedllm.sample.sampler.Sampler` for the logits processing.
    """

    def __init__(self) -> None:
        self.sampler = Sampler()

    def __call__(self, *args, **kwargs) -> RejectionSamplerOutput:
        return self.forward(*args, **kwargs)

    def forward(
        self,
        target_logits: torch.Tensor,
        meta: SamplingMetadata,
        draft_token_ids: Sequence[Sequence[int]],
        generators: Optional[dict[int, torch.Generator]] = None,
        draft_probs: Optional[torch.Tensor] = None,
        match_sampling: Optional[Sequence[bool]] = None,
    ) -> RejectionSamplerOutput:
        """Verify every request's drafts.

        Args:
            target_logits: float ``[T, V]``, ``T = sum(len(d) + 1 for d in draft_token_ids)``;
                request i's rows are consecutive, in request order. Not modified.
            meta: SamplingMetadata with ``T`` rows (row r = the request and draft prefix of
                logits row r); its ``generators`` are ignored (see ``generators``).
            draft_token_ids: per request its draft tokens (may be empty).
            generators: request index -> torch.Generator for seeded random requests.
            draft_probs: float32 ``[sum k_i, V]`` the draft distribution each draft was drawn
                from (row order = drafts in request order), or None for one-hot (deterministic
                proposers).
            match_sampling: per request, True to verify its (point-mass) drafts by match
                sampling (module docstring; its ``draft_probs`` rows are then ignored), or None.

        Returns:
            RejectionSamplerOutput.

        Raises:
            ValueError: shapes that do not line up.
        """
        ks = [len(d) for d in draft_token_ids]
        B = len(ks)
        T = sum(ks) + B
        if target_logits.dim() != 2 or target_logits.shape[0] != T:
            raise ValueError(f"target_logits must be [{T}, V] for drafts of lengths {ks}, got "
                             f"{tuple(target_logits.shape)}")
        if meta.num_rows != T:
            raise ValueError(f"metadata has {meta.num_rows} rows, expected {T}")
        if draft_probs is not None and tuple(draft_probs.shape) != (sum(ks), target_logits.shape[1]):
            raise ValueError(f"draft_probs must be [{sum(ks)}, {target_logits.shape[1]}], got "
                             f"{tuple(draft_probs.shape)}")
        generators = generators or {}
        device = target_logits.device
        V = target_logits.shape[1]

        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(target_logits, dim=-1, dtype=torch.float32)
        logits = target_logits.to(torch.float32, copy=True)
        logits = self.sampler.apply_logits_processors(logits, meta)

        # Per logits row: its request, its index j within the request, its draft token.
        starts = torch.tensor([0] + ks, dtype=torch.int64).cumsum(0)[:-1] + torch.arange(B)
        max_k = max(ks, default=0)
        k_t = torch.tensor(ks, dtype=torch.int64)
        # Draft matrix [B, max_k] (padding 0), and a mask of real drafts.
        drafts = torch.zeros(B, max(max_k, 1), dtype=torch.int64)
        for i, d in enumerate(draft_token_ids):
            if d:
                drafts[i, :len(d)] = torch.as_tensor(list(d), dtype=torch.int64)
        j_idx = torch.arange(max(max_k, 1))
        real = j_idx.unsqueeze(0) < k_t.unsqueeze(1)  # [B, max_k]
        rows = (starts.unsqueeze(1) + j_idx.unsqueeze(0)).clamp(max=T - 1)  # row of draft j's check

        greedy_row = torch.zeros(T, dtype=torch.bool)
        if meta.all_greedy:
            greedy_row[:] = True
        elif not meta.all_random:
            greedy_row = meta.greedy_mask.to("cpu", torch.bool)
        greedy_req = greedy_row[starts]
        match = torch.zeros(B, dtype=torch.bool)
        if match_sampling is not None:
            match = torch.tensor(list(match_sampling), dtype=torch.bool) & ~greedy_req
        vec_random = ~greedy_req & ~match  # random requests verified by the rule above

        argmax = None
        if not meta.all_random:
            argmax = logits.argmax(dim=-1).cpu()
        probs = None
        if not meta.all_greedy:
            probs = self.sampler.compute_probs(logits, meta)

        accept = torch.zeros(B, max(max_k, 1), dtype=torch.bool)
        if argmax is not None:
            accept |= (argmax[rows] == drafts) & greedy_req.unsqueeze(1)
        if probs is not None and max_k > 0:
            # Uniforms: seeded requests draw theirs (k_i of them) from their own generator.
            u = torch.rand(B, max_k)
            for i, g in generators.items():
                if ks[i] and bool(vec_random[i]):
                    u[i, :ks[i]] = torch.rand(ks[i], generator=g, device=g.device).cpu()
            p = probs[rows.to(device), drafts.to(device)].cpu()  # [B, max_k]
            if draft_probs is None:
                q = torch.ones_like(p)
            else:
                flat = torch.zeros(B, max_k, dtype=torch.int64)
                flat[real] = torch.arange(sum(ks))
                q = draft_probs.to(device)[flat.to(device), drafts.to(device)].cpu().float()
            accept |= (u * q < p) & vec_random.unsqueeze(1)
        accept &= real
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        matched: dict[int, int] = {}
        if probs is not None and bool(match.any()):
            for i in match.nonzero().squeeze(1).tolist():
                num_accepted[i], matched[i] = self._match_sample(
                    probs, int(starts[i]), list(draft_token_ids[i]), generators.get(i))
        final_rows = starts + num_accepted  # row that emits the last token

        final = torch.empty(B, dtype=torch.int64)
        if argmax is not None:
            final = argmax[final_rows].clone()
        for i, t in matched.items():
            final[i] = t
        if probs is not None and bool(vec_random.any()):
            rand_reqs = vec_random.nonzero().squeeze(1)
            fr = final_rows[rand_reqs].to(device)
            target = probs.index_select(0, fr)  # [R, V]
            rejected = num_accepted[rand_reqs] < k_t[rand_reqs]
            if bool(rejected.any()):
                # Recovered token: norm(max(0, p - q)) at the rejected position.
                rej = rejected.nonzero().squeeze(1)
                ri = rand_reqs[rej]
                j = num_accepted[ri]
                if draft_probs is None:
                    qd = torch.zeros(len(ri), V, dtype=torch.float32, device=device)
                    qd[torch.arange(len(ri), device=device), drafts[ri, j].to(device)] = 1.0
                else:
                    offs = torch.tensor([0] + ks, dtype=torch.int64).cumsum(0)[:-1]
                    qd = draft_probs.to(device).float()[(offs[ri] + j).to(device)]
                target[rej.to(device)] = self.recovered_distribution(target[rej.to(device)], qd)
            gens = {int(n): generators[int(i)] for n, i in enumerate(rand_reqs.tolist()) if int(i) in generators}
            sampled = random_sample(target, gens).cpu()
            final[rand_reqs] = sampled

        acc = num_accepted.tolist()
        out_ids = [list(d[:a]) + [t] for d, a, t in zip(draft_token_ids, acc, final.tolist())]
        out = RejectionSamplerOutput(output_token_ids=[list(map(int, o)) for o in out_ids],
                                     num_accepted=acc)
        if raw_logprobs is not None:
            # The token emitted at each row: the draft for accepted rows, the final token at
            # each request's final row; rows after it get a placeholder (never read).
            emitted = torch.zeros(T, dtype=torch.int64)
            if max_k > 0:
                emitted[rows[real]] = drafts[real]
            emitted[final_rows] = final
            ids, lps, ranks = gather_logprobs(raw_logprobs, meta.max_num_logprobs, emitted.to(device))
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = ids, lps, ranks
        return out

    @staticmethod
    def _match_sample(probs: torch.Tensor, start: int, drafts: list[int],
                      generator: Optional[torch.Generator]) -> tuple[int, int]:
        """Match sampling of one request (module docstring): ``(accepted drafts, emitted
        token)``, sampling rows ``start ..`` of ``probs`` one at a time as the plain sampler does."""
        j = 0
        while True:
            row = probs[start + j:start + j + 1]
            t = int(random_sample(row, {0: generator} if generator is not None else {})[0])
            if j < len(drafts) and t == drafts[j]:
                j += 1
                continue
            return j, t

    @staticmethod
    def recovered_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Where a rejected position samples from: ``max(0, p - q)`` (unnormalized; the
        sampler normalizes), float32 ``[R, V]`` from target ``p`` and draft ``q`` of the same shape.

        NOTE: an all-zero residual means ``p == q``, where rejection has probability 0; only
        rounding gets there, and sampling ``p`` is then exact.
        """
        resid = (p - q).clamp_(min=0.0)
        empty = resid.sum(dim=-1, keepdim=True) <= 0
        return torch.where(empty, p, resid)

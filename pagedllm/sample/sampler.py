"""Vectorized token sampler (vLLM v1 ``Sampler`` semantics).

Per step, on float32 logits ``[N, V]`` (row i = request i of the SamplingMetadata):

1. Logprobs (if any row asked) are taken from the RAW model distribution,
   ``log_softmax(logits)`` before any of the steps below (vLLM's default
   ``logprobs_mode="raw_logprobs"``).
2. Grammar bitmask (structured outputs): tokens the row's grammar does not allow next are
   set to -inf (before everything below, so penalties, temperature and top-k/p renormalize
   over the allowed tokens only: sampling stays exact).
   ``allowed_token_ids``: every other token is set to -inf.
3. ``bad_words``: the last token of a bad-word sequence is set to -inf when the
   preceding tokens of that sequence match the tail of the output.
4. ``min_tokens``: EOS and stop tokens are set to -inf while the output is shorter, except in a
   row where that would leave no token at all (a grammar or ``allowed_token_ids`` that allows
   only a stop token now, e.g. a finished ``choice``): the constraint wins, the row may stop.
5. ``logit_bias`` is added.
6. Penalties: repetition (prompt + output tokens; positive logits divided, negative
   multiplied), then frequency (times the count in the output) and presence (once if in
   the output) subtracted.
7. Greedy rows take the argmax. Random rows: temperature, min-p, top-k, top-p (this is
   vLLM v1's order: min-p is an "argmax-invariant logits processor" applied right after
   temperature), then an exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``; a
   seeded row draws ``q`` from its own generator, so its tokens do not depend on the
   rest of the batch.

Stages no row needs are skipped (flags in :class:`SamplingMetadata`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.sample.bitmask import apply_token_bitmask
from pagedllm.sample.logprobs import compute_prompt_logprobs, gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata, _pad_2d
from pagedllm.sampling_params import _SAMPLING_EPS

__all__ = ["Sampler", "SamplerOutput", "compute_prompt_logprobs"]

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    Attributes:
        sampled_token_ids: int64 [N].
        logprob_token_ids: int64 [N, 1 + max_k]: the sampled token first, then the
            ``max_k`` most likely tokens (``max_k`` = the batch's largest ``logprobs``;
            row i should keep only its first ``1 + logprobs_i`` columns). None when no row
            asked for logprobs.
        logprobs: float32 [N, 1 + max_k], RAW-distribution logprobs matching
            ``logprob_token_ids``, or None.
        sampled_ranks: int64 [N], 1-based rank of the sampled token in the raw
            distribution, or None.
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    sampled_ranks: Optional[torch.Tensor] = None


class Sampler:
    """Stateless batch sampler; see the module docstring for the order of operations."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, meta)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        if logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"logits have {logits.shape[0]} rows but the metadata has {meta.num_rows}")
        if meta.vocab_size and logits.shape[1] != meta.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns but SamplingMetadata.vocab_size is "
                f"{meta.vocab_size}; build the metadata with the logits' width")

        # 1. Raw logprobs (vLLM default logprobs_mode="raw_logprobs").
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        # Work on a float32 copy: the caller's tensor is never modified. (An all-greedy
        # batch with no logits processing only reads the logits: no copy.)
        mutates = (not meta.all_greedy or meta.allowed_token_ids_mask is not None
                   or bool(meta.bad_words_token_ids) or meta.min_tokens_mask is not None
                   or meta.logit_bias is not None or not meta.no_penalties
                   or meta.grammar_bitmask is not None)
        logits = logits.to(torch.float32, copy=mutates)

        logits = self.apply_logits_processors(logits, meta)
        sampled = self.sample(logits, meta)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, lps, ranks = gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=ids,
                             logprobs=lps, sampled_ranks=ranks)

    # ------------------------------------------------------------------ processors
    def apply_logits_processors(self, logits: torch.Tensor,
                                meta: SamplingMetadata) -> torch.Tensor:
        """Steps 2-6 (in place on ``logits``, which is returned)."""
        if meta.grammar_bitmask is not None:
            apply_token_bitmask(logits, *meta.grammar_bitmask)
        if meta.allowed_token_ids_mask is not None:
            logits.masked_fill_(meta.allowed_token_ids_mask, _NEG_INF)
        if meta.bad_words_token_ids:
            apply_bad_words(logits, meta.bad_words_token_ids, meta.output_token_ids)
        if meta.min_tokens_mask is not None:
            rows, cols = meta.min_tokens_mask
            constrained = meta.grammar_bitmask is not None or meta.allowed_token_ids_mask is not None
            kept = logits[rows, cols].clone() if constrained else None
            logits[rows, cols] = _NEG_INF
            if kept is not None:
                # a row left with no finite logit gets its stop tokens back (the grammar ends it)
                dead = torch.isneginf(logits[rows]).all(dim=-1)
                if bool(dead.any()):
                    logits[rows[dead], cols[dead]] = kept[dead]
        if meta.logit_bias is not None:
            rows, cols, vals = meta.logit_bias
            logits.index_put_((rows, cols), vals, accumulate=True)
        if not meta.no_penalties:
            logits = apply_penalties(
                logits,
                meta.prompt_token_ids,
                meta.output_token_ids,
                meta.presence_penalties,
                meta.frequency_penalties,
                meta.repetition_penalties,
            )
        return logits

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Step 7: int64 [N] token ids."""
        greedy = None
        if not meta.all_random:
            greedy = row_argmax(logits)
            if meta.all_greedy:
                return greedy

        probs = self.compute_probs(logits, meta)
        random = random_sample(probs, meta.generators)
        if greedy is None:
            return random
        return torch.where(meta.greedy_mask, greedy, random)

    def compute_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows sample from: float32 ``[N, V]`` probabilities after
        temperature, min-p and top-k/top-p (in place on the processed ``logits``). Greedy rows
        of a mixed batch are divided by 1 (their row is meaningless and must be ignored).
        The speculative decoding rejection sampler verifies drafts against these."""
        temp = meta.temperature
        if meta.greedy_mask is not None or meta.all_greedy:
            temp = torch.where(temp < _SAMPLING_EPS, torch.ones_like(temp), temp)
        logits.div_(temp.unsqueeze(1))

        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)

        return torch.softmax(logits, dim=-1)


# ---------------------------------------------------------------------- functions
# Above this many threads (and this many elements) torch's parallel argmax beats numpy's.
_NUMPY_ARGMAX_MAX_THREADS = 4
_NUMPY_ARGMAX_ANY_THREADS_NUMEL = 1 << 18


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: the index of each row's largest value (the first of equal ones; a NaN
    counts as the largest), as ``logits.argmax(dim=-1)``.

    On the CPU, for float32 rows, numpy's argmax (a vectorised single-thread loop) takes
    ~1/5-1/8 of torch's here (1 thread, Zen 4: 15 vs 122 us for 256 x 512, 2.2 vs 11.5 ms for
    256 x 49,152), so it is used there with up to ``_NUMPY_ARGMAX_MAX_THREADS`` torch threads, or
    for small inputs; torch's elsewhere (CUDA, other dtypes, many threads). Same result either way.
    """
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and not logits.requires_grad
            and (torch.get_num_threads() <= _NUMPY_ARGMAX_MAX_THREADS
                 or logits.numel() <= _NUMPY_ARGMAX_ANY_THREADS_NUMEL)):
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype("int64", copy=False))
    return logits.argmax(dim=-1)


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                    output_token_ids: list[list[int]]) -> None:
    """Ban (-inf) the last token of each bad-word sequence whose other tokens match the
    tail of the row's output (single-token words are always banned)."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, seqs in bad_words_token_ids.items():
        past = output_token_ids[i]
        for seq in seqs:
            prefix_len = len(seq) - 1
            if prefix_len > len(past):
                continue
            if prefix_len == 0 or list(past[len(past) - prefix_len:]) == list(seq[:-1]):
                if 0 <= seq[-1] < vocab:
                    rows.append(i)
                    cols.append(seq[-1])
    if rows:
        logits[torch.tensor(rows, device=logits.device),
               torch.tensor(cols, device=logits.device)] = _NEG_INF


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts [N, vocab_size] of token ids in a [N, L] tensor padded with vocab_size."""
    n = token_ids.shape[0]
    counts = torch.zeros((n, vocab_size + 1), dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Optional[torch.Tensor],
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM penalties (``apply_penalties``), in place.

    * repetition ``r`` (tokens in prompt or output): ``l / r`` if ``l > 0`` else ``l * r``;
    * frequency ``f``: ``l -= f * count_in_output``;
    * presence ``p``: ``l -= p * (count_in_output > 0)``.

    ``prompt_token_ids`` ([N, Lp] padded with V) may be None when no row has a repetition
    penalty.
    """
    n, vocab = logits.shape
    out_t = _pad_2d(output_token_ids, vocab).to(logits.device)
    out_t = out_t.clamp_(0, vocab)  # out-of-range ids count as padding
    out_counts = _bin_counts(out_t, vocab)
    out_mask = out_counts > 0

    if prompt_token_ids is not None and bool((repetition_penalties != 1.0).any()):
        prompt_mask = _bin_counts(prompt_token_ids.clamp(0, vocab), vocab) > 0
        seen = prompt_mask | out_mask
        rep = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    elif bool((repetition_penalties != 1.0).any()):
        rep = torch.where(out_mask, repetition_penalties.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)

    logits -= frequency_penalties.unsqueeze(1) * out_counts.to(logits.dtype)
    logits -= presence_penalties.unsqueeze(1) * out_mask.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (-inf) tokens with ``prob < min_p * max_prob`` (probabilities after
    temperature). ``min_p`` 0 rows are unchanged."""
    probs = torch.softmax(logits, dim=-1)
    max_probs = probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < min_p.unsqueeze(1) * max_probs, _NEG_INF)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, k: Optional[torch.Tensor],
                      p: Optional[torch.Tensor]) -> torch.Tensor:
    """vLLM's top-k / top-p filter, in place.

    * top-k keeps the tokens whose logit is >= the k-th largest (ties at the threshold
      are kept); rows with ``k >= V`` are unchanged.
    * top-p (after top-k) sorts ascending and drops every token whose cumulative
      probability, counted from the least likely up to and including itself, is
      ``<= 1 - p``; the most likely token is always kept.
    """
    vocab = logits.shape[1]
    if p is None:
        # top-k only: no full sort.
        assert k is not None
        no_k = (k >= vocab).unsqueeze(1)
        k = torch.where(no_k.squeeze(1), torch.ones_like(k), k.clamp(min=1))
        max_k = int(k.max())
        top_vals = torch.topk(logits, max_k, dim=-1).values
        thresh = top_vals.gather(1, (k - 1).unsqueeze(1))
        thresh = torch.where(no_k, torch.full_like(thresh, _NEG_INF), thresh)
        logits.masked_fill_(logits < thresh, _NEG_INF)
        return logits

    need_p = p < 1.0
    if k is None and not bool(need_p.any()):
        return logits
    if bool(need_p.all()) or k is not None:
        if _top_p_fast(logits, k, p):
            return logits
        return _top_k_top_p_sort(logits, k, p)
    # Some rows have no top-p (and there is no top-k): filter only the others.
    rows = need_p.nonzero().squeeze(1)
    sub = logits.index_select(0, rows)
    if not _top_p_fast(sub, None, p.index_select(0, rows)):
        sub = _top_k_top_p_sort(sub, None, p.index_select(0, rows))
    logits.index_copy_(0, rows, sub)
    return logits


# Candidates examined before falling back to a full-vocabulary sort for top-p.
_TOP_P_CANDIDATES = 256


def _top_p_fast(logits: torch.Tensor, k: Optional[torch.Tensor], p: torch.Tensor) -> bool:
    """Top-k/top-p over the ``_TOP_P_CANDIDATES`` most likely tokens only, in place.

    Same rule as ``_top_k_top_p_sort`` (a token is dropped when the probability of the
    tokens more likely than it is >= p), valid whenever every row's nucleus lies inside the
    candidates, which holds for peaked LM distributions; a full sort of a 49k-256k vocabulary
    costs ~100x more on CPU. Returns False (nothing changed) when some row needs more.
    """
    vocab = logits.shape[1]
    c = _TOP_P_CANDIDATES
    if k is not None:
        c = max(c, int(k.clamp(1, vocab).max()))
    if c >= vocab:
        return False
    vals, idx = logits.topk(c, dim=-1)  # descending
    if k is not None:
        kk = k.clamp(1, vocab)
        thresh = vals.gather(1, (kk - 1).unsqueeze(1))
        if bool((vals[:, -1:] >= thresh).any() & (kk < vocab).any()):
            # ties at the top-k threshold may extend past the candidates: use the sort path
            return False
        vals = vals.masked_fill(vals < thresh, _NEG_INF)
        lse = torch.logsumexp(vals, dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = (vals - lse).exp()
    cum = probs.cumsum(dim=-1)
    no_p = p >= 1.0
    # Rows without top-p keep every candidate (their top-k set lies inside the candidates).
    pp = torch.where(no_p, torch.full_like(p, float("inf")), p).unsqueeze(1)
    if k is None and bool(no_p.any()):
        return False
    if not bool(((cum[:, -1:] >= pp) | no_p.unsqueeze(1)).all()):
        return False
    keep = (cum - probs) < pp
    keep[:, 0] = True
    logits.fill_(_NEG_INF)
    logits.scatter_(1, idx, vals.masked_fill(~keep, _NEG_INF))
    return True


def _top_k_top_p_sort(logits: torch.Tensor, k: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """Reference top-k/top-p via a full ascending sort (vLLM's formulation), in place."""
    vocab = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = k.clamp(1, vocab)
        thresh = logits_sort.gather(1, (vocab - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < thresh, _NEG_INF)
    probs_sort = logits_sort.softmax(dim=-1)
    cum = probs_sort.cumsum(dim=-1)
    mask = cum <= (1.0 - p).unsqueeze(1)
    mask[:, -1] = False
    logits_sort.masked_fill_(mask, _NEG_INF)
    return logits.scatter_(1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform ``u`` per row, token = first index whose cumulative
    probability exceeds ``u * total``. Exact for the given probabilities (zero-probability
    tokens are never chosen) and ~30x cheaper on CPU than an exponential race over the whole
    vocabulary. Seeded rows draw their ``u`` from their own generator, so their tokens do not
    depend on the rest of the batch.

    Args:
        probs: float32 ``[N, V]`` (rows need not be exactly normalized).
        generators: row index -> torch.Generator for seeded rows.

    Returns:
        int64 ``[N]`` token ids.
    """
    n = probs.shape[0]
    u = torch.rand(n, 1, device=probs.device) if len(generators) != n else torch.empty(n, 1, device=probs.device)
    for i, gen in generators.items():
        u[i] = torch.rand(1, generator=gen, device=probs.device)
    cdf = probs.cumsum(dim=-1)
    u = u * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

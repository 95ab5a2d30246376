"""Top-k logprob gathering shared by sampled-token and prompt logprobs."""
from __future__ import annotations

import torch


def gather_logprobs(
    logprobs: torch.Tensor, num_top: int, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick each row's target token and its ``num_top`` most likely tokens.

    Args:
        logprobs: float32 [R, V] log-probabilities.
        num_top: how many top tokens to return per row (>= 0).
        token_ids: int64 [R], the target (sampled or prompt) token of each row.

    Returns:
        ids: int64 [R, 1 + num_top], target token first, then top tokens by
            descending logprob.
        values: float32 [R, 1 + num_top], the matching logprobs.
        ranks: int64 [R], 1-based rank of the target token: the number of tokens whose
            logprob is >= the target's (ties count against the target, as vLLM).
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).view(-1, 1)
    token_lp = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_lp).sum(-1)
    if num_top > 0:
        num_top = min(num_top, logprobs.shape[-1])
        top_lp, top_ids = torch.topk(logprobs, num_top, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        values = torch.cat([token_lp, top_lp], dim=1)
    else:
        ids, values = token_ids, token_lp
    return ids, values.to(torch.float32), ranks


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt logprobs: row ``j`` of ``logits`` [P, V] predicts ``target_ids[j]``
    (the prompt token that follows position j).

    Uses the RAW model distribution (``log_softmax`` of the unprocessed logits, in float32),
    as vLLM's default ``logprobs_mode="raw_logprobs"``: no temperature, penalties or
    filtering are applied.

    Returns ``(ids [P, 1 + num_top], logprobs [P, 1 + num_top], ranks [P])`` with the
    target token first (see :func:`gather_logprobs`).
    """
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(lp, num_top, target_ids)

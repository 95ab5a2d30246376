"""Batched sampling parameters for one engine step (vLLM ``v1/sample/metadata.py``).

The model runner builds one :class:`SamplingMetadata` per step from the requests that
sample a token this step; row ``i`` of the logits belongs to request ``i``. Tensors that
only some features need are built only when a row of the batch uses the feature, and
the boolean flags let the :class:`~pagedllm.sample.sampler.Sampler` skip whole stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagedllm.sampling_params import _SAMPLING_EPS, SamplingParams


def _pad_2d(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """int64 [len(rows), max_len] right-padded with ``pad`` (max_len >= 1)."""
    max_len = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(max_len, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for a batch of ``N`` rows.

    Attributes:
        temperature: float32 [N] (greedy rows hold their raw value, < 1e-5).
        all_greedy / all_random: every row greedy / no row greedy.
        greedy_mask: bool [N] (True = greedy row), None when all_greedy or all_random.
        top_k: int64 [N] (rows without top-k hold ``vocab_size``), None if no row uses it.
        top_p: float32 [N] (1.0 = off), None if no row uses it.
        min_p: float32 [N] (0.0 = off), None if no row uses it.
        generators: row -> torch.Generator for seeded random rows.
        num_logprobs: per row the requested ``logprobs`` (None = not requested).
        max_num_logprobs: max over rows of ``logprobs``, None when no row asked.
        no_penalties: True when no row has presence/frequency/repetition penalties.
        presence_penalties / frequency_penalties / repetition_penalties: float32 [N]
            (None when ``no_penalties``).
        prompt_token_ids: int64 [N, Lp] padded with ``vocab_size``; only built when a row
            has a repetition penalty (the only penalty that looks at the prompt).
        output_token_ids: per row the generated tokens so far (not copied).
        allowed_token_ids_mask: bool [N, vocab_size], True = token NOT allowed; None if no
            row restricts.
        bad_words_token_ids: row -> token-id sequences of its bad words.
        min_tokens_mask: (rows, cols) int64 index tensors of (row, stop/EOS token) logits to
            set to -inf this step, or None.
        logit_bias: (rows, cols, values) tensors to add to the logits, or None.
        vocab_size: the model's vocabulary size.
        grammar_bitmask: ``(rows int64 [M], bitmask int32 [M, ceil(vocab_size / 32)])``: row
            ``rows[i]`` may only sample the tokens set in ``bitmask[i]`` (structured outputs;
            see ``pagedllm.sample.bitmask``), or None.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    greedy_mask: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]
    top_p: Optional[torch.Tensor]
    min_p: Optional[torch.Tensor]
    generators: dict[int, torch.Generator]
    num_logprobs: list[Optional[int]]
    max_num_logprobs: Optional[int]
    no_penalties: bool
    presence_penalties: Optional[torch.Tensor]
    frequency_penalties: Optional[torch.Tensor]
    repetition_penalties: Optional[torch.Tensor]
    prompt_token_ids: Optional[torch.Tensor]
    output_token_ids: list[list[int]]
    allowed_token_ids_mask: Optional[torch.Tensor]
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    vocab_size: int = 0
    grammar_bitmask: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[Optional[torch.Generator]],
        vocab_size: int,
        eos_token_ids: Optional[list[Optional[int]]] = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """Build the step's metadata; row i = request i.

        Args:
            params: each request's SamplingParams.
            prompt_token_ids: each request's prompt (read only if it has a
                repetition penalty).
            output_token_ids: each request's generated tokens so far.
            generators: each request's torch.Generator (seeded requests), else None.
                Used only for random (non-greedy) rows.
            vocab_size: the model's vocabulary size (token ids >= it are ignored).
            eos_token_ids: each request's EOS id (masked while below ``min_tokens``).
            device: where the tensors go (the logits' device).
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators "
                             "must have the same length")
        if eos_token_ids is not None and len(eos_token_ids) != n:
            raise ValueError("eos_token_ids must have one entry per request")
        device = torch.device(device)

        temps = [float(p.temperature) for p in params]
        greedy = [t < _SAMPLING_EPS for t in temps]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temperature = torch.tensor(temps, dtype=torch.float32, device=device)
        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)

        top_k = top_p = min_p = None
        if not all_greedy:
            ks = [p.top_k if (not g and 0 < p.top_k < vocab_size) else vocab_size
                  for p, g in zip(params, greedy)]
            if any(k < vocab_size for k in ks):
                top_k = torch.tensor(ks, dtype=torch.int64, device=device)
            ps = [float(p.top_p) if not g else 1.0 for p, g in zip(params, greedy)]
            if any(v < 1.0 for v in ps):
                top_p = torch.tensor(ps, dtype=torch.float32, device=device)
            mps = [float(p.min_p) if not g else 0.0 for p, g in zip(params, greedy)]
            if any(v > 0.0 for v in mps):
                min_p = torch.tensor(mps, dtype=torch.float32, device=device)

        gens = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}

        num_logprobs = [p.logprobs for p in params]
        requested = [k for k in num_logprobs if k is not None]
        max_num_logprobs = max(requested) if requested else None

        pres = [float(p.presence_penalty) for p in params]
        freq = [float(p.frequency_penalty) for p in params]
        rep = [float(p.repetition_penalty) for p in params]
        no_penalties = (all(v == 0.0 for v in pres) and all(v == 0.0 for v in freq)
                        and all(v == 1.0 for v in rep))
        presence_t = frequency_t = repetition_t = prompt_t = None
        if not no_penalties:
            presence_t = torch.tensor(pres, dtype=torch.float32, device=device)
            frequency_t = torch.tensor(freq, dtype=torch.float32, device=device)
            repetition_t = torch.tensor(rep, dtype=torch.float32, device=device)
            if any(v != 1.0 for v in rep):
                prompts = [prompt_token_ids[i] if rep[i] != 1.0 else [] for i in range(n)]
                prompt_t = _pad_2d(prompts, vocab_size).to(device)

        allowed_mask = None
        if any(p.allowed_token_ids is not None for p in params):
            allowed_mask = torch.zeros((n, vocab_size), dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    allowed_mask[i] = True
                    ids = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
                    if ids:
                        allowed_mask[i, ids] = False
            allowed_mask = allowed_mask.to(device)

        bad_words = {i: p._bad_words_token_ids for i, p in enumerate(params)
                     if p._bad_words_token_ids}

        mt_rows: list[int] = []
        mt_cols: list[int] = []
        for i, p in enumerate(params):
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
                stop_ids = set(p.all_stop_token_ids) | set(p.stop_token_ids)
                if eos_token_ids is not None and eos_token_ids[i] is not None:
                    stop_ids.add(eos_token_ids[i])
                for t in sorted(stop_ids):
                    if 0 <= t < vocab_size:
                        mt_rows.append(i)
                        mt_cols.append(t)
        min_tokens_mask = None
        if mt_rows:
            min_tokens_mask = (torch.tensor(mt_rows, dtype=torch.int64, device=device),
                               torch.tensor(mt_cols, dtype=torch.int64, device=device))

        lb_rows: list[int] = []
        lb_cols: list[int] = []
        lb_vals: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    if 0 <= t < vocab_size:
                        lb_rows.append(i)
                        lb_cols.append(t)
                        lb_vals.append(b)
        logit_bias = None
        if lb_rows:
            logit_bias = (torch.tensor(lb_rows, dtype=torch.int64, device=device),
                          torch.tensor(lb_cols, dtype=torch.int64, device=device),
                          torch.tensor(lb_vals, dtype=torch.float32, device=device))

        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=gens,
            num_logprobs=num_logprobs,
            max_num_logprobs=max_num_logprobs,
            no_penalties=no_penalties,
            presence_penalties=presence_t,
            frequency_penalties=frequency_t,
            repetition_penalties=repetition_t,
            prompt_token_ids=prompt_t,
            output_token_ids=output_token_ids,
            allowed_token_ids_mask=allowed_mask,
            bad_words_token_ids=bad_words,
            min_tokens_mask=min_tokens_mask,
            logit_bias=logit_bias,
            vocab_size=vocab_size,
        )

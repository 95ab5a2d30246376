"""Per-request runner state kept from step to step (vLLM's ``InputBatch`` / ``BlockTable`` idea).

Every step the scheduler hands the runner each scheduled request's whole block table and its
SamplingParams. Between two admissions a request's block table only grows (blocks are appended
at the end), and its parameters never change, so the runner keeps one *row* per live request:

* ``block_table``: ``int64 [rows, cols]``, the request's block ids, zero-padded (block 0 is the
  pool's null block). Each step copies only the new tail; the step's ``[B, max_blocks]`` table is
  then one fancy-index gather instead of a list -> array conversion per request.
* the request's sampling parameters, already in the form :class:`SamplingMetadata` wants them
  (float32 temperature / top-p / min-p, int64 top-k, the "this stage is used" flags), so a step
  whose rows are all *simple* (no penalties, allowed tokens, bad words, min_tokens or logit bias:
  nothing that needs the output so far or a per-row Python loop) builds its metadata with a few
  numpy gathers (:meth:`InputBatch.sampling_metadata`).

A row lives from the request's first step after (re)admission (``ScheduledRequest.is_new``)
until it finishes or is preempted (``SchedulerOutput.finished_req_ids`` /
``preempted_req_ids``: :meth:`InputBatch.remove`). A re-admitted request gets a fresh row, so a
prefix hit or a different block list after preemption is picked up.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import _SAMPLING_EPS


# ``output_token_ids`` of every simple row: one shared, never mutated empty list (the sampler
# reads output ids only for penalties and bad words, which simple rows do not have).
_NO_TOKENS: list[int] = []


def is_simple_sampling(sp: Any) -> bool:
    """True when ``sp`` needs none of the per-row Python stages of the sampler.

    Such a row's metadata is a function of its parameters alone: no penalties (they read the
    output so far), no ``allowed_token_ids``, bad words, ``min_tokens`` or ``logit_bias``.
    Temperature, top-k, top-p, min-p, seeds and ``logprobs`` are all fine.
    """
    return (sp is not None and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
            and sp.repetition_penalty == 1.0 and sp.allowed_token_ids is None
            and not sp._bad_words_token_ids and not sp.min_tokens and not sp.logit_bias)


class InputBatch:
    """One row of persistent state per live request (see the module docstring).

    Args:
        vocab_size: the logits' width (``top_k`` >= it means off, as in ``SamplingMetadata``).
        max_rows: initial number of rows (grows by doubling).
        max_blocks: initial block-table width (grows by doubling).

    Attributes:
        row_of: request id -> row.
        block_table: int64 ``[max_rows, max_blocks]``; row ``r`` holds the first
            ``num_blocks[r]`` block ids of its request, then zeros.
        num_blocks: per row, how many block ids are filled (python list of int).
        temperature / top_p / min_p: float32 ``[max_rows]`` (top-p 1.0 and min-p 0.0 on greedy
            rows, as ``SamplingMetadata.from_requests`` builds them).
        top_k: int64 ``[max_rows]`` (``vocab_size`` = off, and on greedy rows).
        greedy / uses_top_k / uses_top_p / uses_min_p / seeded / simple / wants_prompt_logprobs:
            bool ``[max_rows]`` flags (computed from the python values, as ``from_requests`` does).
        num_logprobs: int64 ``[max_rows]``, the row's ``logprobs`` or -1 for None.
        generators: per row the request's torch.Generator (seeded requests) or None.
    """

    def __init__(self, vocab_size: int, max_rows: int = 8, max_blocks: int = 16) -> None:
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._num_rows_used = 0  # rows ever handed out (high-water mark)
        self.block_table = np.zeros((max_rows, max(max_blocks, 1)), dtype=np.int64)
        self.num_blocks: list[int] = [0] * max_rows
        self.temperature = np.zeros(max_rows, dtype=np.float32)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.top_k = np.full(max_rows, vocab_size, dtype=np.int64)
        self.num_logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.greedy = np.zeros(max_rows, dtype=bool)
        self.uses_top_k = np.zeros(max_rows, dtype=bool)
        self.uses_top_p = np.zeros(max_rows, dtype=bool)
        self.uses_min_p = np.zeros(max_rows, dtype=bool)
        self.seeded = np.zeros(max_rows, dtype=bool)
        self.simple = np.zeros(max_rows, dtype=bool)
        self.wants_prompt_logprobs = np.zeros(max_rows, dtype=bool)
        self.generators: list[Optional[torch.Generator]] = [None] * max_rows

    @property
    def num_live(self) -> int:
        """Number of requests holding a row."""
        return len(self.row_of)

    # ------------------------------------------------------------------ rows
    def _grow_rows(self) -> None:
        old = len(self.num_blocks)
        new = 2 * old

        def grow(a: np.ndarray, fill: Any) -> np.ndarray:
            out = np.full((new,) + a.shape[1:], fill, dtype=a.dtype)
            out[:old] = a
            return out

        self.block_table = grow(self.block_table, 0)
        self.temperature = grow(self.temperature, 0.0)
        self.top_p = grow(self.top_p, 1.0)
        self.min_p = grow(self.min_p, 0.0)
        self.top_k = grow(self.top_k, self.vocab_size)
        self.num_logprobs = grow(self.num_logprobs, -1)
        for name in ("greedy", "uses_top_k", "uses_top_p", "uses_min_p", "seeded", "simple",
                     "wants_prompt_logprobs"):
            setattr(self, name, grow(getattr(self, name), False))
        self.num_blocks.extend([0] * (new - old))
        self.generators.extend([None] * (new - old))

    def _grow_cols(self, need: int) -> None:
        cols = self.block_table.shape[1]
        while cols < need:
            cols *= 2
        out = np.zeros((self.block_table.shape[0], cols), dtype=np.int64)
        out[:, :self.block_table.shape[1]] = self.block_table
        self.block_table = out

    def add(self, req_id: str, sampling_params: Any,
            generator: Optional[torch.Generator] = None) -> int:
        """Give ``req_id`` a fresh row (re-using its row if it holds one); returns the row.

        Args:
            req_id: the request id.
            sampling_params: its SamplingParams, or None (pooling request: never sampled).
            generator: its seeded generator, or None.
        """
        row = self.row_of.get(req_id)
        if row is None:
            if self._free_rows:
                row = self._free_rows.pop()
            else:
                if self._num_rows_used == len(self.num_blocks):
                    self._grow_rows()
                row = self._num_rows_used
                self._num_rows_used += 1
            self.row_of[req_id] = row
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._set_sampling(row, sampling_params, generator)
        return row

    def _set_sampling(self, row: int, sp: Any, generator: Optional[torch.Generator]) -> None:
        V = self.vocab_size
        self.generators[row] = generator
        if sp is None:
            self.simple[row] = self.greedy[row] = self.seeded[row] = False
            self.uses_top_k[row] = self.uses_top_p[row] = self.uses_min_p[row] = False
            self.wants_prompt_logprobs[row] = False
            self.temperature[row] = 0.0
            self.top_k[row], self.top_p[row], self.min_p[row] = V, 1.0, 0.0
            self.num_logprobs[row] = -1
            return
        temp = float(sp.temperature)
        greedy = temp < _SAMPLING_EPS
        k = sp.top_k if (not greedy and 0 < sp.top_k < V) else V
        p = float(sp.top_p) if not greedy else 1.0
        mp = float(sp.min_p) if not greedy else 0.0
        self.temperature[row] = temp
        self.greedy[row] = greedy
        self.top_k[row], self.uses_top_k[row] = k, k < V
        self.top_p[row], self.uses_top_p[row] = p, p < 1.0
        self.min_p[row], self.uses_min_p[row] = mp, mp > 0.0
        self.seeded[row] = generator is not None and not greedy
        self.simple[row] = is_simple_sampling(sp)
        self.num_logprobs[row] = -1 if sp.logprobs is None else int(sp.logprobs)
        self.wants_prompt_logprobs[row] = sp.prompt_logprobs is not None

    def remove(self, req_id: str) -> None:
        """Free the request's row (no-op for an unknown id)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.generators[row] = None
        self._free_rows.append(row)

    def update(self, reqs: Sequence[Any],
               generator_for: Callable[[Any], Optional[torch.Generator]]) -> tuple[np.ndarray, int]:
        """Bring the rows of this step's requests up to date.

        Args:
            reqs: the step's ScheduledRequests (``req_id``, ``is_new``, ``block_ids``,
                ``sampling_params``), in batch order.
            generator_for: ScheduledRequest -> its generator (called when a row is created).

        Returns:
            ``(rows, max_blocks)``: int64 ``[B]`` row of each request, and the longest block table.
        """
        row_of = self.row_of
        nblk = self.num_blocks
        rows = []
        max_blocks = 0
        for r in reqs:
            row = row_of.get(r.req_id)
            if row is None or r.is_new:
                row = self.add(r.req_id, r.sampling_params, generator_for(r))
            ids = r.block_ids
            n = len(ids)
            k = nblk[row]
            if n != k:
                if n > self.block_table.shape[1]:
                    self._grow_cols(n)
                if n > k:
                    self.block_table[row, k:n] = ids[k:]
                else:  # never from the Scheduler (tables only grow); rewrite the row
                    self.block_table[row, :k] = 0
                    self.block_table[row, :n] = ids
                nblk[row] = n
            if n > max_blocks:
                max_blocks = n
            rows.append(row)
        return np.array(rows, dtype=np.int64), max_blocks

    def update_cached(self, req_ids: list[str], new_block_ids: dict[str, list[int]]
                      ) -> Optional[tuple[np.ndarray, int]]:
        """:meth:`update` for a step in ``SchedulerOutput``'s flat form (every request an
        unchanged decode, holding a row since its admission): the rows of ``req_ids`` and the
        block tables of ``new_block_ids`` (req_id -> whole table) brought up to date.

        Returns:
            ``(rows, max_blocks)`` as :meth:`update`, or None (nothing changed) when some id holds
            no row (then use :meth:`update` over the step's ``ScheduledRequest``s).
        """
        row_of = self.row_of
        try:
            rows = list(map(row_of.__getitem__, req_ids))
        except KeyError:
            return None
        nblk = self.num_blocks
        for rid, ids in new_block_ids.items():
            row = row_of[rid]
            n, k = len(ids), nblk[row]
            if n > k:
                if n > self.block_table.shape[1]:
                    self._grow_cols(n)
                self.block_table[row, k:n] = ids[k:]
                nblk[row] = n
            elif n < k:  # never from the Scheduler (tables only grow); rewrite the row
                self.block_table[row, :k] = 0
                self.block_table[row, :n] = ids
                nblk[row] = n
        return np.array(rows, dtype=np.int64), max(map(nblk.__getitem__, rows))

    def block_tables(self, rows: np.ndarray, width: int) -> np.ndarray:
        """int64 ``[len(rows), width]``: the rows' block tables, zero-padded (a copy)."""
        if width > self.block_table.shape[1]:
            self._grow_cols(width)
        return self.block_table[rows, :width]

    # ------------------------------------------------------------------ sampling
    def sampling_metadata(self, rows: np.ndarray,
                          device: torch.device | str = "cpu") -> Optional[SamplingMetadata]:
        """The sampler's metadata for ``rows`` (row i of the logits = ``rows[i]``), or None
        when some row is not simple (then use ``SamplingMetadata.from_requests``).

        Equal, tensor for tensor, to ``SamplingMetadata.from_requests`` over the same requests
        (``output_token_ids`` holds one shared empty list per row).
        """
        if not self.simple[rows].all():
            return None
        n = len(rows)
        device = torch.device(device)
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())
        temperature = torch.from_numpy(self.temperature[rows]).to(device)
        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = torch.from_numpy(greedy).to(device)
        top_k = top_p = min_p = None
        gens: dict[int, torch.Generator] = {}
        if not all_greedy:
            if self.uses_top_k[rows].any():
                top_k = torch.from_numpy(self.top_k[rows]).to(device)
            if self.uses_top_p[rows].any():
                top_p = torch.from_numpy(self.top_p[rows]).to(device)
            if self.uses_min_p[rows].any():
                min_p = torch.from_numpy(self.min_p[rows]).to(device)
            seeded = np.flatnonzero(self.seeded[rows])
            gens = {int(i): self.generators[rows[i]] for i in seeded}
        lp = self.num_logprobs[rows]
        max_lp = int(lp.max()) if n else -1
        if max_lp >= 0:
            num_logprobs: list[Optional[int]] = [None if v < 0 else v for v in lp.tolist()]
            max_num_logprobs: Optional[int] = max_lp
        else:
            num_logprobs, max_num_logprobs = [None] * n, None
        return SamplingMetadata(
            temperature=temperature, all_greedy=all_greedy, all_random=all_random,
            greedy_mask=greedy_mask, top_k=top_k, top_p=top_p, min_p=min_p, generators=gens,
            num_logprobs=num_logprobs, max_num_logprobs=max_num_logprobs, no_penalties=True,
            presence_penalties=None, frequency_penalties=None, repetition_penalties=None,
            prompt_token_ids=None, output_token_ids=[_NO_TOKENS] * n,
            allowed_token_ids_mask=None, vocab_size=self.vocab_size,
        )

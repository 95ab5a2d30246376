"""M-RoPE positions (Qwen2-VL / Qwen2.5-VL): the model runner's ``[3, T]`` rotary positions
(temporal, height, width rows) of a step's tokens, from each request's image features.

As transformers' ``Qwen2_5_VLModel.get_rope_index``: text before the first image sits at its prompt
position in all three rows; an image run of a ``(t, h, w)`` patch grid (``h' = h / merge``,
``w' = w / merge`` image tokens a side, in row-major order) starting at prompt position ``o`` with
the running offset ``delta`` (0 before the first image) gives token ``k`` the rows
``(base + k // (h' w'), base + (k // w') % h', base + k % w')``, ``base = o + delta``; the text after
the run continues at ``base + max(h', w')``, i.e. ``delta += max(h', w') - t h' w'``. Every later
token (the rest of the prompt, decode steps, the outputs a preempted request recomputes) is
``p + delta`` in all rows.

The positions depend only on the prompt (its image offsets and grids), never on how it is chunked
or which blocks come from the prefix cache; each request's final ``delta`` is kept here from its
prompt chunks (where ``ScheduledRequest.mm_features`` is set) for its decode steps, and dropped when
the request finishes. Bound: one int per unfinished request.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


def mrope_rows(pos: np.ndarray, features: list, merge: int) -> tuple[np.ndarray, int]:
    """``([3, n] int64 M-RoPE positions of prompt positions pos [n], the prompt's final delta)``.

    Args:
        pos: int64 ``[n]`` positions (any order, any subset of the sequence).
        features: the prompt's ``MultiModalFeature`` list; those with a ``grid_thw`` shape the rows.
        merge: the vision tower's ``spatial_merge_size``.

    Raises:
        ValueError: a feature's length is not ``t * h * w / merge**2``.
    """
    out = np.broadcast_to(pos, (3, pos.shape[0])).copy()
    delta = 0
    for f in sorted((f for f in features if getattr(f, "grid_thw", None) is not None), key=lambda f: f.offset):
        t, h, w = f.grid_thw
        gh, gw = h // merge, w // merge
        if t * gh * gw != f.length:
            raise ValueError(f"image grid {f.grid_thw} (merge {merge}) does not give its {f.length} placeholder tokens")
        end = f.offset + f.length
        base = f.offset + delta
        img = (pos >= f.offset) & (pos < end)
        if img.any():
            k = pos[img] - f.offset
            out[0, img] = base + k // (gh * gw)
            out[1, img] = base + (k // gw) % gh
            out[2, img] = base + k % gw
        delta = base + max(gh, gw) - end
        after = pos >= end
        out[:, after] = pos[after] + delta
    return out, delta


class MRopePositions:
    """The model runner's M-RoPE state: ``positions(reqs, positions, qsl) -> [3, T]``.

    Args:
        merge: the model's ``spatial_merge_size``.
    """

    def __init__(self, merge: int) -> None:
        self.merge = int(merge)
        self.deltas: dict[str, int] = {}  # req id -> the delta of its text after the last image

    def positions(self, reqs: list[Any], positions: torch.Tensor, qsl: np.ndarray) -> torch.Tensor:
        """int64 ``[3, T]`` (CPU) for the step's flat ``positions`` int64 ``[T]``; request ``i``'s
        tokens are rows ``qsl[i] .. qsl[i + 1] - 1`` (draft tokens included)."""
        pos = positions.numpy()
        out = np.broadcast_to(pos, (3, pos.shape[0])).copy()
        for i, r in enumerate(reqs):
            a, b = int(qsl[i]), int(qsl[i + 1])
            if r.mm_features:
                rows, delta = mrope_rows(pos[a:b], r.mm_features, self.merge)
                out[:, a:b] = rows
                if delta:
                    self.deltas[r.req_id] = delta
                continue
            d = self.deltas.get(r.req_id)
            if d:
                out[:, a:b] += d
        return torch.from_numpy(out)

    def release(self, req_id: str) -> None:
        """Forget a finished (or aborted) request."""
        self.deltas.pop(req_id, None)

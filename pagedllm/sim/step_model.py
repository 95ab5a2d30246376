"""The simulator's step-time model: what one engine step costs, from the shape of its batch.

``seconds = a + b * prefill_tokens + c * decode_rows + d * decode_context_k + e * prefill_attention_kpairs
+ f * [prefill_tokens > 0]`` where, over the step's scheduled requests (``ScheduledRequest``):

- ``prefill_tokens``: tokens of chunks that are not a plain decode (``num_tokens > 1`` or still
  inside the prompt);
- ``decode_rows``: one-token chunks past the prompt;
- ``decode_context_k``: the context (KV tokens read) of those decode rows, in thousands of tokens;
- ``prefill_attention_kpairs``: query x key pairs the prefill chunks' attention computes, in
  thousands: a chunk of ``n`` tokens starting at position ``s`` computes ``n * s + n * (n + 1) / 2``;
- ``[prefill_tokens > 0]``: 1 for a step with any prefill chunk (on CPU such a step takes other
  kernel paths than a pure decode step, at a fixed extra cost), else 0.

The coefficients are fitted (least squares, clipped at 0) by ``pagedllm simulate fit`` from steps of
the real engine; the JSON file also records the engine settings the fit ran with (``num_blocks``,
``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``), the simulator's
defaults for a replica.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence


#: The coefficient fields, in the order of ``step_features``' columns (after the constant).
COEFFICIENTS = ("a", "b_prefill_token", "c_decode_row", "d_decode_context_ktoken", "e_prefill_attention_kpair",
                "f_prefill_step")


@dataclass
class StepModel:
    """Step cost coefficients (seconds; see the module docstring) and the fit's engine settings."""

    a: float = 0.002
    b_prefill_token: float = 2.0e-5
    c_decode_row: float = 2.0e-4
    d_decode_context_ktoken: float = 1.0e-4
    e_prefill_attention_kpair: float = 1.0e-6
    f_prefill_step: float = 0.0
    engine: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def cost(self, prefill_tokens: int, decode_rows: int, decode_context_k: float,
             prefill_attention_kpairs: float) -> float:
        """Seconds for one step of that shape (>= ``a``)."""
        t = (self.a + self.b_prefill_token * prefill_tokens + self.c_decode_row * decode_rows
             + self.d_decode_context_ktoken * decode_context_k
             + self.e_prefill_attention_kpair * prefill_attention_kpairs)
        return t + self.f_prefill_step if prefill_tokens else t

    def step_seconds(self, scheduled: Iterable[Any]) -> float:
        """Seconds for the step that computes ``scheduled`` (a ``SchedulerOutput.scheduled``
        list): ``cost(*step_features(scheduled))``."""
        return self.cost(*step_features(scheduled))

    def decode_seconds(self, rows: int, context_tokens: int) -> float:
        """Seconds for a step of ``rows`` plain decodes whose contexts sum to ``context_tokens``
        (the same value as ``step_seconds`` of those rows)."""
        return self.cost(0, rows, float(context_tokens) / 1000.0, 0.0)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, where: str = "--step-model") -> "StepModel":
        """Build from a decoded JSON object; ValueError naming the field when malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        kw: dict[str, Any] = {}
        for name in COEFFICIENTS:
            v = d.get(name, 0.0 if name == "f_prefill_step" else None)  # (added later: optional)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{where}: {name}: expected a number >= 0, got {v!r}")
            kw[name] = float(v)
        for name in ("engine", "meta"):
            v = d.get(name, {})
            if not isinstance(v, dict):
                raise ValueError(f"{where}: {name}: expected an object")
            kw[name] = v
        return cls(**kw)

    @classmethod
    def load(cls, path: str) -> "StepModel":
        """Read a step-model JSON file (``pagedllm simulate fit --output``); ValueError if unreadable."""
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--step-model: cannot read {path}: {e}") from None
        return cls.from_json(d, f"--step-model {path}")


def step_features(scheduled: Iterable[Any]) -> tuple[int, int, float, float]:
    """``(prefill_tokens, decode_rows, decode_context_k, prefill_attention_kpairs)`` of a step's
    ``ScheduledRequest`` list (module docstring)."""
    prefill = rows = 0
    ctx = pairs = 0.0
    for sr in scheduled:
        n = sr.num_tokens
        s = sr.start_pos
        if n == 1 and s >= sr.prompt_len:
            rows += 1
            ctx += s + 1
        else:
            prefill += n
            pairs += n * s + n * (n + 1) / 2
    return prefill, rows, ctx / 1000.0, pairs / 1000.0


def fit_step_model(samples: Sequence[tuple[int, int, float, float, float]], **extra: dict) -> StepModel:
    """Least-squares fit of ``(*step_features, seconds)`` samples (the last coefficient's column,
    ``[prefill_tokens > 0]``, is derived).

    Coefficients are fitted relative to the step time (weights ``1/seconds``: every step counts in
    relative error, so short decode steps are not drowned by long prefills); a negative coefficient
    is dropped (set to 0) and the rest refitted. Raises ValueError with fewer than 4 samples.
    """
    import numpy as np

    k = len(COEFFICIENTS)
    if len(samples) < k:
        raise ValueError(f"fit: need at least {k} steps, got {len(samples)}")
    arr = np.asarray(samples, dtype=np.float64)
    X = np.column_stack([np.ones(len(arr))] + [arr[:, j] for j in range(4)] + [(arr[:, 0] > 0).astype(np.float64)])
    y = arr[:, 4]
    w = 1.0 / np.maximum(y, 1e-6)
    active = list(range(k))
    coef = np.zeros(k)
    while True:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        neg = [active[i] for i, v in enumerate(sol) if v < 0]
        if not neg:
            coef[:] = 0
            coef[active] = sol
            break
        active = [j for j in active if j not in neg]
        if not active:
            break
    pred = X @ coef
    rel = np.abs(pred - y) / y
    model = StepModel(engine=dict(extra.get("engine", {})), meta=dict(extra.get("meta", {})))
    for name, c in zip(COEFFICIENTS, coef):
        setattr(model, name, float(c))
    model.meta.setdefault("fit", {}).update({
        "num_steps": int(len(arr)), "median_rel_error": float(np.median(rel)),
        "p90_rel_error": float(np.quantile(rel, 0.9))})
    return model

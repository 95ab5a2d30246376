"""Beam search (vLLM's ``vllm.beam_search`` shapes and its algorithm), shared by ``LLM.beam_search``
and the server's ``use_beam_search``.

Each step runs every live beam as a one-token request (``max_tokens=1``, ``logprobs=2 *
beam_width``: the most likely ``2 * beam_width`` next tokens with their raw logprobs, plus the
sampled one); every candidate ``beam + token`` scores ``cum_logprob + logprob``. A candidate
ending in EOS (unless ``ignore_eos``) joins the instance's finished beams; of the others the
``beam_width`` with the highest cumulative logprob continue. After ``max_tokens`` steps (or when no
beam is left) finished and live beams are ranked by ``get_beam_search_score`` and the best
``beam_width`` are returned.

Prompt blocks are shared across beams by the engine's prefix caching: each step's request of a
beam is its whole sequence, whose full KV blocks (the prompt's, and the generated ones the beams
share) are prefix-cache hits; only the last partial block (fewer than ``block_size`` tokens) and
the new token are computed again per beam. There is no copy-on-write of a partial block (the KV
manager's blocks are immutable once hashed): this is vLLM's design as well.

Versus ``transformers``' ``generate(num_beams=...)``: the live beams of a step are the same (both
keep the ``beam_width`` best non-EOS continuations by cumulative logprob), so with ``ignore_eos``
and a fixed ``max_tokens`` the returned sequences and their cumulative logprobs agree (ranking
among equal lengths does not depend on the length penalty). With EOS they differ by design:
vLLM (and this) keep every EOS candidate among each beam's top ``2 * beam_width`` as finished and
run until ``max_tokens``, dividing by the whole length (prompt included, EOS not); transformers
keeps only ``num_beams`` finished hypotheses, accepts an EOS only when it ranks in the top
``num_beams`` of the step, divides by the generated length (EOS included) and stops per
``early_stopping``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (prompt included) and per generated position the candidates'
    logprobs (``{token_id: Logprob}``, vLLM's shape).

    Attributes:
        orig_prompt: the prompt as given to the engine (``{"prompt_token_ids": [...],
            "prompt": text or None}``).
        tokens: prompt + generated token ids (a finished beam ends with EOS offline).
        logprobs: one ``{token_id: Logprob}`` per generated token.
        lora_request: the LoRA adapter the beam runs with, or None.
        cum_logprob: sum of the generated tokens' logprobs (natural log).
        text: filled when returned: ``tokenizer.decode(tokens)`` (offline: prompt included).
        finish_reason: "stop" (EOS) or "length", set when returned.
        stop_reason: the EOS id for a beam that ended with it, else None.
    """

    orig_prompt: dict
    tokens: list[int]
    logprobs: list[dict]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None

    def get_prompt(self) -> dict:
        """The TokensPrompt of this beam's next step (its whole sequence)."""
        return {"prompt_token_ids": list(self.tokens), "prompt": self.orig_prompt.get("prompt")}


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The live (``beams``) and finished (``completed``) beams of one prompt."""

    def __init__(self, prompt: dict, lora_request: Any = None, logprobs: Optional[list] = None,
                 max_new_tokens: Optional[int] = None, **kwargs: Any) -> None:
        self.prompt_len = len(prompt["prompt_token_ids"])
        self.max_new_tokens = max_new_tokens
        self.beams: list[BeamSearchSequence] = [BeamSearchSequence(
            orig_prompt=prompt, tokens=list(prompt["prompt_token_ids"]),
            logprobs=[] if logprobs is None else list(logprobs), lora_request=lora_request, **kwargs)]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: Optional[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's (and transformers' original) beam score: ``cumulative_logprob / L ** length_penalty``
    with ``L = len(tokens)`` (prompt included), one less when the last token is EOS."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_id: Optional[int], length_penalty: float) -> Callable:
    """``key(beam) -> get_beam_search_score(...)`` for sorting beams, best last (use reverse)."""
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)
    return sort_beams_key


class BeamSearch:
    """One beam search over several prompts, stepped by the caller.

    ``pending()`` lists the beams to extend this step (submit each as ``beam.get_prompt()``
    with ``step_params()``); ``update(results)`` takes each one's ``{token_id: Logprob}`` of the
    new position (None: the engine returned none, e.g. the request was aborted: the beam is
    dropped); ``finished`` when no beam is left or every instance made its ``max_new_tokens``.

    Args:
        instances: one ``BeamSearchInstance`` per prompt (``max_new_tokens`` set).
        params: ``BeamSearchParams``.
        eos_token_id: the tokenizer's EOS id (None: no beam ends early).
        online: the server's variant (vLLM's online path): a finished beam's ``tokens`` leave
            out the EOS unless ``include_stop_str_in_output``.
    """

    def __init__(self, instances: list[BeamSearchInstance], params: Any, eos_token_id: Optional[int],
                 online: bool = False) -> None:
        self.instances = instances
        self.params = params
        self.eos_token_id = eos_token_id
        self.online = online
        self.sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
        self.steps = 0
        self._pending: list[tuple[BeamSearchInstance, BeamSearchSequence]] = []

    def step_params(self) -> Any:
        """The SamplingParams of every step request: one token, ``2 * beam_width`` logprobs."""
        from pagedllm.sampling_params import SamplingParams

        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width,
                              temperature=self.params.temperature, detokenize=False)

    def pending(self) -> list[BeamSearchSequence]:
        """The beams to extend in this step (empty when finished)."""
        self._pending = [(inst, b) for inst in self.instances
                         if inst.max_new_tokens is None or self.steps < inst.max_new_tokens
                         for b in inst.beams]
        return [b for _, b in self._pending]

    @property
    def finished(self) -> bool:
        return not any(inst.beams and (inst.max_new_tokens is None or self.steps < inst.max_new_tokens)
                       for inst in self.instances)

    def update(self, results: list[Optional[dict]]) -> None:
        """Extend the ``pending()`` beams with their step results (same order)."""
        pending, self._pending = self._pending, []
        if len(results) != len(pending):
            raise ValueError(f"beam search: {len(results)} results for {len(pending)} beams")
        bw, eos, p = self.params.beam_width, self.eos_token_id, self.params
        new: dict[int, list[BeamSearchSequence]] = {}
        for (inst, beam), lps in zip(pending, results):
            cands = new.setdefault(id(inst), [])
            if lps is None:
                continue
            for tok, lp in lps.items():
                tok = int(tok)
                cum = beam.cum_logprob + float(getattr(lp, "logprob", lp))
                if tok == eos and not p.ignore_eos:
                    keep_eos = not self.online or p.include_stop_str_in_output
                    inst.completed.append(BeamSearchSequence(
                        orig_prompt=beam.orig_prompt, tokens=beam.tokens + [tok] if keep_eos else list(beam.tokens),
                        logprobs=beam.logprobs + [lps], lora_request=beam.lora_request, cum_logprob=cum,
                        finish_reason="stop", stop_reason=tok))
                else:
                    cands.append(BeamSearchSequence(
                        orig_prompt=beam.orig_prompt, tokens=beam.tokens + [tok], logprobs=beam.logprobs + [lps],
                        lora_request=beam.lora_request, cum_logprob=cum))
        for inst in self.instances:
            if id(inst) in new:
                # NOTE: equal lengths: the length-penalised key orders like the cumulative logprob
                inst.beams = sorted(new[id(inst)], key=self.sort_key, reverse=True)[:bw]
        self.steps += 1

    def best(self, inst: BeamSearchInstance) -> list[BeamSearchSequence]:
        """The instance's best ``beam_width`` sequences (finished and live), best first; live ones
        get ``finish_reason`` "length"."""
        for b in inst.beams:
            b.finish_reason = b.finish_reason or "length"
        return sorted(inst.completed + inst.beams, key=self.sort_key, reverse=True)[:self.params.beam_width]


def beam_width_error(params: Any, max_logprobs: int) -> Optional[str]:
    """The message for a beam width whose ``2 * beam_width`` candidates exceed the engine's
    ``max_logprobs``, else None."""
    if 2 * params.beam_width > max_logprobs:
        return (f"beam_width: {params.beam_width} needs {2 * params.beam_width} candidate logprobs per "
                f"step, more than max_logprobs {max_logprobs}; use beam_width <= {max_logprobs // 2} "
                f"or raise --max-logprobs")
    return None

"""A new speculative proposer is one class plus a registration: a test-only "repeat the last
token" proposer registered under a test name runs through ``LLM(speculative_config=...)``,
drafts are verified by the target, and greedy outputs equal the non-speculative engine's."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposal, ProposeBatch, Proposer
from pagedllm.spec_decode.registry import _REGISTRY, ProposerContext, register_proposer, registered_proposers

from spec_helpers import tiny_prompts

NAME = "test-repeat-last"
KW = dict(dtype="float32", seed=0, max_model_len=256, num_threads=1)


class RepeatLastProposer(Proposer):
    """Drafts ``k`` copies of each request's last emitted token (capped by ``max_drafts``)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0
        self.removed: set[str] = set()

    def propose(self, batch: ProposeBatch) -> Proposal:
        self.calls += 1
        out = Proposal()
        for r in batch.reqs:
            new = batch.sampled.get(r.req_id)
            if new and r.req_id in batch.want:
                n = min(self.k, batch.max_drafts.get(r.req_id, self.k))
                if n > 0:
                    out.token_ids[r.req_id] = [new[-1]] * n
        return out

    def remove(self, req_id: str, finished: bool = True) -> None:
        self.removed.add(req_id)


BUILT: list[RepeatLastProposer] = []


@pytest.fixture(scope="module")
def registered():
    @register_proposer(NAME)
    def build(cfg: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
        p = RepeatLastProposer(cfg.num_speculative_tokens)
        BUILT.append(p)
        return p
    yield NAME
    del _REGISTRY[NAME]


def test_registered_name_is_validated_like_a_builtin(registered):
    assert NAME in registered_proposers()
    cfg = SpeculativeConfig.from_any({"method": NAME, "num_speculative_tokens": 3})
    assert cfg.method == NAME and not cfg.uses_model and cfg.num_lookahead_tokens == 0
    with pytest.raises(ValueError, match="num_speculative_tokens: required"):
        SpeculativeConfig.from_any({"method": NAME})
    with pytest.raises(ValueError, match=f"must be one of .*{NAME}"):
        SpeculativeConfig.from_any({"method": "no-such-method", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="already registered"):
        register_proposer(NAME)(lambda cfg, ctx: None)


def test_custom_proposer_runs_through_the_engine(registered, tiny_llama_dir):
    prompts = tiny_prompts(6, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = LLM(tiny_llama_dir, **KW).generate(prompts, sp, use_tqdm=False)
    llm = LLM(tiny_llama_dir, speculative_config={"method": NAME, "num_speculative_tokens": 3,
                                                   "disable_by_batch_size": 0}, **KW)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= st.num_drafts
    assert st.num_accepted_tokens <= st.num_draft_tokens
    prop = BUILT[-1]
    # Finished requests leave the worker's batch at the next step (the last one stays until then).
    assert prop.calls > 0 and len(prop.removed) >= len(prompts) - 1

"""Jump-forward on the real SmolLM2 (``batch_invariant=True``: a row's logits do not depend on how
many rows a step verifies): greedy outputs identical with jump-forward on and off over fixed keys,
enums, nested objects, arrays and a named tool call, in fewer engine steps."""
from __future__ import annotations

import json

import pytest

from test_jump_forward import constraints, run

pytestmark = pytest.mark.slow


def test_greedy_identical_on_and_off_smollm2():
    from pagedllm import LLM, SamplingParams
    llm = LLM("SmolLM2-135M-Instruct", batch_invariant=True, seed=0, max_num_batched_tokens=512,
              kv_cache_memory=128 * 1024**2)
    tok = llm.get_tokenizer()
    cons = constraints()
    names = ["fixed_keys", "nested_enum", "array", "tool_call"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Give an example as JSON ({n})."}],
                                       tokenize=False, add_generation_prompt=True) for n in names]
    params = [SamplingParams(temperature=0.0, max_tokens=72, structured_outputs=cons[n]) for n in names]
    on, steps_on, c = run(llm, prompts, params, True)
    off, steps_off, _ = run(llm, prompts, params, False)
    assert on == off
    assert c["jump_forward_num_accepted_tokens"] > 0 and steps_on < steps_off
    for ids, p in zip(on, params):
        if len(ids) < p.max_tokens:
            json.loads(tok.decode(ids, skip_special_tokens=True))  # finished: valid JSON

import random

import pytest

from core_helpers import PP, FakeRunner, make_req, make_sched, run_to_completion, step
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput


def sched_map(out):
    return {s.req_id: s for s in out.scheduled}


def test_single_request_prefill_then_decode():
    s = make_sched()
    r = make_req("a", 10, max_tokens=3)
    s.add_request(r)
    runner = FakeRunner(next_token=7)
    out, outs = step(s, runner)
    sr = out.scheduled[0]
    assert (sr.start_pos, sr.num_tokens, sr.is_last_chunk, sr.is_new) == (0, 10, True, True)
    assert sr.token_ids is r.all_token_ids  # by reference
    assert sr.block_ids == [1, 2, 3] and sr.prompt_len == 10
    assert outs[0].new_token_ids == [7] and outs[0].finish_reason is None
    assert outs[0].new_logprobs == [([7], [-0.5], 1)]
    out, outs = step(s, runner)
    sr = out.scheduled[0]
    assert (sr.start_pos, sr.num_tokens, sr.is_new) == (10, 1, False)
    out, outs = step(s, runner)
    assert outs[0].finish_reason == "length"
    assert r.output_token_ids == [7, 7, 7]
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 63
    out = s.schedule()
    assert out.is_empty and out.finished_req_ids == {"a"}
    assert s.schedule().finished_req_ids == set()


def test_chunked_prefill_alone():
    s = make_sched(max_num_batched_tokens=32, max_model_len=200)
    s.add_request(make_req("p", 100, max_tokens=1))
    runner = FakeRunner()
    run_to_completion(s, runner)
    assert runner.chunks["p"] == [(0, 32), (32, 32), (64, 32), (96, 4)]


def test_chunked_prefill_shares_budget_with_decode():
    s = make_sched(max_num_batched_tokens=33, max_model_len=200)
    d = make_req("d", 5, max_tokens=50)
    s.add_request(d)
    runner = FakeRunner()
    step(s, runner)  # d prefilled
    s.add_request(make_req("p", 100, max_tokens=1))
    for _ in range(4):
        out, _ = step(s, runner)
        m = sched_map(out)
        assert m["d"].num_tokens == 1
        assert out.total_num_scheduled_tokens <= 33
    assert runner.chunks["p"] == [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert [sr.is_last_chunk for o in runner.history[1:5] for sr in o.scheduled
            if sr.req_id == "p"] == [False, False, False, True]
    # Only the last chunk sampled a token (p had max_tokens=1 and is done).
    assert "p" not in s.requests
    assert d.num_output_tokens == 5


def test_budget_limits_decodes_and_admissions():
    s = make_sched(max_num_batched_tokens=3, max_num_seqs=8)
    for i in range(5):
        s.add_request(make_req(f"r{i}", 2, max_tokens=4))
    runner = FakeRunner()
    out, _ = step(s, runner)
    # r0 (2 tokens) + 1-token first chunk of r1
    assert [(x.req_id, x.num_tokens) for x in out.scheduled] == [("r0", 2), ("r1", 1)]
    run_to_completion(s, runner)
    for o in runner.history:
        assert o.total_num_scheduled_tokens <= 3


def test_long_prefill_token_threshold():
    s = make_sched(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    s.add_request(make_req("a", 20, max_tokens=1))
    s.add_request(make_req("b", 4, max_tokens=1))
    runner = FakeRunner()
    out, _ = step(s, runner)
    assert [(x.req_id, x.num_tokens) for x in out.scheduled] == [("a", 8), ("b", 4)]
    run_to_completion(s, runner)
    assert runner.chunks["a"] == [(0, 8), (8, 8), (16, 4)]


def test_max_num_seqs_respected():
    s = make_sched(max_num_seqs=2)
    for i in range(5):
        s.add_request(make_req(f"r{i}", 3, max_tokens=2 + i))
    runner = FakeRunner()
    out, _ = step(s, runner)
    assert [x.req_id for x in out.scheduled] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 3
    while s.has_unfinished_requests():
        out, _ = step(s, runner)
        assert len(out.scheduled) <= 2 and s.num_running <= 2
    assert s.get_num_unfinished_requests() == 0


def test_preemption_newest_first_and_recompute():
    # 4 usable blocks of 4 tokens, no prefix caching: resumed requests recompute all.
    s = make_sched(num_blocks=5, block_size=4, max_model_len=16, enable_caching=False)
    a = make_req("a", 7, max_tokens=4)
    b = make_req("b", 7, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner(tokens={"b": [21, 22, 23, 24]})
    step(s, runner)  # both prefilled: 2 blocks each
    step(s, runner)  # both decode in block 2
    assert s.kv_cache_manager.num_free_blocks == 0
    out, _ = step(s, runner)  # a needs a 3rd block -> b (newest) preempted
    assert out.preempted_req_ids == {"b"}
    assert [x.req_id for x in out.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [21, 22] and s.num_preemptions_total == 1
    assert list(s.waiting) == [b]
    assert s.kv_cache_manager.get_block_ids("b") == []
    run_to_completion(s, runner)
    # b resumed with is_new and recomputed prompt + its 2 outputs in one chunk.
    resumed = [sr for o in runner.history[3:] for sr in o.scheduled if sr.req_id == "b"][0]
    assert (resumed.start_pos, resumed.num_tokens, resumed.is_new) == (0, 9, True)
    assert resumed.token_ids[7:9] == [21, 22]  # token_ids is a live reference
    assert b.output_token_ids == [21, 22, 23, 24]
    assert b.num_preemptions == 1 and b.num_cached_tokens == 0


def test_preemption_with_prefix_cache_rehits_own_blocks():
    s = make_sched(num_blocks=5, block_size=4, max_model_len=16)
    a = make_req("a", 7, max_tokens=4)
    b = Request("b", list(range(500, 507)), a.sampling_params)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner()
    for _ in range(3):
        step(s, runner)
    assert s.num_preemptions_total == 1
    run_to_completion(s, runner)
    resumed = [sr for o in runner.history[3:] for sr in o.scheduled if sr.req_id == "b"][0]
    # b's first (full, cached) block survived: only tokens 4..8 recomputed.
    assert (resumed.start_pos, resumed.num_tokens) == (4, 5)
    # Stats count first admissions only.
    assert s.prefix_cache_queries == 14 and s.prefix_cache_hits == 0


def test_preemption_order_three_requests():
    # 6 usable blocks; three 8-token prompts (2 blocks each) fill the pool.
    s = make_sched(num_blocks=7, block_size=4, max_model_len=24, enable_caching=False)
    reqs = [make_req(f"r{i}", 8, max_tokens=10) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    runner = FakeRunner()
    step(s, runner)
    # r0 needs a 3rd block -> r2 (newest) preempted, freeing 2: r0 and r1 take one each.
    out, _ = step(s, runner)
    assert out.preempted_req_ids == {"r2"}
    assert [x.req_id for x in out.scheduled] == ["r0", "r1"]
    for _ in range(3):
        step(s, runner)  # tokens 10..12 fit in block 3
    out, _ = step(s, runner)  # r0 needs block 4 -> preempt r1 (newest running)
    assert out.preempted_req_ids == {"r1"}
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]  # front of the queue
    run_to_completion(s, runner)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == 10 for r in reqs)


def test_request_preempts_itself():
    s = make_sched(num_blocks=5, block_size=4, max_model_len=16, enable_caching=False)
    a = make_req("a", 6, max_tokens=8)
    b = make_req("b", 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner()
    step(s, runner)
    out, _ = step(s, runner)  # a fits; b (last) needs a 3rd block and is itself preempted
    assert [x.req_id for x in out.scheduled] == ["a"]
    assert out.preempted_req_ids == {"b"}
    run_to_completion(s, runner)
    assert b.num_output_tokens == 8


def test_prefix_hit_same_step_and_counts():
    s = make_sched(block_size=4)
    prompt = list(range(10))
    s.add_request(Request("a", prompt, make_req("x", 1, max_tokens=2).sampling_params))
    s.add_request(Request("b", prompt, make_req("x", 1, max_tokens=2).sampling_params))
    runner = FakeRunner()
    out, outs = step(s, runner)
    m = sched_map(out)
    assert (m["a"].start_pos, m["a"].num_tokens) == (0, 10)
    assert (m["b"].start_pos, m["b"].num_tokens) == (8, 2)
    assert m["b"].block_ids[:2] == m["a"].block_ids[:2]
    assert {o.req_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 8}
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 8)
    run_to_completion(s, runner)
    # Same prompt again, block-aligned prefix of 8 + 2: all full blocks hit.
    s.add_request(Request("c", prompt, make_req("x", 1, max_tokens=1).sampling_params))
    out, outs = step(s, runner)
    assert (out.scheduled[0].start_pos, out.scheduled[0].num_tokens) == (8, 2)
    # Block-aligned prompt fully cached: last block recomputed.
    s.add_request(Request("d", prompt[:8], make_req("x", 1, max_tokens=1).sampling_params))
    out, outs = step(s, runner)
    assert (out.scheduled[0].start_pos, out.scheduled[0].num_tokens) == (4, 4)
    assert outs[0].num_cached_tokens == 4


def test_generated_blocks_are_cached_for_followups():
    # A multi-turn follow-up whose prompt = old prompt + old output hits the output blocks.
    s = make_sched(block_size=4)
    runner = FakeRunner(tokens={"a": [50, 51, 52, 53, 54, 55]})
    s.add_request(Request("a", list(range(6)), make_req("x", 1, max_tokens=6).sampling_params))
    run_to_completion(s, runner)
    a_all = list(range(6)) + [50, 51, 52, 53, 54, 55]
    s.add_request(Request("b", a_all + [9], make_req("x", 1, max_tokens=1).sampling_params))
    out, _ = step(s, runner)
    # 12 tokens of a: blocks 0..1 full and cached (block 2 = tokens 8..11, last token 55
    # was sampled, never computed, so not cached).
    assert out.scheduled[0].start_pos == 8


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_salt_isolation_and_algos(algo):
    s = make_sched(hash_algo=algo)
    prompt = list(range(9))
    runner = FakeRunner()
    sp = make_req("x", 1, max_tokens=1).sampling_params
    s.add_request(Request("a", prompt, sp, cache_salt="alice"))
    s.add_request(Request("b", prompt, sp, cache_salt="bob"))
    s.add_request(Request("c", prompt, sp))
    s.add_request(Request("d", prompt, sp, cache_salt="alice"))
    _, outs = step(s, runner)
    assert {o.req_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 0, "c": 0, "d": 8}


def test_stop_eos():
    s = make_sched()
    r = make_req("a", 3, max_tokens=10, eos=2)
    s.add_request(r)
    outs = run_to_completion(s, FakeRunner(tokens={"a": [5, 2, 6]}))
    assert r.output_token_ids == [5, 2]
    assert outs["a"][-1].finish_reason == "stop" and outs["a"][-1].stop_reason is None
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos():
    s = make_sched()
    r = make_req("a", 3, max_tokens=4, eos=2, ignore_eos=True)
    s.add_request(r)
    outs = run_to_completion(s, FakeRunner(next_token=2))
    assert r.output_token_ids == [2, 2, 2, 2]
    assert outs["a"][-1].finish_reason == "length"


def test_stop_token_ids_with_reason():
    s = make_sched()
    r = make_req("a", 3, max_tokens=10, eos=2, stop_token_ids=[8, 9])
    s.add_request(r)
    outs = run_to_completion(s, FakeRunner(tokens={"a": [5, 9, 6]}))
    assert r.output_token_ids == [5, 9]
    assert outs["a"][-1].finish_reason == "stop" and outs["a"][-1].stop_reason == 9


def test_min_tokens_gates_eos_and_stop_ids():
    s = make_sched()
    r = make_req("a", 3, max_tokens=10, eos=2, stop_token_ids=[9], min_tokens=3)
    s.add_request(r)
    outs = run_to_completion(s, FakeRunner(tokens={"a": [2, 9, 2, 5]}))
    # The 3rd output token may stop (num_output >= min_tokens).
    assert r.output_token_ids == [2, 9, 2]
    assert outs["a"][-1].finish_reason == "stop"


def test_max_model_len_stop():
    s = make_sched(max_model_len=12)
    r = make_req("a", 10, max_tokens=100)
    s.add_request(r)
    outs = run_to_completion(s, FakeRunner())
    assert r.num_tokens == 12 and r.num_output_tokens == 2
    assert outs["a"][-1].finish_reason == "length"


def test_max_tokens_none_runs_to_max_model_len():
    s = make_sched(max_model_len=8)
    r = make_req("a", 5, max_tokens=None)
    s.add_request(r)
    run_to_completion(s, FakeRunner())
    assert r.num_tokens == 8


def test_abort_waiting_running_and_in_flight():
    s = make_sched(max_num_seqs=1)
    a = make_req("a", 9, max_tokens=10)
    b = make_req("b", 9, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner()
    step(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 63 - 3
    s.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)  # waiting
    assert s.num_waiting == 0 and b.status == RequestStatus.FINISHED_ABORTED
    # In flight: scheduled, then aborted before the update.
    out = s.schedule()
    res = runner.execute(out)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 63
    assert s.update_from_output(out, res) == []
    assert a.num_output_tokens == 1
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # already finished: ignored
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished_requests()
    s.check_invariants()
    assert s.schedule().finished_req_ids == {"a"}


def test_finished_ids_reach_runner_once():
    s = make_sched()
    s.add_request(make_req("a", 3, max_tokens=1))
    s.add_request(make_req("b", 3, max_tokens=2))
    runner = FakeRunner()
    step(s, runner)
    out, _ = step(s, runner)
    assert out.finished_req_ids == {"a"}
    out = s.schedule()
    assert out.finished_req_ids == {"b"} and out.is_empty


def test_pooling_request_prefill_only():
    s = make_sched(max_num_batched_tokens=8)
    p = Request("p", list(range(20)), None, pooling_params=PP())
    s.add_request(p)
    outs = run_to_completion(s, FakeRunner())
    assert outs["p"][-1].finish_reason == "stop" and outs["p"][-1].pooled == ("pooled", "p")
    assert p.output_token_ids == [] and len(outs["p"]) == 1
    assert not s.kv_cache_manager.block_pool.cached_block_hash_to_block


def test_no_tokens_no_output():
    s = make_sched(max_num_batched_tokens=4)
    s.add_request(make_req("a", 10))
    out = s.schedule()
    assert s.update_from_output(out, ModelRunnerOutput()) == []


def test_prompt_logprobs_chunks_reported():
    s = make_sched(max_num_batched_tokens=4)
    s.add_request(make_req("a", 6, max_tokens=1, prompt_logprobs=1))
    out = s.schedule()
    res = ModelRunnerOutput(prompt_logprobs={"a": [None, "lp1", "lp2", "lp3"]})
    outs = s.update_from_output(out, res)
    assert outs[0].new_prompt_logprobs == [None, "lp1", "lp2", "lp3"] and outs[0].new_token_ids == []


def test_duplicate_request_id():
    s = make_sched()
    s.add_request(make_req("a", 3))
    with pytest.raises(ValueError):
        s.add_request(make_req("a", 3))


@pytest.mark.parametrize("seed", range(4))
def test_random_stress_invariants(seed):
    rng = random.Random(seed)
    s = make_sched(num_blocks=24, block_size=4, max_num_seqs=rng.choice([2, 4, 8]),
                   max_num_batched_tokens=rng.choice([8, 16, 40]), max_model_len=64,
                   long_prefill_token_threshold=rng.choice([0, 12]))
    runner = FakeRunner(next_token=3)
    shared = [rng.randrange(100) for _ in range(16)]
    reqs = []
    n = 0
    for _ in range(300):
        if n < 40 and rng.random() < 0.3:
            prompt = shared[:rng.randrange(0, 16)] + [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
            r = make_req(f"r{n}", prompt, max_tokens=rng.randrange(1, 20), eos=rng.choice([None, 3]),
                         salt=rng.choice([None, None, "s"]))
            if rng.random() < 0.1:
                r = Request(f"r{n}", prompt, None, pooling_params=PP())
            s.add_request(r)
            reqs.append(r)
            n += 1
        if reqs and rng.random() < 0.05:
            s.finish_requests([rng.choice(reqs).request_id], RequestStatus.FINISHED_ABORTED)
        out, _ = step(s, runner)
        for sr in out.scheduled:
            assert sr.start_pos + sr.num_tokens <= len(sr.token_ids)
            assert len(sr.block_ids) * 4 >= sr.start_pos + sr.num_tokens
    run_to_completion(s, runner)
    assert all(r.is_finished() for r in reqs)
    assert s.kv_cache_manager.num_free_blocks == 23

"""LoRA in the core (pure Python): the running set never holds more than ``max_loras`` distinct
adapters (a waiting request of another adapter waits, later ones go ahead), prefix-cache hashes
separate adapters, preemption keeps the adapter, and the wire codec carries it."""
from __future__ import annotations

from dataclasses import dataclass

from core_helpers import FakeRunner, make_req, make_sched, run_to_completion, step
from pagedllm.core.kv_cache_utils import get_hash_fn, hash_block_tokens, make_root_hash, update_block_hashes
from pagedllm.core.request import Request


@dataclass(eq=False)
class LR:
    """Stand-in for pagedllm.lora.LoRARequest (same field names)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


A, B, C = LR("a", 1), LR("b", 2), LR("c", 3)


def _req(rid, n, lora, **kw):
    r = make_req(rid, n, **kw)
    r.lora_request = lora
    return r


def test_waiting_request_of_a_third_adapter_waits_for_a_slot():
    sched = make_sched(max_loras=2)
    runner = FakeRunner()
    for rid, lora in [("r1", A), ("r2", B), ("r3", C), ("r4", A), ("r5", None)]:
        sched.add_request(_req(rid, 6, lora, max_tokens=3))
    out = step(sched, runner)[0]
    assert [s.req_id for s in out.scheduled] == ["r1", "r2", "r4", "r5"]  # r3 skipped, keeps its place
    assert [s.lora_request for s in out.scheduled] == [A, B, A, None]
    assert [r.request_id for r in sched.waiting] == ["r3"]
    assert sched.lora_adapter_names() == (["a", "b"], ["c"])
    seen = run_to_completion(sched, runner)
    assert "r3" in seen
    for so in runner.history:
        assert len({s.lora_request.lora_int_id for s in so.scheduled if s.lora_request}) <= 2


def test_no_limit_without_lora():
    sched = make_sched()  # max_loras 0: LoRA off, nothing skipped
    for rid, lora in [("r1", A), ("r2", B), ("r3", C)]:
        sched.add_request(_req(rid, 4, lora))
    assert len(step(sched, FakeRunner())[0].scheduled) == 3


def test_preempted_request_keeps_its_adapter():
    # 6 usable blocks of 4 tokens; two requests growing to 3 blocks each: one is preempted
    sched = make_sched(num_blocks=7, block_size=4, max_loras=2, max_num_batched_tokens=64, max_model_len=20)
    runner = FakeRunner()
    sched.add_request(_req("x", 8, A, max_tokens=12))
    sched.add_request(_req("y", 8, B, max_tokens=12))
    run_to_completion(sched, runner)
    assert sched.num_preemptions_total > 0
    for so in runner.history:
        for s in so.scheduled:
            assert s.lora_request is (A if s.req_id == "x" else B)


def test_block_hashes_separate_adapters_and_salts():
    fn = get_hash_fn("sha256")
    root = make_root_hash(fn, 0)
    toks = list(range(8))
    reqs = {"none": Request("n", toks), "a": Request("a", toks), "a2": Request("a2", toks),
            "b": Request("b", toks), "a_salt": Request("as", toks, cache_salt="s")}
    reqs["a"].lora_request = reqs["a2"].lora_request = reqs["a_salt"].lora_request = A
    reqs["b"].lora_request = B
    for r in reqs.values():
        update_block_hashes(r, 4, fn, root)
    assert reqs["a"].block_hashes == reqs["a2"].block_hashes
    firsts = {k: r.block_hashes[0] for k, r in reqs.items()}
    assert len(set(firsts.values())) == 4  # none, a, b, a + salt all differ
    assert firsts["a"] == hash_block_tokens(fn, root, toks[:4], (1,))
    assert firsts["a_salt"] == hash_block_tokens(fn, root, toks[:4], ("s", 1))
    assert firsts["none"] == hash_block_tokens(fn, root, toks[:4], None)
    # later blocks differ through the chain
    assert reqs["a"].block_hashes[1] != reqs["b"].block_hashes[1]


def test_prefix_cache_hits_only_within_one_adapter():
    sched = make_sched(max_loras=2)
    runner = FakeRunner()
    prompt = list(range(100, 117))  # 4 full blocks + 1 token
    for rid, lora in [("p1", A), ("p2", B), ("p3", A), ("p4", None)]:
        r = _req(rid, prompt, lora, max_tokens=1)
        sched.add_request(r)
        run_to_completion(sched, runner)
        hits = {"p1": 0, "p2": 0, "p3": 16, "p4": 0}[rid]
        assert r.num_cached_tokens == hits, (rid, r.num_cached_tokens)

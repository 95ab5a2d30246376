"""The SchedulerOutput wire form carries each request's LoRA adapter: sent once when the request
is new (or re-admitted after preemption), kept by the worker's mirror afterwards (no torch)."""
from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))
from core_helpers import make_req, make_sched  # noqa: E402

from pagedllm.core.sched_output import ModelRunnerOutput  # noqa: E402
from pagedllm.executor.sched_codec import SchedulerOutputDecoder, SchedulerOutputEncoder  # noqa: E402
from pagedllm.lora.request import LoRARequest  # noqa: E402


def test_adapter_travels_with_new_requests_and_stays_in_the_mirror():
    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    sched = make_sched(num_blocks=7, block_size=4, max_num_batched_tokens=64, max_model_len=20, max_loras=2)
    for rid, lora in [("x", a), ("y", b), ("z", None)]:
        r = make_req(rid, 5, max_tokens=10)
        r.lora_request = lora
        sched.add_request(r)
    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    want = {"x": a, "y": b, "z": None}
    steps = readmitted = 0
    while sched.has_unfinished_requests() and steps < 200:
        steps += 1
        so = sched.schedule()
        if so.is_empty:
            enc.defer(so)
            continue
        payload = pickle.loads(pickle.dumps(enc.encode(so)))
        got = dec.decode(payload)
        for r, t in zip(got.scheduled, payload[3]):
            assert r.lora_request == want[r.req_id]  # LoRARequest equality: by name
            assert (want[r.req_id] is None) == (r.lora_request is None)
            if r.is_new:
                assert t[-1] == want[r.req_id]  # sent with the new request only
                readmitted += steps > 1  # all three are admitted in step 1: later ones come back
            else:
                assert len(t) == 8 and t[-1] == []  # a running request's tuple: drafts, no adapter
        out = ModelRunnerOutput(sampled_token_ids={r.req_id: [9] for r in so.scheduled if r.is_last_chunk})
        sched.update_from_output(so, out)
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions_total > 0 and readmitted > 0

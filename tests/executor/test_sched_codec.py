"""The compact SchedulerOutput wire form: over random scheduler runs (chunked prefill,
preemption, aborts, id reuse), every decoded step gives the runner exactly what the
in-process ScheduledRequests give it (no torch)."""
from __future__ import annotations

import pickle
import random
import sys
import os

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))
from core_helpers import make_req, make_sched  # noqa: E402

from pagedllm.core.request import RequestStatus  # noqa: E402
from pagedllm.core.sched_output import ModelRunnerOutput  # noqa: E402
from pagedllm.executor.sched_codec import SchedulerOutputDecoder, SchedulerOutputEncoder  # noqa: E402


def _view(r):
    """What the runner reads of a ScheduledRequest."""
    end = r.start_pos + r.num_tokens
    return (r.req_id, list(r.token_ids[:end]), r.start_pos, r.num_tokens, list(r.block_ids), r.is_last_chunk,
            r.sampling_params, r.pooling_params, r.prompt_len, r.is_new, list(r.spec_token_ids))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spec", [False, True])
def test_round_trip_over_random_runs(seed, spec):
    """``spec``: the runner proposes drafts and returns accepted runs (speculative decoding)."""
    rng = random.Random(seed)
    sched = make_sched(num_blocks=25, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=80)
    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    live, n = set(), 0
    steps = preempted_seen = 0
    while steps < 400:
        steps += 1
        if rng.random() < 0.3 and len(live) < 10:
            rid = f"r{rng.randrange(12)}"  # ids come back after they finish
            if rid not in live:
                sched.add_request(make_req(rid, rng.randrange(1, 40), max_tokens=rng.randrange(1, 30)))
                live.add(rid)
        if rng.random() < 0.05 and live:
            rid = rng.choice(sorted(live))
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        so = sched.schedule()
        preempted_seen += len(so.preempted_req_ids)
        if so.is_empty:
            enc.defer(so)
            continue
        got = dec.decode(pickle.loads(pickle.dumps(enc.encode(so))))
        assert [_view(r) for r in got.scheduled] == [_view(r) for r in so.scheduled]
        assert so.finished_req_ids <= got.finished_req_ids
        out = ModelRunnerOutput()
        for r in so.scheduled:
            if r.is_last_chunk:
                acc = r.spec_token_ids[:rng.randrange(len(r.spec_token_ids) + 1)]
                out.sampled_token_ids[r.req_id] = acc + [rng.randrange(5, 500)]
                if spec:
                    out.spec_token_ids[r.req_id] = [rng.randrange(5, 500) for _ in range(rng.randrange(4))]
        for eco in sched.update_from_output(so, out):
            if eco.finish_reason is not None:
                live.discard(eco.req_id)
        live &= set(sched.requests)
        n += len(so.scheduled)
    assert n > 200 and preempted_seen > 0


def test_running_requests_send_only_new_tokens():
    sched = make_sched()
    sched.add_request(make_req("a", 40, max_tokens=10))
    enc = SchedulerOutputEncoder()
    so = sched.schedule()
    first = pickle.dumps(enc.encode(so))
    sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids={"a": [9]}))
    so = sched.schedule()
    payload = enc.encode(so)
    (rid, off, new_tokens, start, num, new_blocks, last, spec), = payload[3]
    assert (rid, off, new_tokens, start, num) == ("a", 40, [9], 40, 1)
    assert len(pickle.dumps(payload)) < len(first) / 2
